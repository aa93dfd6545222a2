"""Graders for the exercises: the same checks grade labkit's solutions and a learner's code.

A notebook cell calls `check.grade("rms_norm", my_rms_norm)`; the test suite calls every grader
on `tests/adapters.py`, which points at labkit's solutions, or at the learner's stubs in
`exercises/` when `LABKIT_EXERCISES=1`. A grader compares against a small reference written
right here and, when the answer is wrong, says which part is off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch


class ExerciseNotDone(AssertionError):
    """The learner's function still raises NotImplementedError."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: where its stub lives and the grader that checks any implementation."""

    name: str
    module: str  # the stub lives in exercises/<module>.py
    grader: Callable[[Callable], str]


EXERCISES: dict[str, Exercise] = {}


def exercise(name: str, module: str):
    """Register a grader for the stub `exercises/<module>.py::<name>`."""
    def register(grader: Callable[[Callable], str]) -> Callable[[Callable], str]:
        EXERCISES[name] = Exercise(name, module, grader)
        return grader
    return register


def grade(name: str, fn: Callable) -> str:
    """Grade `fn` as the answer to exercise `name`; returns a pass line, raises with a hint."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; known: {sorted(EXERCISES)}")
    try:
        message = EXERCISES[name].grader(fn)
    except NotImplementedError as err:
        task = inspect.getdoc(fn) or str(err)
        raise ExerciseNotDone(
            f"exercises/{EXERCISES[name].module}.py::{name} is not implemented yet.\n"
            f"The task:\n{task}") from None
    line = f"✓ {name}: {message}"
    print(line)
    return line


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    """Assert two tensors agree, saying where and by how much they differ."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        err = (got.float() - want.float()).abs()
        idx = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
        raise AssertionError(f"{what}: max error {err.max():.3g} at index {idx} "
                             f"(got {got[idx]:.6g}, expected {want[idx]:.6g}; "
                             f"tolerance atol={atol}, rtol={rtol})")


# ---------------------------------------------------------------------------------------------
# Chapter 00: welcome
# ---------------------------------------------------------------------------------------------

@exercise("rms_norm", "ch00_welcome")
def _grade_rms_norm(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen) * 3
    w = torch.rand(16, generator=gen) + 0.5
    got = fn(x, w, 1e-5)
    # the reference: divide by the root of the mean square over the last dimension, then scale
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    mean_not_rms = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True) * w
    if got.shape == want.shape and torch.allclose(got, mean_not_rms, atol=1e-3):
        raise AssertionError("rms_norm: this is LayerNorm (it subtracts the mean); RMSNorm only "
                             "divides by sqrt(mean(x^2) + eps)")
    if got.shape == want.shape and torch.allclose(got, want / w, atol=1e-4):
        raise AssertionError("rms_norm: the normalisation is right but the learned `weight` "
                             "scale is missing")
    _close(got, want, "rms_norm", atol=1e-5, rtol=1e-5)  # fp32 rounding only
    return "matches the reference on a [3, 5, 16] input"


@exercise("top_p_filter", "ch00_welcome")
def _grade_top_p(fn: Callable) -> str:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    # the reference: keep the smallest prefix of tokens (by probability) whose mass reaches p
    probs = torch.softmax(logits, -1)
    for p in (0.5, 0.9, 1.0):
        got = fn(logits.clone(), torch.tensor([p, p]))
        order = probs.argsort(-1, descending=True)
        cum = probs.gather(-1, order).cumsum(-1)
        keep_sorted = (cum - probs.gather(-1, order)) < p  # mass *before* a token is below p
        want = torch.full_like(logits, float("-inf"))
        for r in range(2):
            kept = order[r][keep_sorted[r]]
            want[r, kept] = logits[r, kept]
        if got.shape != want.shape:
            raise AssertionError(f"top_p_filter: shape {tuple(got.shape)}, expected "
                                 f"{tuple(want.shape)}")
        kept_got = torch.isfinite(got)
        kept_want = torch.isfinite(want)
        if not torch.equal(kept_got, kept_want):
            raise AssertionError(
                f"top_p_filter(p={p}): kept tokens {kept_got.int().tolist()}, expected "
                f"{kept_want.int().tolist()}. Keep a token while the probability mass of the "
                "tokens ranked above it is still below p (so the top token is always kept).")
        _close(got[kept_got], want[kept_want], "top_p_filter kept logits", 0, 0)
    return "keeps exactly the nucleus for p in (0.5, 0.9, 1.0)"

"""Shared pieces of the graders: compare tensors, and name a mistake only when it alone
explains every wrong result; the tiny random model the engine-level graders run.
"""

from __future__ import annotations

import math

import torch

from labkit.model import ModelConfig


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float, rtol: float
                 ) -> None:
    """Assert two tensors agree, saying where and by how much they differ."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        err = (got.float() - want.float()).abs()
        idx = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
        raise AssertionError(f"{what}: max error {err.max():.3g} at index {idx} "
                             f"(got {got[idx]:.6g}, expected {want[idx]:.6g}; "
                             f"tolerance atol={atol}, rtol={rtol})")


def only_hint(failing: list[dict[str, bool]]) -> str | None:
    """The one hint that matched in every failing case, or None (none, or ambiguous)."""
    if not failing:
        return None
    hints = [h for h in failing[0] if all(case.get(h, False) for case in failing)]
    return hints[0] if len(hints) == 1 else None


def diagnose(what: str, cases: list[tuple[str, float, float, dict[str, float]]]) -> None:
    """Raise if any case is wrong: (label, got, expected, {hint: what that mistake gives}).

    The hint is given only when one known mistake, and no other, reproduces every wrong case.
    """
    failing = [(label, got, want, wrong) for label, got, want, wrong in cases
               if not math.isclose(got, want, rel_tol=1e-9)]
    if not failing:
        return
    hint = only_hint([{h: math.isclose(got, v, rel_tol=1e-9) for h, v in wrong.items()}
                       for _, got, _, wrong in failing])
    label, got, want, _ = failing[0]
    more = f" ({len(failing)} of {len(cases)} cases wrong)" if len(cases) > 1 else ""
    raise AssertionError(f"{what}{label}: got {got:.6g}, expected {want:.6g}{more}."
                         + (f" {hint}" if hint else ""))


def tensor_diagnose(what: str, cases: list[tuple[str, torch.Tensor, torch.Tensor,
                                                  dict[str, torch.Tensor]]],
                     atol: float, rtol: float) -> None:
    """`diagnose` for tensors: (label, got, expected, {hint: what that mistake gives})."""
    def same(a, b):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)

    failing = [c for c in cases if not same(c[1], c[2])]
    if not failing:
        return
    hint = only_hint([{h: same(got, v) and not same(v, want) for h, v in wrong.items()}
                       for _, got, want, wrong in failing])
    label, got, want, _ = failing[0]
    if hint:
        raise AssertionError(f"{what} on {label}: {hint}")
    assert_close(got, want, f"{what} on {label}", atol, rtol)


def tiny_model():
    """The tiny random Llama the engine-level graders run (built once)."""
    global _TINY
    if _TINY is None:
        from labkit.model import LlamaModel, init_random
        _TINY = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=0).requires_grad_(False)
    return _TINY


_TINY = None

"""Graders for the exercises: the same checks grade labkit's solutions and a learner's code.

A notebook cell calls `check.grade("rms_norm", my_rms_norm)`; the test suite calls every grader
on `tests/adapters.py`, which points at labkit's solutions, or at the learner's stubs in
`exercises/` when `LABKIT_EXERCISES=1`; `python -m labkit grade` (what `make grade` runs) prints
one line per exercise. A grader compares against a small reference written right here and, when
the answer is wrong, says which part is off: a hint names a known mistake only when that mistake,
and no other, reproduces every wrong result. tests/test_graders_reject.py lists the mistakes each
grader must reject.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.model import ModelConfig


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


def grade_line(name: str, fn: Callable) -> str:
    """One line for `name`: ✓ and what passed, · not attempted, or ✗ and the grader's message."""
    try:
        return grade(name, fn)
    except ExerciseNotDone:
        return f"· {name}: not attempted (exercises/{EXERCISES[name].module}.py)"
    except Exception as err:  # a learner's bug is a grade, not a crash of the grading run
        text = " ".join(str(err).split())
        if not isinstance(err, AssertionError):
            text = f"raised {type(err).__name__}: {text}"
        return f"✗ {name}: {text}"


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit grade [NAME ...]`: grade the answers in exercises/, one line each."""
    names = list(argv or []) or list(EXERCISES)
    unknown = [n for n in names if n not in EXERCISES]
    if unknown:
        print(f"error: no exercise named {unknown[0]!r}; known: {', '.join(EXERCISES)}",
              file=sys.stderr)
        return 2
    lines = []
    for name in names:
        ex = EXERCISES[name]
        fn = getattr(importlib.import_module(f"exercises.{ex.module}"), name)
        with contextlib.redirect_stdout(io.StringIO()):  # grade() prints its pass line itself
            lines.append(grade_line(name, fn))
        print(lines[-1], flush=True)
    passed = sum(line.startswith("✓") for line in lines)
    todo = sum(line.startswith("·") for line in lines)
    print(f"{passed} passed, {len(lines) - passed - todo} wrong, {todo} not attempted")
    return 0 if passed + todo == len(lines) else 1


# ---------------------------------------------------------------------------------------------
# Helpers: compare, and name a mistake only when it alone explains every wrong result
# ---------------------------------------------------------------------------------------------

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


def _only_hint(failing: list[dict[str, bool]]) -> str | None:
    """The one hint that matched in every failing case, or None (none, or ambiguous)."""
    if not failing:
        return None
    hints = [h for h in failing[0] if all(case.get(h, False) for case in failing)]
    return hints[0] if len(hints) == 1 else None


def _diagnose(what: str, cases: list[tuple[str, float, float, dict[str, float]]]) -> None:
    """Raise if any case is wrong: (label, got, expected, {hint: what that mistake gives}).

    The hint is given only when one known mistake, and no other, reproduces every wrong case.
    """
    failing = [(label, got, want, wrong) for label, got, want, wrong in cases
               if not math.isclose(got, want, rel_tol=1e-9)]
    if not failing:
        return
    hint = _only_hint([{h: math.isclose(got, v, rel_tol=1e-9) for h, v in wrong.items()}
                       for _, got, _, wrong in failing])
    label, got, want, _ = failing[0]
    more = f" ({len(failing)} of {len(cases)} cases wrong)" if len(cases) > 1 else ""
    raise AssertionError(f"{what}{label}: got {got:.6g}, expected {want:.6g}{more}."
                         + (f" {hint}" if hint else ""))


def _tensor_diagnose(what: str, cases: list[tuple[str, torch.Tensor, torch.Tensor,
                                                  dict[str, torch.Tensor]]],
                     atol: float, rtol: float) -> None:
    """`_diagnose` for tensors: (label, got, expected, {hint: what that mistake gives})."""
    def same(a, b):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)

    failing = [c for c in cases if not same(c[1], c[2])]
    if not failing:
        return
    hint = _only_hint([{h: same(got, v) and not same(v, want) for h, v in wrong.items()}
                       for _, got, want, wrong in failing])
    label, got, want, _ = failing[0]
    if hint:
        raise AssertionError(f"{what} on {label}: {hint}")
    _close(got, want, f"{what} on {label}", atol, rtol)


def _tiny_model():
    """The tiny random Llama the engine-level graders run (built once)."""
    global _TINY
    if _TINY is None:
        from labkit.model import LlamaModel, init_random
        _TINY = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=0).requires_grad_(False)
    return _TINY


_TINY = None


# ---------------------------------------------------------------------------------------------
# Chapter 00: welcome
# ---------------------------------------------------------------------------------------------

def _rms_variants(x: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """What each known mistake in RMSNorm gives on (x, w, eps)."""
    ms = (x * x).mean(-1, keepdim=True)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    return {
        "this is LayerNorm (it subtracts the mean); RMSNorm only divides by "
        "sqrt(mean(x^2) + eps)": (x - mu) / torch.sqrt(var + eps) * w,
        "the normalisation is right but the learned `weight` scale is missing":
            x / torch.sqrt(ms + eps),
        "eps is added outside the square root: x / (sqrt(mean(x^2)) + eps); it belongs inside, "
        "sqrt(mean(x^2) + eps)": x / (torch.sqrt(ms) + eps) * w,
        "no eps: x / sqrt(mean(x^2)) blows up on rows near zero; add eps inside the root":
            x / torch.sqrt(ms) * w,
        "a fixed eps of 1e-6 instead of the `eps` argument": x / torch.sqrt(ms + 1e-6) * w,
        "a fixed eps of 1e-5 instead of the `eps` argument": x / torch.sqrt(ms + 1e-5) * w,
        "the mean of squares must be over the last dimension only (each token's own vector)":
            x / torch.sqrt((x * x).mean() + eps) * w,
        "divided by mean(x^2) + eps without the square root": x / (ms + eps) * w,
    }


@exercise("rms_norm", "ch00_welcome")
def _grade_rms_norm(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(16, generator=gen) + 0.5
    inputs = [  # (label, x, eps): small rows make eps matter, a larger eps makes its place matter
        ("a [3, 5, 16] input of scale 3", torch.randn(3, 5, 16, generator=gen) * 3, 1e-5),
        ("rows of scale 1e-3 (mean square 1e-6, below eps=1e-5)",
         torch.randn(4, 16, generator=gen) * 1e-3, 1e-5),
        ("rows of scale 0.05 with eps=1e-3", torch.randn(2, 16, generator=gen) * 0.05, 1e-3),
    ]
    cases = []
    for label, x, eps in inputs:
        got = fn(x.clone(), w.clone(), eps)
        # the reference: divide by the root of the mean square over the last dimension, then scale
        want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
        cases.append((label, torch.as_tensor(got), want, _rms_variants(x, w, eps)))
    _tensor_diagnose("rms_norm", cases, atol=1e-5, rtol=1e-4)  # fp32 rounding only
    return "matches the reference on large, tiny (eps-dominated) and small rows"


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor, descending: bool = True,
             inclusive: bool = False) -> torch.Tensor:
    """Keep mask [B, V] of the reference rule (or a mistaken variant of it)."""
    probs = torch.softmax(logits, -1)
    order = probs.argsort(-1, descending=descending)
    sorted_probs = probs.gather(-1, order)
    cum = sorted_probs.cumsum(-1)
    # the rule: keep a token while the mass ranked above it is below p
    keep_sorted = (cum < top_p[:, None]) if inclusive else (cum - sorted_probs < top_p[:, None])
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _top_p_variants(logits: torch.Tensor, top_p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keep masks known mistakes in top-p produce."""
    probs = torch.softmax(logits, -1)
    correct = _nucleus(logits, top_p)
    k = correct.sum(-1, keepdim=True)
    positions = torch.arange(logits.shape[-1])[None, :]
    return {
        "no sorting: the cumulative mass must run over tokens ranked by probability, not in "
        "vocabulary order": (probs.cumsum(-1) - probs) < top_p[:, None],
        "the keep mask was computed in sorted order but applied to the unsorted logits: "
        "scatter it back through the sort's indices": positions < k,
        "one p for the whole batch (the first row's): each row has its own top_p[i]":
            _nucleus(logits, top_p[:1].expand_as(top_p)),
        "dropped the token whose probability carries the mass past p: keep a token while the "
        "mass ranked *above* it is below p": _nucleus(logits, top_p, inclusive=True),
        "sorted ascending: the nucleus is the most likely tokens":
            _nucleus(logits, top_p, descending=False),
        "kept the tail and dropped the nucleus (the mask is inverted)": ~correct,
    }


@exercise("top_p_filter", "ch00_welcome")
def _grade_top_p(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 12, generator=gen) * 1.5  # unsorted, no ties, no p within 0.01
    top_p = torch.tensor([0.3, 0.55, 0.8, 0.93])  # a different p per row
    want_keep = _nucleus(logits, top_p)
    got = torch.as_tensor(fn(logits.clone(), top_p.clone()))
    if got.shape != logits.shape:
        raise AssertionError(f"top_p_filter: shape {tuple(got.shape)}, expected "
                             f"{tuple(logits.shape)} (one row per sequence)")
    kept = got != float("-inf")
    if torch.equal(kept, torch.ones_like(kept)) and not torch.equal(got, logits):
        vals = got[~want_keep].unique().tolist()[:3]
        raise AssertionError(f"top_p_filter: dropped tokens must become -inf (got {vals} "
                             "where tokens should be dropped): softmax then gives them exactly 0")
    if not torch.equal(kept, want_keep):
        hint = _only_hint([{h: torch.equal(kept, m) for h, m in
                            _top_p_variants(logits, top_p).items()}])
        rows = [r for r in range(len(top_p)) if not torch.equal(kept[r], want_keep[r])]
        r = rows[0]
        raise AssertionError(
            f"top_p_filter: row {r} (p={top_p[r]:.2f}) kept {kept[r].int().tolist()}, expected "
            f"{want_keep[r].int().tolist()} ({len(rows)} of {len(top_p)} rows wrong). "
            + (hint or "Rank tokens by probability; keep a token while the probability mass of "
               "the tokens ranked above it is below p (so the top token is always kept)."))
    if not torch.equal(got[kept], logits[kept]):
        raise AssertionError("top_p_filter: the kept logits changed; return the logits "
                             "themselves (not probabilities, not renormalised), -inf elsewhere")
    # ties: which of equal tokens survive is arbitrary, only how many and from where is not
    tied = torch.tensor([[2.0, 0.0, 2.0, 0.5, 2.0, -1.0, 2.0, 1.0]])
    got = torch.as_tensor(fn(tied.clone(), torch.tensor([0.5])))
    kept = (got != float("-inf"))[0]
    if int(kept.sum()) != 3 or not bool((tied[0][kept] == 2.0).all()):
        raise AssertionError(
            f"top_p_filter on {tied[0].tolist()} with p=0.5: kept {kept.int().tolist()}; expected "
            "any 3 of the four tokens with logit 2.0 (each holds 0.21 of the mass: 0, 0.21, 0.42 "
            "ranked above the first three, 0.63 above the fourth)")
    return "keeps exactly the nucleus on unsorted rows with a p per row, and any tie-break"


# ---------------------------------------------------------------------------------------------
# Chapter 01: roofline
# ---------------------------------------------------------------------------------------------

@exercise("matmul_intensity", "ch01_roofline")
def _grade_matmul_intensity(fn: Callable) -> str:
    shapes = [(1, 4096, 4096, 2), (256, 4096, 4096, 2), (64, 128, 256, 4), (512, 512, 512, 1)]
    cases = []
    for m, n, k, b in shapes:
        got = float(fn(m, n, k, b))
        # the reference: 2 FLOPs per multiply-add, over A, B and C each moved once, in bytes
        flops, elems = 2 * m * n * k, m * k + k * n + m * n
        want = flops / (elems * b)
        cases.append((f"({m}, {n}, {k}, {b})", got, want, {
            "Forgot the 2 in 2MNK: a multiply-add is two FLOPs.": want / 2,
            "Forgot bytes per element: divide by bytes moved, not elements.": flops / elems,
            "Counted the reads of A and B but not the write of C (M*N elements).":
                flops / ((m * k + k * n) * b),
            "Counted only the weights B (K*N); A and C are moved too.": flops / (k * n * b),
            "That is bytes per FLOP: intensity is FLOPs / bytes.": elems * b / flops,
            "Integer division (//) rounds the intensity down: use /.": float(flops // (elems * b)),
        }))
    _diagnose("matmul_intensity", cases)
    return f"exact on {len(shapes)} shapes, from a matvec (I ~ 1) to square matmuls"


def _ref_decode_counts(cfg: ModelConfig, batch: int, context_len: int) -> dict[str, float]:
    """Hand counts of one decode step's FLOPs, term by term."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = d * q + d * kv + d * kv + q * d + 3 * d * f  # q, k, v, o; gate, up, down
    return {"layers": 2 * batch * n * layer_weights, "head": 2 * batch * d * v,
            "attention": 4 * batch * n * q * context_len,  # q.k + p.v, every query head
            # what two known mistakes count instead of the layers' weights
            "layers_no_gqa": 2 * batch * n * (4 * d * q + 3 * d * f),
            "layers_two_mlp": 2 * batch * n * (2 * d * q + 2 * d * kv + 2 * d * f)}


@exercise("decode_step_flops", "ch01_roofline")
def _grade_decode_step_flops(fn: Callable) -> str:
    cases = []
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx in ((1, 1), (4, 100), (16, 2048)):
            got = float(fn(cfg, batch, ctx))
            t = _ref_decode_counts(cfg, batch, ctx)
            want = t["layers"] + t["head"] + t["attention"]
            matmuls = t["layers"] + t["head"]
            cases.append((f"({cfg.name}, batch={batch}, context_len={ctx})", got, want, {
                "Forgot the 2 per weight: a multiply-add is two FLOPs.": want / 2,
                "Forgot the 2 per weight in the matmuls (attention is right).":
                    matmuls / 2 + t["attention"],
                "Counted the matmuls but not attention over the context.": matmuls,
                "Forgot the output head (hidden_size x vocab_size per token).":
                    t["layers"] + t["attention"],
                "Counted the head twice: the embedding is a lookup, not a matmul (tied or not).":
                    want + t["head"],
                "GQA: the k and v projections are hidden_size x num_kv_heads*head_dim, not "
                "num_heads*head_dim.": t["layers_no_gqa"] + t["head"] + t["attention"],
                "The MLP is SwiGLU: three matrices (gate, up, down), not two.":
                    t["layers_two_mlp"] + t["head"] + t["attention"],
                "Attention: every query head (num_heads), not only the KV heads, does the "
                "work.": matmuls + t["attention"] * cfg.num_kv_heads / cfg.num_heads,
                "Attention has two halves: q.k over the keys and p.v over the values.":
                    matmuls + t["attention"] / 2,
                "2 x num_params() counts the norm weights, which do no matmul; count the "
                "projection, MLP and head weights.": 2 * batch * cfg.num_params() + t["attention"],
                "Counted one sequence: every term scales with the batch.": want / batch,
            }))
    _diagnose("decode_step_flops", cases)
    return "exact for tiny and SmolLM2-135M at 3 batch sizes and contexts"


@exercise("decode_step_bytes", "ch01_roofline")
def _grade_decode_step_bytes(fn: Callable) -> str:
    cases = []
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx, wb, kvb in ((1, 1, 2, 2), (8, 1000, 2, 2), (32, 512, 0.5, 1),
                                    (5, 300, 4, 2), (3, 77, 4, 4)):
            got = float(fn(cfg, batch, ctx, wb, kvb))
            # the reference: weights once; each sequence reads ctx tokens of K and V and
            # writes one; a token's K and V hold 2 * layers * kv_heads * head_dim values
            weights = cfg.num_params() * wb
            per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kvb
            kv_read, kv_write = batch * ctx * per_token, batch * per_token
            want = weights + kv_read + kv_write
            kv = kv_read + kv_write
            cases.append((f"({cfg.name}, batch={batch}, context_len={ctx}, weight_bytes={wb}, "
                          f"kv_bytes={kvb})", got, want, {
                "Counted the weights but not the KV cache: each sequence reads the K and V of "
                "its whole context.": weights,
                "Forgot to write the new token's K and V.": weights + kv_read,
                "Weights are read once per step, not once per sequence: that sharing is what "
                "batching buys.": batch * weights + kv,
                "Forgot bytes per element: multiply element counts by weight_bytes / kv_bytes.":
                    weights / wb + kv / kvb,
                "Counted K but not V (or V but not K): the cache holds both.": weights + kv / 2,
                "Sized the KV cache in weight_bytes: K and V are stored in kv_bytes per value.":
                    weights + kv * wb / kvb,
                "The cache holds a K and a V in every layer: multiply by num_layers.":
                    weights + kv / cfg.num_layers,
                "GQA: the cache holds num_kv_heads heads per layer, not num_heads.":
                    weights + kv * cfg.num_heads / cfg.num_kv_heads,
                "Counted the embedding and the head apart: these configs tie them, and "
                "num_params() already counts the shared matrix once.":
                    weights + cfg.hidden_size * cfg.vocab_size * wb + kv,
            }))
    _diagnose("decode_step_bytes", cases)
    return "exact for tiny and SmolLM2-135M, bf16 to int4 weights, fp32 to fp8 KV"


# ---------------------------------------------------------------------------------------------
# Chapter 06: the GPU bubble
# ---------------------------------------------------------------------------------------------

def _covered(intervals: list[tuple[float, float]], presorted: bool = False) -> float:
    """Length covered by intervals (merged after sorting them, unless `presorted`)."""
    total, end = 0.0, float("-inf")
    for a, b in (intervals if presorted else sorted(intervals)):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


@exercise("bubble_fraction", "ch06_gpu_bubble")
def _grade_bubble_fraction(fn: Callable) -> str:
    runs = [  # (busy intervals of the compute lane, unsorted and overlapping; window t0, t1)
        ([(0.5, 1.0), (0.0, 0.2), (0.8, 1.3), (1.5, 1.6)], 0.0, 2.5),
        ([(1.1, 1.9), (1.2, 1.4), (3.0, 3.5), (0.2, 0.6)], -0.5, 4.0),
        ([(2.0, 2.5), (2.5, 3.0), (5.0, 6.0)], 1.0, 7.0),
        ([], 0.0, 1.0),
    ]
    cases = []
    for busy, t0, t1 in runs:
        got = float(fn(list(busy), t0, t1))
        width = t1 - t0
        # the reference: the share of [t0, t1] that no busy interval covers
        want = 1 - _covered(busy) / width
        first_last = (max(b for _, b in busy) - min(a for a, _ in busy)) if busy else width
        cases.append((f"({busy}, {t0}, {t1})", got, want, {
            "Summed the spans' lengths: overlapping spans count once (merge them, or measure "
            "their union).": 1 - sum(b - a for a, b in busy) / width,
            "That is the busy share: the bubble is the idle share, 1 - busy / wall.":
                _covered(busy) / width,
            "Merged the spans without sorting them first: sort by start time.":
                1 - _covered(busy, presorted=True) / width,
            "Measured the wall from the first span to the last: the window is t0 to t1.":
                1 - _covered(busy) / first_last,
            "A percentage: return a fraction in [0, 1].": 100 * want,
        }))
    _diagnose("bubble_fraction", cases)
    return "exact on unsorted, overlapping and empty lanes"


@exercise("cost_model", "ch06_gpu_bubble")
def _grade_cost_model(fn: Callable) -> str:
    runs = [  # (decode launch times of a blocking run, host work and device busy of each step)
        ([0.0, 5.0e-3, 10.5e-3, 15.0e-3, 20.5e-3], [2.0e-3, 2.2e-3, 1.8e-3, 2.0e-3, 4.0e-3],
         [2.5e-3, 2.6e-3, 2.4e-3, 2.5e-3, 1.0e-3]),
        ([0.0, 2.0e-3, 4.2e-3, 6.1e-3], [1.5e-3, 1.6e-3, 1.4e-3, 0.9e-3],
         [0.3e-3, 0.2e-3, 0.4e-3, 0.9e-3]),
        ([1.0, 1.004, 1.0079, 1.0121, 1.016, 1.0201], [1e-3, 1.1e-3, 0.9e-3, 1e-3, 1e-3, 3e-3],
         [2.5e-3, 2.4e-3, 2.6e-3, 2.5e-3, 2.5e-3, 0.5e-3]),
    ]
    terms = {"t_host": [], "t_device": [], "predicted": []}
    for launch, host, device in runs:
        got = fn(list(launch), list(host), list(device))
        if not (isinstance(got, tuple | list) and len(got) == 3):
            raise AssertionError(f"cost_model returned {got!r}; return a tuple (t_host, "
                                 "t_device, predicted)")
        n = len(launch) - 1  # periods between launches: the last step's own period is unknown
        step = (launch[-1] - launch[0]) / n
        t_host, t_dev = sum(host[:n]) / n, sum(device[:n]) / n  # the steps that begin them
        want = (t_host, t_dev, step / max(t_host, t_dev))
        host_all, dev_all = sum(host) / len(host), sum(device) / len(device)
        step_n = (launch[-1] - launch[0]) / len(launch)
        label = f"(launch_s={launch}, host_s={host}, device_s={device})"
        last = ("Averaged every step: the last launch begins no measured period, so leave its "
                "{} out.")
        wrong = [{last.format("host work"): host_all}, {last.format("device time"): dev_all}, {
            "Divided the launch-to-launch span by the number of steps: n launches make n - 1 "
            "periods.": step_n / max(t_host, t_dev),
            "Divided by the shorter term: a pipelined step costs the longer of the two, "
            "max(T_host, T_device).": step / min(t_host, t_dev),
            "A blocking step is the whole period, round trips included, not T_host + T_device: "
            "the pipeline hides the round trips too.": (t_host + t_dev) / max(t_host, t_dev),
            "That is the pipelined step's share of the blocking one, the inverse of the speedup.":
                max(t_host, t_dev) / step,
        }]
        for i, key in enumerate(terms):
            terms[key].append((label, float(got[i]), want[i], wrong[i]))
    for key, cases in terms.items():
        _diagnose(f"cost_model's {key} ", cases)
    return "T_host, T_device and the predicted speedup exact on three blocking runs"


# ---------------------------------------------------------------------------------------------
# Chapter 07: the pipelined decoder
# ---------------------------------------------------------------------------------------------

def _seq(**fields):
    """A sequence-like object holding only the fields the chapter-07 rules read and write."""
    from types import SimpleNamespace

    state = {"finalized": False, "inflight_refs": 0, "released": False, "output_ids": [],
             "zombie_rows": 0}
    state.update(fields)
    return SimpleNamespace(**state)


LENGTHS = (2, 4, 7)  # max_new_tokens of the requests the engine-level graders run


def _engine_run(loop: Callable, lengths=LENGTHS, commit_row: Callable | None = None,
                max_launches: int = 200):
    """Run `loop(engine)` on the tiny random model (in-process device) over requests of
    `lengths` new tokens each, recording their lifecycle; with `commit_row`, the engine's
    commit uses it in place of labkit's. Returns (engine, request ids, lifecycle, error)."""
    from labkit import engine as engine_module
    from labkit.engine import Engine
    from labkit.lifecycle import Lifecycle
    from labkit.sampling import SamplingParams

    eng = Engine(_tiny_model(), None, device="inprocess", kv_tokens=1024, block_size=4,
                 max_seqs=8)
    ids = [eng.submit([3 + i, 17, 29 + i, 40], SamplingParams(
        max_new_tokens=n, ignore_eos=True, temperature=0.8 * (i % 2), seed=7 + i))
        for i, n in enumerate(lengths)]
    original = engine_module.commit_row
    error = None
    count = [0]
    launch = eng.launch

    def counted(launched, slot):  # a loop that never ends is a wrong answer, not a hang
        count[0] += 1
        if count[0] > max_launches:
            raise RuntimeError(f"more than {max_launches} launches for requests of {lengths} "
                               "tokens: the loop does not finish")
        launch(launched, slot)

    eng.launch = counted
    if commit_row is not None:
        engine_module.commit_row = commit_row
    try:
        with Lifecycle.record(eng) as life:
            loop(eng)
    except NotImplementedError:
        raise
    except Exception as err:  # the engine's own checks (a page freed twice, ...) or a hang
        error = f"{type(err).__name__}: {err}"
    finally:
        engine_module.commit_row = original
        del eng.launch
    return eng, ids, life, error


def _blocking_tokens(lengths=LENGTHS) -> list[list[int]]:
    """labkit's blocking loop on the same requests: the tokens any correct loop must give."""
    from labkit.decode_blocking import run_blocking

    eng, ids, _, error = _engine_run(run_blocking, lengths)
    assert error is None, error
    return [eng.seqs[i].output_ids for i in ids]


@exercise("commit_row", "ch07_pipelined")
def _grade_commit_row(fn: Callable) -> str:
    # a zombie: finalized at commit t (EOS = 2 appended), still a row of step t+1
    z = _seq(finalized=True, inflight_refs=1, output_ids=[11, 12, 2])
    got = fn(z, 99)
    if z.output_ids != [11, 12, 2]:
        raise AssertionError(
            f"commit_row: a zombie row appended a token (output_ids became {z.output_ids}): a "
            "sequence finalized at commit t must not grow at commit t+1. When `finalized` is "
            "set, append nothing")
    if z.inflight_refs != 0:
        raise AssertionError(
            f"commit_row: a zombie row left inflight_refs at {z.inflight_refs} (it was 1): the "
            "committed step no longer references the sequence, zombie or not. Without the "
            "decrement `finalized and inflight_refs == 0` never holds and its KV pages leak")
    if z.zombie_rows != 1:
        raise AssertionError(
            f"commit_row: a zombie row left zombie_rows at {z.zombie_rows}, expected 1: count "
            "every skipped row (the zombie tax is measured and reported, not hidden)")
    if got is not False:
        raise AssertionError(f"commit_row: returned {got!r} for a skipped zombie row; return "
                             "False when nothing was appended")
    # a live row: one launched step is committed
    s = _seq(inflight_refs=1, output_ids=[11, 12])
    got = fn(s, 13)
    if s.output_ids != [11, 12, 13]:
        raise AssertionError(f"commit_row: a live row made output_ids {s.output_ids}, expected "
                             "[11, 12, 13]: an unfinished sequence appends the row's token")
    if s.inflight_refs != 0:
        raise AssertionError(f"commit_row: a live row left inflight_refs at {s.inflight_refs}, "
                             "expected 0 (it was 1): every committed row drops one reference")
    if s.zombie_rows != 0:
        raise AssertionError("commit_row: a live row was counted as a zombie")
    if got is not True:
        raise AssertionError(f"commit_row: returned {got!r} for an appended row, expected True")
    for case in (z, s):
        if case.finalized != (case is z):
            raise AssertionError("commit_row changed `finalized`: deciding that a sequence "
                                 "ends is the caller's job (after a True), not the row rule's")
    # the pipelined order: launch t, launch t+1 (refs 2), commit t ends it, commit t+1
    p = _seq(inflight_refs=2, output_ids=[5])
    first = fn(p, 2)  # commit t: EOS; the caller sees it and finalizes
    if p.inflight_refs != 1:
        raise AssertionError(
            f"commit_row: committing step t of a sequence that steps t and t+1 both reference "
            f"(inflight_refs 2) left inflight_refs at {p.inflight_refs}, expected 1. Subtract "
            "one per committed row; setting it to 0 frees the pages while step t+1, in flight, "
            "still writes them (chapter 07's central bug)")
    p.finalized = True
    second = fn(p, 7)  # commit t+1: the zombie row
    state = (first, second, p.output_ids, p.inflight_refs, p.zombie_rows)
    if state != (True, False, [5, 2], 0, 1):
        raise AssertionError(
            "commit_row in the pipelined order (launch t, launch t+1, commit t ends the "
            "sequence, commit t+1): expected (True, False, output_ids [5, 2], inflight_refs 0, "
            f"zombie_rows 1), got {state}")
    # cancelled with two steps in flight: two zombie rows, each counted
    c = _seq(finalized=True, inflight_refs=2, output_ids=[4])
    fn(c, 8)
    fn(c, 9)
    if (c.zombie_rows, c.inflight_refs) != (2, 0):
        raise AssertionError(
            "commit_row: a sequence cancelled while two launched steps reference it has two "
            f"zombie rows; after both commits zombie_rows is {c.zombie_rows} and inflight_refs "
            f"{c.inflight_refs}, expected 2 and 0. Add one to zombie_rows per skipped row "
            "(`+= 1`, not `= 1`)")
    # a row committed with no reference outstanding is a bookkeeping bug: it must show
    b = _seq(inflight_refs=0, output_ids=[4])
    try:
        fn(b, 8)
    except Exception:  # raising is an honest answer too
        pass
    else:
        if b.inflight_refs != -1:
            raise AssertionError(
                f"commit_row: a row of a sequence with inflight_refs 0 left it at "
                f"{b.inflight_refs}, expected -1 (or an error). A commit with no reference "
                "outstanding means a step was counted wrong; clamping at 0 (max(0, ...)) hides "
                "that bug, while -1 keeps the pages from being released and "
                "check_all_released reports it")
    # and inside the engine: the pages come back exactly at the commit of the zombie row
    from labkit.decoders import run

    eng, ids, life, error = _engine_run(lambda e: run(e, "pipelined"), commit_row=fn)
    if error is not None:
        raise AssertionError(f"commit_row inside the engine (pipelined, requests of {LENGTHS} "
                             f"tokens): {error}")
    for rid, n in zip(ids, LENGTHS):
        seq = eng.seqs[rid]
        ended, back = life.finalized_at(rid), life.released_at(rid)
        if len(seq.output_ids) != n:
            raise AssertionError(f"commit_row inside the engine: request {rid} (max_new_tokens "
                                 f"{n}) ended with {len(seq.output_ids)} tokens")
        if back != (None if ended is None else ended + 1):
            where = ("never" if back is None else f"at the commit of step {back}")
            raise AssertionError(
                f"commit_row inside the engine: request {rid} ended at the commit of step "
                f"{ended}, and its pages came back {where}; expected at the commit of step "
                f"{None if ended is None else ended + 1}, its zombie row (step {ended} + 1 was "
                "launched before commit {ended} and still writes its KV pages)".replace(
                    "{ended}", str(ended)))
    eng.check_all_released()
    return ("zombie rows skipped and counted, one reference per row; in the engine every "
            "request's pages came back at its zombie row's commit")


@exercise("can_release", "ch07_pipelined")
def _grade_can_release(fn: Callable) -> str:
    cases = [  # (finalized, inflight_refs, released, expected, the rule a wrong answer breaks)
        (True, 1, False, False,
         "its zombie row is still in flight: that step writes the sequence's KV pages, and a new "
         "request's prefill could already have been given them"),
        (True, 0, False, True,
         "finalized and no launched step references it: release now, or its KV pages leak and "
         "admission stalls"),
        (False, 0, False, False,
         "it is not finalized: it will be launched again and write into pages that are free"),
        (True, 0, True, False,
         "it was released already: releasing twice puts the same pages in the free list twice, "
         "and two requests end up sharing them"),
        (True, 2, False, False, "two launched steps still reference it"),
        (False, 1, False, False, "it is running, with a step in flight"),
        (True, 1, True, False, "it was released already (and is still referenced)"),
        (False, 0, True, False, "it was released already"),
    ]
    for finalized, refs, released, want, rule in cases:
        s = _seq(finalized=finalized, inflight_refs=refs, released=released)
        before = dict(vars(s))
        got = fn(s)
        if vars(s) != before:
            raise AssertionError(f"can_release modified the sequence ({before} -> {vars(s)}): "
                                 "the rule only answers; Scheduler.release_if_done acts on it")
        if not isinstance(got, bool):
            raise AssertionError(f"can_release returned {got!r} ({type(got).__name__}); "
                                 "return a bool")
        if got != want:
            raise AssertionError(
                f"can_release(finalized={finalized}, inflight_refs={refs}, released={released}) "
                f"returned {got}, expected {want}: {rule}")
    return f"releases only when finalized, unreferenced and not yet released ({len(cases)} cases)"


# ---------------------------------------------------------------------------------------------
# Chapter 04: FlashAttention
# ---------------------------------------------------------------------------------------------

def _ref_attention(q, k, v, causal: bool, shift: int = 0):
    """Softmax attention written out; query i sees keys <= L - Tq + i + shift: (out, lse)."""
    # q: [B, H, Tq, D]; k, v: [B, H, L, D]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Tq, L]
    if causal:
        tq, n = q.shape[2], k.shape[2]
        last = torch.arange(tq)[:, None] + n - tq + shift
        s = s.masked_fill(torch.arange(n)[None, :] > last, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


@exercise("online_softmax_update", "ch04_flash_attention")
def _grade_online_softmax_update(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(4)
    v1, v2 = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
    s1 = torch.randn(2, 3, 5, generator=gen)
    s2 = torch.randn(2, 3, 6, generator=gen) + 3.0  # the second tile raises the max
    s2[0, 0] = -100.0  # ... except in one row, where the max stays the first tile's
    m0, l0, acc0 = torch.full((2, 3), float("-inf")), torch.zeros(2, 3), torch.zeros(2, 3, 8)
    m, l, acc = fn(m0, l0, acc0, s1, v1)  # noqa: E741
    m, l, acc = fn(m, l, acc, s2, v2)  # noqa: E741
    scores = torch.cat([s1, s2], -1)
    want_m = scores.amax(-1)
    if torch.equal(m, s2.amax(-1)) and not torch.equal(m, want_m):
        raise AssertionError(
            "online_softmax_update: max over the tile only: the returned m is the second "
            "tile's max, but row [0, 0] saw a larger score in the first tile. m must be the "
            "max over every key seen so far: torch.maximum(m, scores.amax(-1))")
    _close(m, want_m, "online_softmax_update running max m", 0, 0)
    p = torch.exp(scores - want_m[..., None])
    want_l, want_acc = p.sum(-1), p @ torch.cat([v1, v2], -2)
    # the chapter's bug: the first tile's sum stays under the old max when the max grows
    m1 = s1.amax(-1)
    p1, p2 = torch.exp(s1 - m1[..., None]), torch.exp(s2 - want_m[..., None])
    stale_acc = p1 @ v1 + p2 @ v2
    if torch.allclose(acc, stale_acc, atol=1e-4) and not torch.allclose(acc, want_acc,
                                                                         atol=1e-4):
        raise AssertionError(
            "online_softmax_update: no accumulator rescale when the max changes: acc still "
            "holds the first tile's values weighted by exp(score - old max). Multiply acc by "
            "exp(m_old - m_new) before adding this tile's exp(scores - m_new) @ v")
    if torch.allclose(l, p1.sum(-1) + p2.sum(-1), atol=1e-4) and not torch.allclose(
            l, want_l, atol=1e-4):
        raise AssertionError(
            "online_softmax_update: the running sum l is not rescaled when the max changes: "
            "multiply l by exp(m_old - m_new) too")
    _close(l, want_l, "online_softmax_update running sum l", 1e-5, 1e-5)
    _close(acc, want_acc, "online_softmax_update accumulator acc", 1e-5, 1e-5)
    # a fully masked tile first: the row must stay empty, not NaN
    masked = torch.full((2, 3, 5), float("-inf"))  # [..., Tq, Tk]
    m, l, acc = fn(m0, l0, acc0, masked, v1)  # noqa: E741
    if torch.isnan(l).any() or torch.isnan(acc).any():
        raise AssertionError("online_softmax_update: a tile with every score -inf (all keys "
                             "masked) gave NaN: use 0 as the exp() reference while m is -inf")
    return "two tiles with a growing max, and a fully masked tile, match the reference"


@exercise("merge_partials", "ch04_flash_attention")
def _grade_merge_partials(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 1, 8, generator=gen)
    k = torch.randn(2, 3, 20, 8, generator=gen) * 2
    v = torch.randn(2, 3, 20, 8, generator=gen)
    k[:, :, :7] += 1.5  # the first chunk holds most of the softmax mass: unequal parts
    a = _ref_attention(q, k[:, :, :7], v[:, :, :7], causal=False)
    b = _ref_attention(q, k[:, :, 7:], v[:, :, 7:], causal=False)
    want, want_lse = _ref_attention(q, k, v, causal=False)
    out, lse = fn(a, b)
    if torch.allclose(out, (a[0] + b[0]) / 2, atol=1e-5):
        raise AssertionError(
            "merge_partials: merging by plain average: (o1 + o2) / 2 weighs a chunk of 7 "
            "keys like one of 13, and a chunk with little softmax mass like one with most. "
            "Weigh each by its share of the mass, exp(lse_i - lse), with "
            "lse = logaddexp(lse1, lse2)")
    _close(lse, want_lse, "merge_partials lse", 1e-5, 1e-5)
    _close(out, want, "merge_partials out", 1e-5, 1e-5)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    out, lse = fn(a, empty)
    _close(out, a[0], "merge_partials with an empty part (lse -inf)", 1e-6, 1e-6)
    out, _ = fn(empty, empty)
    if torch.isnan(out).any():
        raise AssertionError("merge_partials: two empty parts (both lse -inf) gave NaN; "
                             "return out 0")
    return "split-K merge of unequal chunks matches attention over the whole context"


@exercise("tiled_attention", "ch04_flash_attention")
def _grade_tiled_attention(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(6)
    for tq, n, block_k, causal in ((9, 9, 4, True), (3, 11, 4, True), (1, 10, 3, True),
                                   (5, 13, 5, False)):
        q = torch.randn(2, 2, tq, 8, generator=gen)
        k = torch.randn(2, 2, n, 8, generator=gen)
        v = torch.randn(2, 2, n, 8, generator=gen)
        out, lse = fn(q, k, v, causal=causal, block_k=block_k)
        want, want_lse = _ref_attention(q, k, v, causal)
        what = f"tiled_attention(Tq={tq}, L={n}, block_k={block_k}, causal={causal})"
        if causal and not torch.allclose(out, want, atol=1e-5):
            for shift in (-1, 1):
                shifted = _ref_attention(q, k, v, True, shift)[0]
                if torch.allclose(out, shifted, atol=1e-5, equal_nan=True):
                    side = "misses its own key" if shift < 0 else "sees one key too many"
                    raise AssertionError(
                        f"{what}: causal mask off by one: each query {side}. Query i sits "
                        f"at position L - Tq + i and sees keys 0 .. L - Tq + i inclusive")
            if tq < n and torch.allclose(out, _ref_attention(q, k, v, True, tq - n)[0],
                                         atol=1e-5):
                raise AssertionError(
                    f"{what}: the causal mask is aligned top-left (query i sees keys 0..i); "
                    "with Tq < L the queries are the last Tq positions: L - Tq + i")
        if torch.isnan(out).any():
            raise AssertionError(f"{what}: NaN in the output: a query saw no key at all")
        _close(out, want, f"{what} out", 1e-5, 1e-5)
        _close(lse, want_lse, f"{what} lse", 1e-5, 1e-5)
    return "causal and not, Tq = L, Tq < L and Tq = 1, tiles that do not divide L"
# Chapter 02: batching
# ---------------------------------------------------------------------------------------------

def _admit_variant(need: Callable[[int, int, int], int], fits: Callable[[int, int], bool],
                   jump: bool = False) -> Callable:
    """An admission rule built from a page count and a fit test (the reference and its bugs)."""
    def admit(waiting, free_pages, block_size, free_slots):
        n = 0
        for prompt_len, max_new in waiting:
            pages = need(prompt_len, max_new, block_size)
            if n < free_slots and fits(pages, free_pages):
                free_pages -= pages
                n += 1
            elif not jump:
                break
        return n
    return admit


@exercise("admit_fcfs", "ch02_batching")
def _grade_admit_fcfs(fn: Callable) -> str:
    cases = [  # (waiting, free_pages, block_size, free_slots)
        ([(10, 6)], 1, 16, 4), ([(16, 16), (3, 3)], 2, 16, 4), ([(16, 16), (1, 1)], 3, 16, 4),
        ([(16, 17)], 2, 16, 4), ([(10, 30)], 2, 16, 4), ([(40, 10), (1, 1)], 3, 16, 4),
        ([(1, 1)] * 5, 99, 16, 3), ([(8, 8), (8, 8), (8, 9)], 3, 16, 8), ([], 5, 16, 5),
        ([(20, 10), (5, 5)], 3, 16, 4),
    ]
    ceil = lambda p, m, bs: -(-(p + m) // bs)  # noqa: E731
    le = lambda need, free: need <= free  # noqa: E731
    ref = _admit_variant(ceil, le)
    wrong = {
        "off-by-one budget: a request that needs exactly the pages left fits (compare with "
        "<=, not <)": _admit_variant(ceil, lambda need, free: need < free),
        "off-by-one page count at exact multiples: 32 tokens fill exactly 2 pages of 16 "
        "(ceil(32 / 16) = 2, not 32 // 16 + 1 = 3)":
            _admit_variant(lambda p, m, bs: (p + m) // bs + 1, le),
        "a partly filled page is a whole page: round the page count up":
            _admit_variant(lambda p, m, bs: (p + m) // bs, le),
        "reserve pages for prompt_len + max_new_tokens, not for the prompt alone":
            _admit_variant(lambda p, m, bs: -(-p // bs), le),
        "a request that does not fit stops admission: later requests must not jump it "
        "(first come, first served)": _admit_variant(ceil, le, jump=True),
    }
    got = [fn([tuple(w) for w in c[0]], *c[1:]) for c in cases]
    want = [ref(*c) for c in cases]
    if got == want:
        return f"admits in order under pages and slots ({len(cases)} cases)"
    first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    call = (f"admit_fcfs(waiting={cases[first][0]}, free_pages={cases[first][1]}, "
            f"block_size={cases[first][2]}, free_slots={cases[first][3]}) returned "
            f"{got[first]}, expected {want[first]}")
    for hint, variant in wrong.items():
        if [variant(*c) for c in cases] == got:
            raise AssertionError(f"{call}: {hint}")
    raise AssertionError(f"{call}: admit in arrival order while the pages of prompt_len + "
                         "max_new_tokens (rounded up) and a slot are free")


@exercise("chunk_prefills", "ch02_batching")
def _grade_chunk_prefills(fn: Callable) -> str:
    cases = [  # (num_decode, prefill_left, budget, expected)
        (3, [10, 10], 8, (3, [5, 0])), (3, [2, 10], 8, (3, [2, 3])), (0, [2, 10], 8, (0, [2, 6])),
        (9, [4], 8, (8, [0])), (2, [300, 7], None, (2, [300, 7])), (1, [3], 8, (1, [3])),
        (4, [], 8, (4, [])), (0, [5], 5, (0, [5])),
    ]
    for dec, left, budget, want in cases:
        got = fn(dec, list(left), budget)
        got = (int(got[0]), [int(c) for c in got[1]])
        call = f"chunk_prefills({dec}, {left}, budget={budget})"
        if len(got[1]) != len(left):
            raise AssertionError(f"{call} returned {len(got[1])} chunks for {len(left)} "
                                 "prefills: give one chunk size (maybe 0) per prefill, in order")
        if any(c > r for c, r in zip(got[1], left)) or any(c < 0 for c in got[1]):
            raise AssertionError(f"{call} returned chunks {got[1]}: a chunk is between 0 and "
                                 "what its prefill still needs")
        total = got[0] + sum(got[1])
        if budget is not None and got[0] < min(dec, budget):
            raise AssertionError(f"{call} returned {got}: the chunks starve decode. Running "
                                 f"sequences get their {min(dec, budget)} decode rows first; "
                                 "prefill takes only what is left of the budget")
        if budget is not None and total == budget + 1:
            raise AssertionError(f"{call} returned {got}, {total} tokens: off-by-one budget, "
                                 f"one token over the budget of {budget}")
        if budget is not None and total > budget:
            raise AssertionError(f"{call} returned {got}, {total} tokens: over the budget "
                                 f"of {budget}")
        if budget is not None and total == min(budget, dec + sum(left)) - 1:
            raise AssertionError(f"{call} returned {got}, {total} tokens: off-by-one budget, "
                                 "one token of the budget left unused while a prompt waits")
        if got != want:
            raise AssertionError(f"{call} returned {got}, expected {want}: decode rows first, "
                                 "then each prefill in arrival order takes what it still needs "
                                 "of what is left")
    return f"decode first, then prefill chunks in order, budgets exact ({len(cases)} cases)"


@exercise("latency_percentiles", "ch02_batching")
def _grade_latency_percentiles(fn: Callable) -> str:
    from labkit.metrics import latency_percentiles, percentile

    gen = torch.Generator().manual_seed(2)
    # one long request with fast tokens and many short ones with slow tokens: percentiles
    # over requests and over tokens disagree, as they do on a real server
    times = [[0.05 + 0.01 * i for i in range(400)]]
    for _ in range(30):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        first = float(torch.rand(1, generator=gen)) * 2
        gaps = (torch.rand(n - 1, generator=gen) * 0.3 + 0.1).tolist()
        t = [first]
        for g in gaps:
            t.append(t[-1] + g)
        times.append(t)
    got = fn([list(t) for t in times], (50, 99))
    want = latency_percentiles(times, (50, 99))
    if set(got) != set(want):
        raise AssertionError(f"latency_percentiles returned keys {sorted(got)}, expected "
                             f"{sorted(want)}")
    multi = [t for t in times if len(t) > 1]
    pooled = [b - a for t in multi for a, b in zip(t, t[1:])]
    wrong = {
        "TPOT taken over tokens (every gap of every request pooled) instead of over requests: "
        "the one 400-token request outvotes thirty users": {q: percentile(pooled, q)
                                                           for q in (50, 99)},
        "TPOT includes the wait for the first token (e2e / n): TPOT is the mean gap between "
        "consecutive tokens, (t_last - t_first) / (n - 1)": {
            q: percentile([t[-1] / len(t) for t in times], q) for q in (50, 99)},
        "one-token requests have no inter-token gap: leave them out of TPOT, not in as 0": {
            q: percentile([(t[-1] - t[0]) / max(1, len(t) - 1) for t in times], q)
            for q in (50, 99)},
    }
    for key in want:
        q = float(key.split("_p")[1])
        if math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-12):
            continue
        if key.startswith("tpot"):
            for hint, values in wrong.items():
                if math.isclose(got[key], values[q], rel_tol=1e-9):
                    raise AssertionError(f"latency_percentiles[{key!r}] = {got[key]:.6g}, "
                                         f"expected {want[key]:.6g}: {hint}")
        raise AssertionError(f"latency_percentiles[{key!r}] = {got[key]:.6g}, expected "
                             f"{want[key]:.6g} (percentiles over requests, linear "
                             "interpolation between the closest ranks)")
    return "TTFT and TPOT p50/p99 over 31 requests, one of them 400 tokens long"


# ---------------------------------------------------------------------------------------------
# Chapter 05: paged attention
# ---------------------------------------------------------------------------------------------

@exercise("blocks_needed", "ch05_paged_attention")
def _grade_blocks_needed(fn: Callable) -> str:
    for n, bs in ((0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (32, 16), (33, 16), (7, 1),
                  (100, 7), (98, 7)):
        got, want = int(fn(n, bs)), -(-n // bs)
        if got == want:
            continue
        if n % bs == 0 and got == want + 1:
            raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}: "
                                 f"the off-by-one page count at exact multiples ({n} tokens "
                                 f"fill exactly {want} pages; n // bs + 1 is one too many)")
        if got == n // bs:
            raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}: "
                                 "a partly filled last page is still a page (round up)")
        raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}")
    return "ceil(n / block_size), exact multiples included (10 cases)"


@exercise("translate", "ch05_paged_attention")
def _grade_translate(fn: Callable) -> str:
    table, bs = [7, 2, 5, 0], 4
    for pos in range(16):
        got = int(fn(list(table), pos, bs))
        want = table[pos // bs] * bs + pos % bs
        if got == want:
            continue
        if got == table[pos // bs] + pos % bs:
            hint = "a page id counts pages, not slots: multiply it by block_size"
        elif got == pos:
            hint = "the block table was ignored: token pos lives in page table[pos // bs]"
        elif got == table[min(pos // bs + 1, 3)] * bs + pos % bs:
            hint = "off by one page: position pos is in entry pos // block_size"
        else:
            hint = "slot = block_table[pos // block_size] * block_size + pos % block_size"
        raise AssertionError(f"translate({table}, {pos}, {bs}) returned {got}, expected "
                             f"{want}: {hint}")
    try:
        fn(list(table), 16, bs)
    except IndexError:
        return "every position of a 4-page table, and a position past its end refused"
    raise AssertionError(f"translate({table}, 16, {bs}) did not raise IndexError: position 16 "
                         "needs a fifth page the table does not have")


@exercise("CowPages", "ch05_paged_attention")
def _grade_cow_pages(cls: Callable) -> str:
    pool = cls(4)
    a, b = pool.alloc(), pool.alloc()
    if a == b or pool.num_free != 2 or pool.refcount(a) != 1:
        raise AssertionError(f"alloc: two pages {a}, {b} with {pool.num_free} free left and "
                             f"refcount {pool.refcount(a)}; expected two distinct pages, 2 free, "
                             "refcount 1")
    pool.share(a)  # a second sequence with the same prefix
    pool.free(a)  # one of them finishes
    if pool.num_free != 2 or pool.refcount(a) != 1:
        raise AssertionError(
            f"freed a shared page while refs > 0: page {a} had 2 holders, one freed it, and now "
            f"refcount={pool.refcount(a)}, {pool.num_free} pages free. The other holder still "
            "reads it: it returns to the free list only at refcount 0")
    pool.share(a)
    w = pool.write(a)  # a holder writes into the shared page
    if w == a:
        raise AssertionError(
            f"a forgotten copy-on-write: write({a}) on a page with 2 holders returned the page "
            "itself, so the write would change the other holder's tokens. Allocate a copy and "
            "move the writer's reference to it")
    if pool.refcount(a) != 1 or pool.refcount(w) != 1:
        raise AssertionError(
            f"copy-on-write: after write({a}) the original has refcount {pool.refcount(a)} and "
            f"the copy {pool.refcount(w)}; expected 1 and 1 (the writer's reference moved)")
    if pool.write(w) != w or pool.num_free != 1:
        raise AssertionError("write on a page with one holder must return it in place, "
                             "allocating nothing")
    for p in (a, b, w):
        pool.free(p)
    if pool.num_free != 4:
        raise AssertionError(f"after freeing every page, {pool.num_free} of 4 are free")
    try:
        pool.free(a)
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"free({a}) on a free page did not raise: a double free puts a "
                             "page in the free list twice, and two sequences end up sharing it")
    full = cls(1)
    full.alloc()
    try:
        full.alloc()
    except MemoryError:
        return "alloc, share, free at refcount 0, copy-on-write, double free refused"
    raise AssertionError("alloc on a full pool did not raise MemoryError")


def _check_order(events) -> None:
    """Raise unless the events are a pipelined schedule: see `_grade_run_pipelined`."""
    seen: dict[int, list[str]] = {}
    in_flight: dict[int, int] = {}  # launched, uncommitted step -> its slot
    prev = None  # the step launched before the latest one
    last = None
    for ev in events:
        pieces = seen.setdefault(ev.step, [])
        want_next = ("launch", "finish_sampling", "wait_tokens", "commit")[len(pieces)] \
            if len(pieces) < 4 else None
        if ev.piece != want_next:
            raise AssertionError(
                f"step {ev.step}: {ev.piece} called after {pieces or 'nothing'}; each step goes "
                "launch -> finish_sampling -> wait_tokens -> commit, once each")
        pieces.append(ev.piece)
        if ev.piece == "launch":
            holder = [s for s, slot in in_flight.items() if slot == ev.slot]
            if holder:
                raise AssertionError(
                    f"step {ev.step} was launched into slot {ev.slot} while step {holder[0]}, "
                    "still uncommitted, holds it: alternate the two slots (1 - prev.slot)")
            in_flight[ev.step] = ev.slot
            prev, last = last, ev.step
            if prev is not None and "wait_tokens" in seen[prev]:
                raise AssertionError(
                    f"step {ev.step} was launched after step {prev}'s tokens were read "
                    "(wait_tokens): that is the blocking loop, and the device idles while the "
                    f"host commits. Launch step t+1 first, then commit step t")
        elif ev.piece == "finish_sampling" and prev is not None and ev.step == last \
                and "commit" not in seen[prev]:
            raise AssertionError(
                f"step {ev.step} was sampled (finish_sampling) before step {prev} was committed: "
                f"constrained rows of step {ev.step} need masks from the state commit {prev} "
                "produces. Order: launch t+1, commit t, then finish sampling t+1")
        elif ev.piece == "commit":
            in_flight.pop(ev.step)
    unfinished = {s: p for s, p in seen.items() if len(p) < 4}
    if unfinished:
        step, pieces = min(unfinished.items())
        raise AssertionError(f"step {step} was launched but never committed (it got only "
                             f"{pieces}): commit the last step in flight before returning")


@exercise("run_pipelined", "ch07_pipelined")
def _grade_run_pipelined(fn: Callable) -> str:
    lengths = (2, 4, 7, 5)
    want = _blocking_tokens(lengths)
    eng, ids, life, error = _engine_run(fn, lengths)
    if error is not None:
        raise AssertionError(f"run_pipelined on requests of {lengths} tokens: {error}")
    if not life.events:
        raise AssertionError("run_pipelined launched nothing")
    _check_order(life.events)
    got = [eng.seqs[i].output_ids for i in ids]
    if got != want:
        bad = next(i for i in range(len(ids)) if got[i] != want[i])
        raise AssertionError(f"run_pipelined: request {ids[bad]} decoded {got[bad]}, the "
                             f"blocking loop {want[bad]}: a pipeline must not change the tokens")
    for rid in ids:
        ended, back = life.finalized_at(rid), life.released_at(rid)
        if ended is None or back != ended + 1:
            raise AssertionError(
                f"run_pipelined: request {rid} ended at the commit of step {ended}, its pages "
                f"came back at the commit of step {back}; with step t+1 launched before commit "
                "t they come back one commit later, at its zombie row (finalized and refs == 0)")
    if max(life.max_refs(rid) for rid in ids) < 2:
        raise AssertionError("run_pipelined: no sequence was ever in two launched steps at "
                             "once (inflight_refs 2): nothing overlapped")
    eng.check_all_released()
    return ("same tokens as blocking; step t+1 launched before step t's tokens were read, into "
            "the other slot; sampled after commit t; pages back at the zombie row's commit")


# Chapter 03: quantization
# ---------------------------------------------------------------------------------------------

def _int8_case() -> torch.Tensor:
    """A weight [6, 40] whose rows differ in size by 100x; rows 1 and 4 peak at a NEGATIVE value."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 40, generator=gen) * torch.tensor([0.02, 0.1, 0.5, 1.0, 2.0, 0.05])[:, None]
    w[1, 7], w[4, 0] = -0.6, -9.0  # the largest magnitude of the row is negative
    return w


@exercise("quantize_int8", "ch03_quantization")
def _grade_quantize_int8(fn: Callable) -> str:
    w = _int8_case()
    got = fn(w.clone())
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError("quantize_int8: return a tuple (q, scale)")
    q, scale = got
    amax = w.abs().amax(dim=1)
    want_s = amax / 127  # the reference: symmetric, one scale per output channel (row)
    want_q = torch.clamp(torch.round(w / want_s[:, None]), -127, 127)
    if scale.numel() == 1 or (scale.numel() == w.shape[0] and torch.allclose(
            scale.flatten(), scale.flatten()[0].expand(w.shape[0]))):
        raise AssertionError(
            "quantize_int8: one scale for the whole tensor (per-tensor). Rows here differ in "
            "size by 100x, so the small rows round to a handful of levels; use one scale per "
            "output channel: scale[n] = max|w[n, :]| / 127, shape [N]")
    if scale.shape != (w.shape[0],):
        raise AssertionError(f"quantize_int8: scale has shape {tuple(scale.shape)}, expected "
                             f"({w.shape[0]},): one per output channel (row)")
    if q.dtype != torch.int8:
        raise AssertionError(f"quantize_int8: q has dtype {q.dtype}; store the codes as int8")
    if int(q.min()) == -128 or torch.allclose(scale.float(), amax / 128):
        raise AssertionError(
            "quantize_int8: clamped to -128 with a symmetric scale. With scale = max|w| / 127 "
            "the codes span [-127, 127]; using -128 (or max|w| / 128) makes the grid lopsided: "
            "a row whose largest weight is positive clips it to 127. Clamp to [-127, 127]")
    _close(scale.float(), want_s, "quantize_int8 scale", atol=0, rtol=1e-5)
    if torch.equal(q.float(), torch.trunc(w / want_s[:, None])) and not torch.equal(
            q.float(), want_q):
        raise AssertionError("quantize_int8: the codes are truncated toward zero (int() or "
                             ".to(torch.int8) on w / scale) instead of rounded to the nearest "
                             "level: use torch.round before converting, or the error doubles")
    bad = (q.float() != want_q).nonzero()
    if len(bad):
        n, k = (int(i) for i in bad[0])
        raise AssertionError(f"quantize_int8: q[{n}, {k}] = {int(q[n, k])}, expected "
                             f"{int(want_q[n, k])} (w = {float(w[n, k]):.6g}, scale = "
                             f"{float(want_s[n]):.6g}): round(w / scale) to nearest")
    return "per-channel symmetric scales, codes rounded into [-127, 127]"


@exercise("dequantize_int8", "ch03_quantization")
def _grade_dequantize_int8(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (5, 24), generator=gen, dtype=torch.int8)
    scale = torch.rand(5, generator=gen) + 0.01
    got = fn(q, scale)
    if got.shape != q.shape:
        raise AssertionError(f"dequantize_int8: shape {tuple(got.shape)}, expected (5, 24)")
    if torch.allclose(got.float(), q.float() * scale[0]) and not torch.allclose(scale, scale[0]):
        raise AssertionError("dequantize_int8: every row used scale[0] (a per-tensor scale); "
                             "row n is q[n] * scale[n]")
    _close(got.float(), q.float() * scale[:, None], "dequantize_int8 (w = q * scale[n])",
           atol=0, rtol=1e-6)
    if got.dtype != torch.float32:
        raise AssertionError(f"dequantize_int8: returned {got.dtype}; return fp32 weights")
    return "w = q * scale, one scale per row"


@exercise("pack_int4", "ch03_quantization")
def _grade_pack_int4(fn: Callable) -> str:
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 9, 10]], dtype=torch.uint8)
    got = fn(q.clone())
    want = torch.tensor([[0x21, 0x43], [0x0F, 0xA9]], dtype=torch.uint8)  # even column low
    swapped = torch.tensor([[0x12, 0x34], [0xF0, 0x9A]], dtype=torch.uint8)
    if got.shape != want.shape:
        raise AssertionError(f"pack_int4: shape {tuple(got.shape)}, expected (2, 2): two codes "
                             "per byte along each row")
    if got.dtype != torch.uint8:
        raise AssertionError(f"pack_int4: dtype {got.dtype}, expected torch.uint8")
    if torch.equal(got, swapped):
        raise AssertionError("pack_int4: wrong nibble order: column 2j goes in the LOW nibble "
                             "(bits 0-3) and column 2j+1 in the HIGH nibble (bits 4-7), so "
                             "q = [1, 2] packs to 0x21, not 0x12")
    _close(got.int(), want.int(), "pack_int4", atol=0, rtol=0)
    return "two codes per byte, even column in the low nibble"


@exercise("unpack_int4", "ch03_quantization")
def _grade_unpack_int4(fn: Callable) -> str:
    packed = torch.tensor([[0x21, 0x43], [0x0F, 0xA9]], dtype=torch.uint8)
    want = torch.tensor([[1, 2, 3, 4], [15, 0, 9, 10]], dtype=torch.uint8)
    got = fn(packed.clone())
    if got.shape != want.shape:
        raise AssertionError(f"unpack_int4: shape {tuple(got.shape)}, expected (2, 4)")
    if torch.equal(got.int(), want.int().reshape(2, 2, 2).flip(-1).reshape(2, 4)):
        raise AssertionError("unpack_int4: wrong nibble order: the LOW nibble (byte & 0xF) is "
                             "column 2j and the HIGH nibble (byte >> 4) column 2j+1, so 0x21 "
                             "unpacks to [1, 2], not [2, 1]")
    _close(got.int(), want.int(), "unpack_int4", atol=0, rtol=0)
    return "two codes out of every byte, low nibble first"


def _fake_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Reference int4 group RTN, quantize then dequantize (fp32 scales)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    return (torch.round((wg - lo) / s).clamp(0, 15) * s + lo).reshape(n, k)


@exercise("awq_scale", "ch03_quantization")
def _grade_awq_scale(fn: Callable) -> str:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen)
    x[:, [3, 40]] *= 25  # two channels that large activations hit
    w = torch.randn(32, 64, generator=gen)
    s = fn(x.clone(), w.clone(), 32)
    if s.shape != (64,):
        raise AssertionError(f"awq_scale: shape {tuple(s.shape)}, expected (64,): one scale per "
                             "input channel")

    def err(scale: torch.Tensor) -> float:
        return float(((x @ (_fake_int4(w * scale, 32) / scale).t() - x @ w.t()) ** 2).mean())

    act = x.abs().mean(0)
    grid = [act.pow(i / 20) / (act.pow(i / 20).max() * act.pow(i / 20).min()).sqrt()
            for i in range(21)]
    best, rtn = min(err(g) for g in grid), err(torch.ones(64))
    got = err(s.float())
    if torch.allclose(s.float(), torch.ones(64)) or got >= rtn:
        raise AssertionError(f"awq_scale: output error {got:.4g} is no better than plain RTN "
                             f"({rtn:.4g}): channels 3 and 40 carry 25x larger inputs, so their "
                             "weights should be scaled up (s = mean|x|^alpha) before rounding")
    if got > 1.05 * best:
        raise AssertionError(f"awq_scale: output error {got:.4g}, but the best alpha on the grid "
                             f"reaches {best:.4g}: try every alpha in 0, 0.05, ..., 1 and keep "
                             "the one with the smallest error of x @ W^T")
    return f"output error {got:.4g} against {rtn:.4g} for plain RTN"


# -- chapter 08: the whole engine ------------------------------------------------------------


def _ref_predict_wall(steps, tokens, a, b, h, pipelined, fixed_scale=1.0) -> float:
    device = steps * a * fixed_scale + tokens * b
    return max(steps * h, device) if pipelined else steps * h + device


@exercise("predict_wall", "ch08_capstone")
def _grade_predict_wall(fn: Callable) -> str:
    cases = [  # (steps, tokens, a, b, h, pipelined, fixed_scale): device-bound, host-bound
        (50, 400, 8e-3, 2e-4, 1e-3, False, 1.0), (50, 400, 8e-3, 2e-4, 1e-3, True, 1.0),
        (40, 40, 1e-3, 1e-5, 5e-3, True, 1.0), (40, 40, 1e-3, 1e-5, 5e-3, False, 1.0),
        (30, 900, 6e-3, 1e-4, 2e-3, True, 4.0), (30, 900, 6e-3, 1e-4, 2e-3, False, 3.5),
    ]
    for c in cases:
        steps, tokens, a, b, h, pipelined, scale = c
        got, want = float(fn(*c)), _ref_predict_wall(*c)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        loop = "pipelined" if pipelined else "blocking"
        host, dev = steps * h, steps * a * scale + tokens * b
        if pipelined and math.isclose(got, host + dev, rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s is host + device: the "
                                 "pipelined loop overlaps them, max(host, device)")
        if not pipelined and math.isclose(got, max(host, dev), rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s is max(host, device): the "
                                 "blocking loop waits for each, host + device")
        if math.isclose(got, _ref_predict_wall(steps, tokens, a * scale, b * scale, h,
                                               pipelined), rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s scales the per-token cost by "
                                 "fixed_scale too: the weight bytes are read once per launch, "
                                 "so only a is scaled")
        if math.isclose(got, _ref_predict_wall(steps, tokens, a, b, h, pipelined),
                        rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s ignores fixed_scale ({scale}): "
                                 "fp32 weights take that many times the bytes of quantized ones")
        raise AssertionError(f"predict_wall{c} ({loop}): got {got:.6g} s, want {want:.6g} s "
                             f"(host {host:.4g} s, device {dev:.4g} s)")
    return "blocking adds host and device, pipelined overlaps them; weight bytes scale a only"


def _relay_trial(fn: Callable, script: list, leave_after: int | None) -> tuple:
    """Run `fn` against scripted events; the client leaves after `leave_after` polls."""
    events, polls, cancels = list(script), [0], []

    def next_event(timeout):
        polls[0] += 1
        if polls[0] > 200:
            raise AssertionError("relay kept waiting after its client had left (200 quiet "
                                 "polls): check is_disconnected() whenever nothing arrives")
        return events.pop(0) if events else None

    def is_disconnected():
        return leave_after is not None and polls[0] >= leave_after

    def cancel():
        cancels.append(polls[0])

    out = fn(next_event, is_disconnected, cancel)
    return out, cancels


@exercise("relay", "ch08_capstone")
def _grade_relay(fn: Callable) -> str:
    done = object()
    script = [("text", "Hel"), None, ("text", "lo"), ("done", done)]
    out, cancels = _relay_trial(fn, script, leave_after=None)
    if cancels:
        raise AssertionError("relay cancelled a request whose client stayed: only a client "
                             "that has gone cancels")
    if out is None or list(out[0]) != ["Hel", "lo"] or out[1] is not done:
        raise AssertionError(f"relay returned {out!r} for text 'Hel', 'lo' then done: want "
                             "(['Hel', 'lo'], the done event's value)")
    # the client leaves after the request finished: nothing to cancel (a double free on abort)
    out, cancels = _relay_trial(fn, [("text", "a"), ("done", done), None, None], leave_after=2)
    if cancels:
        raise AssertionError("relay cancelled a request that had already finished: the engine "
                             "has released it, and a cancel now frees its pages twice (the "
                             "double free on abort)")
    # the client leaves mid-answer
    out, cancels = _relay_trial(fn, [("text", "a"), None, None, None], leave_after=3)
    if not cancels:
        raise AssertionError("relay returned without cancelling when its client left: the "
                             "request runs on to max_tokens, holding its KV pages for nobody")
    if len(cancels) > 1:
        raise AssertionError(f"relay cancelled {len(cancels)} times: once is enough")
    if out is not None:
        raise AssertionError(f"relay returned {out!r} after its client left: return None")
    return "collects text until done; a client that leaves cancels once, a finished one never"

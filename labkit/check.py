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
    eng, ids, life, error = _engine_run(lambda e: e.run("pipelined"), commit_row=fn)
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

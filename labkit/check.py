"""Graders for the exercises: the same checks grade labkit's solutions and a learner's code.

A notebook cell calls `check.grade("rms_norm", my_rms_norm)`; the test suite calls every grader
on `tests/adapters.py`, which points at labkit's solutions, or at the learner's stubs in
`exercises/` when `LABKIT_EXERCISES=1`. A grader compares against a small reference written
right here and, when the answer is wrong, says which part is off.
"""

from __future__ import annotations

import inspect
import math
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


# ---------------------------------------------------------------------------------------------
# Chapter 01: roofline
# ---------------------------------------------------------------------------------------------

def _diagnose(got: float, want: float, wrong: dict[str, float], what: str) -> None:
    """Raise with the hint of the first known mistake that reproduces `got`, if any."""
    if math.isclose(got, want, rel_tol=1e-9):
        return
    for hint, value in wrong.items():
        if math.isclose(got, value, rel_tol=1e-9) and not math.isclose(value, want, rel_tol=1e-9):
            raise AssertionError(f"{what}: got {got:.6g}, expected {want:.6g}. {hint}")
    raise AssertionError(f"{what}: got {got:.6g}, expected {want:.6g}")


@exercise("matmul_intensity", "ch01_roofline")
def _grade_matmul_intensity(fn: Callable) -> str:
    cases = [(1, 4096, 4096, 2), (256, 4096, 4096, 2), (64, 128, 256, 4), (512, 512, 512, 1)]
    for m, n, k, b in cases:
        got = float(fn(m, n, k, b))
        # the reference: 2 FLOPs per multiply-add, over A, B and C each moved once, in bytes
        flops, elems = 2 * m * n * k, m * k + k * n + m * n
        want = flops / (elems * b)
        _diagnose(got, want, {
            "Forgot the 2 in 2MNK: a multiply-add is two FLOPs.": want / 2,
            "Forgot bytes per element: divide by bytes moved, not elements.": flops / elems,
            "Counted the reads of A and B but not the write of C (M*N elements).":
                flops / ((m * k + k * n) * b),
            "Counted only the weights B (K*N); A and C are moved too.": flops / (k * n * b),
            "That is bytes per FLOP: intensity is FLOPs / bytes.": elems * b / flops,
        }, f"matmul_intensity({m}, {n}, {k}, {b})")
    return f"exact on {len(cases)} shapes, from a matvec (I ~ 1) to square matmuls"


def _ref_decode_counts(cfg: ModelConfig, batch: int, context_len: int) -> dict[str, float]:
    """Hand counts of one decode step's FLOPs, term by term."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = d * q + d * kv + d * kv + q * d + 3 * d * f  # q, k, v, o; gate, up, down
    return {"layers": 2 * batch * n * layer_weights, "head": 2 * batch * d * v,
            "attention": 4 * batch * n * q * context_len}  # q.k + p.v, every query head


@exercise("decode_step_flops", "ch01_roofline")
def _grade_decode_step_flops(fn: Callable) -> str:
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx in ((1, 1), (4, 100), (16, 2048)):
            got = float(fn(cfg, batch, ctx))
            t = _ref_decode_counts(cfg, batch, ctx)
            want = t["layers"] + t["head"] + t["attention"]
            matmuls = t["layers"] + t["head"]
            _diagnose(got, want, {
                "Forgot the 2 per weight: a multiply-add is two FLOPs.": want / 2,
                "Forgot the 2 per weight in the matmuls (attention is right).":
                    matmuls / 2 + t["attention"],
                "Counted the matmuls but not attention over the context.": matmuls,
                "Forgot the output head (hidden_size x vocab_size per token).":
                    t["layers"] + t["attention"],
                "Attention: every query head (num_heads), not only the KV heads, does the "
                "work.": matmuls + t["attention"] * cfg.num_kv_heads / cfg.num_heads,
                "Attention has two halves: q.k over the keys and p.v over the values.":
                    matmuls + t["attention"] / 2,
                "2 x num_params() counts the norm weights, which do no matmul; count the "
                "projection, MLP and head weights.": 2 * batch * cfg.num_params() + t["attention"],
                "Counted one sequence: every term scales with the batch.": want / batch,
            }, f"decode_step_flops({cfg.name}, batch={batch}, context_len={ctx})")
    return "exact for tiny and SmolLM2-135M at 3 batch sizes and contexts"


@exercise("decode_step_bytes", "ch01_roofline")
def _grade_decode_step_bytes(fn: Callable) -> str:
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx, wb, kvb in ((1, 1, 2, 2), (8, 1000, 2, 2), (32, 512, 0.5, 1),
                                    (3, 77, 4, 4)):
            got = float(fn(cfg, batch, ctx, wb, kvb))
            # the reference: weights once; each sequence reads ctx tokens of K and V and
            # writes one; a token's K and V hold 2 * layers * kv_heads * head_dim values
            weights = cfg.num_params() * wb
            per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kvb
            kv_read, kv_write = batch * ctx * per_token, batch * per_token
            want = weights + kv_read + kv_write
            kv = kv_read + kv_write
            _diagnose(got, want, {
                "Counted the weights but not the KV cache: each sequence reads the K and V of "
                "its whole context.": weights,
                "Forgot to write the new token's K and V.": weights + kv_read,
                "Weights are read once per step, not once per sequence: that sharing is what "
                "batching buys.": batch * weights + kv,
                "Forgot bytes per element: multiply element counts by weight_bytes / kv_bytes.":
                    weights / wb + kv / kvb,
                "Counted K but not V (or V but not K): the cache holds both.": weights + kv / 2,
                "The cache holds a K and a V in every layer: multiply by num_layers.":
                    weights + kv / cfg.num_layers,
                "GQA: the cache holds num_kv_heads heads per layer, not num_heads.":
                    weights + kv * cfg.num_heads / cfg.num_kv_heads,
            }, f"decode_step_bytes({cfg.name}, batch={batch}, context_len={ctx}, "
               f"weight_bytes={wb}, kv_bytes={kvb})")
    return "exact for tiny and SmolLM2-135M, bf16 to int4 weights, fp32 to fp8 KV"


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


@exercise("commit_row", "ch07_pipelined")
def _grade_commit_row(fn: Callable) -> str:
    # a zombie: finalized at commit t (EOS = 2 appended), still a row of step t+1
    z = _seq(finalized=True, inflight_refs=1, output_ids=[11, 12, 2])
    got = fn(z, 99)
    if z.output_ids != [11, 12, 2]:
        raise AssertionError(
            f"commit_row: a zombie row appended a token (output_ids became {z.output_ids}): a "
            "sequence finalized at commit t must not grow at commit t+1. When `finalized` is "
            "set, append nothing (the reference still drops)")
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
    p.finalized = True
    second = fn(p, 7)  # commit t+1: the zombie row
    state = (first, second, p.output_ids, p.inflight_refs, p.zombie_rows)
    if state != (True, False, [5, 2], 0, 1):
        raise AssertionError(
            "commit_row in the pipelined order (launch t, launch t+1, commit t ends the "
            "sequence, commit t+1): expected (True, False, output_ids [5, 2], inflight_refs 0, "
            f"zombie_rows 1), got {state}")
    return "live rows append, zombie rows are skipped and counted, every row drops its ref"


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

"""Chapter 03's graders: int8 per-channel quantization, int4 packing, the AWQ scale."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.graders.common import assert_close


def _int8_case() -> torch.Tensor:
    """A weight [7, 40] whose rows differ in size by 100x; rows 1 and 4 peak at a NEGATIVE value;
    row 6 is all zeros (a pruned channel: its max is 0)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 40, generator=gen) * torch.tensor(
        [0.02, 0.1, 0.5, 1.0, 2.0, 0.05, 0.0])[:, None]
    w[1, 7], w[4, 0] = -0.6, -9.0  # the largest magnitude of the row is negative
    return w


def grade_quantize_int8(fn: Callable) -> str:
    """Grade an answer to exercise `quantize_int8` (exercises/ch03_quantization.py)."""
    w = _int8_case()
    got = fn(w.clone())
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError("quantize_int8: return a tuple (q, scale)")
    q, scale = got
    amax = w.abs().amax(dim=1)
    live = amax > 0  # rows with a weight; the all-zero row is checked on its own, last
    want_s = amax / 127  # the reference: symmetric, one scale per output channel (row)
    want_q = torch.clamp(torch.round(w / want_s.clamp(min=1e-30)[:, None]), -127, 127)
    if scale.numel() == 1 or (scale.numel() == w.shape[0] and torch.allclose(
            scale.flatten()[live], scale.flatten()[0].expand(int(live.sum())))):
        raise AssertionError(
            "quantize_int8: one scale for the whole tensor (per-tensor). Rows here differ in "
            "size by 100x, so the small rows round to a handful of levels; use one scale per "
            "output channel: scale[n] = max|w[n, :]| / 127, shape [N]")
    if scale.shape != (w.shape[0],):
        raise AssertionError(f"quantize_int8: scale has shape {tuple(scale.shape)}, expected "
                             f"({w.shape[0]},): one per output channel (row)")
    if q.dtype != torch.int8:
        raise AssertionError(f"quantize_int8: q has dtype {q.dtype}; store the codes as int8")
    if q.shape != w.shape:
        raise AssertionError(f"quantize_int8: q has shape {tuple(q.shape)}, expected "
                             f"{tuple(w.shape)}: one code per weight")
    # the rows that hold weights: the chapter's mistakes, each on its own evidence
    ql, sl, wl, wq, ws = q[live], scale[live].float(), w[live], want_q[live], want_s[live]
    if int(ql.min()) == -128 or torch.allclose(sl, amax[live] / 128):
        raise AssertionError(
            "quantize_int8: clamped to -128 with a symmetric scale. With scale = max|w| / 127 "
            "the codes span [-127, 127]; using -128 (or max|w| / 128) makes the grid lopsided: "
            "a row whose largest weight is positive clips it to 127. Clamp to [-127, 127]")
    assert_close(sl, ws, "quantize_int8 scale", atol=0, rtol=1e-5)
    if torch.equal(ql.float(), torch.trunc(wl / ws[:, None])) and not torch.equal(
            ql.float(), wq):
        raise AssertionError("quantize_int8: the codes are truncated toward zero (int() or "
                             ".to(torch.int8) on w / scale) instead of rounded to the nearest "
                             "level: use torch.round before converting, or the error doubles")
    bad = (q.float() != want_q)[live].nonzero()
    if len(bad):
        rows = live.nonzero().flatten()
        n, k = int(rows[bad[0, 0]]), int(bad[0, 1])
        raise AssertionError(f"quantize_int8: q[{n}, {k}] = {int(q[n, k])}, expected "
                             f"{int(want_q[n, k])} (w = {float(w[n, k]):.6g}, scale = "
                             f"{float(want_s[n]):.6g}): round(w / scale) to nearest")
    zero = int((~live).nonzero()[0])  # the all-zero row
    s0 = float(scale[zero])
    if s0 == 0:
        raise AssertionError(
            f"quantize_int8: row {zero} is all zeros and its scale is 0, so w / scale is "
            "0 / 0 = NaN there (what NaN becomes in int8 is undefined: a code that happens to "
            "be right on one machine is garbage on another). Clamp max|w| to a tiny positive "
            "number (e.g. 1e-8) before dividing: the row's codes are then 0")
    if not (s0 > 0 and s0 < float("inf")):
        raise AssertionError(f"quantize_int8: row {zero} is all zeros and its scale is {s0}; "
                             "give it a small positive scale (clamp max|w| to e.g. 1e-8)")
    if bool((q[zero] != 0).any()):
        raise AssertionError(f"quantize_int8: row {zero} is all zeros but its codes are "
                             f"{q[zero].tolist()[:6]}...: every code of a zero row must be 0")
    return ("per-channel symmetric scales, codes rounded into [-127, 127], an all-zero row kept "
            "at 0")


def grade_dequantize_int8(fn: Callable) -> str:
    """Grade an answer to exercise `dequantize_int8` (exercises/ch03_quantization.py)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (5, 24), generator=gen, dtype=torch.int8)
    scale = torch.rand(5, generator=gen) + 0.01
    got = fn(q, scale)
    if got.shape != q.shape:
        raise AssertionError(f"dequantize_int8: shape {tuple(got.shape)}, expected (5, 24)")
    if torch.allclose(got.float(), q.float() * scale[0]) and not torch.allclose(scale, scale[0]):
        raise AssertionError("dequantize_int8: every row used scale[0] (a per-tensor scale); "
                             "row n is q[n] * scale[n]")
    assert_close(got.float(), q.float() * scale[:, None], "dequantize_int8 (w = q * scale[n])",
           atol=0, rtol=1e-6)
    if got.dtype != torch.float32:
        raise AssertionError(f"dequantize_int8: returned {got.dtype}; return fp32 weights")
    return "w = q * scale, one scale per row"


def grade_pack_int4(fn: Callable) -> str:
    """Grade an answer to exercise `pack_int4` (exercises/ch03_quantization.py)."""
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
    assert_close(got.int(), want.int(), "pack_int4", atol=0, rtol=0)
    return "two codes per byte, even column in the low nibble"


def grade_unpack_int4(fn: Callable) -> str:
    """Grade an answer to exercise `unpack_int4` (exercises/ch03_quantization.py)."""
    packed = torch.tensor([[0x21, 0x43], [0x0F, 0xA9]], dtype=torch.uint8)
    want = torch.tensor([[1, 2, 3, 4], [15, 0, 9, 10]], dtype=torch.uint8)
    got = fn(packed.clone())
    if got.shape != want.shape:
        raise AssertionError(f"unpack_int4: shape {tuple(got.shape)}, expected (2, 4)")
    if torch.equal(got.int(), want.int().reshape(2, 2, 2).flip(-1).reshape(2, 4)):
        raise AssertionError("unpack_int4: wrong nibble order: the LOW nibble (byte & 0xF) is "
                             "column 2j and the HIGH nibble (byte >> 4) column 2j+1, so 0x21 "
                             "unpacks to [1, 2], not [2, 1]")
    assert_close(got.int(), want.int(), "unpack_int4", atol=0, rtol=0)
    return "two codes out of every byte, low nibble first"


def _fake_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Reference int4 group RTN, quantize then dequantize (fp32 scales)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    return (torch.round((wg - lo) / s).clamp(0, 15) * s + lo).reshape(n, k)


def grade_awq_scale(fn: Callable) -> str:
    """Grade an answer to exercise `awq_scale` (exercises/ch03_quantization.py)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen)
    x[:, [3, 40]] *= 25  # two channels that large activations hit
    w = torch.randn(32, 64, generator=gen)
    s = fn(x.clone(), w.clone(), 32)
    if s.shape != (64,):
        raise AssertionError(f"awq_scale: shape {tuple(s.shape)}, expected (64,): one scale per "
                             "input channel")
    s = s.float()
    bad = ~torch.isfinite(s) | (s <= 0)
    if bool(bad.any()):
        signed = x.mean(0) < 0  # channels whose mean of x (not of |x|) is negative
        why = ("they are the channels whose mean of x is negative: act is the mean of |x|, and a "
               "negative number to a fractional power alpha is NaN" if torch.equal(bad, signed)
               else "every one: a single NaN spreads to all through the normalisation by "
               "sqrt(s.max() * s.min()), and the first is a negative act to a fractional power "
               "when act is the mean of x rather than of |x|" if bool(bad.all())
               else "act = mean over tokens of |x| is positive, and so is every act ** alpha")
        raise AssertionError(f"awq_scale: s[{int(bad.nonzero()[0])}] = "
                             f"{float(s[bad][0]):.4g} ({int(bad.sum())} of 64 scales are NaN, "
                             f"infinite or <= 0): {why}")

    def err(scale: torch.Tensor) -> float:
        return float(((x @ (_fake_int4(w * scale, 32) / scale).t() - x @ w.t()) ** 2).mean())

    act = x.abs().mean(0)
    grid = [act.pow(i / 20) / (act.pow(i / 20).max() * act.pow(i / 20).min()).sqrt()
            for i in range(21)]
    errs = [err(g) for g in grid]
    best, rtn = min(errs), errs[0]
    got = err(s)
    if torch.allclose(s, torch.ones(64)):
        raise AssertionError(
            f"awq_scale: s = 1 for every channel, plain RTN (output error {got:.4g}); alpha = "
            f"{errs.index(best) / 20:g} would cut it to {best:.4g}. A search ends at alpha = 0 "
            "when it measures the weights' error (W_q - W) instead of the outputs' "
            "(x @ W_q^T - x @ W^T), when it forgets to divide the dequantized w * s by s "
            "before the product, or when every alpha > 0 gave NaN (act = mean of x, not of |x|)")
    same = lambda a, b: torch.allclose(a / a.max(), b / b.max(), rtol=1e-3)  # noqa: E731
    on_grid = [i for i, g in enumerate(grid) if same(s, g)]
    if on_grid and got > 1.05 * best:
        i = on_grid[0]
        why = (f"that is the LARGEST error of the grid: a search that keeps the max instead of "
               "the min (or compares with > instead of <) ends here; a fixed alpha = "
               f"{i / 20:g} without a search gives it too" if errs[i] == max(errs)
               else "keep the alpha with the smallest error of x @ W^T, trying every alpha in "
               "0, 0.05, ..., 1")
        raise AssertionError(f"awq_scale: your s is alpha = {i / 20:g} (output error {got:.4g}, "
                             f"plain RTN {rtn:.4g}), the best alpha on the grid is "
                             f"{errs.index(best) / 20:g} ({best:.4g}): {why}")
    if same(1 / s, grid[errs.index(best)]):
        raise AssertionError(f"awq_scale: output error {got:.4g} (plain RTN: {rtn:.4g}, the "
                             f"best alpha: {best:.4g}): you returned 1 / s, the best scale's "
                             "reciprocal. s multiplies the weights (w * s) and divides the input")
    if got >= rtn:
        raise AssertionError(f"awq_scale: output error {got:.4g} is no better than plain RTN "
                             f"({rtn:.4g}): channels 3 and 40 carry 25x larger inputs, so their "
                             "weights should be scaled up (s = mean|x|^alpha) before rounding")
    if got > 1.05 * best:
        raise AssertionError(f"awq_scale: output error {got:.4g}, but the best alpha on the grid "
                             f"reaches {best:.4g}: try every alpha in 0, 0.05, ..., 1 and keep "
                             "the one with the smallest error of x @ W^T")
    return f"output error {got:.4g} against {rtn:.4g} for plain RTN"

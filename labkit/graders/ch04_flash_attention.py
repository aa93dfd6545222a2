"""Chapter 04's graders: the online-softmax update, merging split-K partials, tiled attention
(its numbers, and its peak memory as torch's allocator measures it)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from labkit.graders.common import assert_close


def _ref_attention(q, k, v, causal: bool, shift: int = 0):
    """Softmax attention written out; query i sees keys <= L - Tq + i + shift: (out, lse)."""
    # q: [B, H, Tq, D]; k, v: [B, H, L, D]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Tq, L]
    if causal:
        tq, n = q.shape[2], k.shape[2]
        last = torch.arange(tq)[:, None] + n - tq + shift
        s = s.masked_fill(torch.arange(n)[None, :] > last, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


def grade_online_softmax_update(fn: Callable) -> str:
    """Grade an answer to exercise `online_softmax_update` (exercises/ch04_flash_attention.py)."""
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
    assert_close(m, want_m, "online_softmax_update running max m", 0, 0)
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
    assert_close(l, want_l, "online_softmax_update running sum l", 1e-5, 1e-5)
    assert_close(acc, want_acc, "online_softmax_update accumulator acc", 1e-5, 1e-5)
    # a fully masked tile first: the row must stay empty, not NaN
    masked = torch.full((2, 3, 5), float("-inf"))  # [..., Tq, Tk]
    m, l, acc = fn(m0, l0, acc0, masked, v1)  # noqa: E741
    if torch.isnan(l).any() or torch.isnan(acc).any():
        raise AssertionError("online_softmax_update: a tile with every score -inf (all keys "
                             "masked) gave NaN: use 0 as the exp() reference while m is -inf")
    # ... then a tile of real keys whose scores all lie far below 0: the max must become theirs
    low = torch.randn(2, 3, 6, generator=gen) - 200.0  # [..., Tq, Tk]
    m2, l2, acc2 = fn(m, l, acc, low, v2)
    p = torch.exp(low - low.amax(-1, keepdim=True))
    if torch.equal(m, torch.zeros_like(m)) and not torch.allclose(l2, p.sum(-1)):
        raise AssertionError(
            "online_softmax_update: after a fully masked tile the running max m is 0, the "
            "'safe' exp() reference, instead of -inf. The next tile's scores (about -200 "
            f"here) then give exp(score - 0) = 0: l = {l2.max().item():.3g}, and out = acc / l "
            "is NaN. Use 0 only inside exp(); m = max(m, scores.amax(-1)) stays -inf until a "
            "row sees a key")
    assert_close(m2, low.amax(-1), "online_softmax_update m after a fully masked tile, then "
                 "scores near -200", 0, 0)
    assert_close(l2, p.sum(-1), "online_softmax_update l after a fully masked tile, then "
                 "scores near -200", 1e-5, 1e-5)
    assert_close(acc2, p @ v2, "online_softmax_update acc after a fully masked tile, then "
                 "scores near -200", 1e-5, 1e-5)
    return ("two tiles with a growing max; a fully masked tile, then scores far below 0, "
            "match the reference")


def grade_merge_partials(fn: Callable) -> str:
    """Grade an answer to exercise `merge_partials` (exercises/ch04_flash_attention.py)."""
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
    assert_close(lse, want_lse, "merge_partials lse", 1e-5, 1e-5)
    assert_close(out, want, "merge_partials out", 1e-5, 1e-5)
    # log-sum-exps far from 0: exp() overflows past 88.7 in fp32 (709.8 in fp64) and
    # underflows to 0 below -103 (-745): a merge must weigh by exp(lse_i - lse), never exp(lse_i)
    lse1 = torch.tensor([780.0, 781.5, -780.0, 2.0])  # [rows]
    lse2 = torch.tensor([781.0, 779.0, -779.0, 1.0])
    o1, o2 = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)  # [rows, D]
    big_lse = torch.logaddexp(lse1, lse2)
    big_want = (torch.exp(lse1 - big_lse)[:, None] * o1 + torch.exp(lse2 - big_lse)[:, None] * o2)
    out, lse = fn((o1, lse1), (o2, lse2))
    if not (torch.isfinite(out).all() and torch.allclose(out, big_want, atol=1e-5)
            and torch.allclose(lse, big_lse, atol=1e-4, rtol=1e-6)):
        raise AssertionError(
            "merge_partials: exp(lse) overflows: with lse1, lse2 near +780 (and near -780) "
            f"the merge gave out {out[:, 0].tolist()} and lse {lse.tolist()}, expected out "
            f"{[round(x, 4) for x in big_want[:, 0].tolist()]} and lse "
            f"{[round(x, 3) for x in big_lse.tolist()]}. exp(780) is inf (exp(-780) is 0): "
            "subtract the max before exp(), i.e. weigh each part by exp(lse_i - lse) with "
            "lse = torch.logaddexp(lse1, lse2)")
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    out, lse = fn(a, empty)
    assert_close(out, a[0], "merge_partials with an empty part (lse -inf)", 1e-6, 1e-6)
    out, _ = fn(empty, empty)
    if torch.isnan(out).any():
        raise AssertionError("merge_partials: two empty parts (both lse -inf) gave NaN; "
                             "return out 0")
    return "split-K merge of unequal chunks matches attention over the whole context"


def grade_tiled_attention(fn: Callable) -> str:
    """Grade an answer to exercise `tiled_attention` (exercises/ch04_flash_attention.py)."""
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
        assert_close(out, want, f"{what} out", 1e-5, 1e-5)
        assert_close(lse, want_lse, f"{what} lse", 1e-5, 1e-5)
    _grade_tiled_memory(fn, gen)
    return ("causal and not, Tq = L, Tq < L and Tq = 1, tiles that do not divide L; peak "
            "memory of a tile, not of the [Tq, L] scores")


def _grade_tiled_memory(fn: Callable, gen: torch.Generator) -> None:
    """Hold the peak memory of `fn` to O(tile): the chapter's point, measured by the allocator.

    One causal call with Tq = L = 2048, one head, D = 8, tiles of 16 keys: the inputs and the
    output are 0.26 MiB, a tile's scores [B, H, Tq, block_k] 0.125 MiB, and the whole [Tq, L]
    score matrix 16 MiB (its bool mask 4 MiB). The allowance, 4x the inputs and output plus 8
    tiles, is 2.03 MiB: room for a tile's scores, its mask, its exponentials and the running
    state several times over (labkit's flash_attention peaks at 0.16 MiB, a plain tile loop
    over labkit's online_softmax_update at 0.56 MiB), and half the mask of the whole matrix.
    """
    from labkit.bench.attention import peak_bytes

    b, h, n, d, block_k = 1, 1, 2048, 8, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))  # [B, H, L, D]
    whole = b * h * n * n * 4  # one [Tq, L] fp32 score matrix
    io = 4 * b * h * n * d * 4 + b * h * n * 4  # q, k, v, out, lse
    tile = b * h * n * block_k * 4  # one tile's scores
    allowed = 4 * io + 8 * tile
    seen = peak_bytes(lambda: q @ k.transpose(-1, -2))
    if seen < whole:  # the measurement itself, before it judges anyone
        raise RuntimeError(f"tiled_attention's grader: torch's allocator reported a peak of "
                           f"{seen} bytes for a {whole}-byte matrix; the memory check cannot "
                           "run here (torch.profiler with profile_memory=True)")
    peak = peak_bytes(lambda: fn(q, k, v, causal=True, block_k=block_k))
    if peak > allowed:
        held = (f"tiled_attention(Tq=L={n}, D={d}, block_k={block_k}): held "
                f"{peak / 2**20:.2f} MiB at once (torch's allocator), more than the "
                f"{allowed / 2**20:.2f} MiB allowed (4x the inputs and output, {io / 2**20:.2f} "
                f"MiB, plus 8 tiles of scores [B, H, Tq, block_k], {tile / 2**20:.3f} MiB each)")
        if peak >= whole:
            why = (f"as much as the whole [Tq, L] score matrix ({whole / 2**20:.0f} MiB here): "
                   "the scores are computed all at once, then softmaxed or sliced into tiles")
        else:
            why = (f"less than the whole [Tq, L] score matrix ({whole / 2**20:.0f} MiB) but "
                   f"memory that grows with Tq x L: a [Tq, L] mask built up front "
                   f"({whole / 4 / 2**20:.0f} MiB in bool), or every tile's partial kept until "
                   "the end")
        raise AssertionError(f"{held}: {why}. Compute each tile's scores and mask inside the "
                             "loop, fold them into m, l, acc, and let them go")

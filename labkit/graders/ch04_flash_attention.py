"""Chapter 04's graders: the online-softmax update, merging split-K partials, tiled attention."""

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
    return "two tiles with a growing max, and a fully masked tile, match the reference"


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
    return "causal and not, Tq = L, Tq < L and Tq = 1, tiles that do not divide L"

"""The chapter-04 graders reject the plausible wrong answers, each with a message naming it."""

import math

import pytest
import torch

from labkit.attention import flash_attention, merge_partials, online_softmax_update
from labkit.graders import check


def no_rescale(m, l, acc, scores, v):  # noqa: E741
    """The chapter's bug: the new max is right, but acc keeps the old max's weights."""
    m_new = torch.maximum(m, scores.amax(-1))
    ref = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.exp(m - ref)
    p = torch.exp(scores - ref[..., None])
    return m_new, l * alpha + p.sum(-1), acc + p @ v


def max_of_tile_only(m, l, acc, scores, v):  # noqa: E741
    """Rescales, but forgets the keys before this tile when taking the max."""
    m_new = scores.amax(-1)
    alpha = torch.exp(torch.where(m == float("-inf"), float("-inf"), m - m_new))
    p = torch.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def safe_zero_max(m, l, acc, scores, v):  # noqa: E741
    """Guards exp() against a fully masked tile by making 0 the running max itself: m = 0,
    l = 0 after that tile, and a next tile far below 0 underflows to l = 0 (NaN at the end)."""
    m_new = torch.maximum(m, scores.amax(-1))
    m_new = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def plain_average(a, b):
    return (a[0] + b[0]) / 2, torch.logaddexp(a[1], b[1])


def weighed_by_exp_lse(a, b, dtype=torch.float32):
    """Weighs each part by exp(lse_i) / (exp(lse1) + exp(lse2)), with no max subtracted: right
    while lse is small, inf / inf = NaN past exp's range (fp32 88.7, fp64 709.8)."""
    (o1, lse1), (o2, lse2) = a, b
    w1, w2 = torch.exp(lse1.to(dtype)), torch.exp(lse2.to(dtype))
    out = (w1[..., None] * o1.to(dtype) + w2[..., None] * o2.to(dtype)) / (w1 + w2)[..., None]
    return out.float(), torch.log(w1 + w2).float()


def whole_matrix(q, k, v, *, causal=True, block_k=4):
    """Right numbers, no tiles: the whole [Tq, L] score matrix at once."""
    tq, n = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Tq, L]
    if causal:
        last = torch.arange(tq)[:, None] + n - tq
        s = s.masked_fill(torch.arange(n)[None, :] > last, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


def tiles_over_whole_scores(q, k, v, *, causal=True, block_k=4):
    """A tile loop over score tiles sliced from the whole [Tq, L] matrix, computed first."""
    tq, n = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Tq, L]
    last = torch.arange(tq)[:, None] + n - tq
    m = torch.full(q.shape[:3], float("-inf"))
    total, acc = torch.zeros(q.shape[:3]), torch.zeros(q.shape)
    for j0 in range(0, n, block_k):
        st = s[..., j0:j0 + block_k]
        if causal:
            st = st.masked_fill(torch.arange(j0, j0 + st.shape[-1])[None, :] > last,
                                float("-inf"))
        m, total, acc = online_softmax_update(m, total, acc, st, v[:, :, j0:j0 + block_k])
    return acc / total[..., None], m + torch.log(total)


def tiles_with_whole_mask(q, k, v, *, causal=True, block_k=4):
    """Tiled scores, but the causal mask of the whole [Tq, L] built up front (bool: 4x smaller
    than the scores, still O(L^2))."""
    tq, n = q.shape[2], k.shape[2]
    hidden = torch.arange(n)[None, :] > torch.arange(tq)[:, None] + n - tq  # [Tq, L]
    m = torch.full(q.shape[:3], float("-inf"))
    total, acc = torch.zeros(q.shape[:3]), torch.zeros(q.shape)
    for j0 in range(0, n, block_k):
        s = q @ k[:, :, j0:j0 + block_k].transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(hidden[:, j0:j0 + block_k], float("-inf"))
        m, total, acc = online_softmax_update(m, total, acc, s, v[:, :, j0:j0 + block_k])
    return acc / total[..., None], m + torch.log(total)


def tiles(mask_shift):
    """A tile loop whose causal limit is `L - Tq + i + mask_shift` (0 is right)."""
    def fn(q, k, v, *, causal=True, block_k=4):
        tq, n = q.shape[2], k.shape[2]
        m = torch.full(q.shape[:3], float("-inf"))
        total, acc = torch.zeros(q.shape[:3]), torch.zeros(q.shape)
        last = torch.arange(tq)[:, None] + n - tq + mask_shift
        for j0 in range(0, n, block_k):
            kt, vt = k[:, :, j0:j0 + block_k], v[:, :, j0:j0 + block_k]
            s = q @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
            if causal:
                s = s.masked_fill(torch.arange(j0, j0 + kt.shape[2])[None, :] > last,
                                  float("-inf"))
            m, total, acc = online_softmax_update(m, total, acc, s, vt)
        return acc / total[..., None], m + torch.log(total)
    return fn


@pytest.mark.parametrize("name,wrong,says", [
    ("online_softmax_update", no_rescale, "no accumulator rescale when the max changes"),
    ("online_softmax_update", max_of_tile_only, "max over the tile only"),
    ("online_softmax_update", safe_zero_max, "the running max m is 0, the 'safe' exp() "
                                             "reference, instead of -inf"),
    ("merge_partials", plain_average, "merging by plain average"),
    ("merge_partials", weighed_by_exp_lse, "exp(lse) overflows"),
    ("merge_partials", lambda a, b: weighed_by_exp_lse(a, b, torch.float64),
     "exp(lse) overflows"),
    ("tiled_attention", tiles(+1), "causal mask off by one"),
    ("tiled_attention", tiles(-1), "causal mask off by one"),
    ("tiled_attention", whole_matrix, "as much as the whole [Tq, L] score matrix"),
    ("tiled_attention", tiles_over_whole_scores, "as much as the whole [Tq, L] score matrix"),
    ("tiled_attention", tiles_with_whole_mask, "a [Tq, L] mask built up front"),
])
def test_grader_rejects_the_known_mistake(name, wrong, says):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    assert says in str(info.value), f"{name}: the message does not name the mistake " \
        f"({says!r}): {info.value}"


def test_graders_accept_the_right_answers():
    assert check.grade("online_softmax_update", online_softmax_update).startswith("✓")
    assert check.grade("merge_partials", merge_partials).startswith("✓")
    assert check.grade("tiled_attention", tiles(0)).startswith("✓")


def test_memory_check_has_room_on_both_sides():
    """The grader's case (causal, Tq = L = 2048, one head, D = 8, tiles of 16 keys; allowance
    4x the inputs and output plus 8 tiles = 2.03 MiB): right answers peak far below it, the
    whole matrix far above, so neither a noisy count nor a careful learner sits at the edge."""
    from labkit.bench.attention import peak_bytes

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 8, generator=gen) for _ in range(3))
    allowed = 4 * (4 * 2048 * 8 * 4 + 2048 * 4) + 8 * 2048 * 16 * 4

    def peak(fn):
        return peak_bytes(lambda: fn(q, k, v, causal=True, block_k=16))

    assert peak(flash_attention) < allowed / 4, peak(flash_attention)
    assert peak(tiles(0)) < allowed / 2, peak(tiles(0))
    assert peak(whole_matrix) > 8 * allowed, peak(whole_matrix)
    assert peak(tiles_with_whole_mask) > 1.5 * allowed, peak(tiles_with_whole_mask)

"""The chapter-04 graders reject the plausible wrong answers, each with a message naming it."""

import math

import pytest
import torch

from labkit.attention import merge_partials, online_softmax_update
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


def plain_average(a, b):
    return (a[0] + b[0]) / 2, torch.logaddexp(a[1], b[1])


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
    ("merge_partials", plain_average, "merging by plain average"),
    ("tiled_attention", tiles(+1), "causal mask off by one"),
    ("tiled_attention", tiles(-1), "causal mask off by one"),
])
def test_grader_rejects_the_known_mistake(name, wrong, says):
    with pytest.raises(AssertionError, match=says):
        check.grade(name, wrong)


def test_graders_accept_the_right_answers():
    assert check.grade("online_softmax_update", online_softmax_update).startswith("✓")
    assert check.grade("merge_partials", merge_partials).startswith("✓")
    assert check.grade("tiled_attention", tiles(0)).startswith("✓")

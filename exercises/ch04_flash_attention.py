"""Chapter 04 exercises: FlashAttention's three pieces. Fill in each function, then run
`make grade` (or the check cells in notebooks/04_flash_attention.ipynb). The graders are the
same tests that check labkit's own solutions in labkit/attention.py."""

import torch


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,  # noqa: E741
                          scores: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of keys into the running softmax state; return the new (m, l, acc).

    Shapes: m, l [..., Tq] (the running max of the scores seen so far, and the sum of
    exp(score - m)); acc [..., Tq, D] (the sum of exp(score - m) * value, not yet divided by
    l); scores [..., Tq, Tk] (this tile's scores, -inf where masked); v [..., Tk, D].

    - The new max is the max over *every* key seen so far: max(m, this tile's max).
    - What was summed under the old max must be rescaled to the new one: multiply l and acc by
      exp(m_old - m_new) before adding this tile's exp(scores - m_new) (and its @ v).
    - A row whose scores have all been -inf so far keeps m = -inf: use 0 as the reference in
      exp() for such rows, so that they stay at l = 0, acc = 0 instead of NaN. Only inside
      exp(): the m you return stays -inf, or a next tile whose scores lie far below 0 would
      be measured against 0 and underflow to l = 0.

    labkit's version: labkit/attention.py::online_softmax_update.
    """
    raise NotImplementedError("online_softmax_update: see the docstring for the task")


def merge_partials(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attentions of the same queries over two disjoint sets of keys (split-K).

    Each of `a`, `b` is (out [..., D], lse [...]): the normalised attention output over its
    keys and the log-sum-exp of its scores. Return (out, lse) of the attention over both sets:
    lse = log(exp(lse1) + exp(lse2)) (use torch.logaddexp), and out weighted by each part's
    share of the softmax mass, exp(lse_i - lse). Never exp(lse_i) alone: it overflows once lse
    passes 88.7 in fp32 (the grader tries lse near +780 and -780). A part with lse = -inf (no
    keys) has weight 0; if both are -inf, return out 0 (not NaN). labkit's version:
    labkit/attention.py::merge_partials.
    """
    raise NotImplementedError("merge_partials: see the docstring for the task")


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    block_k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile loop: attention over K and V `block_k` keys at a time; return (out, lse).

    q: [B, H, Tq, D]; k, v: [B, H, L, D] (one KV head per query head here); out [B, H, Tq, D],
    lse [B, H, Tq]. Scale the scores by 1 / sqrt(D). Causal: the Tq queries are the *last* Tq
    positions, so query i sits at position L - Tq + i and sees keys 0 .. L - Tq + i, itself
    included. Start from m = -inf, l = 0, acc = 0; for each tile, compute its scores, mask
    them, fold them in with online_softmax_update; at the end out = acc / l and
    lse = m + log(l). Never build the [Tq, L] score matrix, nor its [Tq, L] mask: the grader
    measures your function's peak memory with torch's allocator at Tq = L = 2048 and allows a
    few tiles' worth, not L x Tq. labkit's version (with grouped heads and query blocks too):
    labkit/attention.py::flash_attention.
    """
    raise NotImplementedError("tiled_attention: see the docstring for the task")

"""labkit's cached decoding against a full recomputation with no cache (tiny model)."""

import math

import torch

from labkit.model import LlamaModel


class FullAttention:
    """Causal attention over just the tokens given, all in one sequence (no cache)."""

    def attend(self, layer, q, k, v):
        # q: [T, H, D]; k, v: [T, Hkv, D]
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        t = q.shape[0]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def full_forward_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence, recomputed from scratch: [T, V]."""
    return model(torch.tensor(ids), torch.arange(len(ids)), FullAttention())

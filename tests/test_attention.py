"""Paged and flash attention agree with naive attention and with a reference written here."""

import math

import pytest
import torch

from labkit.attention import FlashAttention, NaiveAttention, PagedAttention
from labkit.model import ModelConfig
from labkit.paged_kv import PagedKVCache


def reference(q_seq, k_ctx, v_ctx, start):
    """Causal GQA attention of one sequence's new queries over its whole context."""
    # q_seq: [n, H, D]; k_ctx, v_ctx: [L, Hkv, D]; query j sits at position start + j
    h, d = q_seq.shape[1], q_seq.shape[2]
    g = h // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(g, 1)
    v = v_ctx.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q_seq, k) / math.sqrt(d)
    qpos = torch.arange(q_seq.shape[0])[:, None] + start
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class GatherPagedAttention(PagedAttention):
    """PagedAttention's path without labkit's CPU kernel: gather, then SDPA."""

    def __init__(self, store):
        super().__init__(store, cpu_kernel=False)


@pytest.mark.parametrize("backend", [NaiveAttention, PagedAttention, GatherPagedAttention,
                                     FlashAttention])
@pytest.mark.parametrize("starts,qlens", [([0, 0, 0], [5, 9, 2]), ([7, 3, 12], [1, 1, 1]),
                                          ([4, 0, 9], [3, 6, 1])])
def test_backend_matches_reference(backend, starts, qlens):
    gen = torch.Generator().manual_seed(sum(starts) + sum(qlens))
    cfg = ModelConfig.tiny()
    bs = 4
    cache = PagedKVCache(cfg, num_blocks=32, block_size=bs)
    tables = [[5, 2, 9, 11, 30], [0, 17, 3, 4, 8], [21, 22, 6, 7, 1]]  # scattered pages
    hkv, d, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    # the context already cached for each sequence, written straight into the pool
    ctx_k = [torch.randn(s + q, hkv, d, generator=gen) for s, q in zip(starts, qlens)]
    ctx_v = [torch.randn(s + q, hkv, d, generator=gen) for s, q in zip(starts, qlens)]
    for b, s in enumerate(starts):
        slots = torch.tensor(cache.slots(tables[b], 0, s), dtype=torch.long)
        cache.write(0, slots, ctx_k[b][:s], ctx_v[b][:s])
    meta = backend.meta_type.build(torch.tensor(qlens), torch.tensor(starts), torch.tensor(tables),
                                   bs)
    attn = backend(cache)
    attn.begin_step(meta)
    q = torch.randn(sum(qlens), h, d, generator=gen)
    k_new = torch.cat([ctx_k[b][s:] for b, s in enumerate(starts)])
    v_new = torch.cat([ctx_v[b][s:] for b, s in enumerate(starts)])
    out = attn.attend(0, q, k_new, v_new)
    offset = 0
    for b, (s, n) in enumerate(zip(starts, qlens)):
        want = reference(q[offset:offset + n], ctx_k[b], ctx_v[b], s)
        # fp32, different summation orders only
        torch.testing.assert_close(out[offset:offset + n], want, atol=1e-5, rtol=1e-5)
        offset += n


@pytest.mark.parametrize("meta_type", ["AttentionMeta", "FlashMeta"])
def test_a_decode_steps_metadata_from_host_lengths_equals_the_general_build(meta_type):
    # one new token a sequence, its lengths known on the host (what the runner passes): the
    # short layout (_Queries.layout's decode branch) gives every tensor the general build gives
    import dataclasses

    from labkit import attention

    build = getattr(attention, meta_type).build
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        b = int(torch.randint(1, 7, (1,), generator=gen))
        block = int(torch.randint(1, 6, (1,), generator=gen))
        starts = torch.randint(0, 40, (b,), generator=gen)
        pages = int((starts.max() + 1 + block - 1) // block) + int(trial % 3)  # some padding
        tables = torch.randperm(b * pages, generator=gen).reshape(b, pages)
        ones = torch.ones(b, dtype=torch.long)
        general = build(ones, starts, tables, block)
        short = build(ones, starts, tables, block, 1, int(starts.max()) + 1,
                      host_query_lens=[1] * b, host_starts=starts.tolist())
        assert attention._Queries.layout(ones, starts, tables.device, 1, None, [1] * b,
                                         meta_type).decode
        for field in dataclasses.fields(general):
            want, got = getattr(general, field.name), getattr(short, field.name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), (trial, field.name)
        assert short.host_ctx_lens == (starts + 1).tolist()
    # a row with no new token (a fork row) keeps the general layout
    assert not attention._Queries.layout(torch.tensor([1, 0]), torch.tensor([3, 3]),
                                         torch.device("cpu"), 1, None, [1, 0], "t").decode

"""FlashAttention: the tiled teaching function, split-K merging, the engine backend, memory."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.attention import (
    AttentionMeta,
    FlashAttention,
    FlashMeta,
    NaiveAttention,
    flash_attention,
    flash_decode,
    merge_partials,
)
from labkit.model import ModelConfig
from labkit.paged_kv import PagedKVCache


def naive(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v with the S x S scores written out; (out, lse)."""
    # q: [B, H, Tq, D]; k, v: [B, Hkv, L, D]; query i sits at position L - Tq + i
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Tq, L]
    tq, seq_len = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(tq)[:, None] + seq_len - tq
        s = s.masked_fill(torch.arange(seq_len)[None, :] > i, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), g=st.integers(1, 3),
       tq=st.integers(1, 37), extra=st.integers(0, 40), d=st.sampled_from([4, 8, 16]),
       causal=st.booleans(), block_q=st.integers(1, 20), block_k=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_flash_attention_is_exact(b, hkv, g, tq, extra, d, causal, block_q, block_k, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_len = tq + extra  # Tq <= L: the queries are the last Tq positions
    q = torch.randn(b, hkv * g, tq, d, generator=gen)
    k = torch.randn(b, hkv, seq_len, d, generator=gen)
    v = torch.randn(b, hkv, seq_len, d, generator=gen)
    out, lse = flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    want, want_lse = naive(q, k, v, causal)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # fp32: summation order only
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_k_decode_merges_to_the_whole(splits):
    gen = torch.Generator().manual_seed(splits)
    q = torch.randn(2, 6, 1, 16, generator=gen)
    k = torch.randn(2, 2, 45, 16, generator=gen)
    v = torch.randn(2, 2, 45, 16, generator=gen)
    out, lse = flash_decode(q, k, v, num_splits=splits, block_k=8)
    want, want_lse = naive(q, k, v, causal=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_an_empty_part_is_the_other_part():
    o = torch.randn(3, 4)
    lse = torch.randn(3)
    empty = (torch.zeros(3, 4), torch.full((3,), float("-inf")))
    got, got_lse = merge_partials((o, lse), empty)
    torch.testing.assert_close(got, o)
    torch.testing.assert_close(got_lse, lse)


def _paged_case(starts, qlens, bs, seed):
    """A scattered paged pool holding each sequence's context; the step's new q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.tiny()
    hkv, d, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    need = [-(-(s + q) // bs) for s, q in zip(starts, qlens)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    width = max(need)
    padded = [t + [perm[-1]] * (width - len(t)) for t in tables]
    cache = PagedKVCache(cfg, num_blocks=num_blocks, block_size=bs)
    ks = [torch.randn(s + q, hkv, d, generator=gen) for s, q in zip(starts, qlens)]
    vs = [torch.randn(s + q, hkv, d, generator=gen) for s, q in zip(starts, qlens)]
    for b, s in enumerate(starts):
        slots = torch.tensor(cache.slots(tables[b], 0, s), dtype=torch.long)
        cache.write(0, slots, ks[b][:s], vs[b][:s])
    q = torch.randn(sum(qlens), h, d, generator=gen)
    k_new = torch.cat([ks[b][s:] for b, s in enumerate(starts)])
    v_new = torch.cat([vs[b][s:] for b, s in enumerate(starts)])
    return cfg, cache, torch.tensor(padded), q, k_new, v_new


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4),
       decode=st.booleans(), bs=st.sampled_from([1, 4, 16]), tile=st.integers(1, 48),
       seed=st.integers(0, 2**16))
def test_flash_backend_matches_naive_on_ragged_paged_batches(rows, decode, bs, tile, seed):
    starts = [s for s, _ in rows]
    qlens = [1 if decode else n for _, n in rows]
    cfg, cache, tables, q, k_new, v_new = _paged_case(starts, qlens, bs, seed)
    outs = []
    for backend, meta_type in ((NaiveAttention, AttentionMeta), (FlashAttention, FlashMeta)):
        attn = backend(cache) if backend is NaiveAttention else backend(cache, tile_tokens=tile)
        attn.begin_step(meta_type.build(torch.tensor(qlens), torch.tensor(starts), tables, bs))
        outs.append(attn.attend(0, q, k_new, v_new))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)  # fp32 rounding only


def test_flash_meta_has_no_context_slots_and_no_mask():
    meta = FlashMeta.build(torch.tensor([3, 1]), torch.tensor([5, 9]),
                           torch.tensor([[0, 1, 2], [3, 4, 5]]), 4)
    ref = AttentionMeta.build(torch.tensor([3, 1]), torch.tensor([5, 9]),
                              torch.tensor([[0, 1, 2], [3, 4, 5]]), 4)
    assert meta.mask is None and meta.ctx_slots is None
    for name in ("write_slots", "positions", "q_index", "unpad_index", "last_rows"):
        assert torch.equal(getattr(meta, name), getattr(ref, name)), name


def _engine_tokens(attention: str, decoder: str, cache: str = "paged",
                   flash_kernel: bool = True) -> list[list[int]]:
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.model import LlamaModel, init_random
    from labkit.sampling import SamplingParams

    model = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=3)
    engine = Engine(model, None, kv_tokens=1024, block_size=4, max_seqs=4, attention=attention,
                    cache=cache)
    if attention == "flash":
        engine.device.runner.backend.tile_tokens = 8  # two pages a tile: many tiles per step
        engine.device.runner.backend.cpu_kernel = flash_kernel  # False: the Python tiles
    gen = torch.Generator().manual_seed(0)
    ids = []
    for i, n in enumerate([3, 17, 40, 9, 26]):  # more requests than rows: some wait, some mix
        prompt = torch.randint(3, 200, (n,), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=12, temperature=0.0 if i % 2 else 1.0, seed=i,
                                ignore_eos=True)
        ids.append(engine.submit(prompt, params))
    run(engine, decoder)
    out = [engine.seqs[r].output_ids for r in ids]
    engine.close()
    return out


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_engine_gives_the_same_tokens_with_flash(decoder):
    paged = _engine_tokens("paged", decoder)
    assert _engine_tokens("flash", decoder) == paged  # on a CPU: labkit's C++ kernel
    assert _engine_tokens("flash", decoder, flash_kernel=False) == paged  # its Python tiles
    assert _engine_tokens("naive", decoder) == paged
    # the contiguous cache is one page per row: flash's tiles are slices of that page
    assert _engine_tokens("flash", decoder, cache="contiguous") == paged


def test_flash_peak_memory_grows_linearly_in_s():
    from labkit.bench.attention import peak_bytes

    peaks = {}
    for s in (512, 1024, 2048):
        gen = torch.Generator().manual_seed(s)
        q = torch.randn(1, 2, s, 32, generator=gen)
        k = torch.randn(1, 2, s, 32, generator=gen)
        peaks[s] = peak_bytes(lambda q=q, k=k: flash_attention(q, k, k, block_q=128,
                                                                block_k=128))
    # O(S): doubling S at most doubles the peak, plus the fixed tile scratch (a quadratic
    # method would quadruple it). Measured by the allocator, not predicted.
    assert peaks[2048] <= 2.2 * peaks[1024] and peaks[1024] <= 2.2 * peaks[512], peaks
    out_bytes = 2 * 2048 * 32 * 4
    assert peaks[2048] < 4 * out_bytes + 2 * 128 * 128 * 2 * 4 * 4, peaks

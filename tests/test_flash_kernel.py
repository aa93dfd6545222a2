"""FlashAttention's C++ kernel (labkit/kernels/flash_attention.cpp) against its Python tiles
(`FlashAttention.reference`): the same writes and outputs on ragged paged batches (prefill,
decode, mixed; grouped-query heads; pages of 1, 5 and 16 tokens; contexts across many tiles,
with the max moving between tiles), and the same bits for a token whatever shares its step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.attention import FlashAttention, FlashMeta
from labkit.kernels import cpu as cpu_kernels
from labkit.model import ModelConfig
from labkit.paged_kv import PagedKVCache

built = cpu_kernels.kernels()
needs_kernel = pytest.mark.skipif(built is None,
                                  reason="no C++ compiler and ninja: the kernel cannot build")
# (heads, KV heads, head width): groups of 3, 2, 5, 4 and 1; widths with 8-lane tails and none
HEADS = [(9, 3, 64), (4, 2, 16), (5, 1, 20), (8, 2, 72), (2, 2, 8)]


def _step(starts, qlens, heads=(9, 3, 64), bs=16, seed=0, drift=0.0):
    """A pool holding each sequence's context on scattered pages (every other slot random too),
    and a step's q, k, v. drift scales key p of a context by 1 + drift * p / len: with drift > 0
    later tiles hold larger scores (the running max moves), with drift < 0 smaller ones."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d = heads
    cfg = ModelConfig.tiny().with_(num_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=1)
    need = [-(-(s + q) // bs) for s, q in zip(starts, qlens)]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n] + [perm[-1]] * (max(need) - n))  # padded with any page
        at += n
    cache = PagedKVCache(cfg, sum(need) + 3, bs)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    ks = []
    for b, (s, n) in enumerate(zip(starts, qlens)):
        grow = 1 + drift * torch.arange(s + n) / (s + n)  # [L]
        kb = torch.randn(s + n, hkv, d, generator=gen) * grow[:, None, None]
        slots = torch.tensor(cache.slots(tables[b], 0, s), dtype=torch.long)
        cache.write(0, slots, kb[:s], torch.randn(s, hkv, d, generator=gen))
        ks.append(kb[s:])
    q = torch.randn(sum(qlens), h, d, generator=gen)
    k = torch.cat(ks)
    v = torch.randn(sum(qlens), hkv, d, generator=gen)
    meta = FlashMeta.build(torch.tensor(qlens), torch.tensor(starts), torch.tensor(tables), bs)
    return cache, meta, q, k, v


def _attend(cache, meta, q, k, v, tile, kernel=True):
    """FlashAttention on a copy of the pool (writes land in the copy): (out, the copy)."""
    store = PagedKVCache(ModelConfig.tiny().with_(num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                                  head_dim=q.shape[2], num_layers=1),
                         cache.num_blocks, cache.block_size)
    store.k.copy_(cache.k)
    store.v.copy_(cache.v)
    attn = FlashAttention(store, tile_tokens=tile, cpu_kernel=kernel)
    attn.begin_step(meta)
    return attn.attend(0, q, k, v), store


def _check_equal_to_the_tiles(cache, meta, q, k, v, tile):
    got, store = _attend(cache, meta, q, k, v, tile)
    want, want_store = _attend(cache, meta, q, k, v, tile, kernel=False)
    assert torch.equal(store.k, want_store.k) and torch.equal(store.v, want_store.v), (
        "the kernel wrote k, v elsewhere than the Python path's store.write")
    # fp32, the same tiles: the order of sums and exp's rounding (~2e-7) only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 9)), min_size=1, max_size=5),
       kind=st.sampled_from(["prefill", "decode", "mixed"]), heads=st.sampled_from(HEADS),
       bs=st.sampled_from([1, 5, 16]), tile=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_python_tiles_on_ragged_batches(rows, kind, heads, bs, tile, seed):
    starts = [s for s, _ in rows]
    qlens = [1 if kind == "decode" or (kind == "mixed" and i % 2) else n
             for i, (_, n) in enumerate(rows)]
    _check_equal_to_the_tiles(*_step(starts, qlens, heads, bs, seed), tile)


@needs_kernel
@pytest.mark.parametrize("drift", [0.0, 4.0, -0.9])
@pytest.mark.parametrize("bs,tile", [(16, 256), (16, 48), (1, 100), (5, 64)])
def test_the_kernel_equals_the_python_tiles_on_long_contexts(drift, bs, tile):
    # decode rows over 700 and 1500 keys (split-K over up to 94 tiles) beside a 300-token
    # prefill chunk after 200 cached ones; the max moves to later tiles (drift > 0) or stays
    # in the first while later tiles fade (drift < 0)
    _check_equal_to_the_tiles(*_step([700, 1500, 200], [1, 1, 300], bs=bs, seed=7,
                                     drift=drift), tile)


@needs_kernel
def test_the_contiguous_cache_is_one_page_per_row_cut_into_tiles():
    # one page of 96 tokens per row (the contiguous cache's layout), tiles of 40: slices of it
    _check_equal_to_the_tiles(*_step([50, 90, 10], [1, 6, 1], bs=96, seed=3), 40)


@needs_kernel
def test_a_tokens_output_does_not_depend_on_what_shares_its_step():
    tile = 32  # a context of 200 keys: 7 tiles, split-K for the decode token
    cache, meta, q, k, v = _step([199, 0, 57], [1, 12, 1], seed=5)
    together, written = _attend(cache, meta, q, k, v, tile)
    tables = meta.block_tables
    # the decode token alone: bit-equal to the same token beside a prefill chunk and a decode
    solo = FlashMeta.build(torch.tensor([1]), torch.tensor([199]), tables[:1], 16)
    alone, _ = _attend(cache, solo, q[:1], k[:1], v[:1], tile)
    assert torch.equal(alone[0], together[0]), "a decode token's output changed with its step"
    # a prompt's last token (row 1's token 11) in the whole prefill, and as a one-token chunk
    # after the other 11 are cached: the decode path (tiles in parallel, folded after) and
    # the prefill path (folded as it goes) must give the same bits
    chunk = FlashMeta.build(torch.tensor([1]), torch.tensor([11]), tables[1:2], 16)
    last, _ = _attend(written, chunk, q[12:13], k[12:13], v[12:13], 8)
    again, _ = _attend(cache, meta, q, k, v, 8)
    assert torch.equal(last[0], again[12]), (
        "a prompt's last token differs as a decode-like chunk: split-K and the prefill fold "
        "must do the same operations in the same order")
    # how many threads share the work never changes a bit
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _attend(cache, meta, q, k, v, tile)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together), "the output changed with the number of threads"


@needs_kernel
def test_the_kernel_refuses_a_page_outside_the_pool():
    cache, meta, q, k, v = _step([20], [1], bs=4)
    meta.block_tables[0, 2] = cache.num_blocks  # one past the end, inside the context
    with pytest.raises(RuntimeError, match="page outside the pool"):
        _attend(cache, meta, q, k, v, 8)


def test_without_the_kernel_the_python_tiles_run(monkeypatch):
    cache, meta, q, k, v = _step([30, 5], [1, 4], bs=4)
    calls = []
    original = FlashAttention.reference
    monkeypatch.setattr(FlashAttention, "reference",
                        lambda self, *a: calls.append(1) or original(self, *a))
    _attend(cache, meta, q, k, v, 8, kernel=False)
    assert calls == [1], "cpu_kernel=False must run FlashAttention.reference"
    monkeypatch.setitem(cpu_kernels._state, "module", None)  # as if no compiler
    _attend(cache, meta, q, k, v, 8)
    assert calls == [1, 1], "without a built kernel FlashAttention must run its Python tiles"

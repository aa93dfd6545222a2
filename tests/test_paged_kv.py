"""The block allocator and the two KV caches."""

import pytest
import torch

from labkit.model import ModelConfig
from labkit.paged_kv import (
    BlockAllocator,
    ContiguousKVCache,
    KVPoolExhausted,
    PagedKVCache,
    blocks_needed,
)


def test_allocate_and_free_round_trip():
    a = BlockAllocator(4)
    pages = a.allocate(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 1
    a.free(pages)
    assert a.num_free == 4 and [a.refcount(p) for p in range(4)] == [0, 0, 0, 0]


def test_double_free_names_the_page():
    a = BlockAllocator(4)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(RuntimeError, match=f"KV page {pages[0]} freed while free"):
        a.free(pages[:1])


def test_write_to_free_page_raises_with_its_id():
    a = BlockAllocator(3)
    a.allocate(1)
    with pytest.raises(RuntimeError, match="KV page 2 written while free"):
        a.check_writable([0, 2])


def test_exhaustion_takes_nothing():
    a = BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(KVPoolExhausted, match="asked for 2 KV pages, 1 of 3"):
        a.allocate(2)
    assert a.num_free == 1  # the failed request took no page


def test_shared_page_returns_at_zero_refs():
    a = BlockAllocator(2)
    (p,) = a.allocate(1)
    a.share([p])
    a.free([p])
    assert a.num_free == 1  # one reference left
    a.free([p])
    assert a.num_free == 2


def test_blocks_needed_is_a_ceiling():
    assert [blocks_needed(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_paged_slot_addressing_matches_the_pool_view():
    cfg = ModelConfig.tiny()
    cache = PagedKVCache(cfg, num_blocks=5, block_size=4)
    table = [3, 0, 4]  # token 5 lives in page 0, offset 1
    slot = cache.slot(table, 5)
    gen = torch.Generator().manual_seed(0)
    k_new = torch.randn(1, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    cache.write(1, torch.tensor([slot]), k_new, k_new)
    k_pool, _ = cache.pool(1)  # [num_blocks, block_size, Hkv, D]
    assert torch.equal(k_pool[0, 1], k_new[0])
    assert cache.slots(table, 3, 6) == [3 * 4 + 3, 0 * 4 + 0, 0 * 4 + 1]


def test_contiguous_rows_refuse_overflow():
    cache = ContiguousKVCache(ModelConfig.tiny(), max_seqs=2, max_len=8)
    assert cache.slots(1, 0, 3) == [8, 9, 10]
    with pytest.raises(IndexError, match="position 8 does not fit"):
        cache.slots(0, 0, 9)


def test_shared_page_is_read_only():
    a = BlockAllocator(2)
    (p,) = a.allocate(1)
    a.share([p])
    with pytest.raises(RuntimeError, match=f"KV page {p} written while shared"):
        a.check_writable([p])


def test_kept_page_is_cached_at_zero_refs_and_evicted_least_recently_used():
    a = BlockAllocator(3)
    pages = a.allocate(3)
    evicted = []
    a.on_evict = evicted.append
    for p in pages[:2]:
        a.keep(p)
    a.free(pages)
    assert a.num_free == 3  # cached pages count as free
    a.share([pages[1]])  # a cache hit revives page 1
    assert a.refcount(pages[1]) == 1 and a.num_free == 2
    assert a.allocate(2) == [pages[2], pages[0]]  # the free page first, then evict page 0
    assert evicted == [pages[0]]

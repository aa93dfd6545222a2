"""The KV cache, two ways: a paged pool with block tables, and a contiguous cache to compare.

A decode step reads every earlier token's keys and values, so they are kept ("the KV cache").
The contiguous cache gives each sequence a slab of `max_len` slots up front: simple, but a
sequence that stops early wastes the rest. PagedAttention cuts the cache into fixed-size pages
(blocks); a sequence owns a *block table*, the list of pages holding its tokens in order, and
takes pages from a shared pool only as it needs them, like virtual memory.

Both caches store K and V per layer in one flat tensor of *slots* (a slot holds one token's
keys or values for every KV head). The only difference between them is the address of token
`pos` of a sequence: `page = table[pos // block_size]; slot = page * block_size + pos %
block_size` when paged, `slot = row * max_len + pos` when contiguous. Attention reads by slot
(on the CPU, labkit's kernel reads each slot in place; elsewhere a gather), so the same
attention code runs on both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from labkit.model import ModelConfig
from labkit.utils import pages


class KVPoolExhausted(RuntimeError):
    """Not enough free pages for a request right now (it should wait, not crash)."""


class BlockAllocator:
    """Owns page ids: a free list, a reference count per page, and cached pages kept for reuse.

    A page is *free* (refcount 0, on the free list), *owned* (refcount >= 1; more than one
    owner means it is shared, hence read-only), or *cached* (refcount 0 but its KV kept because
    a prefix cache may hand it out again; evicted least recently used when the free list is
    empty). Cached pages count as free: `num_free` is what `allocate` can hand out now.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one page, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # pop() takes from the end: hand out low page ids first, which reads better in demos
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, KV kept; LRU first
        self._keep: set[int] = set()  # pages whose KV a prefix cache may hand out again
        # hooks: `on_free(page)` when a page's last reference goes (tests prove no page is
        # freed while a launched step references it); `on_evict(page)` when a cached page is
        # taken for someone else (the prefix cache forgets it)
        self.on_free: Callable[[int], None] | None = None
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one sequence."""
        return self.num_blocks - self.num_free

    def refcount(self, page: int) -> int:
        """Owners of `page` (0: free or cached)."""
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each), or raise KVPoolExhausted taking nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise KVPoolExhausted(f"asked for {n} KV pages, {self.num_free} of "
                                  f"{self.num_blocks} are free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:  # evict the least recently used cached page: its KV is forgotten
                p, _ = self._cached.popitem(last=False)
                self._keep.discard(p)
                if self.on_evict is not None:
                    self.on_evict(p)
            self._refs[p] = 1
            pages.append(p)
        return pages

    def keep(self, page: int) -> None:
        """Mark an owned page's KV as reusable: at refcount 0 it is cached, not freed."""
        self._check_live(page, "kept")
        self._keep.add(page)

    def unkeep(self, page: int) -> None:
        """Undo `keep`: at refcount 0 the page is freed, its KV forgotten."""
        self._check_live(page, "unkept")
        self._keep.discard(page)

    def drop_cached(self) -> int:
        """Forget every cached page's KV (they become plain free pages); returns how many.
        A benchmark's round starts cold this way, as a fresh engine would."""
        dropped = list(self._cached)
        self._cached.clear()
        for p in dropped:
            self._keep.discard(p)
            if self.on_evict is not None:
                self.on_evict(p)
            self._free.append(p)
        return len(dropped)

    def share(self, pages: Sequence[int]) -> None:
        """Add a reference to pages already owned or cached (prefix sharing, forks)."""
        for p in pages:
            if self._refs[p] == 0 and p in self._cached:  # a cache hit revives the page
                del self._cached[p]
            else:
                self._check_live(p, "shared")
            self._refs[p] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; at zero it returns to the pool (cached if kept)."""
        for p in pages:
            self._check_live(p, "freed")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self.on_free is not None:
                    self.on_free(p)
                if p in self._keep:
                    self._cached[p] = None  # most recently used last
                else:
                    self._free.append(p)

    def check_writable(self, pages: Sequence[int], shared_ok: bool = False) -> None:
        """Raise if a page is free (writing corrupts its next owner) or shared (read-only).

        `shared_ok`: only the first check. A launch may write a page that a later row of the
        same launch shares (the device writes each layer's KV before any row reads it); the
        scheduler checks each row against sharing when it plans it, before anyone shares.
        """
        for p in pages:
            self._check_live(p, "written")
            if self._refs[p] > 1 and not shared_ok:
                raise RuntimeError(f"KV page {p} written while shared (refcount "
                                   f"{self._refs[p]}): copy-on-write must give the writer a "
                                   "private page first")

    def _check_live(self, page: int, action: str) -> None:
        if not 0 <= page < self.num_blocks:
            raise IndexError(f"KV page {page} {action}, but the pool has pages "
                             f"0..{self.num_blocks - 1}")
        if self._refs[page] == 0:
            raise RuntimeError(f"KV page {page} {action} while free (double free, or a "
                               "use after free: check who still holds this block table)")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Pages to hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class KVStore:
    """K and V for every layer as flat slot arrays: `k[layer]: [num_slots, Hkv, D]`."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim)
        if torch.device(device).type == "cpu":  # in 2 MiB pages where the kernel gives them
            # (labkit.utils.pages): decode reads a token's keys scattered through the pool
            self.k, self.v = pages.zeros(shape, dtype), pages.zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # k: [L, S, Hkv, D]
            self.v = torch.zeros(shape, dtype=dtype, device=device)  # v: [L, S, Hkv, D]
        self.num_slots = num_slots
        # each layer's [S, Hkv, D] views, made once: indexing self.k[layer] is an op of its own,
        # dispatched from Python twice per layer per step
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    def nbytes(self) -> int:
        """Bytes held by K and V together."""
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k, v ([T, Hkv, D]) at their slots ([T])."""
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)


class PagedKVCache(KVStore):
    """The paged pool: per layer `[num_blocks, block_size, Hkv, D]`, viewed as flat slots."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        super().__init__(cfg, num_blocks * block_size, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K and V pools as `[num_blocks, block_size, Hkv, D]` views."""
        shape = (self.num_blocks, self.block_size, *self.k.shape[2:])
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: pages `dst` get the K and V of pages `src` ([n] each), every layer."""
        shape = (self.k.shape[0], self.num_blocks, self.block_size, *self.k.shape[2:])
        for pool in (self.k.view(shape), self.v.view(shape)):
            pool[:, dst] = pool[:, src]  # the gather is a new tensor: no overlap hazard

    def slot(self, block_table: Sequence[int], pos: int) -> int:
        """Flat slot of token `pos` of a sequence with this block table."""
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens start..end-1 of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]


class ContiguousKVCache(KVStore):
    """One slab of `max_len` slots per sequence row, reserved up front (for comparison)."""

    def __init__(self, cfg: ModelConfig, max_seqs: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(cfg, max_seqs * max_len, dtype, device)
        self.max_seqs, self.max_len = max_seqs, max_len

    def slots(self, row: int, start: int, end: int) -> list[int]:
        """Flat slots of tokens start..end-1 of the sequence in `row`."""
        if end > self.max_len:
            raise IndexError(f"position {end - 1} does not fit a contiguous row of "
                             f"{self.max_len} slots")
        base = row * self.max_len
        return list(range(base + start, base + end))

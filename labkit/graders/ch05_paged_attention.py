"""Chapter 05's graders: pages per sequence, logical-to-physical translation, copy-on-write
pages."""

from __future__ import annotations

from collections.abc import Callable


def grade_blocks_needed(fn: Callable) -> str:
    """Grade an answer to exercise `blocks_needed` (exercises/ch05_paged_attention.py)."""
    for n, bs in ((0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (32, 16), (33, 16), (7, 1),
                  (100, 7), (98, 7)):
        got, want = int(fn(n, bs)), -(-n // bs)
        if got == want:
            continue
        if n % bs == 0 and got == want + 1:
            raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}: "
                                 f"the off-by-one page count at exact multiples ({n} tokens "
                                 f"fill exactly {want} pages; n // bs + 1 is one too many)")
        if got == n // bs:
            raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}: "
                                 "a partly filled last page is still a page (round up)")
        raise AssertionError(f"blocks_needed({n}, {bs}) returned {got}, expected {want}")
    return "ceil(n / block_size), exact multiples included (10 cases)"


def grade_translate(fn: Callable) -> str:
    """Grade an answer to exercise `translate` (exercises/ch05_paged_attention.py)."""
    table, bs = [7, 2, 5, 0], 4
    for pos in range(16):
        got = int(fn(list(table), pos, bs))
        want = table[pos // bs] * bs + pos % bs
        if got == want:
            continue
        if got == table[pos // bs] + pos % bs:
            hint = "a page id counts pages, not slots: multiply it by block_size"
        elif got == pos:
            hint = "the block table was ignored: token pos lives in page table[pos // bs]"
        elif got == table[min(pos // bs + 1, 3)] * bs + pos % bs:
            hint = "off by one page: position pos is in entry pos // block_size"
        else:
            hint = "slot = block_table[pos // block_size] * block_size + pos % block_size"
        raise AssertionError(f"translate({table}, {pos}, {bs}) returned {got}, expected "
                             f"{want}: {hint}")
    try:
        fn(list(table), 16, bs)
    except IndexError:
        return "every position of a 4-page table, and a position past its end refused"
    raise AssertionError(f"translate({table}, 16, {bs}) did not raise IndexError: position 16 "
                         "needs a fifth page the table does not have")


def grade_cow_pages(cls: Callable) -> str:
    """Grade an answer to exercise `CowPages` (exercises/ch05_paged_attention.py)."""
    pool = cls(4)
    a, b = pool.alloc(), pool.alloc()
    if a == b or pool.num_free != 2 or pool.refcount(a) != 1:
        raise AssertionError(f"alloc: two pages {a}, {b} with {pool.num_free} free left and "
                             f"refcount {pool.refcount(a)}; expected two distinct pages, 2 free, "
                             "refcount 1")
    pool.share(a)  # a second sequence with the same prefix
    pool.free(a)  # one of them finishes
    if pool.num_free != 2 or pool.refcount(a) != 1:
        raise AssertionError(
            f"freed a shared page while refs > 0: page {a} had 2 holders, one freed it, and now "
            f"refcount={pool.refcount(a)}, {pool.num_free} pages free. The other holder still "
            "reads it: it returns to the free list only at refcount 0")
    pool.share(a)
    w = pool.write(a)  # a holder writes into the shared page
    if w == a:
        raise AssertionError(
            f"a forgotten copy-on-write: write({a}) on a page with 2 holders returned the page "
            "itself, so the write would change the other holder's tokens. Allocate a copy and "
            "move the writer's reference to it")
    if pool.refcount(a) != 1 or pool.refcount(w) != 1:
        raise AssertionError(
            f"copy-on-write: after write({a}) the original has refcount {pool.refcount(a)} and "
            f"the copy {pool.refcount(w)}; expected 1 and 1 (the writer's reference moved)")
    if pool.write(w) != w or pool.num_free != 1:
        raise AssertionError("write on a page with one holder must return it in place, "
                             "allocating nothing")
    for p in (a, b, w):
        pool.free(p)
    if pool.num_free != 4:
        raise AssertionError(f"after freeing every page, {pool.num_free} of 4 are free")
    try:
        pool.free(a)
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"free({a}) on a free page did not raise: a double free puts a "
                             "page in the free list twice, and two sequences end up sharing it")
    full = cls(1)
    full.alloc()
    try:
        full.alloc()
    except MemoryError:
        return "alloc, share, free at refcount 0, copy-on-write, double free refused"
    raise AssertionError("alloc on a full pool did not raise MemoryError")

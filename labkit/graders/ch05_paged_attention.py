"""Chapter 05's graders: pages per sequence, logical-to-physical translation, copy-on-write
pages. A hint names a known mistake only when that mistake, and no other, reproduces every
result the answer gave (a value, or the exception it raised) on the whole set of cases."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _outcome(fn: Callable, *args) -> object:
    """What `fn(*args)` gives: its value, or the name of the exception it raises."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as err:  # a learner's exception is a result to compare, not a crash
        return f"raised {type(err).__name__}"


def _name_the_mistake(got: list, cases: Sequence[tuple], wrong: dict[str, Callable]
                      ) -> str | None:
    """The one known mistake that reproduces every outcome in `got`, or None."""
    hits = [hint for hint, variant in wrong.items()
            if [_outcome(variant, *c) for c in cases] == got]
    return hits[0] if len(hits) == 1 else None


def _ceil(n: int, bs: int) -> int:
    return -(-n // bs)


def grade_blocks_needed(fn: Callable) -> str:
    """Grade an answer to exercise `blocks_needed` (exercises/ch05_paged_attention.py)."""
    cases = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (32, 16), (33, 16), (7, 1),
             (100, 7), (98, 7), (5, 10)]
    wrong = {
        "the off-by-one page count at exact multiples: n // block_size + 1 is one page too "
        "many when the tokens fill their pages exactly": lambda n, bs: n // bs + 1,
        "a partly filled last page is still a page: round up, not down":
            lambda n, bs: n // bs,
        "rounded to the nearest page: a page a third full is still a whole page (round up)":
            lambda n, bs: round(n / bs),
        "a fraction of a page: n / block_size is not a page count; round it up to an int":
            lambda n, bs: n / bs,
        "0 tokens need 0 pages: a sequence with nothing in it holds no page":
            lambda n, bs: max(1, _ceil(n, bs)),
    }
    got = [_outcome(fn, n, bs) for n, bs in cases]
    want = [_ceil(n, bs) for n, bs in cases]
    # an int-valued float (2.0) counts as right; 1.0625 pages does not
    if all(not isinstance(g, str) and g == w for g, w in zip(got, want)):
        return f"ceil(n / block_size), exact multiples included ({len(cases)} cases)"
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if isinstance(g, str) or g != w)
    n, bs = cases[i]
    hint = _name_the_mistake(got, cases, wrong) or (
        "pages = ceil(num_tokens / block_size), an int; exact multiples need no extra page")
    raise AssertionError(f"blocks_needed({n}, {bs}) {_said(got[i])}, expected {want[i]}: "
                         f"{hint}")


def _said(outcome: object) -> str:
    return outcome if isinstance(outcome, str) else f"returned {outcome!r}"


def _slot(t: Sequence[int], pos: int, bs: int) -> int:
    if not 0 <= pos < len(t) * bs:
        raise IndexError(pos)
    return t[pos // bs] * bs + pos % bs


# The plausible ways to get translate wrong, each written out (Python's own indexing included:
# a negative index reads from the end, an index past the end raises IndexError)
_TRANSLATE_MISTAKES: dict[str, Callable] = {
    "a page id counts pages, not slots: multiply block_table[pos // block_size] by "
    "block_size before adding the offset": lambda t, pos, bs: t[pos // bs] + pos % bs,
    "the block table was ignored: token pos lives in page block_table[pos // block_size], "
    "not at slot pos": lambda t, pos, bs: pos,
    "// and % swapped: the page is block_table[pos // block_size] and the offset within it "
    "pos % block_size, not block_table[pos % block_size] and pos // block_size":
        lambda t, pos, bs: t[pos % bs] * bs + pos // bs,
    "off by one page: position pos is in entry pos // block_size of the block table, not the "
    "next one": lambda t, pos, bs: t[pos // bs + 1] * bs + pos % bs,
    "the offset within the page was dropped: add pos % block_size to the page's first slot":
        lambda t, pos, bs: t[pos // bs] * bs,
    "the offset is pos % block_size, not pos: a page holds only block_size slots":
        lambda t, pos, bs: t[pos // bs] * bs + pos,
    "the page id was scaled by the number of pages, not by block_size (slot = page * "
    "block_size + offset)": lambda t, pos, bs: t[pos // bs] * len(t) + pos % bs,
}


def grade_translate(fn: Callable) -> str:
    """Grade an answer to exercise `translate` (exercises/ch05_paged_attention.py)."""
    # two geometries, the table's length unlike block_size, page 0 not first: no mistake
    # above gives the right slot everywhere, and no two of them agree on every position
    for table, bs in (([7, 2, 5, 0, 3], 4), ([3, 9, 1], 8)):
        cases = [(list(table), pos, bs) for pos in range(len(table) * bs)]
        got = [_outcome(fn, *c) for c in cases]
        want = [_slot(*c) for c in cases]
        if got == want:
            continue
        i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        hint = _name_the_mistake(got, cases, _TRANSLATE_MISTAKES) or (
            "slot = block_table[pos // block_size] * block_size + pos % block_size")
        raise AssertionError(f"translate({table}, {cases[i][1]}, {bs}) {_said(got[i])}, "
                             f"expected {want[i]}: {hint}")
    table, bs = [7, 2, 5, 0], 4
    for pos, why in ((16, "position 16 needs a fifth page the table does not have"),
                     (-1, "a negative position is no token: table[-1 // 4] is table[-1], so "
                          "without a check it reads the last page; refuse pos < 0"),
                     (-4, "a negative position is no token: refuse pos < 0 (table[-4 // 4] "
                          "silently reads the last page)")):
        got = _outcome(fn, list(table), pos, bs)
        if got != "raised IndexError":
            raise AssertionError(f"translate({table}, {pos}, {bs}) {_said(got)}, expected "
                                 f"IndexError: {why}")
    return ("every position of two block tables; past the end and negative positions refused "
            "with IndexError")


def _expect_raise(what: str, error: type, why: str, fn: Callable, *args) -> None:
    """Raise an AssertionError that says `why` unless `fn(*args)` raises `error`."""
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except error:
        return
    except Exception as err:
        raise AssertionError(f"{what} raised {type(err).__name__}, expected "
                             f"{error.__name__}: {why}") from None
    raise AssertionError(f"{what} did not raise {error.__name__}: {why}")


def grade_cow_pages(cls: Callable) -> str:
    """Grade an answer to exercise `CowPages` (exercises/ch05_paged_attention.py)."""
    pool = cls(4)
    a, b = pool.alloc(), pool.alloc()
    if a == b or pool.num_free != 2 or pool.refcount(a) != 1:
        raise AssertionError(f"alloc: two pages {a}, {b} with {pool.num_free} free left and "
                             f"refcount {pool.refcount(a)}; expected two distinct pages, 2 free, "
                             "refcount 1")
    if pool.share(a) != a:  # a second sequence with the same prefix
        raise AssertionError(f"share({a}) must return the page it shares, {a}")
    if pool.refcount(a) != 2:
        raise AssertionError(f"share({a}): refcount {pool.refcount(a)}, expected 2 (one more "
                             "holder)")
    if pool.num_free != 2:
        counts_refs = pool.num_free == 4 - (pool.refcount(a) + pool.refcount(b))
        hint = (f"num_free counts references, not pages: page {a} has 2 holders and is still "
                "one page" if counts_refs else
                "sharing adds a holder, not a page: no page leaves or joins the free list")
        raise AssertionError(f"after share({a}), num_free is {pool.num_free}, expected 2 (pages "
                             f"{a} and {b} held, page {a} by 2 sequences): {hint}")
    pool.free(a)  # one of them finishes
    if pool.num_free != 2 or pool.refcount(a) != 1:
        state = (f"page {a} had 2 holders, one freed it, and now refcount={pool.refcount(a)}, "
                 f"{pool.num_free} pages free; expected refcount 1, 2 free")
        if pool.num_free == 3:  # the page went back to the free list with a holder left
            raise AssertionError(
                f"freed a shared page while refs > 0: {state}. The other holder still reads it: "
                "it returns to the free list only at refcount 0")
        raise AssertionError(f"free drops one reference: {state}")
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
    # pages are 0..3 (the docstring's contract): the one nobody holds now
    free_page = next(p for p in range(4) if p not in (a, b, w))
    for action, call, why in (
            ("share", pool.share, "only a page someone holds can be shared; a free page stays "
             "on the free list, so the next alloc hands it to a second owner while the first "
             "reads it"),
            ("write", pool.write, "a holder writes only pages it holds; a write after free "
             "corrupts whoever allocates the page next")):
        _expect_raise(f"{action}({free_page}) on a free page", RuntimeError, why, call,
                      free_page)
        if pool.num_free != 1 or pool.refcount(free_page) != 0:
            raise AssertionError(
                f"a refused {action} changed the pool: after {action}({free_page}) raised, page "
                f"{free_page} has refcount {pool.refcount(free_page)} and {pool.num_free} pages "
                "are free, expected 0 and 1 (check the page before changing anything)")
    for p in (a, b, w):
        pool.free(p)
    if pool.num_free != 4:
        raise AssertionError(f"after freeing every page, {pool.num_free} of 4 are free")
    _expect_raise(f"free({a}) on a free page", RuntimeError, "a double free puts a page in the "
                  "free list twice, and two sequences end up sharing it", pool.free, a)
    full = cls(1)
    full.alloc()
    _expect_raise("alloc on a full pool", MemoryError, "no page is free", full.alloc)
    return ("alloc, share, num_free counting pages, free at refcount 0, copy-on-write; double "
            "free, sharing and writing a free page refused")

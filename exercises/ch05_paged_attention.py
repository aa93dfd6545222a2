"""Chapter 05 exercises: the bookkeeping of PagedAttention. Fill in each function and the class,
then run `make grade` (or the check cell in notebooks/05_paged_attention.ipynb). The graders
are the same tests that check labkit's own solutions (labkit/paged_kv.py,
labkit/instruments/kv_sim.py)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Return how many pages of `block_size` tokens hold `num_tokens` tokens: a partly filled
    page is a whole page, and a sequence of exactly k * block_size tokens needs k pages."""
    raise NotImplementedError("blocks_needed: see the docstring for the task")


def translate(block_table, pos: int, block_size: int) -> int:
    """Return the flat slot of token `pos` of a sequence: its page is
    block_table[pos // block_size], and slot = page * block_size + pos % block_size. Raise
    IndexError for a position the block table does not cover: past its end, or negative
    (mind Python: block_table[-1] is the last page, not an error)."""
    raise NotImplementedError("translate: see the docstring for the task")


class CowPages:
    """A reference-counted page allocator with copy-on-write, over pages 0..num_pages-1.

    - `alloc() -> page`: a free page, now with one reference (MemoryError if none is free);
    - `share(page) -> page`: one more holder (a sequence with the same prefix); returns `page`;
    - `free(page)`: drop one reference; the page is free again only when none is left;
    - `write(page) -> page`: the page a holder may write: `page` itself if it is the only
      holder, else a freshly allocated copy; the caller's reference moves from `page` to the
      copy (the other holders keep reading the original, unchanged);
    - `refcount(page) -> int`, and the property `num_free`: pages nobody holds (a page shared
      by three sequences is one page in use, not three);
    - sharing, writing or freeing a free page raises RuntimeError, and changes nothing.
    """

    def __init__(self, num_pages: int):
        raise NotImplementedError("CowPages: see the class docstring for the task")

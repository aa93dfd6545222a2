"""Prefix sharing: requests with the same prompt prefix share its full KV pages.

A full page's KV depends only on the tokens up to its end, so a page is named by a *hash chain*:
`h_i = hash((h_{i-1}, tokens of page i))`, with `h_{-1}` the request's salt (its adapter). Two
requests whose first k pages hold the same tokens compute the same k hashes and can share the
pages by reference count (`BlockAllocator.share`). A shared system prompt is prefilled once.

- Only *full* pages are named, and only by tokens known on the host when their row is planned
  (prefill chunks): a named page is never written again, so sharing it is safe.
- A page becomes findable when the launch that writes it is planned: the device runs launches
  in order, so any later launch that reads it runs after it is written.
- At refcount 0 a named page stays cached (`BlockAllocator.keep`) until the pool needs it; the
  allocator evicts the least recently used one and this cache forgets its name.
- Copy-on-write: a row never writes into a shared page. The one place it would, the last page
  of a context that is entirely cached (its last token must be computed again to get logits),
  is not shared: the sequence takes a private page and recomputes that page's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.paged_kv import BlockAllocator


class PrefixCache:
    """Maps hash-chain names of full pages to the pages holding their KV."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self._page_of: dict[int, int] = {}  # hash -> page
        # page -> (parent hash, its tokens, its hash): checked on every hit (no collisions)
        self._name_of: dict[int, tuple[int, tuple[int, ...], int]] = {}
        allocator.on_evict = self._forget

    def chain(self, tokens: Sequence[int], salt: int, known: list[int]) -> list[int]:
        """Hashes of every full page of `tokens`, extending `known` (hashes computed before)."""
        bs = self.block_size
        hashes = list(known)
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else hash(("labkit-prefix", salt))
            hashes.append(hash((parent, tuple(tokens[i * bs:(i + 1) * bs]))))
        return hashes

    def match(self, tokens: Sequence[int], salt: int) -> list[int]:
        """Share the cached pages of the longest cached full-page prefix of `tokens`."""
        bs = self.block_size
        pages: list[int] = []
        parent = hash(("labkit-prefix", salt))
        for i in range(len(tokens) // bs):
            piece = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, piece))
            page = self._page_of.get(h)
            if page is None or self._name_of[page][:2] != (parent, piece):  # miss (or collision)
                break
            pages.append(page)
            parent = h
        self.allocator.share(pages)
        return pages

    def register(self, tokens: Sequence[int], salt: int, block_table: list[int],
                 known: list[int], num_written: int) -> list[int]:
        """Name the full pages among the first `num_written` tokens; returns the hash chain."""
        bs = self.block_size
        hashes = self.chain(tokens[:num_written - num_written % bs], salt, known)
        for i in range(len(known), len(hashes)):
            h, page = hashes[i], block_table[i]
            if h in self._page_of or page in self._name_of:
                continue  # the same KV is already cached under this name, or page named
            parent = hashes[i - 1] if i else hash(("labkit-prefix", salt))
            self._page_of[h] = page
            self._name_of[page] = (parent, tuple(tokens[i * bs:(i + 1) * bs]), h)
            self.allocator.keep(page)
        return hashes

    def unname(self, pages: Sequence[int]) -> None:
        """Forget the names of owned pages whose KV was never written (a launch undone)."""
        for page in pages:
            if page in self._name_of:
                self._forget(page)
                self.allocator.unkeep(page)

    def _forget(self, page: int) -> None:
        name = self._name_of.pop(page, None)
        if name is not None and self._page_of.get(name[2]) == page:
            del self._page_of[name[2]]

    def __len__(self) -> int:
        return len(self._page_of)

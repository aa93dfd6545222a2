"""KV memory, simulated: where a cache policy's memory goes, and the bookkeeping of pages.

Three ways to hold the KV cache of sequences whose final length nobody knows in advance:

- **contiguous**: each sequence gets one region of the longest length it may reach (what a
  framework without paging must do); the pool fits `pool // max_len` sequences, whatever
  their real lengths;
- **reserve**: pages, but all of `prompt + max_new_tokens` reserved at admission;
- **on_demand**: pages as the sequence grows, a new one when its last page fills.

At every step each sequence's slots fall in three bins (the vLLM paper's accounting):
**used** (holding a token), **reserved-unused** (held for a token the sequence will write
later), and **internal waste** (held, but beyond the sequence's final length: never written).
What the pool cannot hand out although it is free is **external fragmentation** (the leftover
of a pool that is not a multiple of the region size). `simulate_pool` replays a workload with
every sequence running to its final length and reports the time-averaged shares and the peak
concurrency: a prediction that `python -m labkit bench paged` then measures on the engine.

`translate` and `CowPages` are the chapter-05 exercises' reference solutions: the address of a
token in a paged cache, and a reference-counted page allocator with copy-on-write.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.paged_kv import blocks_needed

POLICIES = ("contiguous", "reserve", "on_demand")


def translate(block_table: Sequence[int], pos: int, block_size: int) -> int:
    """Flat slot of token `pos`: page `block_table[pos // block_size]`, offset
    `pos % block_size` within it."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    covered = len(block_table) * block_size
    if pos < 0:  # Python's table[-1] would silently answer with the last page
        raise IndexError(f"position {pos} is negative: a block table of {len(block_table)} "
                         f"pages of {block_size} covers positions 0..{covered - 1}")
    if pos >= covered:
        raise IndexError(f"position {pos} is outside a block table of {len(block_table)} pages "
                         f"of {block_size} (positions 0..{covered - 1})")
    return block_table[pos // block_size] * block_size + pos % block_size


class CowPages:
    """Page ids with reference counts: alloc, free, share, and copy-on-write before a write."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.copies: list[tuple[int, int]] = []  # (from, to) page copies done by write()

    @property
    def num_free(self) -> int:
        """Pages with no reference: a page shared by k holders is one page, not k."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        """Holders of `page` (0: free)."""
        self._in_pool(page)
        return self.refs[page]

    def alloc(self) -> int:
        """A free page, refcount 1; raises MemoryError when none is free."""
        if not self._free:
            raise MemoryError("no free page")
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> int:
        """One more holder of `page` (a sequence with the same prefix); returns the page."""
        self._live(page, "shared")
        self.refs[page] += 1
        return page

    def free(self, page: int) -> None:
        """Drop one reference; the page returns to the free list only at zero."""
        self._live(page, "freed")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free.append(page)

    def write(self, page: int) -> int:
        """The page a holder may write in place of `page`: itself if private, else a fresh
        copy (copy-on-write; the caller's reference moves to the copy)."""
        self._live(page, "written")
        if self.refs[page] == 1:
            return page
        new = self.alloc()
        self.refs[page] -= 1
        self.copies.append((page, new))
        return new

    def _in_pool(self, page: int) -> None:
        if not 0 <= page < len(self.refs):  # refs[-1] would silently answer for the last page
            raise IndexError(f"page {page} is not in this pool of {len(self.refs)} pages "
                             f"(0..{len(self.refs) - 1})")

    def _live(self, page: int, action: str) -> None:
        self._in_pool(page)
        if self.refs[page] == 0:
            why = {"shared": "only a page someone holds can be shared; it is still on the free "
                             "list, so the next alloc would hand it to a second owner",
                   "written": "a write after free corrupts whoever allocates the page next",
                   "freed": "a double free puts the page on the free list twice"}[action]
            raise RuntimeError(f"page {page} {action} while free: {why}")


@dataclass(frozen=True)
class PoolReport:
    """A simulated run of one policy: peak concurrency, steps, time-averaged shares of the
    memory held (used + reserved_unused + internal = 1) and external fragmentation of the
    pool. `running[t]` and `waiting[t]` count the sequences running and queued at step t: while
    some wait, the pool is what limits concurrency; once none wait, the workload is draining."""

    policy: str
    pool_tokens: int
    max_concurrent: int
    mean_concurrent: float
    steps: int
    used: float
    reserved_unused: float
    internal: float
    external: float
    timeline: list[tuple[int, int, int, int]]  # per step: (used, reserved, internal, free)
    running: list[int]  # per step: sequences running
    waiting: list[int]  # per step: requests queued (not admitted, or preempted)


def _held(policy: str, tokens: int, final: int, cap: int, block_size: int, max_len: int) -> int:
    """Slots a sequence holds with `tokens` written, `final` at the end, `cap` allowed."""
    if policy == "contiguous":
        return max_len
    if policy == "reserve":
        return blocks_needed(cap, block_size) * block_size
    return blocks_needed(tokens, block_size) * block_size


def simulate_pool(lengths: Sequence[tuple[int, int, int]], pool_tokens: int, policy: str, *,
                  block_size: int = 16, max_len: int | None = None, max_seqs: int = 256
                  ) -> PoolReport:
    """Replay requests (prompt_len, final_output_len, max_new_tokens), all waiting at time 0,
    one decode token per sequence per step, admission FCFS while memory allows.

    contiguous regions are `max_len` slots (default: the longest prompt + max_new); on_demand
    admits a request when the pages of its prompt and first token are free and preempts the
    latest arrival when a running sequence cannot get its next page."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    max_len = max_len or max(p + m for p, _, m in lengths)
    waiting = deque(range(len(lengths)))
    running: list[int] = []
    done_tokens = [0] * len(lengths)  # output tokens so far
    steps, peak, conc_sum, timeline = 0, 0, 0, []
    running_at, waiting_at = [], []
    sums = [0.0, 0.0, 0.0]
    rows = pool_tokens // max_len if policy == "contiguous" else None
    pages = pool_tokens // block_size

    def held(i: int, extra: int = 0) -> int:
        p, f, m = lengths[i]
        return _held(policy, p + done_tokens[i] + extra, p + f, p + m, block_size, max_len)

    while waiting or running:
        # admission (contiguous: a free region; paged: the pages it needs now)
        while waiting and len(running) < max_seqs:
            i = waiting[0]
            if policy == "contiguous":
                fits = len(running) < rows
            else:
                used = sum(held(j) for j in running) // block_size
                fits = used + held(i, 1) // block_size <= pages
            if not fits:
                break
            running.append(waiting.popleft())
        if not running:
            raise ValueError(f"request {waiting[0]} {lengths[waiting[0]]} can never fit a pool "
                             f"of {pool_tokens} tokens under {policy!r}")
        # on demand: every running sequence needs room for one more token, or someone leaves
        while policy == "on_demand" and sum(held(j, 1) for j in running) > pages * block_size:
            victim = running.pop()  # the latest arrival is preempted (recomputed later)
            waiting.appendleft(victim)
        if not running:
            raise ValueError(f"request {waiting[0]} {lengths[waiting[0]]} outgrows a pool of "
                             f"{pool_tokens} tokens on its own")
        for i in running:
            done_tokens[i] += 1
        steps += 1
        peak = max(peak, len(running))
        conc_sum += len(running)
        running_at.append(len(running))
        waiting_at.append(len(waiting))
        u = r = w = 0
        for i in running:
            p, f, _ = lengths[i]
            tok, h = p + done_tokens[i], held(i)
            u += tok
            r += min(h, p + f) - tok
            w += h - min(h, p + f)
        free = pool_tokens - u - r - w
        timeline.append((u, r, w, free))
        for k, v in enumerate((u, r, w)):
            sums[k] += v / max(1, u + r + w)
        running = [i for i in running if done_tokens[i] < lengths[i][1]]
    external = (pool_tokens - rows * max_len) / pool_tokens if rows is not None else 0.0
    return PoolReport(policy, pool_tokens, peak, conc_sum / steps, steps, sums[0] / steps,
                      sums[1] / steps, sums[2] / steps, external, timeline, running_at,
                      waiting_at)

"""Who runs next: mixed steps under a token budget, pages on demand, preemption.

The scheduler decides; it owns no tensors. Each launch is a list of `Row`s, one per sequence:
a *decode row* (one token, read back on the device) or a *prefill chunk* (prompt tokens, sent
from the host). `schedule()` plans one launch:

1. **Decode rows first**, for every running sequence whose context is computed: they are what
   the inter-token latency measures, so arrivals never stall them.
2. **Admission**: waiting requests join (first come, first served) while a device row, an
   adapter slot and the pages of their prompt are free. `batching="static"` admits a batch
   only when the last one has entirely left; its finished members stay as padding rows (as
   transformers' `generate` pads finished rows) until every member has finished.
3. **Prefill chunks** in arrival order, until the step's token budget is spent. A chunk's row
   emits a token only if it ends the sequence's known context; an earlier chunk is *silent*.

**Plan allocates, commit appends, release frees.** The pages a row writes are allocated when
it is planned (`kv_reserve="on_demand"`), so a launched step never finds its page missing;
`kv_reserve="max"` reserves prompt + max_new_tokens pages at admission instead (the policy
paging replaces). When a row that must run cannot get a page, the latest arrival is
*preempted*: it stops being planned, its pages return when no launched step references it
(`inflight_refs == 0`), and it waits with prompt + outputs to be prefilled again (recompute).
Sampling is keyed by (request seed, token index), so its tokens are the same as if it had never
been preempted. A request that could never fit the pool is refused at submit.

**Forks share, the first write copies.** Parallel sampling submits n sequences with one prompt;
the later ones are forks of the first (`Sequence.fork_of`). They are admitted with it and wait,
holding no pages, until its prompt's last chunk is planned; there each fork shares every page
of the prompt, the last partial one included, and gets a *fork row* that computes nothing and
samples its first token, with its own seed, from the same logits. A row never writes into a
shared page: the first write copies it to a private page (a device copy in the same launch,
before the forward: `copies`), and the last owner writes in place. A fork whose prompt's owner
is preempted or ends first simply prefills its prompt itself.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from labkit.paged_kv import BlockAllocator, blocks_needed
from labkit.prefix_cache import PrefixCache
from labkit.sequence import FinishReason, Sequence, Status

BATCHING = ("continuous", "static")
KV_RESERVE = ("on_demand", "max")


class RequestError(ValueError):
    """A request that can never run (it is refused, nothing else is affected)."""


class SlotPool:
    """A finite pool of integer slots (device rows, adapter slots) with checked frees."""

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._free = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots not in use."""
        return len(self._free)

    def take(self) -> int:
        """A free slot (the caller checked num_free)."""
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        """Return a slot; returning one twice raises."""
        if slot not in self._used:
            raise RuntimeError(f"{self.what} {slot} returned twice (or never taken)")
        self._used.remove(slot)
        self._free.append(slot)


@dataclass
class Row:
    """One sequence's slice of a launch."""

    seq: Sequence
    start: int  # positions of the sequence already computed before this row
    n: int  # tokens this row computes (1 for a decode row)
    emits: bool  # it ends the known context: its sampled token is the sequence's next one
    from_device: bool  # its one input token is the last one sampled, read on the device
    pad: bool = False  # static batching: a finished member kept in the batch as padding
    sample_from: int | None = None  # a fork row: the launch row whose logits it samples
    # a verify row (speculative decoding): the drafted tokens after the last committed one;
    # the row computes both and samples all n = 1 + len(draft) positions
    draft: list[int] | None = None


def blocks_for(seq: Sequence, upto: int, block_size: int) -> int:
    """New pages `seq` needs so that its block table covers positions 0..upto-1."""
    return max(0, blocks_needed(upto, block_size) - len(seq.block_table))


class Scheduler:
    """Admission, mixed steps, pages on demand, preemption and release for one engine."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_seqs: int,
                 context_len: int, num_adapter_slots: int = 4, *,
                 max_step_tokens: int | None = None, batching: str = "continuous",
                 kv_reserve: str = "on_demand", prefix_caching: bool = False,
                 reserve_tokens: int | None = None, stats=None,
                 device_rows: int | None = None, foresee_finishes: bool = False):
        if max_step_tokens is not None and (isinstance(max_step_tokens, bool) or not isinstance(
                max_step_tokens, int) or max_step_tokens < 1):
            raise ValueError(f"max_step_tokens must be None (no budget) or an integer >= 1, "
                             f"got {max_step_tokens!r}")
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if kv_reserve not in KV_RESERVE:
            raise ValueError(f"kv_reserve must be one of {KV_RESERVE}, got {kv_reserve!r}")
        self.allocator, self.block_size = allocator, block_size
        self.context_len = context_len
        self.max_step_tokens, self.batching, self.kv_reserve = (max_step_tokens, batching,
                                                                kv_reserve)
        # a contiguous cache reserves a whole row's slab per sequence, whatever it asks for
        self.reserve_tokens = reserve_tokens
        self.prefix = PrefixCache(allocator, block_size) if prefix_caching else None
        # decode rows must always fit the budget: at most that many sequences run at once
        self.max_running = min(max_seqs, max_step_tokens or max_seqs)
        # device rows: one per running sequence, zombies included (they hold theirs until
        # their last launch commits); at most max_running are planned in any step
        self.rows = SlotPool(device_rows or max_seqs, "device row")
        self.adapters = SlotPool(num_adapter_slots, "adapter slot")
        self.waiting: deque[Sequence] = deque()  # in arrival order (request id)
        self.running: list[Sequence] = []  # in arrival order; holds resources
        self.stats = stats  # an object with the counters below (EngineStats), or None
        self.step = 0  # the step counter, for the record of when things happened
        # forks share their prompt's pages where pages are on demand and batches continuous
        # (a contiguous cache or max reservation gives each its own slab)
        self.fork_sharing = (reserve_tokens is None and kv_reserve == "on_demand"
                             and batching == "continuous")
        self.copies: list[tuple[int, int]] = []  # copy-on-write of the launch being planned
        # a finish by length is known when the next step is planned: with foresight, a sequence
        # whose last token is already in flight gets no row after it (no zombie row) and stops
        # counting as live (a waiting request takes its place in that very step, as in the
        # blocking loop). Finishes the host finds only at commit (EOS, a stop string, a cancel)
        # still make zombies. Off: every finish is found at commit, as in Photon's loop.
        self.foresee_finishes = foresee_finishes
        self._ending: set[int] = set()  # those, when the launch being planned began

    def _count(self, name: str, n: int = 1) -> None:
        if self.stats is not None:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- requests ------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """Validate a request; returns its max_new_tokens clipped to the context."""
        if not prompt_ids:
            raise RequestError("empty prompt: give at least one token to condition on")
        if len(prompt_ids) >= self.context_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens does not fit the model's context of "
                f"{self.context_len} tokens (it must leave room for at least one new token)")
        max_new = min(max_new_tokens, self.context_len - len(prompt_ids))
        pages = blocks_needed(len(prompt_ids) + max_new, self.block_size)
        if pages > self.allocator.num_blocks:
            raise RequestError(
                f"request needs {pages} KV pages ({len(prompt_ids)} prompt + {max_new} new "
                f"tokens, {self.block_size} per page) but the whole pool has "
                f"{self.allocator.num_blocks}; it could never run. Lower max_new_tokens or "
                "give the engine more KV pages")
        return max_new

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence."""
        if seq.adapter is not None and self.adapters.size == 0:
            raise RequestError("request asks for an adapter but the engine has no adapter slots")
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        # arrival order: a preempted sequence goes back ahead of everyone who came after it
        ids = [s.request_id for s in self.waiting]
        self.waiting.insert(bisect.bisect(ids, seq.request_id), seq)

    # -- planning one launch -------------------------------------------------------------------

    def schedule(self) -> list[Row]:
        """Plan the next launch: decode rows, admissions, prefill chunks (see the module)."""
        for _ in range(len(self.running) + 1):
            rows = self._plan()
            if rows or not self._stalled():
                return rows
            # nothing can run and nothing in flight will free a page: make room (rare)
            self.preempt(max(self.live(), key=lambda s: s.request_id))
        return []

    def _plan(self) -> list[Row]:
        budget = self.max_step_tokens or 1 << 62
        # (a row planned in this launch that emits a sequence's last token does not free its
        # place in this launch: at most max_running sequences have rows in one launch)
        self._ending = {s.request_id for s in self.running if self.foresee_finishes
                        and s.pending > 0 and not s.finalized
                        and len(s.output_ids) + s.pending >= s.max_new_tokens}
        self.copies = []
        rows: list[Row] = []
        planned: set[int] = set()
        static = self.batching == "static"
        # a static batch's finished members ride along as padding, a token each of the budget;
        # their rows are added last, once the live rows are planned (a preemption while
        # planning can end the batch and release them)
        padding = [s for s in self.running
                   if static and (s.finalized or self.foreseen(s)) and not s.released]
        budget -= len(padding)
        # speculative drafts take what the budget leaves beyond one token per decode row
        spare = budget - sum(1 for s in self.running if s.decoding and not (
            s.preempted or s.released or s.finalized or self.foreseen(s)))
        for s in list(self.running):  # 1. decode rows, arrival order
            if s.preempted or s.released or s.finalized or not s.decoding or self.foreseen(s):
                continue
            draft = self._draft_fits(s, spare)
            if not self._grow(s, s.num_cached + 1 + len(draft), planned):
                continue
            if draft:  # a verify row: the last committed token and the draft, from the host
                rows.append(Row(s, s.num_cached, 1 + len(draft), True, False, draft=draft))
            else:
                rows.append(Row(s, s.num_cached, 1, True, True))
            planned.add(s.request_id)
            budget -= rows[-1].n
            spare -= len(draft)
            self._written(rows[-1])
        if static and not self.running:  # a static batch is admitted whole, then runs until
            while self._admit_one() is not None:  # every member has left
                pass
        # 2. prefill chunks in arrival order: running sequences first, then admissions (each
        # admitted one planned before the next is matched, so it finds the pages just named)
        prefilling = [s for s in self.running if not (
            s.preempted or s.finalized or s.decoding or s.attached or self.foreseen(s)
            or s.request_id in planned)]
        while budget > 0:
            if prefilling:
                s = prefilling.pop(0)
            elif static or (s := self._admit_one()) is None:
                break
            end = min(s.num_tokens, s.num_cached + budget)
            end = min(end, self._fits(s, end))
            if end <= s.num_cached:
                continue  # no page for it now: it waits (decode rows free pages as they end)
            self._take_pages(s, end)
            n = end - s.num_cached
            rows.append(Row(s, s.num_cached, n, end == s.num_tokens, False))
            planned.add(s.request_id)
            budget -= n
            self._written(rows[-1])
            if rows[-1].emits:
                self._fork(s, len(rows) - 1, rows, planned)
        if rows:  # padding beside live rows only: a step of padding alone computes nothing
            rows += [Row(s, 0, 1, False, False, pad=True) for s in padding if not s.released]
        return rows

    def _draft_fits(self, seq: Sequence, spare: int) -> list[int]:
        """The part of `seq.draft` (set by the engine's proposer) this step runs: within the
        budget's spare tokens and the free pages (a draft never preempts anyone)."""
        if not seq.draft or spare <= 0:
            return []
        assert seq.pending == 0, "a verify row needs its last token on the host (blocking loop)"
        draft = seq.draft[:spare]
        end = seq.num_cached + 1 + len(draft)
        need = blocks_for(seq, end, self.block_size) + len(
            self._shared_in(seq, seq.num_cached, end))
        return draft if need <= self.allocator.num_free else []

    def rollback(self, seq: Sequence, num_cached: int) -> None:
        """Forget the KV of positions >= num_cached (a verify row's rejected drafts): the
        sequence's length goes back, and pages holding only those positions return to the
        pool. They were never named in the prefix cache (a verify row's tokens are not known
        when it is planned), so no cached page ever holds an unaccepted token."""
        assert num_cached <= seq.num_cached, (num_cached, seq.num_cached)
        seq.num_cached = num_cached
        if self.kv_reserve == "on_demand" and not seq.released:
            keep = blocks_needed(num_cached, self.block_size)
            extra, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
            self.allocator.free(extra)
            self._count("draft_pages_returned", len(extra))

    def _fork(self, seq: Sequence, row: int, rows: list[Row], planned: set[int]) -> None:
        """`seq`'s prompt is complete in this launch: its attached forks share every page of it
        and sample their first token from the same logits (fork rows, no tokens computed)."""
        for f in self.running:
            if not (f.attached and f.fork_of is seq):
                continue
            f.attached = False
            if f.finalized:  # cancelled while it waited: it never shares
                continue
            self.allocator.share(seq.block_table)
            f.block_table, f.page_hashes = list(seq.block_table), list(seq.page_hashes)
            f.num_cached = seq.num_cached
            self._count("prefill_tokens_saved", seq.num_cached)
            self._count("pages_saved", len(seq.block_table))
            rows.append(Row(f, f.num_cached, 0, True, False, sample_from=row))
            planned.add(f.request_id)
            self._written(rows[-1])

    def _detach(self, seq: Sequence) -> None:
        """`seq` will not finish its prompt now: its waiting forks prefill it themselves."""
        for f in self.running:
            if f.attached and f.fork_of is seq:
                f.attached = False

    def _shared_in(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Indices into seq's block table of shared pages that positions start..end-1 write."""
        bs, table = self.block_size, seq.block_table
        return [i for i in range(start // bs, min(-(-end // bs), len(table)))
                if self.allocator.refcount(table[i]) > 1]

    def _copy_on_write(self, seq: Sequence, start: int, end: int) -> None:
        """Give `seq` a private copy of each shared page it is about to write (pages free)."""
        for i in self._shared_in(seq, start, end):
            src = seq.block_table[i]
            dst = self.allocator.allocate(1)[0]
            self.copies.append((src, dst))
            seq.block_table = seq.block_table[:i] + [dst] + seq.block_table[i + 1:]
            self.allocator.free([src])  # one owner fewer; the last one writes it in place
            self._count("cow_copies")

    def _written(self, r: Row) -> None:
        """Book what a planned row computes: the launch that carries it writes its KV."""
        s, bs = r.seq, self.block_size
        # a row writes only pages its sequence alone owns (shared ones are read-only)
        if r.n:
            self.allocator.check_writable(
                s.block_table[r.start // bs:(r.start + r.n - 1) // bs + 1])
        s.num_cached += r.n
        if r.emits:
            s.pending += 1
            s.decoding = True
        if not r.from_device and r.draft is None and self.prefix is not None:
            # its tokens are known (a verify row's drafts are only guesses): name full pages
            s.page_hashes = self.prefix.register(s.context, s.adapter or 0, s.block_table,
                                                 s.page_hashes, s.num_cached)

    def _stalled(self) -> bool:
        """Live sequences, none planned, and no launched step will return a page."""
        return bool(self.live()) and not any(s.inflight_refs for s in self.running)

    def _fits(self, seq: Sequence, end: int) -> int:
        """The furthest position <= end the free pages let `seq` compute up to."""
        pages = len(seq.block_table) + self.allocator.num_free
        return min(end, pages * self.block_size)

    def _take_pages(self, seq: Sequence, end: int) -> None:
        seq.block_table += self.allocator.allocate(blocks_for(seq, end, self.block_size))

    def _grow(self, seq: Sequence, end: int, planned: set[int]) -> bool:
        """Pages for a row that must run (a decode row), preempting the latest arrival if the
        pool is short. False when `seq` cannot run this step (preempted itself, or waiting
        for a preempted sequence's pages to come back from a launched step)."""
        # new pages past the table, and a private copy of each shared page it writes
        need = blocks_for(seq, end, self.block_size) + len(
            self._shared_in(seq, seq.num_cached, end))
        while need > self.allocator.num_free:
            if need <= self.allocator.num_free + self._returning_pages():
                return False  # pages come back at the next commit: skip one step
            victim = max((s for s in self.live() if s.request_id not in planned),
                         key=lambda s: s.request_id)
            self.preempt(victim)
            if victim is seq:
                return False
        self._copy_on_write(seq, seq.num_cached, end)
        self._take_pages(seq, end)
        return True

    def _returning_pages(self) -> int:
        """Pages that sequences done or preempted give back once their launches commit (a
        static batch's finished members keep theirs until the batch is over)."""
        alloc, static = self.allocator, self.batching == "static"
        return sum(1 for s in self.running
                   if s.inflight_refs and (s.preempted or (s.finalized and not static))
                   for p in s.block_table if alloc.refcount(p) == 1)

    def _admit_one(self) -> Sequence | None:
        """Move the head of the queue to running if its resources are free (FCFS), or None."""
        if not self.waiting or len(self.live()) >= self.max_running or not self.rows.num_free:
            return None  # (a zombie is not planned again: only live sequences take step rows)
        seq = self.waiting[0]
        if seq.adapter is not None and self.adapters.num_free == 0:
            return None  # the head waits; later requests do not jump it (no starvation)
        shared = self._match_prefix(seq)
        reserve = (self.reserve_tokens or seq.max_total_tokens
                   if self.kv_reserve == "max" else seq.num_tokens)
        if blocks_for(seq, reserve, self.block_size) > self.allocator.num_free:
            self.allocator.free(shared)  # give the hit back: it waits for pages
            seq.block_table, seq.page_hashes, seq.num_cached = [], [], 0
            return None
        if shared:
            self._count("prefill_tokens_saved", seq.num_cached)
            self._count("pages_saved", len(shared))
        if self.kv_reserve == "max":
            self._take_pages(seq, reserve)
        self.waiting.popleft()
        self._run(seq)
        if self.fork_sharing and not seq.output_ids:
            for f in seq.forks:  # its forks come in beside it while rows are free
                if (f.status is Status.WAITING and not f.finalized and not f.output_ids
                        and len(self.live()) < self.max_running and self.rows.num_free
                        and (f.adapter is None or self.adapters.num_free)):
                    self.waiting.remove(f)
                    self._run(f)
                    f.attached = True
        return seq

    def _run(self, seq: Sequence) -> None:
        """Move an admitted sequence into running, with a device row (and adapter slot)."""
        seq.row = self.rows.take()
        if seq.adapter is not None:
            seq.adapter_slot = self.adapters.take()
        seq.status = Status.RUNNING
        seq.decoding, seq.pending = False, 0
        ids = [s.request_id for s in self.running]
        self.running.insert(bisect.bisect(ids, seq.request_id), seq)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Share cached full pages of the sequence's context (prompt, plus outputs after a
        preemption); its last token is always computed, for its logits."""
        if self.prefix is None:
            return []
        context = seq.context
        shared = self.prefix.match(context, seq.adapter or 0)
        if shared and len(shared) * self.block_size >= len(context):
            # copy-on-write: the last token's row would write into this shared page, so it
            # takes a private page and computes that page's tokens again
            self.allocator.free(shared[-1:])
            shared = shared[:-1]
        seq.block_table = list(shared)
        seq.num_cached = len(shared) * self.block_size
        seq.page_hashes = self.prefix.chain(context[:seq.num_cached], seq.adapter or 0, [])
        return shared

    # -- leaving -------------------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Stop planning `seq`; it returns to waiting once no launched step references it."""
        if seq.preempted or seq.finalized:
            return
        seq.preempted, seq.attached = True, False
        self._detach(seq)
        self._count("preemptions")
        self.release_if_done(seq)

    def unplan(self, rows: list[Row]) -> None:
        """Undo a planned launch that never reached the device (an error between plan and
        launch): its sequences are preempted, so they are recomputed later with the same
        tokens, and the pages it would have filled lose their prefix names (no KV was
        written to them, so no later request may share them)."""
        bs = self.block_size
        for r in rows:
            if r.pad or self.prefix is None:
                continue
            pages = r.seq.block_table[r.start // bs:(r.start + r.n - 1) // bs + 1]
            self.prefix.unname(pages)
        for seq in dict.fromkeys(r.seq for r in rows if not r.pad):
            self.preempt(seq)

    def finalize(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence over (idempotent); its resources wait for inflight_refs == 0."""
        if seq.finalized:
            return
        seq.finalized, seq.finish_reason = True, reason
        seq.finished_at_step = self.step
        self._detach(seq)
        if seq.status is Status.WAITING:  # not admitted, or preempted and drained: holds nothing
            self.waiting.remove(seq)
            seq.status, seq.released = Status.FINISHED, True
            seq.released_at_step = self.step
        self.release_if_done(seq)

    def release_if_done(self, seq: Sequence) -> bool:
        """The release rule: resources go back exactly once, when no launched step references
        the sequence: for good if it is finalized, to wait again if it was preempted."""
        if seq.released or seq.inflight_refs or seq.status is not Status.RUNNING:
            return False
        if seq.finalized:
            if self.batching == "static" and self._batch_live():
                return False  # a static batch keeps its finished members until the end
            self._give_back(seq)
            seq.released, seq.status = True, Status.FINISHED
            seq.released_at_step = self.step
            if self.batching == "static" and not self._batch_live():
                for s in list(self.running):  # the batch is over: everyone leaves
                    self.release_if_done(s)
            return True
        if seq.preempted:
            self._give_back(seq)
            seq.block_table, seq.page_hashes = [], []
            seq.num_cached, seq.decoding, seq.preempted = 0, False, False
            seq.status = Status.WAITING
            self._enqueue(seq)
            if self.batching == "static" and not self._batch_live():
                for s in list(self.running):
                    self.release_if_done(s)
            return True
        return False

    def _give_back(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        self.rows.give_back(seq.row)
        seq.row = None
        if seq.adapter_slot is not None:
            self.adapters.give_back(seq.adapter_slot)
            seq.adapter_slot = None
        self.running.remove(seq)

    def _batch_live(self) -> bool:
        return any(not s.finalized and not s.preempted for s in self.running)

    def live(self) -> list[Sequence]:
        """Running sequences still being planned (not finalized, not preempted, not ending in
        a launched step by length when finishes are foreseen)."""
        return [s for s in self.running
                if not s.finalized and not s.preempted and not self.foreseen(s)]

    def foreseen(self, seq: Sequence) -> bool:
        """With `foresee_finishes`: `seq`'s last token (by length) is in a launched step."""
        return seq.request_id in self._ending and not seq.finalized

    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        return not self.waiting and not self.running

"""Who runs next: admission under a KV budget, continuous batching, and resource release.

The scheduler decides; it owns no tensors. A request is *admitted* (moved from waiting to
running) only when everything it could ever need is free: KV pages for its prompt plus its
maximum output (plus the one extra "zombie" row a pipelined decoder may run), a device row, and
an adapter slot if it asked for one. Reserving up front means a running request can never hit
a full pool halfway through; a request that could not fit even in an empty pool is refused at
once with a clear error instead of waiting forever. Admission is first come, first served.

Continuous batching falls out of calling `admit()` between steps: finished sequences leave,
waiting ones join, and the batch never waits for its slowest member.
"""

from __future__ import annotations

from collections import deque

from labkit.paged_kv import BlockAllocator, blocks_needed
from labkit.sequence import FinishReason, Sequence, Status


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


class Scheduler:
    """Waiting queue, running set, and the pools they draw from."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_seqs: int,
                 context_len: int, num_adapter_slots: int = 4):
        self.allocator, self.block_size = allocator, block_size
        self.context_len = context_len
        self.rows = SlotPool(max_seqs, "device row")
        self.adapters = SlotPool(num_adapter_slots, "adapter slot")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step = 0  # the step counter, for the record of when things happened

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
        self.waiting.append(seq)

    def admit(self, max_admit: int | None = None) -> list[Sequence]:
        """Move waiting sequences to running while their resources are free (FCFS)."""
        admitted: list[Sequence] = []
        while self.waiting and (max_admit is None or len(admitted) < max_admit):
            seq = self.waiting[0]
            pages = blocks_needed(seq.max_total_tokens, self.block_size)
            if (pages > self.allocator.num_free or self.rows.num_free == 0
                    or (seq.adapter is not None and self.adapters.num_free == 0)):
                break  # the head waits; later requests do not jump it (no starvation)
            self.waiting.popleft()
            seq.block_table = self.allocator.allocate(pages)
            seq.row = self.rows.take()
            if seq.adapter is not None:
                seq.adapter_slot = self.adapters.take()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Undo `admit` for sequences whose prefill never launched: back to the queue's head,
        their resources returned (an error ended the run between admission and launch)."""
        for seq in reversed(seqs):
            if seq.status is not Status.RUNNING or seq.inflight_refs or seq.output_ids:
                continue
            self.allocator.free(seq.block_table)
            self.rows.give_back(seq.row)
            if seq.adapter_slot is not None:
                self.adapters.give_back(seq.adapter_slot)
            seq.block_table, seq.row, seq.adapter_slot = [], None, None
            seq.status = Status.WAITING
            self.running.remove(seq)
            if not seq.finalized:
                self.waiting.appendleft(seq)
            else:  # cancelled in between: it holds nothing now
                seq.status, seq.released = Status.FINISHED, True

    def finalize(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence over (idempotent); its resources wait for inflight_refs == 0."""
        if seq.finalized:
            return
        seq.finalized, seq.finish_reason = True, reason
        seq.finished_at_step = self.step
        if seq.status is Status.WAITING:  # cancelled before admission: holds nothing
            self.waiting.remove(seq)
            seq.status, seq.released = Status.FINISHED, True
            seq.released_at_step = self.step
        self.release_if_done(seq)

    def release_if_done(self, seq: Sequence) -> bool:
        """The release rule: return pages, row and adapter slot exactly once, when safe."""
        if not seq.can_release:
            return False
        self.allocator.free(seq.block_table)
        self.rows.give_back(seq.row)
        if seq.adapter_slot is not None:
            self.adapters.give_back(seq.adapter_slot)
        seq.released, seq.status = True, Status.FINISHED
        seq.released_at_step = self.step
        self.running.remove(seq)
        return True

    def live(self) -> list[Sequence]:
        """Running sequences that are not finalized: the rows of the next decode step."""
        return [s for s in self.running if not s.finalized]

    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        return not self.waiting and not self.running

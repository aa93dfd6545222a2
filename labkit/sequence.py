"""A request's life: its tokens, its status, and the resources it holds.

A `Sequence` is created WAITING, becomes RUNNING when the scheduler admits it (a device row and
possibly an adapter slot; KV pages as it grows), and FINISHED when a commit sees EOS, a stop
token, the length cap, a completed constraint, or a cancel. A preempted one goes back to WAITING
with its outputs and is prefilled again. Two fields make pipelining safe:

- `finalized`: set the moment a commit decides the sequence is over; nothing is ever appended
  to it again, and its rows in steps launched before that moment are skipped ("zombies");
- `inflight_refs`: launched steps that still reference it (+1 at launch, -1 at that step's
  commit). Its resources go back exactly once, when `finalized and inflight_refs == 0`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from labkit.sampling import SamplingParams


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended."""

    STOP = "stop"  # EOS, a stop token, or a constraint that is complete
    LENGTH = "length"  # max_new_tokens, or the model's context is full
    CANCELLED = "cancelled"
    ERROR = "error"  # its commit raised (a constraint, the detokenizer): `Sequence.error` says


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_new_tokens, clipped to what the context can hold
    adapter: int | None = None  # an adapter (LoRA stand-in) the request asks for, or None
    constraint: Any = None  # a labkit.constraints.Constraint, or None
    output_ids: list[int] = field(default_factory=list)
    # with params.logprobs: per output token (its log-probability, [(id, log-probability)] of
    # the most likely ones), see labkit.sampling.token_logprobs
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR: the one line of what raised
    finalized: bool = False
    inflight_refs: int = 0
    released: bool = False  # resources returned (exactly once)
    block_table: list[int] = field(default_factory=list)
    row: int | None = None  # the device row holding its last sampled token
    adapter_slot: int | None = None
    constraint_state: Any = None
    text: str = ""
    detok: Any = None  # incremental detokenizer
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_at_step: int | None = None
    released_at_step: int | None = None
    zombie_rows: int = 0  # rows of this sequence skipped at commit because it had finished
    # scheduling state (labkit/scheduler.py): what planned launches have computed so far
    num_cached: int = 0  # positions whose KV a planned launch writes (or a shared page holds)
    pending: int = 0  # planned rows that emit a token, not committed yet
    decoding: bool = False  # its context is computed: next rows feed back its last token
    preempted: bool = False  # out of the plan; its pages return at inflight_refs == 0
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache names of full pages
    # parallel sampling: the sequence whose prompt this one shares (None: its own), and
    # whether it is admitted beside it, waiting to fork when that prompt's last chunk runs
    fork_of: Sequence | None = None
    forks: list[Sequence] = field(default_factory=list)  # the sequences forked from this one
    attached: bool = False
    # speculative decoding: the tokens the proposer drafted for the step being planned
    draft: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def context(self) -> list[int]:
        """Prompt plus output tokens so far (what a recompute prefills)."""
        return self.prompt_ids + self.output_ids

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV the sequence may ever write, including one zombie row."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def can_release(self) -> bool:
        """The release rule (see `can_release` below)."""
        return can_release(self)


def can_release(seq) -> bool:
    """The release rule: finalized, no launched step still references it, not yet released."""
    return seq.finalized and seq.inflight_refs == 0 and not seq.released


def commit_row(seq, token: int) -> bool:
    """One row of a commit: drop the step's reference; skip and count a zombie; else append.

    Returns True when the token was appended (the sequence was still live).
    """
    seq.inflight_refs -= 1  # this step no longer references the sequence, zombie or not
    if seq.finalized:  # ended at an earlier commit, still a row of this step: a zombie
        seq.zombie_rows += 1
        return False
    seq.output_ids.append(token)
    return True

"""Serving, simulated with a cost model: static against continuous batching, chunked prefill.

A real serving run on a CPU takes minutes; this simulation takes milliseconds, so a notebook
slider can move the arrival rate and redraw the latency curves at once. It runs the same rules
as labkit's scheduler on the same `labkit.serving.workload` requests, but time comes from a
cost model of one launch (`StepCostModel`: a fixed cost per step, mostly reading the weights,
plus a cost per token in it) instead of from a model. **It is a cost-model simulation, not a
measurement**: use it to see shapes and trade-offs, and `python -m labkit bench serve` for numbers.

Two pure rules sit at its heart, the chapter-02 exercises' reference solutions:

- `admit_fcfs`: admission under a page budget, first come first served, nobody jumps the head;
- `chunk_prefills`: one step's token budget, decode rows first, then prefill chunks in arrival
  order, so that a long prompt never stalls the running requests' next tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.paged_kv import blocks_needed
from labkit.serving.workload import Request


def admit_fcfs(waiting: Sequence[tuple[int, int]], free_pages: int, block_size: int,
               free_slots: int) -> int:
    """How many of the `waiting` requests, (prompt_len, max_new_tokens) in arrival order, can
    be admitted now: each needs blocks_needed(prompt_len + max_new_tokens) pages and a slot;
    stop at the first that does not fit (later requests never jump it)."""
    admitted = 0
    for prompt_len, max_new in waiting:
        need = blocks_needed(prompt_len + max_new, block_size)
        if admitted == free_slots or need > free_pages:
            break
        free_pages -= need
        admitted += 1
    return admitted


def chunk_prefills(num_decode: int, prefill_left: Sequence[int], budget: int | None
                   ) -> tuple[int, list[int]]:
    """One step under a token budget: (decode rows, chunk size per prefill, in order).

    Decode rows go first (one token each: they are what TPOT measures), then each waiting
    prefill in arrival order gets min(its remaining tokens, what is left of the budget).
    `budget=None` is unlimited (whole prompts)."""
    left = math.inf if budget is None else budget
    decode = int(min(num_decode, left))
    left -= decode
    chunks = []
    for remaining in prefill_left:
        take = int(min(remaining, left))
        chunks.append(take)
        left -= take
    return decode, chunks


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per launch = fixed_s + per_token_s * tokens in the launch (a cost model)."""

    fixed_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.per_token_s < 0:
            raise ValueError(f"costs must be >= 0, got {self.fixed_s}, {self.per_token_s}")

    def step_s(self, tokens: int) -> float:
        """Seconds for a launch of `tokens` tokens."""
        return self.fixed_s + self.per_token_s * tokens

    @staticmethod
    def from_roofline(cfg, hw, context_len: int = 256, dtype: str = "fp32") -> StepCostModel:
        """Fit to `labkit.roofline.step_cost` floors on hardware `hw`: the batch-1 decode step
        is the fixed cost, the growth to batch 64 the per-token cost."""
        from labkit.roofline import step_cost

        one = step_cost(cfg, 1, context_len, "decode", dtype, dtype, hw).floor_s
        many = step_cost(cfg, 64, context_len, "decode", dtype, dtype, hw).floor_s
        return StepCostModel(one, (many - one) / 63)


@dataclass(frozen=True)
class SimResult:
    """Token times of each request (s after its arrival), the wall time, the step records."""

    token_times: list[list[float]]
    wall_s: float
    step_tokens: list[int]  # tokens computed in each launch (padding rows included)
    padding_rows: int  # static batching: decode rows of members that had already finished
    max_running: int


def simulate(requests: Sequence[Request], policy: str = "continuous", *, slots: int = 16,
             budget: int | None = None, cost: StepCostModel = StepCostModel(0.05, 0.002)
             ) -> SimResult:
    """Replay `requests` through a batching `policy` ("static" or "continuous") with `slots`
    sequences at most and a per-step token budget, timing each launch by `cost`."""
    if policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
    if slots < 1 or (budget is not None and budget < 1):
        raise ValueError(f"slots and budget must be >= 1, got slots={slots}, budget={budget}")
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    pending = deque(reqs)
    waiting: deque[Request] = deque()
    running: list[dict] = []  # {"req", "prefill_left", "out"}
    times: dict[int, list[float]] = {r.index: [] for r in reqs}
    t, steps, padding, max_running, done = 0.0, [], 0, 0, 0
    while done < len(reqs):
        while pending and pending[0].arrival_s <= t:
            waiting.append(pending.popleft())
        if not running and not waiting:
            t = pending[0].arrival_s  # idle: jump to the next arrival
            continue
        if policy == "continuous" or not running:  # static: only an empty batch admits
            while waiting and len(running) < slots:
                r = waiting.popleft()
                running.append({"req": r, "prefill_left": r.prompt_len, "out": 0})
        max_running = max(max_running, len(running))
        live = [s for s in running if s["out"] < s["req"].max_new_tokens]
        decoding = [s for s in live if s["prefill_left"] == 0]
        prefilling = [s for s in live if s["prefill_left"] > 0]
        n_dec, chunks = chunk_prefills(len(decoding), [s["prefill_left"] for s in prefilling],
                                       budget)
        pad = len(running) - len(live) if policy == "static" else 0  # finished rows stay
        tokens = n_dec + sum(chunks) + pad
        t += cost.step_s(tokens)
        steps.append(tokens)
        padding += pad
        emit = decoding[:n_dec]
        for s, c in zip(prefilling, chunks):
            s["prefill_left"] -= c
            if c and s["prefill_left"] == 0:  # the last chunk samples the first token
                emit.append(s)
        for s in emit:
            s["out"] += 1
            times[s["req"].index].append(t - s["req"].arrival_s)
        finished = [s for s in running if s["out"] >= s["req"].max_new_tokens]
        if policy == "continuous":
            running = [s for s in running if s not in finished]
            done += len(finished)
        elif len(finished) == len(running):  # static: the batch leaves together
            running, done = [], done + len(finished)
    return SimResult([times[r.index] for r in requests], t, steps, padding, max_running)

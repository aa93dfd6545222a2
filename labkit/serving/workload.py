"""Serving workloads: seeded Poisson arrivals with long-tailed prompt and output lengths.

A server is never handed its requests all at once. They arrive one by one, at random moments:
with a mean rate of λ requests per second and no memory between arrivals, the gaps between
them are exponential with mean 1/λ (a Poisson process). Their lengths are long-tailed: most
prompts and answers are short, a few are long, and the long ones decide how much KV memory a
max-length reservation wastes. `LengthDist` states such a distribution (a log-normal clipped to
[lo, hi]); `poisson_workload` draws a whole workload from one seed, so every policy a benchmark
compares sees the same requests.

`ArrivalFeeder` replays a workload in wall time: set it as `engine.on_step`, and between steps
it submits every request whose arrival time has passed. When the engine has nothing to do it
sleeps until the next arrival, so an idle server waits for work as a real one does.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from labkit.sampling import SamplingParams


@dataclass(frozen=True)
class LengthDist:
    """A long-tailed length distribution: log-normal with median `median`, clipped to [lo, hi].

    `sigma` is the spread of log(length): 0 gives every request the median, 1 gives a tail
    where about one request in six is 2.7x the median or more.
    """

    lo: int
    hi: int
    median: float
    sigma: float = 0.8

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"lengths need 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")
        if not self.lo <= self.median <= self.hi:
            raise ValueError(f"median {self.median} is outside [{self.lo}, {self.hi}]")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: random.Random) -> int:
        """One length, an int in [lo, hi]."""
        x = math.exp(rng.gauss(math.log(self.median), self.sigma))
        return int(min(self.hi, max(self.lo, round(x))))

    def mean(self, draws: int = 20000, seed: int = 0) -> float:
        """The mean length (estimated from `draws` seeded samples: the clip has no closed form
        worth reading)."""
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(draws)) / draws


# The stated distributions of the course's serving benchmarks (issues #12, #13): prompts of
# 20-400 tokens and outputs of 10-500, most short, a few long
PROMPT_LENGTHS = LengthDist(20, 400, median=80, sigma=0.8)
OUTPUT_LENGTHS = LengthDist(10, 500, median=60, sigma=0.9)


@dataclass(frozen=True)
class Request:
    """One request of a workload: when it arrives (s after the start) and what it asks."""

    index: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_ids)


def poisson_workload(n: int, rate: float, *, seed: int = 0,
                     prompt: LengthDist = PROMPT_LENGTHS, output: LengthDist = OUTPUT_LENGTHS,
                     vocab_size: int = 49152, first_token: int = 100) -> list[Request]:
    """`n` requests with exponential gaps of mean 1/`rate` s; prompts are random token ids in
    [first_token, vocab_size) (the first ids are often special tokens), drawn from `seed`.

    `rate=math.inf` makes every request arrive at time 0 (an offline batch)."""
    if n < 1:
        raise ValueError(f"a workload needs at least one request, got n={n}")
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate}")
    if not 0 <= first_token < vocab_size:
        raise ValueError(f"first_token {first_token} must be in [0, vocab_size={vocab_size})")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i > 0 and math.isfinite(rate):
            t += rng.expovariate(rate)  # Poisson process: exponential gaps, mean 1 / rate
        p_len, o_len = prompt.sample(rng), output.sample(rng)
        ids = tuple(rng.randrange(first_token, vocab_size) for _ in range(p_len))
        out.append(Request(i, t, ids, o_len))
    return out


@dataclass
class ArrivalFeeder:
    """An `engine.on_step` callback that submits each request when its arrival time comes.

    Requests are greedy and run to their `max_new_tokens` (EOS ignored), so that every policy
    does the same work. `ids[i]` is the engine's request id of workload request i; `lag_s[i]`
    how late it was submitted (it arrived during a step and waited for the step to end). The
    engine's TTFT starts at submission, so a fair TTFT adds this lag (`metrics` does).
    """

    requests: list[Request]
    start_s: float | None = None  # wall clock of time 0; set at the first call
    ids: dict[int, int] = field(default_factory=dict)
    lag_s: dict[int, float] = field(default_factory=dict)
    _next: int = 0

    @property
    def done(self) -> bool:
        """Every request has been submitted."""
        return self._next >= len(self.requests)

    def __call__(self, engine) -> None:
        """Submit what has arrived; if the engine is idle, wait for the next arrival."""
        if self.start_s is None:
            self.start_s = time.perf_counter()
        if self.done:
            return
        now = time.perf_counter() - self.start_s
        if engine.scheduler.idle():  # nothing to run: wait, as an idle server does
            wait = self.requests[self._next].arrival_s - now
            if wait > 0:
                time.sleep(wait)
                now = time.perf_counter() - self.start_s
        while not self.done and self.requests[self._next].arrival_s <= now:
            r = self.requests[self._next]
            params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
            self.ids[r.index] = engine.submit(list(r.prompt_ids), params)
            self.lag_s[r.index] = now - r.arrival_s
            self._next += 1

"""Serving metrics: what a user of a server feels, per request, and a run's summary.

Three latencies per request, all from its arrival:

- **TTFT** (time to first token): queueing + prefill. What a chat user waits before text moves.
- **TPOT** (time per output token): the mean gap between its consecutive tokens,
  `(t_last - t_first) / (n - 1)`; undefined (nan) for a one-token answer. What streaming
  speed feels like.
- **e2e**: arrival to last token.

A run's summary takes percentiles **over requests**: each request counts once, however many
tokens it produced. Pooling every inter-token gap of every request instead would let the long
answers outvote the short ones (a 500-token answer would weigh 50x a 10-token one), and a p99
"over tokens" can hide that one request in ten had a terrible time. Goodput is the share of
requests that met a service-level objective on both TTFT and TPOT: throughput counts tokens
whoever waited for them, goodput counts users who were served well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (as
    numpy's default); nan for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100  # fractional rank
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestLatency:
    """One request's latencies in seconds (tpot is nan with fewer than two tokens)."""

    ttft_s: float
    tpot_s: float
    e2e_s: float
    tokens: int


def latency_from_times(token_times_s: Sequence[float], lag_s: float = 0.0) -> RequestLatency:
    """Latencies from a request's token times (s after its submission); `lag_s` is how long
    after its arrival it was submitted (0 when submitted on arrival)."""
    t = list(token_times_s)
    if not t:
        nan = float("nan")
        return RequestLatency(nan, nan, nan, 0)
    tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
    return RequestLatency(t[0] + lag_s, tpot, t[-1] + lag_s, len(t))


def request_latency(completion, lag_s: float = 0.0) -> RequestLatency:
    """Latencies of a `labkit.engine.Completion` (from its token times)."""
    return latency_from_times(completion.token_times_s, lag_s)


@dataclass(frozen=True)
class SLO:
    """A service-level objective: a request is served well if both latencies are within."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO bounds must be > 0 s, got ttft_s={self.ttft_s}, "
                             f"tpot_s={self.tpot_s}")

    def met(self, r: RequestLatency) -> bool:
        """Both bounds held (a one-token answer has no gap, so only its TTFT counts)."""
        return r.ttft_s <= self.ttft_s and (math.isnan(r.tpot_s) or r.tpot_s <= self.tpot_s)


@dataclass(frozen=True)
class RunSummary:
    """A serving run in a few numbers; percentiles are over requests, in seconds."""

    requests: int
    tokens: int
    wall_s: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    goodput: float  # share of requests meeting the SLO, 0..1
    slo: SLO

    def row(self) -> dict:
        """The benchmark row's latency and throughput fields, in ms and tok/s."""
        return {"throughput_tok_s": self.throughput_tok_s,
                "ttft_p50_ms": self.ttft_p50_s * 1e3, "ttft_p99_ms": self.ttft_p99_s * 1e3,
                "tpot_p50_ms": self.tpot_p50_s * 1e3, "tpot_p99_ms": self.tpot_p99_s * 1e3,
                "goodput": self.goodput}


def summarize(latencies: Sequence[RequestLatency], wall_s: float, slo: SLO = SLO()
              ) -> RunSummary:
    """Throughput (output tokens / wall s), p50/p99 TTFT and TPOT over requests, goodput."""
    if not latencies:
        raise ValueError("no requests to summarize")
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ttft = [r.ttft_s for r in latencies]
    tpot = [r.tpot_s for r in latencies if not math.isnan(r.tpot_s)]  # 1-token answers: none
    tokens = sum(r.tokens for r in latencies)
    return RunSummary(
        len(latencies), tokens, wall_s, tokens / wall_s,
        percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
        percentile([r.e2e_s for r in latencies], 50),
        sum(slo.met(r) for r in latencies) / len(latencies), slo)


def latency_percentiles(token_times: Sequence[Sequence[float]], qs: Sequence[float] = (50, 99)
                        ) -> dict[str, float]:
    """`{"ttft_p50": .., "tpot_p50": .., ...}` over requests, from each request's token times
    (s after arrival). The chapter-02 exercise's reference solution."""
    lat = [latency_from_times(t) for t in token_times if t]
    tpot = [r.tpot_s for r in lat if not math.isnan(r.tpot_s)]
    out = {}
    for q in qs:
        out[f"ttft_p{q:g}"] = percentile([r.ttft_s for r in lat], q)
        out[f"tpot_p{q:g}"] = percentile(tpot, q)
    return out

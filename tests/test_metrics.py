"""Serving metrics: per-request latencies, percentiles over requests, goodput."""

import math

import pytest

from labkit.serving.metrics import (
    SLO,
    latency_from_times,
    latency_percentiles,
    percentile,
    summarize,
)


def ref_percentile(xs, q):  # numpy's default: linear between the closest ranks
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_linear_interpolation(q):
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    assert percentile(xs, q) == pytest.approx(ref_percentile(xs, q), abs=1e-12)
    assert math.isnan(percentile([], q))


def test_latency_of_one_request():
    r = latency_from_times([0.5, 0.6, 0.8, 0.9], lag_s=0.1)
    assert r.ttft_s == pytest.approx(0.6) and r.e2e_s == pytest.approx(1.0)
    assert r.tpot_s == pytest.approx(0.4 / 3)  # mean gap, the first token's wait excluded
    assert math.isnan(latency_from_times([0.3]).tpot_s)


def test_percentiles_are_over_requests_not_tokens():
    # one long request with fast tokens, nine short ones with slow tokens
    long = [0.1 + 0.01 * i for i in range(500)]
    short = [[0.1, 0.3, 0.5] for _ in range(9)]
    p = latency_percentiles([long] + short)
    assert p["tpot_p50"] == pytest.approx(0.2)  # nine of ten requests had 200 ms gaps
    pooled = sorted(g for t in [long] + short for g in (b - a for a, b in zip(t, t[1:])))
    assert pooled[len(pooled) // 2] == pytest.approx(0.01)  # what pooling tokens would say


def test_summary_and_goodput():
    lat = [latency_from_times(t) for t in ([0.2, 0.3], [2.0, 2.1], [0.1, 0.5], [0.4])]
    s = summarize(lat, wall_s=2.0, slo=SLO(ttft_s=1.0, tpot_s=0.2))
    assert s.tokens == 7 and s.throughput_tok_s == pytest.approx(3.5)
    assert s.goodput == pytest.approx(2 / 4)  # late first token; slow gap; the rest met it
    assert s.row()["ttft_p50_ms"] == pytest.approx(300)
    with pytest.raises(ValueError):
        SLO(ttft_s=0)
    with pytest.raises(ValueError):
        summarize([], 1.0)

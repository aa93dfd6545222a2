"""Seeded Poisson workloads and their wall-time replay into an engine."""

import math
import statistics

import pytest

from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.serving.workload import (
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    ArrivalFeeder,
    LengthDist,
    poisson_workload,
)


def test_same_seed_same_workload_and_stated_ranges():
    a = poisson_workload(200, rate=5.0, seed=3)
    assert a == poisson_workload(200, rate=5.0, seed=3)
    assert a != poisson_workload(200, rate=5.0, seed=4)
    assert all(20 <= r.prompt_len <= 400 and 10 <= r.max_new_tokens <= 500 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a) and a[0].arrival_s == 0


def test_gaps_are_exponential_with_mean_one_over_rate():
    reqs = poisson_workload(4000, rate=8.0, seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    # mean 1/8 s; the standard error of 4000 exponential gaps is 1.6%: 6% is ~4 sigma
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.06)
    # exponential: the share of gaps above the mean is e^-1
    assert sum(g > 1 / 8 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)


def test_lengths_are_long_tailed():
    reqs = poisson_workload(4000, rate=1.0, seed=1)
    outs = sorted(r.max_new_tokens for r in reqs)
    mean, median = statistics.mean(outs), outs[len(outs) // 2]
    assert mean > 1.2 * median  # a long tail pulls the mean above the median
    assert outs[int(0.99 * len(outs))] > 4 * median
    assert PROMPT_LENGTHS.mean() == pytest.approx(statistics.mean(r.prompt_len for r in reqs),
                                                  rel=0.05)
    assert OUTPUT_LENGTHS.mean() == pytest.approx(mean, rel=0.05)


@pytest.mark.parametrize("bad", [dict(lo=0, hi=5, median=2), dict(lo=5, hi=4, median=4),
                                 dict(lo=1, hi=9, median=10), dict(lo=1, hi=9, median=3,
                                                                   sigma=-1)])
def test_bad_distributions_are_refused(bad):
    with pytest.raises(ValueError):
        LengthDist(**bad)


@pytest.mark.parametrize("n, rate", [(0, 1.0), (3, 0.0), (3, -2.0), (3, float("nan"))])
def test_bad_workloads_are_refused(n, rate):
    with pytest.raises(ValueError):
        poisson_workload(n, rate)


def test_feeder_submits_in_wall_time_and_waits_when_idle():
    cfg = ModelConfig.tiny()
    model = init_random(LlamaModel(cfg).eval(), seed=0)
    eng = Engine(model, None, kv_tokens=4096, block_size=8, max_seqs=8)
    small = LengthDist(2, 6, 4)
    reqs = poisson_workload(6, rate=50.0, seed=2, prompt=small, output=small,
                            vocab_size=cfg.vocab_size, first_token=3)
    feeder = ArrivalFeeder(reqs)
    eng.on_step = feeder
    decoders.run(eng, "blocking")
    eng.check_all_released()
    assert feeder.done and sorted(feeder.ids) == list(range(6))
    for r in reqs:
        c = eng.completion(feeder.ids[r.index])
        assert len(c.output_ids) == r.max_new_tokens  # ignore_eos: the stated work is done
        assert feeder.lag_s[r.index] >= 0
    # the last request cannot have been submitted before it arrived
    assert eng.seqs[feeder.ids[5]].arrival_s - feeder.start_s >= reqs[5].arrival_s - 1e-6

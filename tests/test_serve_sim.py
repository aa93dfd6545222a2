"""The cost-model serving simulation and its two pure rules (admission, chunking)."""

import pytest

from labkit.instruments.serve_sim import StepCostModel, admit_fcfs, chunk_prefills, simulate
from labkit.serving.metrics import latency_from_times, summarize
from labkit.serving.workload import LengthDist, poisson_workload


def test_admission_is_fcfs_under_pages_and_slots():
    assert admit_fcfs([(10, 6), (16, 16), (1, 1)], free_pages=3, block_size=16,
                      free_slots=8) == 2  # 1 page + exactly 2 pages; the third finds none
    assert admit_fcfs([(40, 10), (1, 1)], free_pages=3, block_size=16, free_slots=8) == 0
    assert admit_fcfs([(1, 1)] * 5, free_pages=99, block_size=16, free_slots=3) == 3


def test_chunks_fill_the_budget_after_decode_rows():
    assert chunk_prefills(3, [10, 10], 8) == (3, [5, 0])
    assert chunk_prefills(3, [2, 10], 8) == (3, [2, 3])
    assert chunk_prefills(9, [4], 8) == (8, [0])
    assert chunk_prefills(2, [300], None) == (2, [300])


def _work(rate, n=40):
    return poisson_workload(n, rate, seed=0, prompt=LengthDist(20, 400, 80),
                            output=LengthDist(10, 200, 40))


def test_continuous_beats_static_on_ttft_and_wastes_no_rows():
    cost = StepCostModel(0.02, 0.0005)
    res = {p: simulate(_work(20.0), p, slots=8, cost=cost) for p in ("static", "continuous")}
    s = {p: summarize([latency_from_times(t) for t in r.token_times], r.wall_s)
         for p, r in res.items()}
    assert res["continuous"].padding_rows == 0 < res["static"].padding_rows
    assert s["continuous"].ttft_p50_s < s["static"].ttft_p50_s
    assert all(len(t) == r.max_new_tokens for t, r in zip(res["static"].token_times,
                                                          _work(20.0)))


def test_budget_holds_and_chunking_lowers_decode_gap_p99():
    cost = StepCostModel(0.02, 0.0005)
    whole = simulate(_work(20.0), "continuous", slots=8, budget=None, cost=cost)
    chunked = simulate(_work(20.0), "continuous", slots=8, budget=32, cost=cost)
    assert max(chunked.step_tokens) <= 32
    gap = [max(b - a for a, b in zip(t, t[1:])) for t in chunked.token_times if len(t) > 1]
    gap_whole = [max(b - a for a, b in zip(t, t[1:])) for t in whole.token_times if len(t) > 1]
    assert max(gap) < max(gap_whole)


def test_bad_arguments():
    with pytest.raises(ValueError):
        simulate(_work(1.0, 2), "dynamic")
    with pytest.raises(ValueError):
        simulate(_work(1.0, 2), budget=0)

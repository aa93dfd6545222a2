"""KV pool accounting under three policies; translate; the copy-on-write page allocator."""

import pytest

from labkit.instruments.kv_sim import CowPages, simulate_pool, translate
from labkit.serving.workload import poisson_workload


def test_translate():
    assert translate([7, 2, 5], 0, 16) == 112
    assert translate([7, 2, 5], 16, 16) == 32  # the first slot of the second page
    assert translate([7, 2, 5], 47, 16) == 95
    with pytest.raises(IndexError):
        translate([7, 2, 5], 48, 16)


def test_cow_pages():
    a = CowPages(4)
    p = a.alloc()
    a.share(p)
    q = a.write(p)  # shared: the writer gets a private copy
    assert q != p and a.refs[p] == 1 and a.refs[q] == 1 and a.copies == [(p, q)]
    assert a.write(q) == q  # private: written in place
    a.free(p)
    a.free(q)
    assert a.num_free == 4
    with pytest.raises(RuntimeError):
        a.free(p)


def test_on_demand_runs_three_times_the_sequences_of_contiguous():
    reqs = poisson_workload(300, 1.0, seed=0)
    lengths = [(r.prompt_len, r.max_new_tokens, 500) for r in reqs]
    pool = 16 * 1024
    rep = {p: simulate_pool(lengths, pool, p, block_size=16) for p in
           ("contiguous", "reserve", "on_demand")}
    assert rep["on_demand"].max_concurrent >= 3 * rep["contiguous"].max_concurrent
    assert rep["contiguous"].max_concurrent <= rep["reserve"].max_concurrent
    for r in rep.values():
        assert r.used + r.reserved_unused + r.internal == pytest.approx(1.0)
        assert all(sum(t) == pool for t in r.timeline)
    assert rep["on_demand"].internal + rep["on_demand"].reserved_unused < 0.25
    assert rep["contiguous"].internal > 0.5  # most of a max-length region is never written


def test_a_request_that_cannot_fit_is_refused():
    with pytest.raises(ValueError):
        simulate_pool([(100, 10, 10)], 64, "on_demand", block_size=16)

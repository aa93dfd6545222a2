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


def test_translate_refuses_a_negative_position_by_name():
    # table[-1 // 16] is table[-1]: without the check, position -1 reads the last page
    with pytest.raises(IndexError, match="negative"):
        translate([7, 2, 5], -1, 16)
    with pytest.raises(IndexError, match="negative"):
        translate([7, 2, 5], -48, 16)
    with pytest.raises(ValueError, match="block_size"):
        translate([7, 2, 5], 3, 0)


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


def test_cow_pages_refuses_to_share_or_write_a_free_page():
    a = CowPages(4)
    p = a.alloc()
    with pytest.raises(RuntimeError, match="page 1 shared while free"):
        a.share(1)
    with pytest.raises(RuntimeError, match="page 1 written while free"):
        a.write(1)
    assert a.num_free == 3 and a.refcount(1) == 0 and a.alloc() == 1  # nothing changed
    a.free(p)
    with pytest.raises(RuntimeError, match="shared while free"):  # freed, then shared
        a.share(p)


def test_cow_pages_refuses_a_page_outside_the_pool():
    a = CowPages(4)
    a.alloc(), a.alloc(), a.alloc(), a.alloc()
    for page in (-1, 4):  # refs[-1] is page 3's count: a negative id must not alias it
        with pytest.raises(IndexError, match="not in this pool of 4 pages"):
            a.refcount(page)
        with pytest.raises(IndexError, match="not in this pool"):
            a.share(page)
        with pytest.raises(IndexError, match="not in this pool"):
            a.free(page)
    assert a.refcount(3) == 1


def test_num_free_counts_pages_not_references():
    a = CowPages(4)
    p = a.alloc()
    for holders in (2, 3, 4):
        a.share(p)
        assert a.num_free == 3 and a.refcount(p) == holders  # one page, however many hold it
    q = a.write(p)  # one holder writes: a copy is one more page in use
    assert a.num_free == 2 and a.refcount(p) == 3 and a.refcount(q) == 1
    for _ in range(2):
        a.free(p)
        assert a.num_free == 2  # still held by someone
    a.free(p)
    assert a.num_free == 3
    a.free(q)
    assert a.num_free == 4


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


def test_pool_report_counts_running_and_waiting_per_step():
    reqs = poisson_workload(60, 1.0, seed=1)
    lengths = [(r.prompt_len, r.max_new_tokens, 500) for r in reqs]
    rep = simulate_pool(lengths, 4096, "on_demand", block_size=16)
    assert len(rep.running) == len(rep.waiting) == rep.steps
    assert max(rep.running) == rep.max_concurrent
    assert sum(rep.running) / rep.steps == pytest.approx(rep.mean_concurrent)
    assert rep.running[0] + rep.waiting[0] == 60  # all queued at time 0
    assert rep.waiting[0] > 0 and rep.waiting[-1] == 0  # the pool limits, then the queue drains


def test_a_request_that_cannot_fit_is_refused():
    with pytest.raises(ValueError):
        simulate_pool([(100, 10, 10)], 64, "on_demand", block_size=16)

"""The chapter-02 and chapter-05 graders, tested by the wrong answers they must reject."""

import pytest

from labkit.graders import check
from labkit.instruments.kv_sim import CowPages
from labkit.instruments.serve_sim import chunk_prefills
from labkit.paged_kv import blocks_needed
from labkit.serving.metrics import latency_from_times, percentile


def rejects(name, fn, *words):
    with pytest.raises(AssertionError) as info:
        check.grade(name, fn)
    message = str(info.value)
    for w in words:
        assert w in message, f"{name}: message does not name {w!r}: {message}"


# -- chapter 02 --------------------------------------------------------------------------------

def admit_strict(waiting, free_pages, bs, slots):  # < instead of <=
    n = 0
    for p, m in waiting:
        need = -(-(p + m) // bs)
        if n == slots or need >= free_pages:
            break
        free_pages -= need
        n += 1
    return n


def admit_floor_plus_one(waiting, free_pages, bs, slots):
    n = 0
    for p, m in waiting:
        need = (p + m) // bs + 1
        if n == slots or need > free_pages:
            break
        free_pages -= need
        n += 1
    return n


def admit_jumping(waiting, free_pages, bs, slots):
    n = 0
    for p, m in waiting:
        need = blocks_needed(p + m, bs)
        if n < slots and need <= free_pages:
            free_pages -= need
            n += 1
    return n


def test_admit_rejects_off_by_one_budget():
    rejects("admit_fcfs", admit_strict, "off-by-one budget")


def test_admit_rejects_off_by_one_pages_and_queue_jumping():
    rejects("admit_fcfs", admit_floor_plus_one, "off-by-one page count")
    rejects("admit_fcfs", admit_jumping, "must not jump")


def chunks_prefill_first(num_decode, left, budget):
    rest = float("inf") if budget is None else budget
    chunks = []
    for r in left:
        chunks.append(int(min(r, rest)))
        rest -= chunks[-1]
    return int(min(num_decode, rest)), chunks


def chunks_over_by_one(num_decode, left, budget):
    return chunk_prefills(num_decode, left, None if budget is None else budget + 1)


def chunks_under_by_one(num_decode, left, budget):
    d, c = chunk_prefills(num_decode, left, budget)
    if budget is not None and c and sum(c) > 0:
        last = max(i for i, x in enumerate(c) if x)
        c[last] -= 1
    return d, c


def test_chunks_reject_starving_decode_and_off_by_one_budgets():
    rejects("chunk_prefills", chunks_prefill_first, "starve decode")
    rejects("chunk_prefills", chunks_over_by_one, "off-by-one budget", "over")
    rejects("chunk_prefills", chunks_under_by_one, "off-by-one budget", "unused")


def percentiles_over_tokens(times, qs=(50, 99)):
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    out = {}
    for q in qs:
        out[f"ttft_p{q:g}"] = percentile([t[0] for t in times], q)
        out[f"tpot_p{q:g}"] = percentile(gaps, q)
    return out


def percentiles_tpot_with_ttft(times, qs=(50, 99)):
    out = {}
    for q in qs:
        out[f"ttft_p{q:g}"] = percentile([latency_from_times(t).ttft_s for t in times], q)
        out[f"tpot_p{q:g}"] = percentile([t[-1] / len(t) for t in times], q)
    return out


def test_percentiles_reject_tokens_instead_of_requests():
    rejects("latency_percentiles", percentiles_over_tokens, "over tokens", "over requests")
    rejects("latency_percentiles", percentiles_tpot_with_ttft, "first token")


# -- chapter 05 --------------------------------------------------------------------------------

def test_blocks_needed_rejects_off_by_one_at_exact_multiples():
    rejects("blocks_needed", lambda n, bs: n // bs + 1, "exact multiples")
    rejects("blocks_needed", lambda n, bs: n // bs, "round up")


def test_translate_rejects_page_not_scaled():
    rejects("translate", lambda t, pos, bs: t[pos // bs] + pos % bs, "multiply")
    rejects("translate", lambda t, pos, bs: pos, "block table was ignored")


class FreesShared(CowPages):
    def free(self, page):  # returns the page at once, whoever still holds it
        self._live(page, "freed")
        self.refs[page] = 0
        self._free.append(page)


class NoCopyOnWrite(CowPages):
    def write(self, page):
        self._live(page, "written")
        return page


class CopyKeepsReference(CowPages):
    def write(self, page):  # copies, but the writer's reference stays on the original
        return page if self.refs[page] == 1 else self.alloc()


class NoDoubleFreeCheck(CowPages):
    def free(self, page):
        if self.refs[page] > 0:
            self.refs[page] -= 1
        if self.refs[page] == 0 and page not in self._free:
            self._free.append(page)


def test_allocator_rejects_the_chapters_bugs():
    rejects("CowPages", FreesShared, "freed a shared page while refs > 0")
    rejects("CowPages", NoCopyOnWrite, "forgotten copy-on-write")
    rejects("CowPages", CopyKeepsReference, "reference moved")
    rejects("CowPages", NoDoubleFreeCheck, "double free")

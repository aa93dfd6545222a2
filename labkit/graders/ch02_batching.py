"""Chapter 02's graders: FCFS admission under a KV budget, chunked prefill, latency percentiles."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _admit_variant(need: Callable[[int, int, int], int], fits: Callable[[int, int], bool],
                   jump: bool = False, slots: bool = True, spend: bool = True) -> Callable:
    """An admission rule built from a page count and a fit test (the reference and its bugs)."""
    def admit(waiting, free_pages, block_size, free_slots):
        n = 0
        for prompt_len, max_new in waiting:
            pages = need(prompt_len, max_new, block_size)
            if (n < free_slots or not slots) and fits(pages, free_pages):
                free_pages -= pages if spend else 0
                n += 1
            elif not jump:
                break
        return n
    return admit


def grade_admit_fcfs(fn: Callable) -> str:
    """Grade an answer to exercise `admit_fcfs` (exercises/ch02_batching.py)."""
    cases = [  # (waiting, free_pages, block_size, free_slots)
        ([(10, 6)], 1, 16, 4), ([(16, 16), (3, 3)], 2, 16, 4), ([(16, 16), (1, 1)], 3, 16, 4),
        ([(16, 17)], 2, 16, 4), ([(10, 30)], 2, 16, 4), ([(40, 10), (1, 1)], 3, 16, 4),
        ([(1, 1)] * 5, 99, 16, 3), ([(8, 8), (8, 8), (8, 9)], 3, 16, 8), ([], 5, 16, 5),
        ([(20, 10), (5, 5)], 3, 16, 4),
    ]
    ceil = lambda p, m, bs: -(-(p + m) // bs)  # noqa: E731
    le = lambda need, free: need <= free  # noqa: E731
    ref = _admit_variant(ceil, le)
    wrong = {
        "off-by-one budget: a request that needs exactly the pages left fits (compare with "
        "<=, not <)": _admit_variant(ceil, lambda need, free: need < free),
        "off-by-one page count at exact multiples: 32 tokens fill exactly 2 pages of 16 "
        "(ceil(32 / 16) = 2, not 32 // 16 + 1 = 3)":
            _admit_variant(lambda p, m, bs: (p + m) // bs + 1, le),
        "a partly filled page is a whole page: round the page count up":
            _admit_variant(lambda p, m, bs: (p + m) // bs, le),
        "reserve pages for prompt_len + max_new_tokens, not for the prompt alone":
            _admit_variant(lambda p, m, bs: -(-p // bs), le),
        "a request that does not fit stops admission: later requests must not jump it "
        "(first come, first served)": _admit_variant(ceil, le, jump=True),
        "each admitted request takes a slot: stop when the free slots are used up":
            _admit_variant(ceil, le, slots=False),
        "each admitted request takes its pages: subtract them from free_pages before the "
        "next one": _admit_variant(ceil, le, spend=False),
    }
    got = [fn([tuple(w) for w in c[0]], *c[1:]) for c in cases]
    want = [ref(*c) for c in cases]
    if got == want:
        return f"admits in order under pages and slots ({len(cases)} cases)"
    first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    call = (f"admit_fcfs(waiting={cases[first][0]}, free_pages={cases[first][1]}, "
            f"block_size={cases[first][2]}, free_slots={cases[first][3]}) returned "
            f"{got[first]}, expected {want[first]}")
    for hint, variant in wrong.items():
        if [variant(*c) for c in cases] == got:
            raise AssertionError(f"{call}: {hint}")
    raise AssertionError(f"{call}: admit in arrival order while the pages of prompt_len + "
                         "max_new_tokens (rounded up) and a slot are free")


def _chunk_variant(cap_decode: bool = True, clamp: bool = True, decode_first: bool = True,
                   decode_counts: bool = True, spend: bool = True, all_prefills: bool = True,
                   slack: int = 0, last_short: bool = False) -> Callable:
    """A chunking rule with one switch turned (the reference and its bugs)."""
    def chunk(num_decode, prefill_left, budget):
        left = math.inf if budget is None else budget + slack
        decode = min(num_decode, left) if cap_decode else num_decode
        if not decode_first:  # prefill takes the budget first; decode rows get what is left
            chunks = []
            for remaining in prefill_left:
                chunks.append(min(remaining, left))
                left -= chunks[-1]
            return int(min(num_decode, left)), [int(c) for c in chunks]
        if decode_counts:
            left -= decode
        chunks = []
        for i, remaining in enumerate(prefill_left):
            take = min(remaining, max(left, 0) if clamp else left)
            take = take if all_prefills or i == 0 else 0
            chunks.append(int(take))
            if spend:
                left -= take
        if last_short and budget is not None and any(chunks):  # the last chunk stops short
            chunks[max(i for i, c in enumerate(chunks) if c)] -= 1
        return int(decode), chunks
    return chunk


def grade_chunk_prefills(fn: Callable) -> str:
    """Grade an answer to exercise `chunk_prefills` (exercises/ch02_batching.py)."""
    cases = [  # (num_decode, prefill_left, budget)
        (3, [10, 10], 8), (3, [2, 10], 8), (0, [2, 10], 8), (9, [4], 8), (2, [300, 7], None),
        (1, [3], 8), (4, [], 8), (0, [5], 5), (20, [5, 5], 16), (2, [3, 3, 3], 8),
    ]
    ref = _chunk_variant()
    wrong = {  # each names the rule it breaks; matched only if it explains every case
        "decode rows are capped by the budget too: with more running sequences than the "
        "budget, only `budget` of them decode this step (min(num_decode, budget))":
            [_chunk_variant(cap_decode=False), _chunk_variant(cap_decode=False, clamp=False)],
        "the chunks starve decode: running sequences get their decode rows first, and prefill "
        "takes only what is left of the budget": [_chunk_variant(decode_first=False)],
        "the decode rows count against the budget: prefill gets the budget minus the decode "
        "rows, not the whole budget": [_chunk_variant(decode_counts=False)],
        "each chunk spends the budget: the next prefill gets only what the earlier ones left":
            [_chunk_variant(spend=False)],
        "every waiting prefill in arrival order takes what is left, not only the first":
            [_chunk_variant(all_prefills=False)],
        "off-by-one budget: the step holds one token over the budget":
            [_chunk_variant(slack=1)],
        "off-by-one budget: one token of the budget is left unused while a prompt waits":
            [_chunk_variant(slack=-1)],
        "off-by-one budget: the last chunk stops one token short, so a token of the budget "
        "goes unused and the prompt needs one more step": [_chunk_variant(last_short=True)],
    }
    got = []
    for dec, left, budget in cases:
        out = fn(dec, list(left), budget)
        call = f"chunk_prefills({dec}, {left}, budget={budget})"
        if len(out[1]) != len(left):
            raise AssertionError(f"{call} returned {len(out[1])} chunks for {len(left)} "
                                 "prefills: give one chunk size (maybe 0) per prefill, in order")
        got.append((int(out[0]), [int(c) for c in out[1]]))
    want = [ref(*c) for c in cases]
    if got == want:
        return f"decode first, then prefill chunks in order, budgets exact ({len(cases)} cases)"
    first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    dec, left, budget = cases[first]
    call = f"chunk_prefills({dec}, {left}, budget={budget}) returned {got[first]}"
    for hint, variants in wrong.items():
        if any([v(*c) for c in cases] == got for v in variants):
            raise AssertionError(f"{call}, expected {want[first]}: {hint}")
    total = got[first][0] + sum(got[first][1])
    if any(c > r for c, r in zip(got[first][1], left)) or any(c < 0 for c in got[first][1]):
        raise AssertionError(f"{call}: a chunk is between 0 and what its prefill still needs")
    if budget is not None and total > budget:
        raise AssertionError(f"{call}, {total} tokens: over the budget of {budget}")
    raise AssertionError(f"{call}, expected {want[first]}: decode rows first (at most the "
                         "budget), then each prefill in arrival order takes what it still needs "
                         "of what is left")


def grade_latency_percentiles(fn: Callable) -> str:
    """Grade an answer to exercise `latency_percentiles` (exercises/ch02_batching.py)."""
    from labkit.serving.metrics import latency_percentiles, percentile

    gen = torch.Generator().manual_seed(2)
    # one long request with fast tokens and many short ones with slow tokens: percentiles
    # over requests and over tokens disagree, as they do on a real server
    times = [[0.05 + 0.01 * i for i in range(400)]]
    for _ in range(30):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        first = float(torch.rand(1, generator=gen)) * 2
        gaps = (torch.rand(n - 1, generator=gen) * 0.3 + 0.1).tolist()
        t = [first]
        for g in gaps:
            t.append(t[-1] + g)
        times.append(t)
    got = fn([list(t) for t in times], (50, 99))
    want = latency_percentiles(times, (50, 99))
    if set(got) != set(want):
        raise AssertionError(f"latency_percentiles returned keys {sorted(got)}, expected "
                             f"{sorted(want)}")
    multi = [t for t in times if len(t) > 1]
    pooled = [b - a for t in multi for a, b in zip(t, t[1:])]
    wrong = {
        "TPOT taken over tokens (every gap of every request pooled) instead of over requests: "
        "the one 400-token request outvotes thirty users": {q: percentile(pooled, q)
                                                           for q in (50, 99)},
        "TPOT includes the wait for the first token (e2e / n): TPOT is the mean gap between "
        "consecutive tokens, (t_last - t_first) / (n - 1)": {
            q: percentile([t[-1] / len(t) for t in times], q) for q in (50, 99)},
        "one-token requests have no inter-token gap: leave them out of TPOT, not in as 0": {
            q: percentile([(t[-1] - t[0]) / max(1, len(t) - 1) for t in times], q)
            for q in (50, 99)},
    }
    for key in want:
        q = float(key.split("_p")[1])
        if math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-12):
            continue
        if key.startswith("tpot"):
            for hint, values in wrong.items():
                if math.isclose(got[key], values[q], rel_tol=1e-9):
                    raise AssertionError(f"latency_percentiles[{key!r}] = {got[key]:.6g}, "
                                         f"expected {want[key]:.6g}: {hint}")
        raise AssertionError(f"latency_percentiles[{key!r}] = {got[key]:.6g}, expected "
                             f"{want[key]:.6g} (percentiles over requests, linear "
                             "interpolation between the closest ranks)")
    return "TTFT and TPOT p50/p99 over 31 requests, one of them 400 tokens long"

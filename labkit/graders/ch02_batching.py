"""Chapter 02's graders: FCFS admission under a KV budget, chunked prefill, latency percentiles."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _admit_variant(need: Callable[[int, int, int], int], fits: Callable[[int, int], bool],
                   jump: bool = False) -> Callable:
    """An admission rule built from a page count and a fit test (the reference and its bugs)."""
    def admit(waiting, free_pages, block_size, free_slots):
        n = 0
        for prompt_len, max_new in waiting:
            pages = need(prompt_len, max_new, block_size)
            if n < free_slots and fits(pages, free_pages):
                free_pages -= pages
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


def grade_chunk_prefills(fn: Callable) -> str:
    """Grade an answer to exercise `chunk_prefills` (exercises/ch02_batching.py)."""
    cases = [  # (num_decode, prefill_left, budget, expected)
        (3, [10, 10], 8, (3, [5, 0])), (3, [2, 10], 8, (3, [2, 3])), (0, [2, 10], 8, (0, [2, 6])),
        (9, [4], 8, (8, [0])), (2, [300, 7], None, (2, [300, 7])), (1, [3], 8, (1, [3])),
        (4, [], 8, (4, [])), (0, [5], 5, (0, [5])),
    ]
    for dec, left, budget, want in cases:
        got = fn(dec, list(left), budget)
        got = (int(got[0]), [int(c) for c in got[1]])
        call = f"chunk_prefills({dec}, {left}, budget={budget})"
        if len(got[1]) != len(left):
            raise AssertionError(f"{call} returned {len(got[1])} chunks for {len(left)} "
                                 "prefills: give one chunk size (maybe 0) per prefill, in order")
        if any(c > r for c, r in zip(got[1], left)) or any(c < 0 for c in got[1]):
            raise AssertionError(f"{call} returned chunks {got[1]}: a chunk is between 0 and "
                                 "what its prefill still needs")
        total = got[0] + sum(got[1])
        if budget is not None and got[0] < min(dec, budget):
            raise AssertionError(f"{call} returned {got}: the chunks starve decode. Running "
                                 f"sequences get their {min(dec, budget)} decode rows first; "
                                 "prefill takes only what is left of the budget")
        if budget is not None and total == budget + 1:
            raise AssertionError(f"{call} returned {got}, {total} tokens: off-by-one budget, "
                                 f"one token over the budget of {budget}")
        if budget is not None and total > budget:
            raise AssertionError(f"{call} returned {got}, {total} tokens: over the budget "
                                 f"of {budget}")
        if budget is not None and total == min(budget, dec + sum(left)) - 1:
            raise AssertionError(f"{call} returned {got}, {total} tokens: off-by-one budget, "
                                 "one token of the budget left unused while a prompt waits")
        if got != want:
            raise AssertionError(f"{call} returned {got}, expected {want}: decode rows first, "
                                 "then each prefill in arrival order takes what it still needs "
                                 "of what is left")
    return f"decode first, then prefill chunks in order, budgets exact ({len(cases)} cases)"


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

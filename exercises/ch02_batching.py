"""Chapter 02 exercises: the three rules of a batching server. Fill in each function, then run
`make grade` (or the check cell in notebooks/02_batching.ipynb). The graders are the same
tests that check labkit's own solutions (in labkit/instruments/serve_sim.py and
labkit/serving/metrics.py)."""


def admit_fcfs(waiting, free_pages: int, block_size: int, free_slots: int) -> int:
    """Return how many requests at the head of `waiting` can be admitted now.

    `waiting` lists (prompt_len, max_new_tokens) in arrival order. Admitting a request
    reserves KV pages for everything it may ever hold, prompt_len + max_new_tokens tokens,
    in pages of `block_size` tokens (a partly filled page is a whole page), plus one of the
    `free_slots` sequence slots. Admit in order while both fit; a request that needs exactly
    the pages that are left fits. Stop at the first one that does not fit: later, smaller
    requests must not jump it, or a long request could wait forever.
    """
    raise NotImplementedError("admit_fcfs: see the docstring for the task")


def chunk_prefills(num_decode: int, prefill_left, budget):
    """Plan one step under a token budget: return (decode_rows, chunks).

    `num_decode` running sequences each want one decode token; `prefill_left` lists, in arrival
    order, how many prompt tokens each admitted sequence still has to prefill. `budget` is the
    most tokens one step may carry (None: no limit). Decode rows come first (min(num_decode,
    budget) of them: they are what TPOT measures, and a long prompt must not stall them); then
    each prefill in order gets as much of the rest of the budget as it still needs. Return the
    number of decode rows and a list with one chunk size per entry of `prefill_left` (0 for
    those that get nothing). The step uses the whole budget when there is work for it.
    """
    raise NotImplementedError("chunk_prefills: see the docstring for the task")


def latency_percentiles(token_times, qs=(50, 99)) -> dict:
    """Return {"ttft_p50": .., "tpot_p50": .., "ttft_p99": .., "tpot_p99": ..} in seconds.

    `token_times[i]` lists the times (s after request i arrived) at which request i's tokens
    came out. Per request: TTFT is its first token time; TPOT is the mean gap between its
    consecutive tokens, (t_last - t_first) / (n - 1), and a one-token request has none. Then take
    each percentile over REQUESTS (every request counts once, however many tokens it has), with
    linear interpolation between the closest ranks, as numpy.percentile does by default. Keys
    are f"ttft_p{q:g}" and f"tpot_p{q:g}" for each q in `qs`.
    """
    raise NotImplementedError("latency_percentiles: see the docstring for the task")

"""Chapter 09 exercises: speculative decoding's rules. Fill in each function, then run `make
grade` (or the check cell in notebooks/09_speculative.ipynb). The graders are the same tests
that check labkit's own solutions (labkit/speculative.py)."""


def expected_tokens(alpha: float, k: int) -> float:
    """Return the tokens one verify step commits on average, when each of the k draft tokens
    is accepted with probability `alpha`, independently, and the first rejection ends the run.
    A step commits the accepted prefix plus one token from the target model: the bonus token
    after k acceptances, or the resample at the first rejection. (At alpha = 1 every draft is
    accepted.) labkit's version: `labkit.speculative.expected_tokens`."""
    raise NotImplementedError("expected_tokens: see the docstring for the task")


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """Return the tokens a greedy verify step commits.

    `draft` holds k tokens; `target[i]` is the target model's greedy token after the verify
    chunk's first i + 1 inputs (the last committed token, then draft[:i]), k + 1 of them.
    Commit the longest prefix of `draft` that agrees with `target`, then the target's own
    token at the first disagreement, or, when every draft agreed, the bonus token target[k].
    labkit's version: `labkit.speculative.accept_greedy`.
    """
    raise NotImplementedError("accept_greedy: see the docstring for the task")


def accept_sampled(draft, q, p, uniform, sample) -> list[int]:
    """Return the tokens a sampled verify step commits: the rejection rule.

    draft: k token ids, draft[i] drawn from the draft model's distribution q[i] (q: [k, V]
    tensor); p: the target model's distributions at the k + 1 positions of the verify chunk
    ([k + 1, V]). In order, accept draft[i] = x when uniform() < min(1, p[i, x] / q[i, x]).
    At the first rejection, stop: return the accepted tokens and one token drawn with
    `sample(dist)` from the residual max(0, p[i] - q[i]), normalised to sum to 1. When all k
    are accepted, append one more, drawn with `sample` from p[k]. Call uniform() once per
    draft you test, in order. labkit's version: `labkit.speculative.accept_sampled`.
    """
    raise NotImplementedError("accept_sampled: see the docstring for the task")


def rollback(kv_len: int, accepted: int, pages: list[int], block_size: int):
    """Return (valid, kept, freed) after a verify step.

    The sequence had KV entries at positions 0 .. kv_len - 1 on `pages` (its block table, in
    order, `block_size` entries a page). The verify chunk wrote entries at kv_len .. kv_len + k
    (its inputs: the last committed token, then the k drafts), and `accepted` drafts were
    accepted. `valid`: how many entries stay valid; `kept`: the pages that hold them, in
    order; `freed`: the pages to return to the pool (those holding only rejected entries).
    The token the step ends with (the bonus or the resample) has no entry yet: the next step
    writes it. labkit's version: `labkit.speculative.rollback`.
    """
    raise NotImplementedError("rollback: see the docstring for the task")

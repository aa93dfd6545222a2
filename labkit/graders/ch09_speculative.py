"""Chapter 09's graders: speculative decoding's expected tokens, the greedy and the sampled
acceptance rules, and the KV rollback. Each compares against a small reference written here
and names a known mistake only when it alone reproduces every wrong result."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from labkit.graders.common import diagnose, only_hint


def _ref_expected(alpha: float, k: int) -> float:
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def grade_expected_tokens(fn: Callable) -> str:
    """Grade an answer to exercise `expected_tokens` (exercises/ch09_speculative.py)."""
    cases = []
    for alpha, k in ((0.0, 4), (0.5, 1), (0.5, 4), (0.8, 8), (0.9, 3), (1.0, 5)):
        try:
            got = float(fn(alpha, k))
        except ZeroDivisionError:
            raise AssertionError(f"expected_tokens({alpha}, {k}) divided by zero: at alpha = 1 "
                                 "every draft is accepted, and a step commits k + 1 tokens"
                                 ) from None
        cases.append((f"({alpha}, {k})", got, _ref_expected(alpha, k), {
            "it forgets the target's own token: a step commits the accepted drafts plus one "
            "more (the bonus after k acceptances, the resample at a rejection)":
                _ref_expected(alpha, k) - 1,
            "the sum stops one term early: 1 + alpha + ... + alpha^k has k + 1 terms, "
            "(1 - alpha^(k+1)) / (1 - alpha)": _ref_expected(alpha, k - 1),
            "each draft is not accepted on its own: the i-th counts only if all before it "
            "were (a prefix), so the terms are alpha^i, not alpha": 1 + k * alpha,
        }))
    diagnose("expected_tokens", cases)
    return "1 + alpha + ... + alpha^k: the accepted prefix and the target's own token"


def grade_accept_greedy(fn: Callable) -> str:
    """Grade an answer to exercise `accept_greedy` (exercises/ch09_speculative.py)."""
    cases = [  # (draft, target, committed)
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all agree: the bonus token too
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # a mismatch at 1: the target's token, then stop
        ([5, 6, 7], [4, 6, 7, 8], [4]),  # the first draft rejected: still one token
        ([5], [5, 3], [5, 3]),
        ([], [2], [2]),  # k = 0: plain decoding, one token
    ]
    wrong = []
    for draft, target, want in cases:
        got = list(fn(list(draft), list(target)))
        if got != want:
            wrong.append((draft, target, got, want))
    if not wrong:
        return "the agreeing prefix, then the target's own token (the bonus when all agree)"
    hints = []
    for draft, _target, got, want in wrong:
        n = len(want) - 1  # accepted drafts
        hints.append({
            "no bonus token: when every draft agrees, the target's token after the last one "
            "(target[k]) is committed too, for free": got == want[:-1] and n == len(draft),
            "at the first disagreement commit the target's token, not the draft's: the draft "
            "guessed wrong there": n < len(draft) and got == want[:-1] + [draft[n]],
            "a disagreement ends the run: later drafts were conditioned on the wrong token, "
            "so even those that agree cannot be kept": n < len(draft) and len(got) > len(want),
            "a rejection commits one token from the target: without it the step can commit "
            "nothing and decoding stalls": n < len(draft) and got == want[:-1],
        })
    draft, target, got, want = wrong[0]
    hint = only_hint(hints)
    raise AssertionError(f"accept_greedy(draft={draft}, target={target}) returned {got}, want "
                         f"{want} ({len(wrong)} of {len(cases)} cases wrong)"
                         + (f": {hint}" if hint else ""))


class _Recorder:
    """A scripted uniform() and a sample() that records the distribution it was asked for."""

    def __init__(self, uniforms: list[float], pick: int):
        self.uniforms, self.calls, self.asked, self.pick = list(uniforms), 0, [], pick

    def uniform(self) -> float:
        self.calls += 1
        if not self.uniforms:
            raise AssertionError("uniform() was called more often than there are drafts to "
                                 "test: once per draft, and no more after a rejection")
        return self.uniforms.pop(0)

    def sample(self, dist: torch.Tensor) -> int:
        self.asked.append(torch.as_tensor(dist, dtype=torch.float64).clone())
        return self.pick


def _dists() -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Three drafts over 5 tokens with p/q at the drafted tokens of 1.5, 0.6 and 0.25."""
    q = torch.tensor([[0.10, 0.40, 0.20, 0.20, 0.10],
                      [0.10, 0.10, 0.50, 0.20, 0.10],
                      [0.05, 0.05, 0.10, 0.40, 0.40]], dtype=torch.float64)
    p = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.10],
                      [0.20, 0.20, 0.30, 0.20, 0.10],
                      [0.30, 0.30, 0.20, 0.10, 0.10],
                      [0.10, 0.20, 0.30, 0.25, 0.15]], dtype=torch.float64)
    return [1, 2, 3], q, p


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum()


def _rule(draft, q, p, uniform, sample, *, accept="ratio", resample="residual", bonus=0,
          stop=True):
    """The rejection rule, and the mistakes learners make in it (for the hints)."""
    out, first_rejected = [], None
    for i, x in enumerate(draft):
        u = uniform()
        ok = (u < min(1.0, float(p[i, x] / q[i, x]))) if accept == "ratio" else bool(
            p[i, x] >= q[i, x])
        if ok:
            out.append(x)
            continue
        if not stop:  # the mistake: keep testing the drafts after a rejection
            first_rejected = i if first_rejected is None else first_rejected
            continue
        return out + [sample(_residual(p[i], q[i]) if resample == "residual" else p[i])]
    if first_rejected is not None:
        return out + [sample(_residual(p[first_rejected], q[first_rejected]))]
    if bonus is None:
        return out
    return out + [sample(p[len(draft) + bonus])]


MISTAKES = {  # hint: the mistaken rule's options
    "accept with probability min(1, p/q), not only when p >= q: a draft token the target "
    "likes less than the draft did is still kept p/q of the time": {"accept": "p>=q"},
    "on a rejection the resample is drawn from the residual max(0, p - q), normalised, not "
    "from p: p counts again the mass the draft already had its chance to produce, and the "
    "output is no longer the target's distribution": {"resample": "p"},
    "the bonus token is drawn from p[k], the target's row after the last draft, not p[k - 1] "
    "(an off-by-one at the bonus position)": {"bonus": -1},
    "a step always ends with one token drawn by sample(): when all drafts are accepted, the "
    "bonus from p[k]": {"bonus": None},
    "a rejection ends the step: the drafts after it were drawn after a token that is not "
    "committed, so none of them may be accepted": {"stop": False},
}


def _run(fn, uniforms: list[float]) -> tuple[list[int], list[torch.Tensor], int]:
    draft, q, p = _dists()
    rec = _Recorder(uniforms, pick=4)
    got = [int(t) for t in fn(list(draft), q.clone(), p.clone(), rec.uniform, rec.sample)]
    return got, rec.asked, rec.calls


def grade_accept_sampled(fn: Callable) -> str:
    """Grade an answer to exercise `accept_sampled` (exercises/ch09_speculative.py).

    Deterministic: uniform() is scripted and sample() records the distribution it is asked to
    draw from (and returns token 4), so each case has one right answer."""
    cases = [  # (uniforms, what the case shows)
        ([0.9, 0.3, 0.1], "p/q at the drafts is 1.5, 0.6, 0.25, so all three are accepted "
         "(u < p/q each time), then the bonus is drawn from p[k]"),
        ([0.9, 0.3, 0.5], "draft 2 is rejected (u = 0.5 >= p/q = 0.25): the resample is "
         "drawn from max(0, p - q), normalised"),
        ([0.2, 0.7, 0.0], "draft 1 is rejected (u = 0.7 >= p/q = 0.6)"),
    ]

    def same(a, b) -> bool:
        return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
            torch.allclose(x, y, atol=1e-9) for x, y in zip(a[1], b[1]))

    failing = []
    for uniforms, why in cases:
        got = _run(fn, uniforms)
        want = _run(_rule, uniforms)
        if not same(got, want):
            failing.append((uniforms, why, got, want, {
                hint: same(got, _run(lambda *a, o=opts: _rule(*a, **o), uniforms))
                for hint, opts in MISTAKES.items()}))
        elif got[2] != want[2]:
            raise AssertionError(f"accept_sampled called uniform() {got[2]} times when "
                                 f"{why.split(':')[0]}; want {want[2]}: once per draft "
                                 "tested, in order, and none after a rejection")
    if not failing:
        return "accept with min(1, p/q); resample from max(0, p - q); the bonus from p[k]"
    uniforms, why, got, want, _ = failing[0]
    hint = only_hint([h for *_, h in failing])

    def dists(asked):
        return [[round(x, 4) for x in d.tolist()] for d in asked]

    raise AssertionError(
        f"accept_sampled with uniforms {uniforms} returned {got[0]}, sampling from "
        f"{dists(got[1])}; want {want[0]}, sampling from {dists(want[1])}, since {why} "
        f"({len(failing)} of {len(cases)} cases wrong)" + (f": {hint}" if hint else ""))


def grade_rollback(fn: Callable) -> str:
    """Grade an answer to exercise `rollback` (exercises/ch09_speculative.py)."""
    cases = [  # (kv_len, accepted, pages, block_size)
        (10, 0, [7, 3, 9, 4], 4),  # 11 valid: pages 7, 3, 9 hold them; 4 held only drafts
        (8, 0, [1, 2, 5], 4),  # only the last token's entry stays: 9 valid, 3 pages
        (7, 4, [0, 6, 2], 4),  # 12 valid exactly fill 3 pages: none freed
        (14, 1, [3, 8, 11, 12, 5], 4),  # 16 valid fill four pages: the fifth goes
    ]
    rows = []
    for kv_len, accepted, pages, bs in cases:
        got = fn(kv_len, accepted, list(pages), bs)
        try:
            valid, kept, freed = int(got[0]), list(got[1]), list(got[2])
        except (TypeError, IndexError, ValueError):
            raise AssertionError(f"rollback returned {got!r}: want (valid, kept pages, freed "
                                 "pages)") from None
        want_valid = kv_len + 1 + accepted
        keep = math.ceil(want_valid / bs)
        rows.append(((kv_len, accepted, pages, bs), (valid, kept, freed),
                     (want_valid, pages[:keep], pages[keep:])))
    wrong = [r for r in rows if r[1] != r[2]]
    if not wrong:
        return ("the last token's entry and the accepted drafts' stay; pages with only "
                "rejected entries go back")
    hints = []
    for (kv_len, accepted, _pages, bs), (valid, kept, _freed), _ in wrong:
        hints.append({
            "the rejected drafts' entries are kept: their positions will hold other tokens, "
            "so attention would read a token that was never committed":
                valid > kv_len + 1 + accepted,
            "the chunk's first input, the last committed token, wrote an entry too: kv_len + "
            "1 + accepted stay valid": valid == kv_len + accepted,
            "a page that holds any valid entry stays (a ceiling, not a floor): freeing it hands "
            "accepted entries to another sequence":
                valid == kv_len + 1 + accepted and len(kept) == valid // bs,
        })
    args, got, want = wrong[0]
    hint = only_hint(hints)
    raise AssertionError(f"rollback{args} returned {got}, want {want} ({len(wrong)} of "
                         f"{len(rows)} cases wrong)" + (f": {hint}" if hint else ""))

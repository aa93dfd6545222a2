"""Chapter 09's graders meet the wrong answers learners give (STYLE rule 16): each mistake
written out as a small function, and a phrase the grader's message must contain to name it."""

from __future__ import annotations

import pytest

from labkit.graders import check

# ---------------------------------------------------------------------------------------------
# chapter 09: speculative decoding's rules
# ---------------------------------------------------------------------------------------------


def spec_expected(alpha, k, *, bonus=True, terms=None):
    n = k + 1 if terms is None else terms
    total = sum(alpha ** i for i in range(n))
    return total if bonus else total - 1


@pytest.mark.parametrize(("wrong", "phrase"), [
    (lambda a, k: spec_expected(a, k, bonus=False), "forgets the target's own token"),
    (lambda a, k: spec_expected(a, k, terms=k), "stops one term early"),
    (lambda a, k: 1 + k * a, "a prefix"),
    (lambda a, k: (1 - a ** (k + 1)) / (1 - a), "divided by zero"),  # alpha = 1
])
def test_ch09_expected_tokens_rejects(wrong, phrase):
    with pytest.raises(AssertionError) as info:
        check.grade("expected_tokens", wrong)
    assert phrase in str(info.value), info.value


def greedy_variant(draft, target, *, bonus=True, draft_at_miss=False, whole=False,
                   nothing_at_miss=False):
    out = []
    for d, t in zip(draft, target):
        if d == t:
            out.append(d)
        elif whole:
            continue  # keeps looking past a mismatch
        else:
            return out + ([] if nothing_at_miss else [d if draft_at_miss else t])
    return out + ([target[len(draft)]] if bonus else [])


@pytest.mark.parametrize(("wrong", "phrase"), [
    (lambda d, t: greedy_variant(d, t, bonus=False), "no bonus token"),
    (lambda d, t: greedy_variant(d, t, draft_at_miss=True), "not the draft's"),
    (lambda d, t: greedy_variant(d, t, whole=True), "a disagreement ends the run"),
    (lambda d, t: greedy_variant(d, t, nothing_at_miss=True), "decoding stalls"),
])
def test_ch09_accept_greedy_rejects(wrong, phrase):
    with pytest.raises(AssertionError) as info:
        check.grade("accept_greedy", wrong)
    assert phrase in str(info.value), info.value


def sampled_variant(draft, q, p, uniform, sample, *, accept="ratio", resample="residual",
                    bonus=0, no_stop=False, ratio_inverted=False):
    out, rejected = [], None
    for i, x in enumerate(draft):
        u = uniform()
        ratio = float(q[i, x] / p[i, x]) if ratio_inverted else float(p[i, x] / q[i, x])
        ok = u < min(1.0, ratio) if accept == "ratio" else bool(p[i, x] >= q[i, x])
        if ok:
            out.append(x)
        elif no_stop:
            rejected = i if rejected is None else rejected
        else:
            r = (p[i] - q[i]).clamp(min=0)
            return out + [sample(r / r.sum() if resample == "residual" else p[i])]
    if rejected is not None:
        r = (p[rejected] - q[rejected]).clamp(min=0)
        return out + [sample(r / r.sum())]
    return out if bonus is None else out + [sample(p[len(draft) + bonus])]


@pytest.mark.parametrize(("wrong", "phrase"), [
    (lambda *a: sampled_variant(*a, accept="p>=q"), "not only when p >= q"),
    (lambda *a: sampled_variant(*a, resample="p"), "residual max(0, p - q)"),
    (lambda *a: sampled_variant(*a, bonus=-1), "off-by-one at the bonus"),
    (lambda *a: sampled_variant(*a, bonus=None), "always ends with one token"),
    (lambda *a: sampled_variant(*a, no_stop=True), "a rejection ends the step"),
    (lambda *a: sampled_variant(*a, ratio_inverted=True), "accept_sampled"),
])
def test_ch09_accept_sampled_rejects(wrong, phrase):
    with pytest.raises(AssertionError) as info:
        check.grade("accept_sampled", wrong)
    assert phrase in str(info.value), info.value


def rollback_variant(kv_len, accepted, pages, bs, *, keep_rejected=False, no_last=False,
                     floor=False):
    valid = kv_len + 1 + accepted
    if keep_rejected:
        valid = kv_len + 1 + accepted + 1  # the first rejected draft's entry stays too
    if no_last:
        valid = kv_len + accepted
    keep = valid // bs if floor else -(-valid // bs)
    return valid, pages[:keep], pages[keep:]


@pytest.mark.parametrize(("wrong", "phrase"), [
    (lambda *a: rollback_variant(*a, keep_rejected=True), "rejected drafts' entries are kept"),
    (lambda *a: rollback_variant(*a, no_last=True), "the last committed token, wrote an entry"),
    (lambda *a: rollback_variant(*a, floor=True), "a ceiling, not a floor"),
    (lambda kv, acc, pages, bs: (kv + len(pages) * 0 + 99, pages, []), "rollback"),
])
def test_ch09_rollback_rejects(wrong, phrase):
    with pytest.raises(AssertionError) as info:
        check.grade("rollback", wrong)
    assert phrase in str(info.value), info.value

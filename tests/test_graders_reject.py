"""Every grader is tested by the wrong answers it must reject (STYLE rule 16).

For each exercise: the plausible mistakes, the chapter's own bug first, each written out as a
small function, and a phrase the grader's message must contain to name it. A mistake that a
grader lets through, or rejects with a message that does not name it, fails here.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from labkit import sequence
from labkit.bench import decode as bench_decode
from labkit.decode_blocking import run_blocking
from labkit.graders import check
from labkit.instruments import timeline

# ---------------------------------------------------------------------------------------------
# chapter 00
# ---------------------------------------------------------------------------------------------


def rms(x, w, eps):
    return (x * x).mean(-1, keepdim=True)


def nucleus_sorted(logits, top_p, inclusive=False):
    probs = torch.softmax(logits, -1)
    sp, order = probs.sort(-1, descending=True)
    cum = sp.cumsum(-1)
    keep = (cum < top_p[:, None]) if inclusive else (cum - sp < top_p[:, None])
    return keep, order


def scatter(keep, order):
    return torch.zeros_like(keep).scatter(1, order, keep)


def top_p_masked(logits, keep):
    return logits.masked_fill(~keep, float("-inf"))


WRONG = {
    "rms_norm": [
        (lambda x, w, eps: x / (rms(x, w, eps).sqrt() + eps) * w, "eps is added outside"),
        (lambda x, w, eps: x / rms(x, w, eps).sqrt() * w, "no eps"),
        (lambda x, w, eps: x / (rms(x, w, eps) + 1e-6).sqrt() * w, "fixed eps of 1e-6"),
        (lambda x, w, eps: (x - x.mean(-1, keepdim=True))
         / (x.var(-1, keepdim=True, unbiased=False) + eps).sqrt() * w, "LayerNorm"),
        (lambda x, w, eps: x / (rms(x, w, eps) + eps).sqrt(), "`weight` scale is missing"),
        (lambda x, w, eps: x / ((x * x).mean() + eps).sqrt() * w, "last dimension only"),
        (lambda x, w, eps: x / (rms(x, w, eps) + eps) * w, "without the square root"),
    ],
    "top_p_filter": [
        (lambda lg, p: top_p_masked(lg, (torch.softmax(lg, -1).cumsum(-1)
                                         - torch.softmax(lg, -1)) < p[:, None]), "no sorting"),
        (lambda lg, p: top_p_masked(lg, nucleus_sorted(lg, p)[0]), "scatter it back"),
        (lambda lg, p: top_p_masked(lg, scatter(*nucleus_sorted(lg, p[:1].expand_as(p)))),
         "one p for the whole batch"),
        (lambda lg, p: top_p_masked(lg, scatter(*nucleus_sorted(lg, p, inclusive=True))),
         "carries the mass past p"),
        (lambda lg, p: lg.masked_fill(~scatter(*nucleus_sorted(lg, p)), 0.0), "must become -inf"),
        (lambda lg, p: torch.softmax(lg, -1).masked_fill(~scatter(*nucleus_sorted(lg, p)),
                                                         float("-inf")), "kept logits changed"),
        (lambda lg, p: top_p_masked(lg, ~scatter(*nucleus_sorted(lg, p))), "inverted"),
    ],
}

# ---------------------------------------------------------------------------------------------
# chapter 01
# ---------------------------------------------------------------------------------------------


def flops_parts(cfg, batch, ctx, kv_heads=None, mlp=3, head=1):
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q = cfg.num_heads * cfg.head_dim
    kv = (kv_heads or cfg.num_kv_heads) * cfg.head_dim
    return (2 * batch * n * (2 * d * q + 2 * d * kv + mlp * d * f) + head * 2 * batch * d * v
            + 4 * batch * n * q * ctx)


def bytes_parts(cfg, batch, ctx, wb, kvb, kv_size=None, heads=None, untied=False):
    weights = cfg.num_params() * wb + (cfg.hidden_size * cfg.vocab_size * wb if untied else 0)
    per_token = 2 * cfg.num_layers * (heads or cfg.num_kv_heads) * cfg.head_dim
    return weights + batch * (ctx + 1) * per_token * (kv_size or kvb)


WRONG.update({
    "matmul_intensity": [
        (lambda m, n, k, b: 2 * m * n * k // ((m * k + k * n + m * n) * b), "Integer division"),
        (lambda m, n, k, b: m * n * k / ((m * k + k * n + m * n) * b), "two FLOPs"),
        (lambda m, n, k, b: 2 * m * n * k / (m * k + k * n + m * n), "bytes per element"),
        (lambda m, n, k, b: 2 * m * n * k / ((m * k + k * n) * b), "write of C"),
    ],
    "decode_step_flops": [
        (lambda cfg, b, c: flops_parts(cfg, b, c, kv_heads=cfg.num_heads), "GQA"),
        (lambda cfg, b, c: flops_parts(cfg, b, c, mlp=2), "three matrices"),
        (lambda cfg, b, c: flops_parts(cfg, b, c, head=2), "head twice"),
        (lambda cfg, b, c: flops_parts(cfg, b, c, head=0), "output head"),
    ],
    "decode_step_bytes": [
        (lambda cfg, b, c, wb, kvb: bytes_parts(cfg, b, c, wb, kvb, kv_size=wb),
         "in weight_bytes"),
        (lambda cfg, b, c, wb, kvb: bytes_parts(cfg, b, c, wb, kvb, kv_size=kvb / 2),
         "K but not V"),
        (lambda cfg, b, c, wb, kvb: bytes_parts(cfg, b, c, wb, kvb, heads=cfg.num_heads), "GQA"),
        (lambda cfg, b, c, wb, kvb: bytes_parts(cfg, b, c, wb, kvb, untied=True), "tie them"),
        (lambda cfg, b, c, wb, kvb: cfg.num_params() * wb, "not the KV cache"),
    ],
})

# ---------------------------------------------------------------------------------------------
# chapter 06
# ---------------------------------------------------------------------------------------------


def summed(busy, t0, t1):
    return 1 - sum(b - a for a, b in busy) / (t1 - t0)


def first_to_last(busy, t0, t1):
    if not busy:
        return 1.0
    return timeline.idle_fraction(busy, min(a for a, _ in busy), max(b for _, b in busy))


def unsorted_merge(busy, t0, t1):
    total, end = 0.0, float("-inf")
    for a, b in busy:
        if b > end:
            total, end = total + b - max(a, end), b
    return 1 - total / (t1 - t0)


def costs(launch, host, device, n_periods=None, all_host=False, all_device=False,
          two_terms=False, by_min=False):
    n = len(launch) - 1
    step = (launch[-1] - launch[0]) / (n_periods or n)
    t_host = sum(host) / len(host) if all_host else sum(host[:n]) / n
    t_dev = sum(device) / len(device) if all_device else sum(device[:n]) / n
    pick = min if by_min else max
    return t_host, t_dev, (t_host + t_dev if two_terms else step) / pick(t_host, t_dev)


WRONG.update({
    "bubble_fraction": [
        (summed, "overlapping spans count once"),
        (lambda busy, t0, t1: 1 - timeline.idle_fraction(busy, t0, t1), "idle share"),
        (unsorted_merge, "without sorting"),
        (first_to_last, "the window is t0 to t1"),
        (lambda busy, t0, t1: 100 * timeline.idle_fraction(busy, t0, t1), "percentage"),
    ],
    "cost_model": [
        (lambda la, ho, de: costs(la, ho, de, n_periods=len(la)), "n - 1 periods"),
        (lambda la, ho, de: costs(la, ho, de, all_host=True), "leave its host work out"),
        (lambda la, ho, de: costs(la, ho, de, all_device=True), "leave its device time out"),
        (lambda la, ho, de: costs(la, ho, de, two_terms=True), "round trips"),
        (lambda la, ho, de: costs(la, ho, de, by_min=True), "max(T_host, T_device)"),
    ],
})

# ---------------------------------------------------------------------------------------------
# chapter 07
# ---------------------------------------------------------------------------------------------


def refs_zeroed(seq, token):  # the chapter's central bug
    seq.inflight_refs = 0
    if seq.finalized:
        seq.zombie_rows += 1
        return False
    seq.output_ids.append(token)
    return True


def zombie_set_to_one(seq, token):
    seq.inflight_refs -= 1
    if seq.finalized:
        seq.zombie_rows = 1
        return False
    seq.output_ids.append(token)
    return True


def clamped(seq, token):
    seq.inflight_refs = max(0, seq.inflight_refs - 1)
    if seq.finalized:
        seq.zombie_rows += 1
        return False
    seq.output_ids.append(token)
    return True


def no_decrement_for_zombies(seq, token):
    if seq.finalized:
        seq.zombie_rows += 1
        return False
    seq.inflight_refs -= 1
    seq.output_ids.append(token)
    return True


def zombie_appends(seq, token):
    seq.inflight_refs -= 1
    seq.output_ids.append(token)
    return not seq.finalized


def pipelined_with(slot_of=None, sample_first=False, drop_last=False):
    """labkit's loop with one thing done wrong."""
    def loop(engine):
        prev = None
        while True:
            engine.between_steps()
            if prev is None and engine.scheduler.idle():
                return
            nxt = engine.plan_step()
            if nxt is None and drop_last:
                return
            if nxt is not None:
                slot = slot_of(prev) if slot_of else (1 - prev.slot if prev else 0)
                engine.launch(nxt, slot)
                if sample_first:
                    engine.finish_sampling(nxt)
            if prev is not None:
                engine.commit(prev, engine.wait_tokens(prev))
            if nxt is not None and not sample_first:
                engine.finish_sampling(nxt)
            prev = nxt
    return loop


WRONG.update({
    "commit_row": [
        (refs_zeroed, "setting it to 0 frees the pages"),
        (zombie_set_to_one, "not `= 1`"),
        (clamped, "max(0, ...)"),
        (no_decrement_for_zombies, "zombie or not"),
        (zombie_appends, "appended a token"),
    ],
    "can_release": [
        (lambda s: s.finalized and not s.released, "zombie row is still in flight"),
        (lambda s: s.inflight_refs == 0 and not s.released, "not finalized"),
        (lambda s: s.finalized and s.inflight_refs == 0, "released already"),
    ],
    "run_pipelined": [
        (run_blocking, "that is the blocking loop"),
        (pipelined_with(slot_of=lambda prev: 0), "alternate the two slots"),
        (pipelined_with(sample_first=True), "before step"),
        (pipelined_with(drop_last=True), "never committed"),
    ],
})

CASES = [(name, i) for name in WRONG for i in range(len(WRONG[name]))]


@pytest.mark.parametrize(("name", "i"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_grader_rejects_and_names_the_mistake(name, i):
    wrong, phrase = WRONG[name][i]
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    assert phrase in str(info.value), f"{name}: the message does not name the mistake " \
        f"({phrase!r}): {info.value}"


def test_every_exercise_has_wrong_answers():
    """Each grader meets wrong answers: listed here (WRONG), or in its chapter's grader tests
    (tests/test_*grader*.py), which name the exercise they grade."""
    here = pathlib.Path(__file__)
    elsewhere = "".join(p.read_text() for p in here.parent.glob("test_*grader*.py") if p != here)
    assert set(WRONG) <= set(check.EXERCISES), set(WRONG) - set(check.EXERCISES)
    untested = [n for n in check.EXERCISES
                if n not in WRONG and f'"{n}"' not in elsewhere and f"'{n}'" not in elsewhere]
    assert not untested, f"graders with no wrong answers to reject in any test: {untested}"


def test_a_correct_answer_with_the_other_tie_break_passes():
    def stable_ascending_ties(logits, top_p):  # equal logits ranked by *descending* index
        idx = torch.arange(logits.shape[-1], dtype=logits.dtype)
        _, order = (logits * 1e6 + idx * 1e-3).sort(-1, descending=True)
        probs = torch.softmax(logits, -1).gather(-1, order)
        keep = probs.cumsum(-1) - probs < top_p[:, None]
        return logits.masked_fill(~scatter(keep, order), float("-inf"))

    assert check.grade("top_p_filter", stable_ascending_ties).startswith("✓")


def test_grade_line_is_one_line_per_outcome():
    assert check.grade_line("commit_row", sequence.commit_row).startswith("✓ commit_row")
    assert check.grade_line("commit_row", refs_zeroed).startswith("✗ commit_row")
    assert check.grade_line("cost_model", bench_decode.cost_model).startswith("✓")

    def todo(seq, token):
        """The task."""
        raise NotImplementedError

    assert check.grade_line("commit_row", todo).startswith("· commit_row: not attempted")
    line = check.grade_line("cost_model", lambda a, b, c: 1 / 0)
    assert line.startswith("✗ cost_model: raised ZeroDivisionError") and "\n" not in line

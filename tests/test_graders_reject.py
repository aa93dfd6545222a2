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


# ---------------------------------------------------------------------------------------------
# chapter 03: the all-zero row of int8, and the AWQ search's mistakes (the per-tensor scale,
# -128, truncation and nibble-order mistakes are in tests/test_grader_ch03.py)
# ---------------------------------------------------------------------------------------------


def int8_zero_scale(w):  # right everywhere but an all-zero row: scale 0, codes 0 / 0 = NaN
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_zero_row_nonzero_codes(w):  # a positive scale for the zero row, but codes not 0
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    q[scale < 1e-9] = 1
    return q.to(torch.int8), scale


def _awq_search(error, pick=min, signed=False, reciprocal=False):
    """An AWQ search over alpha in 0, 0.05, ..., 1 with one mistake switched in."""
    from labkit.graders.ch03_quantization import _fake_int4

    def search(x, w, group):
        act = x.mean(0) if signed else x.abs().mean(0)  # [K]
        cands = []
        for i in range(21):
            s = act.pow(i / 20)
            s = s / (s.max() * s.min()).sqrt()
            cands.append((error(x, w, s, group, _fake_int4), i, s))
        errs = torch.tensor([c[0] for c in cands])
        j = int(errs.argmin()) if pick is min else int(errs.argmax())
        s = cands[j][2]
        return 1 / s if reciprocal else s
    return search


def _out_err(x, w, s, g, fq):
    return float(((x @ (fq(w * s, g) / s).t() - x @ w.t()) ** 2).mean())


def _weight_err(x, w, s, g, fq):  # the weights' error, not the outputs'
    return float(((fq(w * s, g) / s - w) ** 2).mean())


def _undivided_err(x, w, s, g, fq):  # forgot to divide the dequantized w * s by s
    return float(((x @ fq(w * s, g).t() - x @ w.t()) ** 2).mean())


CH03_WRONG = [
    ("quantize_int8", int8_zero_scale, "all zeros and its scale is 0"),
    ("quantize_int8", int8_zero_row_nonzero_codes, "every code of a zero row must be 0"),
    ("awq_scale", _awq_search(_weight_err), "measures the weights' error"),
    ("awq_scale", _awq_search(_undivided_err), "forgets to divide the dequantized w * s by s"),
    ("awq_scale", _awq_search(_out_err, pick=max), "LARGEST error"),
    ("awq_scale", _awq_search(_out_err, reciprocal=True), "returned 1 / s"),
    ("awq_scale", lambda x, w, g: x.abs().mean(0), "a fixed alpha = 1 without a search"),
    ("awq_scale", _awq_search(_out_err, signed=True), "mean of x rather than of |x|"),
    ("awq_scale", lambda x, w, g: x.mean(0).pow(0.5), "channels whose mean of x is negative"),
]


@pytest.mark.parametrize(("name", "wrong", "phrase"), CH03_WRONG,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CH03_WRONG)])
def test_ch03_grader_rejects_and_names_the_mistake(name, wrong, phrase):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    assert phrase in str(info.value), f"{name}: the message does not name the mistake " \
        f"({phrase!r}): {info.value}"


def test_ch03_graders_pass_a_right_search_and_a_zero_safe_int8():
    from labkit.quant import quantize_int8

    assert check.grade("awq_scale", _awq_search(_out_err)).startswith("✓")
    assert check.grade("quantize_int8", quantize_int8).startswith("✓")


# ---------------------------------------------------------------------------------------------
# chapters 00 and 01: mistakes that used to be named after another mistake they resembled
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "wrong", "phrase", "not_phrase"), [
    # softmax without any filtering: every value changed, none is -inf; it is not the
    # "dropped tokens must become -inf" mistake (the nucleus changed too)
    ("top_p_filter", lambda lg, p: torch.softmax(lg, -1), "return the logits themselves",
     "must become -inf"),
    # the nucleus kept, the rest scaled down instead of dropped: values changed everywhere
    ("top_p_filter", lambda lg, p: lg.masked_fill(~scatter(*nucleus_sorted(lg, p)), 0.0) * 0.5,
     "return the logits themselves", "must become -inf"),
    # dropped to a large negative number instead of -inf: the nucleus is intact
    ("top_p_filter", lambda lg, p: lg.masked_fill(~scatter(*nucleus_sorted(lg, p)), -1e9),
     "must become -inf", "return the logits themselves"),
    # int() truncates like //: the message names both
    ("matmul_intensity", lambda m, n, k, b: int(2 * m * n * k / ((m * k + k * n + m * n) * b)),
     "int()", "Forgot"),
])
def test_ch00_ch01_grader_names_the_mistake_not_a_lookalike(name, wrong, phrase, not_phrase):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    message = str(info.value)
    assert phrase in message and not_phrase not in message, f"{name}: {message}"


# ---------------------------------------------------------------------------------------------
# chapter 02: chunk_prefills and admit_fcfs name the mistake made, not a coincidence
# ---------------------------------------------------------------------------------------------

def ch02_chunks_decode_uncapped(num_decode, prefill_left, budget):
    """Every running sequence decodes, whatever the budget (the rest clamped at 0)."""
    left = float("inf") if budget is None else budget - num_decode
    chunks = []
    for remaining in prefill_left:
        chunks.append(int(max(0, min(remaining, left))))
        left -= chunks[-1]
    return num_decode, chunks


def ch02_chunks_decode_uncapped_negative(num_decode, prefill_left, budget):
    """The same, without the clamp: a negative budget left gives negative chunks."""
    left = float("inf") if budget is None else budget - num_decode
    chunks = []
    for remaining in prefill_left:
        chunks.append(int(min(remaining, left)))
        left -= chunks[-1]
    return num_decode, chunks


def ch02_chunks_whole_budget(num_decode, prefill_left, budget):
    """Decode rows capped, but prefill still takes the whole budget."""
    left = float("inf") if budget is None else budget
    chunks = []
    for remaining in prefill_left:
        chunks.append(int(min(remaining, left)))
        left -= chunks[-1]
    return int(min(num_decode, left if budget is None else budget)), chunks


def ch02_chunks_budget_not_spent(num_decode, prefill_left, budget):
    """Every prefill gets what decode left, as if the earlier chunks took nothing."""
    decode = int(min(num_decode, float("inf") if budget is None else budget))
    left = float("inf") if budget is None else budget - decode
    return decode, [int(min(r, left)) for r in prefill_left]


def ch02_chunks_first_prefill_only(num_decode, prefill_left, budget):
    """Only the oldest prefill gets a chunk each step."""
    decode = int(min(num_decode, float("inf") if budget is None else budget))
    left = float("inf") if budget is None else budget - decode
    return decode, [int(min(r, left)) if i == 0 else 0 for i, r in enumerate(prefill_left)]


def ch02_admit_ignores_slots(waiting, free_pages, block_size, free_slots):
    """Pages checked, slots forgotten."""
    n = 0
    for prompt_len, max_new in waiting:
        need = -(-(prompt_len + max_new) // block_size)
        if need > free_pages:
            break
        free_pages -= need
        n += 1
    return n


def ch02_admit_pages_not_taken(waiting, free_pages, block_size, free_slots):
    """Each request checked against all the free pages, none taken by the earlier ones."""
    n = 0
    for prompt_len, max_new in waiting:
        if n == free_slots or -(-(prompt_len + max_new) // block_size) > free_pages:
            break
        n += 1
    return n


CH02_WRONG = [
    ("chunk_prefills", ch02_chunks_decode_uncapped, "decode rows are capped by the budget",
     "off-by-one"),
    ("chunk_prefills", ch02_chunks_decode_uncapped_negative,
     "decode rows are capped by the budget", "between 0 and"),
    ("chunk_prefills", ch02_chunks_whole_budget, "decode rows count against the budget",
     "off-by-one"),
    ("chunk_prefills", ch02_chunks_budget_not_spent, "each chunk spends the budget",
     "off-by-one"),
    ("chunk_prefills", ch02_chunks_first_prefill_only, "not only the first", "off-by-one"),
    ("admit_fcfs", ch02_admit_ignores_slots, "takes a slot", "off-by-one"),
    ("admit_fcfs", ch02_admit_pages_not_taken, "takes its pages", "off-by-one"),
]


@pytest.mark.parametrize(("name", "wrong", "phrase", "not_phrase"), CH02_WRONG,
                         ids=[w[1].__name__ for w in CH02_WRONG])
def test_ch02_grader_names_the_mistake_not_a_coincidence(name, wrong, phrase, not_phrase):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    message = str(info.value)
    assert phrase in message and not_phrase not in message, f"{name}: {message}"


# ---------------------------------------------------------------------------------------------
# chapter 05: blocks_needed, translate, CowPages (the toy allocator's free-page and num_free
# rules; a swapped translation must not be reported as an unscaled page id)
# ---------------------------------------------------------------------------------------------


def ch05_translate_swapped(table, pos, block_size):  # // and % exchanged
    return table[pos % block_size] * block_size + pos // block_size


def ch05_translate_no_negative_check(table, pos, block_size):  # table[-1] is the last page
    if pos // block_size >= len(table):
        raise IndexError(pos)
    return table[pos // block_size] * block_size + pos % block_size


def ch05_translate_value_error(table, pos, block_size):
    if not 0 <= pos < len(table) * block_size:
        raise ValueError(pos)
    return table[pos // block_size] * block_size + pos % block_size


def ch05_translate_page_times_pages(table, pos, block_size):
    return table[pos // block_size] * len(table) + pos % block_size


def ch05_translate_unknown(table, pos, block_size):  # matches no known mistake
    return table[pos // block_size] * block_size + pos % block_size + (pos == 9)


class Ch05CowPages:
    """A correct allocator; each subclass below switches in one mistake."""

    def __init__(self, num_pages):
        self.refs = [0] * num_pages
        self.free_list = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self):
        return len(self.free_list)

    def refcount(self, page):
        return self.refs[page]

    def alloc(self):
        if not self.free_list:
            raise MemoryError("no free page")
        page = self.free_list.pop()
        self.refs[page] = 1
        return page

    def check(self, page):
        if self.refs[page] == 0:
            raise RuntimeError(f"page {page} is free")

    def share(self, page):
        self.check(page)
        self.refs[page] += 1
        return page

    def free(self, page):
        self.check(page)
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_list.append(page)

    def write(self, page):
        self.check(page)
        if self.refs[page] == 1:
            return page
        new = self.alloc()
        self.refs[page] -= 1
        return new


class Ch05ShareFreePage(Ch05CowPages):
    def share(self, page):  # no check: a free page gets a holder but stays on the free list
        self.refs[page] += 1
        return page


class Ch05WriteFreePage(Ch05CowPages):
    def write(self, page):  # refcount 0 or 1 both look "private"
        if self.refs[page] <= 1:
            return page
        return super().write(page)


class Ch05NumFreeCountsRefs(Ch05CowPages):
    @property
    def num_free(self):
        return len(self.refs) - sum(self.refs)


class Ch05ShareReturnsNothing(Ch05CowPages):
    def share(self, page):
        super().share(page)


class Ch05ShareChecksLate(Ch05CowPages):
    def share(self, page):  # changes the count, then refuses
        self.refs[page] += 1
        if self.refs[page] == 1:
            raise RuntimeError(f"page {page} is free")
        return page


class Ch05FullPoolIndexError(Ch05CowPages):
    def alloc(self):  # list.pop on an empty free list
        page = self.free_list.pop()
        self.refs[page] = 1
        return page


CH05_WRONG = [
    ("translate", ch05_translate_swapped, "// and % swapped", "multiply"),
    ("translate", lambda t, pos, bs: t[pos // bs] + pos % bs, "counts pages, not slots",
     "swapped"),
    ("translate", lambda t, pos, bs: pos, "block table was ignored", "multiply"),
    ("translate", lambda t, pos, bs: t[pos // bs + 1] * bs + pos % bs, "off by one page",
     "multiply"),
    ("translate", lambda t, pos, bs: t[pos // bs] * bs, "offset within the page was dropped",
     "multiply"),
    ("translate", lambda t, pos, bs: t[pos // bs] * bs + pos, "not pos: a page holds",
     "multiply"),
    ("translate", ch05_translate_page_times_pages, "number of pages", "swapped"),
    ("translate", ch05_translate_no_negative_check, "negative position", "past"),
    ("translate", ch05_translate_value_error, "raised ValueError, expected IndexError",
     "multiply"),
    ("translate", ch05_translate_unknown, "slot = block_table[pos // block_size]", "multiply"),
    ("blocks_needed", lambda n, bs: n // bs + 1, "exact multiples", "round up, not down"),
    ("blocks_needed", lambda n, bs: n // bs, "round up, not down", "exact multiples"),
    ("blocks_needed", lambda n, bs: round(n / bs), "nearest", "exact multiples"),
    ("blocks_needed", lambda n, bs: n / bs, "fraction of a page", "exact multiples"),
    ("blocks_needed", lambda n, bs: max(1, -(-n // bs)), "0 tokens need 0 pages",
     "exact multiples"),
    ("CowPages", Ch05ShareFreePage, "only a page someone holds can be shared", "double free"),
    ("CowPages", Ch05WriteFreePage, "write after free", "double free"),
    ("CowPages", Ch05NumFreeCountsRefs, "num_free counts references, not pages", "freed a"),
    ("CowPages", Ch05ShareReturnsNothing, "must return the page it shares", "num_free"),
    ("CowPages", Ch05ShareChecksLate, "a refused share changed the pool", "did not"),
    ("CowPages", Ch05FullPoolIndexError, "raised IndexError, expected MemoryError",
     "double free"),
]


@pytest.mark.parametrize(("name", "wrong", "phrase", "not_phrase"), CH05_WRONG,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(CH05_WRONG)])
def test_ch05_grader_names_the_mistake_not_a_coincidence(name, wrong, phrase, not_phrase):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert not isinstance(info.value, check.ExerciseNotDone)
    message = str(info.value)
    assert phrase in message and not_phrase not in message, f"{name}: {message}"


def test_ch05_graders_pass_a_correct_allocator_written_differently():
    assert check.grade("CowPages", Ch05CowPages).startswith("✓ CowPages")
    assert check.grade("blocks_needed", lambda n, bs: (n + bs - 1) // bs).startswith("✓")


class Ch05FreeKeepsCount(Ch05CowPages):
    def free(self, page):  # never decrements: the page is not returned, but not freed early
        self.check(page)
        if self.refs[page] == 1:
            self.refs[page] = 0
            self.free_list.append(page)


def test_ch05_free_that_forgets_to_decrement_is_not_called_an_early_free():
    with pytest.raises(AssertionError) as info:
        check.grade("CowPages", Ch05FreeKeepsCount)
    message = str(info.value)
    assert "free drops one reference" in message and "while refs > 0" not in message, message


# ---------------------------------------------------------------------------------------------
# chapter 08: predict_wall names a mistake only when it alone gives the answer in every case
# (a value one case shares with a mistake is a coincidence: the grader used to call the answer
# below that scales h "ignores fixed_scale", from the one case where the two agree)
# ---------------------------------------------------------------------------------------------


def ch08_wall(steps, tokens, a, b, h, pipelined, fixed_scale=1.0, *, swap=False, h_scaled=False,
              only_pipelined=False):
    host = steps * h * (fixed_scale if h_scaled and (pipelined or not only_pipelined) else 1)
    dev = steps * a * (1 if h_scaled and (pipelined or not only_pipelined) else fixed_scale)
    dev += tokens * b
    return max(host, dev) if pipelined != swap else host + dev


@pytest.mark.parametrize(("wrong", "phrase", "not_phrase"), [
    (lambda *c: ch08_wall(*c, swap=True), "swapped", "overlaps them, max"),
    (lambda *c: ch08_wall(*c, h_scaled=True), "scales the host's work h", "ignores fixed_scale"),
    # h scaled in the pipelined branch only: one wrong case, where it equals ignoring the
    # scale; the blocking cases say it does not ignore it, so no mistake is named
    (lambda *c: ch08_wall(*c, h_scaled=True, only_pipelined=True), "want", "ignores fixed_scale"),
])
def test_ch08_predict_wall_names_the_mistake_not_a_coincidence(wrong, phrase, not_phrase):
    with pytest.raises(AssertionError) as info:
        check.grade("predict_wall", wrong)
    assert phrase in str(info.value), info.value
    assert not_phrase not in str(info.value), info.value

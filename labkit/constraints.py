"""Constrained decoding: a finite-state machine decides which tokens may come next.

A constraint is first a *character* automaton: a start state, a step function that reads one
character (or dies), and a set of accepting states. The model emits *tokens*, though, each one a
string of characters, so the automaton is lifted to tokens by walking the vocabulary: token t is
allowed in state s iff feeding its characters one by one from s never dies. The walk runs over a
trie of the token strings, so tokens that share a prefix share the work, and only tokens built
from the characters the grammar can ever emit are in the trie at all (a few hundred of SmolLM2's
49,152 for a JSON point). Each state's mask, a bool tensor [V], is computed once and cached.

Rules the decoders rely on:

- EOS is allowed only in accepting states; in an accepting state with no other way on, only EOS.
- Every token a mask allows leads to a state from which acceptance is still reachable with this
  vocabulary, so a mask is never all False and every output parses.
- A constraint that no token sequence can satisfy raises `ConstraintError` when it is built,
  before any decode step runs.

The kinds, as JSONL requests spell them (`parse_constraint`):

- `{"choice": ["yes", "no", "maybe"]}`: the text is exactly one of the options.
- `{"point": {"min": 0, "max": 1, "decimals": 3}}`: the text is `{"x": 0.412, "y": 0.078}`.
- `{"box": {"min": 0, "max": 1, "decimals": 3}}`: the text is
  `{"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6}`, with x_min <= x_max and
  y_min <= y_max (a box with its corners swapped is not a box).

Objects are written with canonical spacing only (one space after each colon and each comma, none
elsewhere) and keys in the order shown. A number is `-?(0|[1-9][0-9]*)(\\.[0-9]{1,decimals})?`
with its value in [min, max]; `-0` (negative zero, in any spelling) is not allowed. Every such
text is valid JSON.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal, localcontext
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import torch

State = Hashable  # opaque to the decoders: start() makes one, advance() makes the next


class ConstraintError(ValueError):
    """A constraint spec is malformed, cannot be satisfied, or a token broke it."""


# ---------------------------------------------------------------------------------- vocabulary


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:  # bytes that are not printable get the next free code points
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


_BYTES = _byte_decoder()


def _byte_level_text(piece: str) -> str | None:
    """The text of a byte-level BPE piece ('Ġyes' -> ' yes'); None if it is not whole UTF-8."""
    try:
        return bytes(_BYTES[c] for c in piece).decode("utf-8")
    except (KeyError, UnicodeDecodeError):  # not byte-level, or half of a multi-byte character
        return None


@dataclass(frozen=True, eq=False)
class Vocab:
    """What each token id decodes to; "" marks a token never allowed (special, partial UTF-8)."""

    token_strings: Sequence[str]  # [V], stored as a tuple
    eos_id: int
    _tries: dict = field(default_factory=dict, init=False, repr=False)
    _parsed: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_strings", tuple(self.token_strings))
        if not all(isinstance(s, str) for s in self.token_strings):
            raise ConstraintError("Vocab.token_strings must all be str ('' for never allowed)")
        if not 0 <= self.eos_id < len(self.token_strings):
            raise ConstraintError(
                f"Vocab.eos_id={self.eos_id} is not a token id (vocab size {self.size})")

    def __repr__(self) -> str:
        return f"Vocab(size={self.size}, eos_id={self.eos_id})"

    @property
    def size(self) -> int:
        """V, the number of token ids (the width of every mask)."""
        return len(self.token_strings)

    @classmethod
    def from_tokenizer(cls, tok: Any, size: int | None = None) -> Vocab:
        """Read a tokenizer: transformers' (or labkit's wrapper), or one with the same methods."""
        eos = getattr(tok, "eos_id", None)  # labkit.loading.Tokenizer: eos_id, and .hf inside
        tok = getattr(tok, "hf", tok)
        eos = getattr(tok, "eos_token_id", None) if eos is None else eos
        if eos is None:
            raise ConstraintError(f"{type(tok).__name__} has no eos_token_id: EOS must be known")
        n_tok = len(tok) if hasattr(tok, "__len__") else tok.vocab_size
        size = n_tok if size is None else size  # size: the model's logits width, may be padded
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        special = set(getattr(tok, "all_special_ids", []) or [])
        special |= {i for i, t in added.items() if getattr(t, "special", False)}
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel" or hasattr(tok, "byte_decoder")
        pieces = tok.convert_ids_to_tokens(list(range(min(n_tok, size))))
        strings = []
        for i, piece in enumerate(pieces):
            text = None
            if i in special or piece is None:
                text = ""
            elif i in added:  # added tokens are stored as plain text, not byte-level
                text = added[i].content
            elif byte_level:
                text = _byte_level_text(piece)
            if text is None:  # not byte-level: decode alone; "\ufffd" means partial UTF-8
                text = tok.decode([i])
                text = "" if "\ufffd" in text else text
                if piece.startswith("▁") and not text.startswith(" "):
                    text = " " + text  # SentencePiece drops the word's space when decoding alone
            strings.append(text)
        strings += [""] * (size - len(strings))
        return cls(strings, int(eos))

    @cached_property
    def single_chars(self) -> frozenset[str]:
        """The characters that are a token by themselves."""
        return frozenset(s for i, s in enumerate(self.token_strings)
                         if len(s) == 1 and i != self.eos_id)

    def trie(self, alphabet: frozenset[str]) -> dict:
        """Trie of the tokens spelled only with `alphabet`: char -> child; "" -> token ids."""
        if alphabet not in self._tries:
            outside = re.compile("[^" + "".join(re.escape(c) for c in sorted(alphabet)) + "]")
            root: dict = {}
            for i, text in enumerate(self.token_strings):
                if not text or i == self.eos_id or outside.search(text):
                    continue
                node = root
                for ch in text:
                    node = node.setdefault(ch, {})
                node.setdefault("", []).append(i)
            self._tries[alphabet] = root
        return self._tries[alphabet]


# ---------------------------------------------------------------------------------- the lift


class Constraint(ABC):
    """A character automaton lifted to tokens; masks are cached per state."""

    alphabet: frozenset[str]  # every character the grammar can ever emit
    SEARCH_LIMIT = 100_000  # states one productivity search may expand (only odd vocabularies)
    CACHE_LIMIT = 200_000  # cached states before the caches start over (a box visits new states
    # with every request, since x_max's range depends on x_min; ~1 KB per state)

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._trie = vocab.trie(self.alphabet)
        self._steps: dict[tuple[State, str], State | None] = {}
        self._successors: dict[State, dict[int, State]] = {}  # state -> {token id: next state}
        self._productive: dict[State, bool] = {}
        self._relaxed: Constraint | None = None  # set by kinds whose states carry values
        self._allowed: dict[State, dict[int, State]] = {}
        self._masks: dict[State, torch.Tensor] = {}
        self._interned: dict[tuple[int, ...], torch.Tensor] = {}  # equal masks share storage
        # If every character the grammar uses is a token by itself, every live character state
        # can be completed one character at a time; otherwise search for a completion.
        self._always_productive = self.alphabet <= vocab.single_chars

    # -- the character automaton, one per kind

    @abstractmethod
    def _char_start(self) -> State:
        """The state before any character."""

    @abstractmethod
    def _char_step(self, state: State, ch: str) -> State | None:
        """The state after reading `ch`; None if no accepted text continues this way."""

    @abstractmethod
    def _next_chars(self, state: State) -> Iterable[str]:
        """A superset of the characters `_char_step` accepts in `state`."""

    @abstractmethod
    def is_accepting(self, state: State) -> bool:
        """Whether the text so far is a complete answer (EOS allowed)."""

    # -- the token level, shared

    def _check_satisfiable(self) -> None:
        """Raise now, before any decode step, if no token sequence satisfies the constraint."""
        if not self._is_productive(self.start()):
            raise ConstraintError(
                f"{self!r} cannot be satisfied with this vocabulary ({self.vocab!r}): no sequence "
                f"of its tokens spells an accepted text (is a needed character missing?)")

    def start(self) -> State:
        """The state before the first generated token."""
        return self._char_start()

    def _step(self, state: State, ch: str) -> State | None:
        key = (state, ch)
        if key not in self._steps:
            self._steps[key] = self._char_step(state, ch)
        return self._steps[key]

    def _walk(self, state: State) -> dict[int, State]:
        """Every token whose characters keep the automaton alive from `state`, to its end state."""
        if state not in self._successors:
            out: dict[int, State] = {}
            stack = [(self._trie, state)]  # depth-first over the trie, carrying the char state
            while stack:
                node, s = stack.pop()
                for ch in self._next_chars(s):
                    child = node.get(ch)
                    if child is None or (s2 := self._step(s, ch)) is None:
                        continue
                    for token_id in child.get("", ()):
                        out[token_id] = s2
                    stack.append((child, s2))
            self._successors[state] = out
        return self._successors[state]

    def _relax(self, state: State) -> State:
        """The matching state of `self._relaxed`, an automaton for a superset of the language."""
        return state

    def _is_productive(self, state: State) -> bool:
        """Whether some token sequence leads from `state` to acceptance (the states form a DAG)."""
        if self._always_productive:
            return True
        memo, stack, budget = self._productive, [state], self.SEARCH_LIMIT
        while stack:  # iterative depth-first search that stops at the first accepting path
            s = stack[-1]
            if s in memo:
                stack.pop()
                continue
            if self.is_accepting(s):
                memo[s] = True
                continue
            if self._relaxed is not None and not self._relaxed._is_productive(self._relax(s)):
                memo[s] = False  # not even the looser automaton gets there: prune the subtree
                continue
            budget -= 1
            if budget < 0:
                missing = "".join(sorted(self.alphabet - self.vocab.single_chars))
                raise ConstraintError(
                    f"{self!r}: gave up searching for a token sequence after {self.SEARCH_LIMIT} "
                    f"states; the vocabulary has no single-character token for {missing!r}")
            nexts = set(self._walk(s).values())
            if any(memo.get(n) for n in nexts):
                memo[s] = True
            elif pending := [n for n in nexts if n not in memo]:
                stack.append(pending[0])
            else:
                memo[s] = False
        return memo[state]

    def allowed(self, state: State) -> dict[int, State]:
        """Allowed non-EOS tokens in `state`, each mapped to the state it leads to."""
        if state not in self._allowed:
            self._allowed[state] = {
                t: n for t, n in self._walk(state).items() if self._is_productive(n)}
        return self._allowed[state]

    def mask(self, state: State) -> torch.Tensor:
        """Bool [V] of the tokens allowed next (cached; shared storage: do not modify)."""
        if state not in self._masks:
            if len(self._masks) >= self.CACHE_LIMIT:
                for cache in (self._steps, self._successors, self._allowed, self._masks,
                              self._interned):
                    cache.clear()
            ids = sorted(self.allowed(state))
            if self.is_accepting(state):
                ids.append(self.vocab.eos_id)
            key = tuple(ids)
            if key not in self._interned:
                m = np.zeros(self.vocab.size, dtype=np.bool_)  # m: [V]
                m[list(key)] = True
                # numpy, not torch.zeros: torch fills 49k elements on its thread pool, and on a
                # busy 2-core machine waking that pool costs milliseconds
                self._interned[key] = torch.from_numpy(m)
            self._masks[state] = self._interned[key]
        return self._masks[state]

    def advance(self, state: State, token_id: int) -> State:
        """The state after `token_id` (EOS keeps an accepting state); a disallowed token raises."""
        token_id = int(token_id)  # a 0-d tensor would hash by identity and never be found
        if token_id == self.vocab.eos_id and self.is_accepting(state):
            return state
        nxt = self.allowed(state).get(token_id)
        if nxt is None:
            text = self.vocab.token_strings[token_id] if 0 <= token_id < self.vocab.size else None
            what = "EOS before the answer is complete" if token_id == self.vocab.eos_id else (
                f"token {token_id} ({text!r}) cannot continue the answer here")
            raise ConstraintError(f"{self!r} in state {state!r}: {what}; sample from mask(state)")
        return nxt

    def is_done(self, state: State) -> bool:
        """Accepting with no way on but EOS: the answer is complete."""
        return self.is_accepting(state) and not self.allowed(state)


# ---------------------------------------------------------------------------------- choice


class Choice(Constraint):
    """The text is exactly one of `options`."""

    def __init__(self, vocab: Vocab, options: Sequence[str]) -> None:
        if isinstance(options, str) or not options:
            raise ConstraintError(f"choice needs a non-empty list of strings, got {options!r}")
        if not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(f"choice options must be non-empty strings, got {options!r}")
        self.options = tuple(dict.fromkeys(options))  # duplicates dropped, order kept
        self._next: dict[str, set[str]] = {}  # every prefix of an option -> chars that follow it
        for o in self.options:
            for k in range(len(o) + 1):
                self._next.setdefault(o[:k], set()).update(o[k:k + 1])
        self.alphabet = frozenset("".join(self.options))
        super().__init__(vocab)
        for o in self.options:  # name the option that cannot be spelled, not just "impossible"
            if not self._spellable(o):
                raise ConstraintError(
                    f"{self!r}: option {o!r} cannot be spelled with the tokens of {vocab!r}")

    def __repr__(self) -> str:
        return f"Choice({list(self.options)!r})"

    @property
    def max_text_len(self) -> int:
        """Characters in the longest complete answer."""
        return max(map(len, self.options))

    def _spellable(self, text: str) -> bool:
        """Whether `text` splits into allowed tokens (word break over the trie)."""
        reach = [True] + [False] * len(text)  # reach[k]: text[:k] is a sequence of tokens
        for k in range(len(text)):
            node = self._trie if reach[k] else None
            for j in range(k, len(text)):
                node = node.get(text[j]) if node is not None else None
                if node is None:
                    break
                reach[j + 1] |= bool(node.get(""))
        return reach[-1]

    def _char_start(self) -> State:
        return ""

    def _char_step(self, state: State, ch: str) -> State | None:
        return state + ch if ch in self._next.get(state, ()) else None

    def _next_chars(self, state: State) -> Iterable[str]:
        return self._next.get(state, ())

    def is_accepting(self, state: State) -> bool:
        """Whether the text so far is one of the options."""
        return state in self.options


# ---------------------------------------------------------------------------------- numbers

_NUMBER_PREFIX = re.compile(r"(-?)((?:0|[1-9][0-9]*)?)(\.?)([0-9]*)")
_NUMBER_CHARS = "-.0123456789"


def number_alive(prefix: str, lo: Decimal, hi: Decimal, decimals: int) -> bool:
    """Whether some number of the grammar that starts with `prefix` lies in [lo, hi]."""
    m = _NUMBER_PREFIX.fullmatch(prefix)
    if m is None:
        return False
    sign, whole, dot, frac = m.groups()
    if not sign and not whole and not dot:  # nothing read yet: a sign may still come
        return number_alive("-", lo, hi, decimals) or number_alive("0", lo, hi, decimals) or any(
            number_alive(d, lo, hi, decimals) for d in "123456789")
    if (dot and not whole) or (frac and not dot) or len(frac) > decimals:
        return False
    if dot and decimals == 0:
        return False
    with localcontext() as ctx:
        ctx.prec = 80  # exact for any range a person would write
        step = Decimal(1).scaleb(-decimals)  # the grid every number lies on
        low, high = (max(-hi, step), -lo) if sign else (max(lo, Decimal(0)), hi)  # |value|

        def hits(a: Decimal, b: Decimal) -> bool:  # a grid point in [a, b] and [low, high]?
            a, b = max(a, low), min(b, high)
            return a <= b and (a / step).to_integral_value(ROUND_CEILING) * step <= b

        if not whole:  # "-": any magnitude
            return hits(Decimal(0), high)
        if dot:  # whole.frac, more fraction digits to come
            base = Decimal(f"{whole}.{frac}" if frac else whole)
            return hits(base, base + Decimal(1).scaleb(-len(frac)) - step)
        if whole == "0":
            return hits(Decimal(0), 1 - step)
        n, scale = Decimal(whole), Decimal(1)  # more whole digits may follow: n*10^k...
        while n * scale <= high:
            if hits(n * scale, (n + 1) * scale - step):
                return True
            scale *= 10
        return False


def number_value(text: str, lo: Decimal, hi: Decimal, decimals: int) -> Decimal | None:
    """The value of `text` if it is a complete number of the grammar in [lo, hi], else None."""
    m = _NUMBER_PREFIX.fullmatch(text)
    if m is None:
        return None
    sign, whole, dot, frac = m.groups()
    if not whole or bool(dot) != bool(frac) or len(frac) > decimals:
        return None
    value = Decimal(text)
    if sign and value == 0 or not lo <= value <= hi:  # "-0.0" is not canonical
        return None
    return value


class _ObjState(NamedTuple):
    """Where a JSON-object constraint stands."""

    part: int  # index into the template: literal text or a number field
    text: str  # characters read so far within this part
    bounds: tuple[tuple[int, Decimal], ...]  # (field, value) of fields a later field must exceed


class _NumberObject(Constraint):
    """A JSON object of numbers with canonical spacing: the automaton behind Point and Box."""

    keys: tuple[str, ...]
    order: dict[int, int] = {}  # field -> the earlier field it must be >= to

    def __init__(self, vocab: Vocab, min: float, max: float, decimals: int, *,
                 ordered: bool = True) -> None:
        name = type(self).__name__
        self.order = type(self).order if ordered else {}
        for label, v in (("min", min), ("max", max)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConstraintError(f"{name}: {label} must be a finite number, got {v!r}")
        if isinstance(decimals, bool) or not isinstance(decimals, int) or decimals < 0:
            raise ConstraintError(f"{name}: decimals must be an int >= 0, got {decimals!r}")
        if min > max:
            raise ConstraintError(f"{name}: min ({min}) > max ({max})")
        self.min, self.max, self.decimals = min, max, decimals
        self._lo, self._hi = Decimal(repr(min)), Decimal(repr(max))
        if not number_alive("", self._lo, self._hi, decimals):
            raise ConstraintError(
                f"{self!r}: no number with at most {decimals} decimals lies in [{min}, {max}]")
        # template: literal, number, literal, number, ..., literal ('{"x": ', N, ', "y": ', N, '}')
        self.parts: list[str | int] = []
        for f, key in enumerate(self.keys):
            self.parts += [("{" if f == 0 else ", ") + json.dumps(key) + ": ", f]
        self.parts.append("}")
        literal = "".join(p for p in self.parts if isinstance(p, str))
        self.alphabet = frozenset(literal + _NUMBER_CHARS)
        super().__init__(vocab)
        if self.order:  # the same object without the order: a cheap, sound first test
            self._relaxed = type(self)(vocab, min, max, decimals, ordered=False)
        self._check_satisfiable()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min={self.min}, max={self.max}, decimals={self.decimals})"

    @property
    def max_text_len(self) -> int:
        """Characters in the longest complete answer: the literals plus the longest numbers."""
        whole = len(str(int(max(abs(self._lo), abs(self._hi)))))
        number = (self._lo < 0) + whole + (1 + self.decimals if self.decimals else 0)
        return sum(len(p) for p in self.parts if isinstance(p, str)) + len(self.keys) * number

    def _relax(self, state: State) -> State:
        return state._replace(bounds=())

    def _range(self, f: int, bounds: tuple[tuple[int, Decimal], ...]) -> tuple[Decimal, Decimal]:
        lo = dict(bounds).get(self.order.get(f), self._lo)
        return max(lo, self._lo), self._hi

    def _enter(self, part: int, bounds: tuple) -> _ObjState:
        return _ObjState(part, "", bounds)

    def _char_start(self) -> State:
        return self._enter(0, ())

    def _char_step(self, state: State, ch: str) -> State | None:
        part, text, bounds = state
        spec = self.parts[part]
        if isinstance(spec, str):  # literal: the next character must match exactly
            if text + ch != spec[:len(text) + 1]:
                return None
            done = len(text) + 1 == len(spec) and part + 1 < len(self.parts)
            return self._enter(part + 1, bounds) if done else _ObjState(part, text + ch, bounds)
        lo, hi = self._range(spec, bounds)
        if ch in _NUMBER_CHARS:
            return _ObjState(part, text + ch, bounds) if number_alive(
                text + ch, lo, hi, self.decimals) else None
        nxt = self.parts[part + 1]  # the number ends where the next literal starts
        value = number_value(text, lo, hi, self.decimals)
        if ch != nxt[0] or value is None:
            return None
        if spec in self.order.values():  # a later field is bounded below by this one
            bounds = (*bounds, (spec, value))
        bounds = tuple((f, v) for f, v in bounds if any(  # forget bounds no later field needs
            g > spec and self.order.get(g) == f for g in range(len(self.keys))))
        return self._char_step(self._enter(part + 1, bounds), ch)

    def _next_chars(self, state: State) -> Iterable[str]:
        part, text, _ = state
        spec = self.parts[part]
        if isinstance(spec, str):
            return spec[len(text):len(text) + 1]
        return _NUMBER_CHARS + self.parts[part + 1][0]

    def is_accepting(self, state: State) -> bool:
        """Whether the closing brace has been read."""
        return state.part == len(self.parts) - 1 and state.text == self.parts[-1]


class Point(_NumberObject):
    """`{"x": X, "y": Y}` with X and Y in [min, max], at most `decimals` decimals."""

    keys = ("x", "y")


class Box(_NumberObject):
    """`{"x_min": …, "y_min": …, "x_max": …, "y_max": …}` in [min, max], min <= max per axis.

    `ordered=False` drops the x_min <= x_max and y_min <= y_max rule.
    """

    keys = ("x_min", "y_min", "x_max", "y_max")
    order = {2: 0, 3: 1}  # x_max >= x_min, y_max >= y_min


# ---------------------------------------------------------------------------------- parsing


def parse_constraint(spec: dict, vocab: Vocab) -> Constraint:
    """Build the constraint a JSONL request names, e.g. {"choice": ["yes", "no"]} (cached)."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConstraintError(
            f"a constraint is one of {{'choice': [...]}}, {{'point': {{...}}}}, "
            f"{{'box': {{...}}}}; got {spec!r}")
    ((kind, args),) = spec.items()
    try:
        key = json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"a constraint must be plain JSON, got {spec!r}: {e}") from None
    if key in vocab._parsed:  # requests with the same constraint share its mask cache
        return vocab._parsed[key]
    if kind == "choice":
        if not isinstance(args, list):
            raise ConstraintError(f"'choice' takes a list of strings, got {args!r}")
        made: Constraint = Choice(vocab, args)
    elif kind in ("point", "box"):
        if not isinstance(args, dict) or set(args) != {"min", "max", "decimals"}:
            raise ConstraintError(
                f"'{kind}' takes exactly {{'min': ..., 'max': ..., 'decimals': ...}}, got {args!r}")
        made = (Point if kind == "point" else Box)(vocab, args["min"], args["max"],
                                                    args["decimals"])
    else:
        raise ConstraintError(f"unknown constraint kind {kind!r}; known: choice, point, box")
    vocab._parsed[key] = made
    return made

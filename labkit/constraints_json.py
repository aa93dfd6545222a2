"""Point and box constraints (JSON objects of numbers, as character automata), and the JSON spec
a request names its constraint by (`parse_constraint`).

`Point` spells `{"x": 0.412, "y": 0.078}` and `Box` spells
`{"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6}`. Both are one template, literal text
and number fields in turn, read one character at a time; `labkit.constraints.Constraint` lifts
the automaton to tokens.

Objects are written with canonical spacing only (one space after each colon and each comma, none
elsewhere) and keys in the order shown. A number is `-?(0|[1-9][0-9]*)(\\.[0-9]{1,decimals})?`
with its value in [min, max]; `-0` (negative zero, in any spelling) is not allowed. Every such
text is valid JSON. A box also needs x_min <= x_max and y_min <= y_max (a box with its corners
swapped is not a box), so its state carries the values a later field must not fall below.

Whether a half-read number can still end in range (`number_alive`) is decided exactly, with
decimal arithmetic on the grid of allowed values, never by trying every number.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from decimal import ROUND_CEILING, Decimal, localcontext
from typing import NamedTuple

from labkit.constraints import Choice, Constraint, State
from labkit.vocab import ConstraintError, Vocab

# ---------------------------------------------------------------------------------- numbers

_NUMBER_PREFIX = re.compile(r"(-?)((?:0|[1-9][0-9]*)?)(\.?)([0-9]*)")
_NUMBER_CHARS = "-.0123456789"
EXACT_DIGITS = 60  # digits of a number (whole + decimals) that `number_alive` keeps exact
builtins_max = max  # the constructors below name a parameter `max`


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
        digits = len(str(int(builtins_max(abs(self._lo), abs(self._hi))))) + decimals
        if digits > EXACT_DIGITS:  # beyond it the grid arithmetic rounds, or overflows
            raise ConstraintError(
                f"{name}: numbers up to {builtins_max(abs(min), abs(max))} with {decimals} "
                f"decimals need {digits} digits; at most {EXACT_DIGITS} are computed exactly")
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

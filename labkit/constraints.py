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

This module holds the lift and `Choice`. The numeric kinds, their canonical spelling, their
number grammar and `parse_constraint` (a request's JSON spec to a constraint) live in
`labkit.constraints_json`; the token strings and their tries in `labkit.vocab`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from labkit.vocab import ConstraintError, Vocab

State = Hashable  # opaque to the decoders: start() makes one, advance() makes the next


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

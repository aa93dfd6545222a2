"""The vocabulary as a constrained decoder sees it: the text each token id adds to the output.

A tokenizer stores its pieces in its own spelling: GPT-2's byte-level alphabet writes a space as
"Ġ", SentencePiece writes it as "▁", and a piece may be half of a multi-byte UTF-8 character.
`Vocab.from_tokenizer` turns every id into plain text once, "" for an id that is never allowed
(special tokens, partial characters), and EOS is kept apart. A constraint then asks for a trie of
only the tokens spelled with its alphabet (`Vocab.trie`), built once per alphabet and shared by
every constraint that uses it: for a JSON point that is a few hundred of SmolLM2's 49,152
tokens, and the only ones `labkit.constraints` ever walks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


class ConstraintError(ValueError):
    """A constraint spec is malformed, cannot be satisfied, or a token broke it (raised by
    every constrained-decoding module; it lives here, in the lowest of them)."""


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
        eos = getattr(tok, "eos_id", None)  # labkit.tokenizer.Tokenizer: eos_id, and .hf inside
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

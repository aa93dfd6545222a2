"""Stop strings over streamed text: cut at the first one, never emitting part of one.

An API request may say `stop: ["\\n\\n", "User:"]`: the answer ends just before the first place
where any of those strings begins. The engine stops on token ids; a stop *string* is a matter
of text, and a streamed answer arrives in pieces that need not line up with it ("Us" in one
piece, "er:" in the next). So `StopText` holds back the tail of the text that could still
grow into a stop string, and releases it once it cannot. What it emits, piece by piece, is
exactly the whole text cut at its first stop string: a client never sees half of one.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Cuts streamed text before the first of some stop strings; `push` each piece in order."""

    def __init__(self, stops: Sequence[str]):
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"a stop string must be a string, got {s!r}")
            if not s:
                raise ValueError("a stop string must not be empty (it would match at once)")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""  # the text's tail that may be the start of a stop string

    def push(self, piece: str) -> tuple[str, bool]:
        """Add the next piece; return (the text now safe to emit, whether a stop string came)."""
        if self.stopped:
            return "", True
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:  # the earliest start wins, whichever string it is
            self.stopped, self._held = True, ""
            return text[:min(hits)], True
        keep = self._open_tail(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The text held back, at the end of the stream (nothing once a stop string came)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _open_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with (0 if none)."""
        longest = max((len(s) for s in self.stops), default=1) - 1  # a whole one was found
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[len(text) - k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

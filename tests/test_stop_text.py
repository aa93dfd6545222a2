"""Stop strings over streamed text: `StopText` against a whole-text reference."""

import random

import pytest

from labkit.stop_text import StopText


def cut_at_first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: the text before the earliest place any stop string starts."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def stream(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """What StopText emits for `pieces` (flushed at the end if no stop string came)."""
    matcher, out = StopText(stops), []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


@pytest.mark.parametrize("pieces, stops, want", [
    (["Hello", " wor", "ld. Bye"], ["world"], "Hello "),  # split across pieces
    (["ab", "c"], ["bc"], "a"),
    (["a", "a", "a", "b", "zz"], ["aab"], "a"),  # overlapping prefixes: "aa" then "aab"
    (["xab"], ["b", "ab"], "x"),  # the earliest start wins, not the first listed
    (["日本", "語の", "文"], ["語の"], "日本"),  # unicode
    (["no stop ", "here"], ["STOP"], "no stop here"),
    (["end with a pre", "fix S"], ["STOP"], "end with a prefix S"),  # held, then released
])
def test_stop_text_cuts_before_the_stop_string(pieces, stops, want):
    out, stopped = stream(pieces, stops)
    assert "".join(out) == want, f"emitted {out!r}, want {want!r}"
    assert stopped == cut_at_first_stop("".join(pieces), stops)[1]


def test_stop_text_never_emits_part_of_a_stop_string():
    matcher = StopText(["</s>"])
    assert matcher.push("text<") == ("text", False), "'<' may start '</s>': hold it back"
    assert matcher.push("/") == ("", False)
    assert matcher.push("x") == ("</x", False), "'</x' cannot start '</s>': release it"
    assert matcher.push("</s") == ("", False)
    assert matcher.push(">more") == ("", True)
    assert matcher.push("after") == ("", True), "nothing comes out after the stop"
    assert matcher.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_stop_text_equals_the_whole_text_reference_on_random_pieces(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abé日 ") for _ in range(60))
    stops = [text[i:i + rng.randint(1, 4)] if rng.random() < 0.7 else "zz"
             for i in (rng.randrange(50) for _ in range(rng.randint(1, 4)))]
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, stopped = stream(pieces, stops)
    assert ("".join(out), stopped) == cut_at_first_stop(text, stops), (
        f"pieces {pieces!r}, stops {stops!r}")


@pytest.mark.parametrize("stops, words", [
    ([""], "empty"),
    (["ok", 3], "string"),
])
def test_stop_text_refuses_what_is_not_a_stop_string(stops, words):
    with pytest.raises(ValueError, match=words):
        StopText(stops)

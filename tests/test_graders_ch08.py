"""The chapter-08 graders, tested by the wrong answers they must reject."""

import pytest

from labkit.bench.ablation import predict_wall
from labkit.graders import check
from labkit.serving.server import relay


def rejects(name, fn, *words):
    with pytest.raises(AssertionError) as info:
        check.grade(name, fn)
    message = str(info.value)
    for w in words:
        assert w in message, f"{name}: message does not name {w!r}: {message}"


def test_the_solutions_pass():
    assert "overlaps" in check.grade("predict_wall", predict_wall)
    assert "cancels once" in check.grade("relay", relay)


# -- predict_wall ------------------------------------------------------------------------------

def wall_always_adds(steps, tokens, a, b, h, pipelined, fixed_scale=1.0):
    return steps * h + steps * a * fixed_scale + tokens * b


def wall_always_overlaps(steps, tokens, a, b, h, pipelined, fixed_scale=1.0):
    return max(steps * h, steps * a * fixed_scale + tokens * b)


def wall_scales_everything(steps, tokens, a, b, h, pipelined, fixed_scale=1.0):
    dev = (steps * a + tokens * b) * fixed_scale
    return max(steps * h, dev) if pipelined else steps * h + dev


def wall_no_scale(steps, tokens, a, b, h, pipelined, fixed_scale=1.0):
    dev = steps * a + tokens * b
    return max(steps * h, dev) if pipelined else steps * h + dev


def wall_per_step_tokens(steps, tokens, a, b, h, pipelined, fixed_scale=1.0):
    dev = steps * (a * fixed_scale + tokens * b)  # tokens read as per launch
    return max(steps * h, dev) if pipelined else steps * h + dev


@pytest.mark.parametrize("fn, words", [
    (wall_always_adds, ["pipelined loop overlaps"]),
    (wall_always_overlaps, ["blocking loop waits"]),
    (wall_scales_everything, ["only a is scaled"]),
    (wall_no_scale, ["ignores fixed_scale"]),
    (wall_per_step_tokens, ["want"]),
])
def test_predict_wall_rejects(fn, words):
    rejects("predict_wall", fn, *words)


# -- relay -------------------------------------------------------------------------------------

def relay_never_cancels(next_event, is_disconnected, cancel, poll_s=0.25):
    pieces = []
    while True:
        ev = next_event(poll_s)
        if ev is None:
            if is_disconnected():
                return None
            continue
        if ev[0] == "text":
            pieces.append(ev[1])
        else:
            return pieces, ev[1]


def relay_cancels_at_the_end(next_event, is_disconnected, cancel, poll_s=0.25):
    out = relay(next_event, is_disconnected, lambda: None, poll_s)
    if is_disconnected():  # the client left: cancel, even if the request had finished
        cancel()
    return out


def relay_never_checks(next_event, is_disconnected, cancel, poll_s=0.25):
    pieces = []
    while True:
        ev = next_event(poll_s)
        if ev is None:
            continue
        if ev[0] == "text":
            pieces.append(ev[1])
        else:
            return pieces, ev[1]


def relay_cancels_on_quiet(next_event, is_disconnected, cancel, poll_s=0.25):
    pieces = []
    while True:
        ev = next_event(poll_s)
        if ev is None:  # a quiet moment taken for a disconnect
            cancel()
            if is_disconnected():
                return None
            continue
        if ev[0] == "text":
            pieces.append(ev[1])
        else:
            return pieces, ev[1]


def relay_checks_only_when_idle(next_event, is_disconnected, cancel, poll_s=0.25):
    pieces = []  # the chapter's own bug: while tokens flow nothing is quiet, nobody asks
    while True:
        ev = next_event(poll_s)
        if ev is None:
            if is_disconnected():
                cancel()
                return None
            continue
        if ev[0] == "text":
            pieces.append(ev[1])
        else:
            return pieces, ev[1]


def relay_checks_before_done(next_event, is_disconnected, cancel, poll_s=0.25):
    pieces = []
    while True:
        ev = next_event(poll_s)
        if is_disconnected():  # asked before looking at the event: a finished one is cancelled
            cancel()
            return None
        if ev is not None and ev[0] == "text":
            pieces.append(ev[1])
        elif ev is not None:
            return pieces, ev[1]


@pytest.mark.parametrize("fn, words", [
    (relay_checks_only_when_idle, ["only when idle"]),
    (relay_checks_before_done, ["already finished", "double free"]),
    (relay_never_cancels, ["without cancelling"]),
    (relay_cancels_at_the_end, ["already finished", "double free"]),
    (relay_never_checks, ["kept waiting"]),
    (relay_cancels_on_quiet, ["client stayed"]),
])
def test_relay_rejects(fn, words):
    rejects("relay", fn, *words)

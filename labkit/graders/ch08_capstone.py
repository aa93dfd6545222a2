"""Chapter 08's graders: the whole engine's wall-time model and the server's relay."""

from __future__ import annotations

import math
from collections.abc import Callable


def _ref_predict_wall(steps, tokens, a, b, h, pipelined, fixed_scale=1.0) -> float:
    device = steps * a * fixed_scale + tokens * b
    return max(steps * h, device) if pipelined else steps * h + device


def grade_predict_wall(fn: Callable) -> str:
    """Grade an answer to exercise `predict_wall` (exercises/ch08_capstone.py)."""
    cases = [  # (steps, tokens, a, b, h, pipelined, fixed_scale): device-bound, host-bound
        (50, 400, 8e-3, 2e-4, 1e-3, False, 1.0), (50, 400, 8e-3, 2e-4, 1e-3, True, 1.0),
        (40, 40, 1e-3, 1e-5, 5e-3, True, 1.0), (40, 40, 1e-3, 1e-5, 5e-3, False, 1.0),
        (30, 900, 6e-3, 1e-4, 2e-3, True, 4.0), (30, 900, 6e-3, 1e-4, 2e-3, False, 3.5),
    ]
    for c in cases:
        steps, tokens, a, b, h, pipelined, scale = c
        got, want = float(fn(*c)), _ref_predict_wall(*c)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        loop = "pipelined" if pipelined else "blocking"
        host, dev = steps * h, steps * a * scale + tokens * b
        if pipelined and math.isclose(got, host + dev, rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s is host + device: the "
                                 "pipelined loop overlaps them, max(host, device)")
        if not pipelined and math.isclose(got, max(host, dev), rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s is max(host, device): the "
                                 "blocking loop waits for each, host + device")
        if math.isclose(got, _ref_predict_wall(steps, tokens, a * scale, b * scale, h,
                                               pipelined), rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s scales the per-token cost by "
                                 "fixed_scale too: the weight bytes are read once per launch, "
                                 "so only a is scaled")
        if math.isclose(got, _ref_predict_wall(steps, tokens, a, b, h, pipelined),
                        rel_tol=1e-9):
            raise AssertionError(f"predict_wall{c}: {got:.4g} s ignores fixed_scale ({scale}): "
                                 "fp32 weights take that many times the bytes of quantized ones")
        raise AssertionError(f"predict_wall{c} ({loop}): got {got:.6g} s, want {want:.6g} s "
                             f"(host {host:.4g} s, device {dev:.4g} s)")
    return "blocking adds host and device, pipelined overlaps them; weight bytes scale a only"


def _relay_trial(fn: Callable, script: list, leave_after: int | None) -> tuple:
    """Run `fn` against scripted events; the client leaves after `leave_after` polls."""
    events, polls, cancels = list(script), [0], []

    def next_event(timeout):
        polls[0] += 1
        if polls[0] > 200:
            raise AssertionError("relay kept waiting after its client had left (200 quiet "
                                 "polls): check is_disconnected() whenever nothing arrives")
        return events.pop(0) if events else None

    def is_disconnected():
        return leave_after is not None and polls[0] >= leave_after

    def cancel():
        cancels.append(polls[0])

    out = fn(next_event, is_disconnected, cancel)
    return out, cancels


def grade_relay(fn: Callable) -> str:
    """Grade an answer to exercise `relay` (exercises/ch08_capstone.py)."""
    done = object()
    script = [("text", "Hel"), None, ("text", "lo"), ("done", done)]
    out, cancels = _relay_trial(fn, script, leave_after=None)
    if cancels:
        raise AssertionError("relay cancelled a request whose client stayed: only a client "
                             "that has gone cancels")
    if out is None or list(out[0]) != ["Hel", "lo"] or out[1] is not done:
        raise AssertionError(f"relay returned {out!r} for text 'Hel', 'lo' then done: want "
                             "(['Hel', 'lo'], the done event's value)")
    # the client leaves after the request finished: nothing to cancel (a double free on abort)
    out, cancels = _relay_trial(fn, [("text", "a"), ("done", done), None, None], leave_after=2)
    if cancels:
        raise AssertionError("relay cancelled a request that had already finished: the engine "
                             "has released it, and a cancel now frees its pages twice (the "
                             "double free on abort)")
    # the client leaves mid-answer
    out, cancels = _relay_trial(fn, [("text", "a"), None, None, None], leave_after=3)
    if not cancels:
        raise AssertionError("relay returned without cancelling when its client left: the "
                             "request runs on to max_tokens, holding its KV pages for nobody")
    if len(cancels) > 1:
        raise AssertionError(f"relay cancelled {len(cancels)} times: once is enough")
    if out is not None:
        raise AssertionError(f"relay returned {out!r} after its client left: return None")
    # the client leaves while the text keeps coming: a stream that flows is never quiet
    flowing = [("text", str(i)) for i in range(60)] + [("done", done)]
    out, cancels = _relay_trial(fn, flowing, leave_after=3)
    if not cancels:
        raise AssertionError("relay let the request run to its end after its client left "
                             "while text kept coming: it asks is_disconnected() only when idle, "
                             "and while tokens flow nothing is ever quiet. Ask after every "
                             "piece too")
    if len(cancels) > 1 or out is not None:
        raise AssertionError(f"relay cancelled {len(cancels)} times and returned {out!r} when "
                             "its client left mid-stream: cancel once, return None")
    return ("collects text until done; a client that leaves cancels once, even mid-stream, "
            "a finished one never")

"""Chapter 08's graders: the whole engine's wall-time model and the server's relay."""

from __future__ import annotations

import math
from collections.abc import Callable

from labkit.graders.common import only_hint


def _ref_predict_wall(steps, tokens, a, b, h, pipelined, fixed_scale=1.0) -> float:
    device = steps * a * fixed_scale + tokens * b
    return max(steps * h, device) if pipelined else steps * h + device


def grade_predict_wall(fn: Callable) -> str:
    """Grade an answer to exercise `predict_wall` (exercises/ch08_capstone.py).

    A mistake is named only when it, and no other, gives the answer's result in every case: a
    value that one case happens to share with a mistake is a coincidence, not a diagnosis.
    """
    cases = [  # (steps, tokens, a, b, h, pipelined, fixed_scale): device-bound, host-bound
        (50, 400, 8e-3, 2e-4, 1e-3, False, 1.0), (50, 400, 8e-3, 2e-4, 1e-3, True, 1.0),
        (40, 40, 1e-3, 1e-5, 5e-3, True, 1.0), (40, 40, 1e-3, 1e-5, 5e-3, False, 1.0),
        (30, 900, 6e-3, 1e-4, 2e-3, True, 4.0), (30, 900, 6e-3, 1e-4, 2e-3, False, 3.5),
    ]

    def same(x: float, y: float) -> bool:
        return math.isclose(x, y, rel_tol=1e-9)

    results = []  # every case, right or wrong: a mistake must reproduce all of them
    for c in cases:
        steps, tokens, a, b, h, pipelined, scale = c
        got, want = float(fn(*c)), _ref_predict_wall(*c)
        host, dev = steps * h, steps * a * scale + tokens * b
        added, overlapped = host + dev, max(host, dev)
        mistakes = {  # what each known mistake gives in this case
            "host + device for the pipelined loop: the pipelined loop overlaps them, "
            "max(host, device)": added,
            "max(host, device) for the blocking loop: the blocking loop waits for each, "
            "host + device": overlapped,
            "the two loops are swapped: blocking adds host and device (it waits for each), "
            "pipelined overlaps them (max)": overlapped if not pipelined else added,
            "fixed_scale scales the per-token cost too: the weight bytes are read once per "
            "launch, so only a is scaled": _ref_predict_wall(steps, tokens, a * scale,
                                                             b * scale, h, pipelined),
            "it ignores fixed_scale: fp32 weights take that many times the bytes of quantized "
            "ones, so a launch reads a * fixed_scale": _ref_predict_wall(steps, tokens, a, b, h,
                                                                          pipelined),
            "fixed_scale scales the host's work h: it scales the weight bytes, a":
                _ref_predict_wall(steps, tokens, a, b, h * scale, pipelined),
        }
        results.append((c, got, want, host, dev, {m: same(got, v) for m, v in mistakes.items()}))
    failing = [r for r in results if not same(r[1], r[2])]
    if not failing:
        return "blocking adds host and device, pipelined overlaps them; weight bytes scale a only"
    c, got, want, host, dev, _ = failing[0]
    hint = only_hint([named for *_, named in results])
    loop = "pipelined" if c[5] else "blocking"
    more = f" ({len(failing)} of {len(cases)} cases wrong)"
    raise AssertionError(f"predict_wall{c} ({loop}): got {got:.6g} s, want {want:.6g} s (host "
                         f"{host:.4g} s, device {dev:.4g} s){more}" + (f": {hint}" if hint else ""))


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

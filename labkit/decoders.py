"""Which decode loop runs an engine: `run(engine, "blocking" | "pipelined")`.

The two loops are built from the same engine pieces and emit the same tokens; they differ only
in when the host waits (see `labkit.decode_blocking` and `labkit.decode_pipelined`). This module
sits above both and above the engine, so that the engine never imports a loop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

from labkit.decode_blocking import run_blocking
from labkit.decode_pipelined import run_pipelined
from labkit.engine import Engine

DECODERS: dict[str, Callable[[Engine, int | None], None]] = {
    "blocking": run_blocking, "pipelined": run_pipelined}


def run(engine: Engine, decoder: str = "blocking", max_steps: int | None = None) -> None:
    """Run `decoder` until every request has finished.

    `max_steps`: return (with nothing in flight) after about that many launches instead, so
    that decoders can take turns on one workload, as `bench decode` has them do.
    """
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(map(repr, DECODERS))}, "
                         f"got {decoder!r}")
    with engine.device.host_thread(), deferred_interrupts(engine):
        DECODERS[decoder](engine, max_steps)  # the host's loop keeps off the device's core


@contextlib.contextmanager
def deferred_interrupts(engine: Engine):
    """Ctrl-C during a run is raised between steps, never inside a half-committed step.

    The first SIGINT only marks the engine (`interrupt_pending`); the loop raises
    KeyboardInterrupt at its next `between_steps`, and the loop's `finally` settles the step
    in flight. A second SIGINT raises at once (a way out of a device that hangs), which is safe
    where the host spends its time: waiting for a copy. Only in the main thread; whatever
    handler was in place (Python's, Jupyter's) is restored afterwards.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield  # not ours to defer: SIGINT ignored or left to the OS
        return

    def handler(signum, frame):
        if engine.interrupt_pending:
            raise KeyboardInterrupt
        engine.interrupt_pending = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    except BaseException:
        engine.interrupt_pending = False  # the run ends with this error; a Ctrl-C is moot
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if engine.interrupt_pending:  # it came after the last step: still the caller's Ctrl-C
        engine.interrupt_pending = False
        raise KeyboardInterrupt

"""Which decode loop runs an engine: `run(engine, "blocking" | "pipelined")`.

The two loops are built from the same engine pieces and emit the same tokens; they differ only
in when the host waits (see `labkit.decode_blocking` and `labkit.decode_pipelined`). This module
sits above both and above the engine, so that the engine never imports a loop.
"""

from __future__ import annotations

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
    with engine.device.host_thread():  # the host's loop keeps off the device's core
        DECODERS[decoder](engine, max_steps)

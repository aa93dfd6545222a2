"""The blocking decode loop: every step waits for its tokens before the next one starts.

Each iteration plans one launch (decode rows of every running sequence plus prefill chunks of
admitted ones, under the step's token budget), then takes it plan -> launch -> sample -> copy
-> wait -> commit. While the host
waits, then commits (reads tokens, detokenizes, checks stop conditions, plans the next step),
the device has nothing queued: that idle gap is the GPU bubble that `decode_pipelined` removes.
"""

from __future__ import annotations

from labkit.engine import Engine, Launch


def step_blocking(engine: Engine, launch: Launch) -> None:
    """Launch one step and see it all the way through its commit."""
    engine.launch(launch, slot=0)
    engine.finish_sampling(launch)
    tokens = engine.wait_tokens(launch)  # the device idles from here...
    engine.commit(launch, tokens)  # ...to the next launch: the bubble


def run_blocking(engine: Engine, max_steps: int | None = None) -> None:
    """Run until every request has finished (or until `max_steps` launches have run).

    On any exception (an interrupt, a callback that raises, a device error) the step in flight
    is finished or discarded before the exception propagates (`Engine.settle`), so the engine
    stays usable and a later run goes on with the same tokens.
    """
    sched = engine.scheduler
    launched = 0
    current: Launch | None = None  # the step between its plan and its commit
    try:
        while max_steps is None or launched < max_steps:
            engine.between_steps()
            if sched.idle():
                return
            current = engine.plan_step()
            if current is None:  # requests, but nothing to launch and nothing in flight
                raise engine.stuck()
            step_blocking(engine, current)
            launched += 1
    finally:
        engine.settle(current)

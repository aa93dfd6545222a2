"""The blocking decode loop: every step waits for its tokens before the next one starts.

Each iteration: admit new requests and prefill them, then one decode step for every live
sequence, each launch going plan -> launch -> sample -> copy -> wait -> commit. While the host
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
    """Run until every request has finished (or until `max_steps` launches have run)."""
    sched = engine.scheduler
    launched = 0
    while max_steps is None or launched < max_steps:
        engine.between_steps()
        if sched.idle():
            return
        admitted = sched.admit()
        if admitted:
            step_blocking(engine, engine.plan_prefill(admitted))
            launched += 1
        live = sched.live()
        if live:
            step_blocking(engine, engine.plan_decode(live))
            launched += 1
        elif not admitted and sched.waiting and not sched.running:
            raise RuntimeError("scheduler stuck: requests wait but nothing runs "
                               "(a request larger than the pool was not refused at submit)")

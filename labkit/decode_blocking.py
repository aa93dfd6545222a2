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
    """Run until every request has finished (or until `max_steps` launches have run)."""
    sched = engine.scheduler
    launched = 0
    while max_steps is None or launched < max_steps:
        engine.between_steps()
        if sched.idle():
            return
        launch = engine.plan_step()
        if launch is None:  # nothing is in flight here, so nothing would ever change
            raise RuntimeError("scheduler stuck: requests wait but nothing runs "
                               "(a request larger than the pool was not refused at submit)")
        step_blocking(engine, launch)
        launched += 1

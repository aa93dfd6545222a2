"""The pipelined decode loop: launch step t+1 before committing step t (after Moondream Photon).

In the blocking loop the device idles while the host commits a step. Here each iteration does:

1. **launch t+1** — its forward reads the tokens of step t from the device's `last_tokens`, so it
   needs nothing from the host and goes straight onto the compute stream;
2. **commit t** — wait for step t's tokens (copied device-to-host on the copy stream into slot
   t's host buffer), append them, detokenize, check stop conditions, release what is done;
3. **finish sampling t+1** — build constrained-decoding masks from the state commit t just
   produced, sample on the device into slot t+1, and start its copy.

While the host commits t, the device computes t+1: the bubble is filled. Two decode slots
(ping-pong) hold the per-step buffers, so step t+1 never overwrites what the host still reads
of step t. A sequence that ends at commit t is already in step t+1: a *zombie*. Its row there is
skipped at commit, and its KV pages, device row and adapter slot return only when no launched
step references it (`finalized and inflight_refs == 0`, see labkit/sequence.py). Prefill of
newly admitted requests rides in the same launches (mixed steps), chunk by chunk.

Step t+1 is planned before commit t, so a sequence whose row in step t emits a token is one
token further on than its `output_ids` say: the scheduler counts it in `seq.pending`, and its
row in step t+1 reads that token on the device. The pages step t+1 writes, that pending
position included, are allocated when it is planned.

Speculative decoding is refused here: a verify row's next row starts after however many
tokens the target accepted, known only at its commit, but step t+1 is planned before commit t.
"""

from __future__ import annotations

from labkit.device import NUM_SLOTS
from labkit.engine import Engine, Launch
from labkit.scheduler import RequestError


def run_pipelined(engine: Engine, max_steps: int | None = None) -> None:
    """Run until every request has finished, one step always in flight.

    With `max_steps`, stop launching after that many launches and return once the last one is
    committed: nothing is left in flight, and any decoder can carry on from there.
    """
    sched = engine.scheduler
    speculative = [s.request_id for s in (*sched.waiting, *sched.running)
                   if s.params.speculative is not None and not s.finalized]
    if speculative:
        raise RequestError(
            f"requests {speculative[:8]} ask for speculative decoding, which runs on the "
            "blocking decoder: the pipelined one plans step t+1 before commit t knows how many "
            "drafted tokens step t accepted (so where step t+1 starts)")
    occupant: list[Launch | None] = [None] * NUM_SLOTS  # the uncommitted launch in each slot
    prev: Launch | None = None
    nxt: Launch | None = None
    slot = 0
    launched = 0
    try:
        while True:
            engine.between_steps()
            more = max_steps is None or launched < max_steps
            if prev is None and (sched.idle() or not more):
                return
            nxt = engine.plan_step(speculate=False) if more else None
            if nxt is not None:  # 1. launch t+1
                launched += 1
                slot = 1 - prev.slot if prev is not None else slot
                assert occupant[slot] is None, (
                    f"slot {slot} reused by step {nxt.plan.step} while step "
                    f"{occupant[slot].plan.step} is uncommitted")  # ping-pong: impossible
                occupant[slot] = nxt
                engine.launch(nxt, slot)
            if prev is not None:  # 2. commit t
                tokens = engine.wait_tokens(prev)
                engine.commit(prev, tokens)
                occupant[prev.slot] = None
            if nxt is not None:  # 3. finish sampling t+1 with masks from commit t's state
                engine.finish_sampling(nxt)
            elif prev is None:  # requests, but nothing to launch and nothing in flight
                raise engine.stuck()
            prev = nxt
    finally:  # an exception: finish (or discard) steps t and t+1, in order, then propagate
        engine.settle(prev, nxt)

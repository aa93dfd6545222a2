"""Chapter 07 exercises: the two rules that make a pipelined decoder safe. Fill in each function,
then run `make grade` (or the check cell in notebooks/07_pipelined_decoder.ipynb). The graders
are the same tests that check labkit's own solutions.

Both functions take a *sequence-like* object: anything with the attributes the docstring names
(the graders pass `types.SimpleNamespace` objects; labkit passes its `Sequence`)."""


def commit_row(seq, token: int) -> bool:
    """Apply one row of a committed step to its sequence: the zombie rule.

    `seq` has `finalized` (bool), `inflight_refs` (int), `output_ids` (list of int) and
    `zombie_rows` (int). `token` is what the step sampled for this row.

    - The step being committed no longer references the sequence: decrease `inflight_refs` by
      one for *every* row, zombie or not (otherwise a zombie's pages never come back).
    - If the sequence is already `finalized` (it ended at an earlier commit, but the step being
      committed was launched before that commit knew it), this row is a zombie: append
      nothing, add one to `seq.zombie_rows`, return False.
    - Otherwise append `token` to `seq.output_ids` and return True.

    Do not decide here whether the sequence ends (the caller checks EOS and the length cap after
    a True) and do not change `finalized`. labkit's version: the loop body of `Engine.commit` in
    labkit/engine.py.
    """
    raise NotImplementedError("commit_row: see the docstring for the task")


def can_release(seq) -> bool:
    """Return whether a sequence's resources (KV pages, device row, adapter slot) may go back
    to their pools now: the release rule.

    `seq` has `finalized` (bool), `inflight_refs` (int) and `released` (bool). Resources return
    exactly once, and only when nothing can still touch them: the sequence is finalized (it
    will never be launched again), no launched step still references it (its KV pages may still
    be written by a step in flight), and it has not been released already (a second release
    would put the same pages in the free list twice). Do not modify `seq`. labkit's version:
    `Sequence.can_release` in labkit/sequence.py.
    """
    raise NotImplementedError("can_release: see the docstring for the task")


def run_pipelined(engine) -> None:
    """Write the pipelined decode loop from the engine's step pieces; run until every request
    has finished, one step always in flight.

    Each iteration: call `engine.between_steps()`; stop when nothing is in flight and
    `engine.scheduler.idle()`. Then:

    1. **launch t+1**: `nxt = engine.plan_step()` (one launch: a decode row for every live
       sequence plus prefill chunks of new arrivals, under the step's token budget; None when
       nothing can run) and, if there is one,
       `engine.launch(nxt, slot)` into the slot step t is *not* using (0 for the first launch,
       then `1 - prev.slot`);
    2. **commit t**: if a step `prev` is in flight, `engine.commit(prev,
       engine.wait_tokens(prev))`;
    3. **finish sampling t+1**: `engine.finish_sampling(nxt)`, after commit t, so that
       constrained rows are masked with the state that commit produced.

    Then `prev = nxt`. The grader checks the tokens against the blocking loop, that step t+1
    is launched before step t's tokens are read, the slots, and when pages come back.
    labkit's version: labkit/decode_pipelined.py::run_pipelined.
    """
    raise NotImplementedError("run_pipelined: see the docstring for the task")

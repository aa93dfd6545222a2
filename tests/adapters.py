"""The one switch between labkit's solutions and a learner's exercises.

Every grader in tests/test_exercises.py calls only these functions. With `LABKIT_EXERCISES=1`
they call the stubs in `exercises/`; otherwise labkit's own solutions, which must pass.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

USE_EXERCISES = os.environ.get("LABKIT_EXERCISES") == "1"


def pick(module: str, name: str, solution: Callable) -> Callable:
    """The learner's `exercises/<module>.py::<name>` when grading exercises, else `solution`."""
    if USE_EXERCISES:
        return getattr(importlib.import_module(f"exercises.{module}"), name)
    return solution


def stub(module: str, name: str) -> Callable:
    """The untouched stub, for the test that checks stubs fail with a helpful message."""
    return getattr(importlib.import_module(f"exercises.{module}"), name)


def _labkit_commit_row(seq, token: int) -> bool:
    """labkit's zombie rule: the loop of `Engine.commit` run on a one-row launch.

    labkit has no per-row function yet, so this drives the real `Engine.commit` on a real
    `Sequence` in the same state, with a stand-in engine whose stop check never ends the
    sequence and whose scheduler releases nothing (the graders test the row rule alone).
    """
    from types import SimpleNamespace

    from labkit.engine import Engine
    from labkit.sampling import SamplingParams
    from labkit.sequence import Sequence

    real = Sequence(0, [0], SamplingParams(), max_new_tokens=1 << 30, finalized=seq.finalized,
                    inflight_refs=seq.inflight_refs, output_ids=list(seq.output_ids),
                    zombie_rows=seq.zombie_rows)
    host = SimpleNamespace(
        scheduler=SimpleNamespace(release_if_done=lambda s: False, finalize=lambda s, r: None),
        zombie_rows=0, eos_id=None, on_text=None, extra_host_work_s=0.0,
        _span=lambda *args: None, _stop_reason=lambda s, t: None)
    Engine.commit(host, SimpleNamespace(seqs=[real]), [token])
    seq.inflight_refs, seq.zombie_rows = real.inflight_refs, real.zombie_rows
    seq.output_ids[:] = real.output_ids
    return host.zombie_rows == 0


def _labkit_can_release(seq) -> bool:
    """labkit's release rule: `Sequence.can_release` of a Sequence in the same state."""
    from labkit.sampling import SamplingParams
    from labkit.sequence import Sequence

    return Sequence(0, [0], SamplingParams(), 1, finalized=seq.finalized,
                    inflight_refs=seq.inflight_refs, released=seq.released).can_release


def solutions() -> dict[str, Callable]:
    """Exercise name -> the function the graders check (learner's or labkit's)."""
    from labkit import model, roofline, sampling

    return {
        # chapter 00
        "rms_norm": pick("ch00_welcome", "rms_norm", model.rms_norm),
        "top_p_filter": pick("ch00_welcome", "top_p_filter", sampling.top_p_filter),
        # later chapters add their exercises below, one line each
        # chapter 01
        "matmul_intensity": pick("ch01_roofline", "matmul_intensity", roofline.matmul_intensity),
        "decode_step_flops": pick("ch01_roofline", "decode_step_flops",
                                  roofline.decode_step_flops),
        "decode_step_bytes": pick("ch01_roofline", "decode_step_bytes",
                                  roofline.decode_step_bytes),
        # chapter 07
        "commit_row": pick("ch07_pipelined", "commit_row", _labkit_commit_row),
        "can_release": pick("ch07_pipelined", "can_release", _labkit_can_release),
    }

"""Graders for the exercises: the same checks grade labkit's solutions and a learner's code.

A notebook cell calls `check.grade("rms_norm", my_rms_norm)`; the test suite calls every grader
on `tests/adapters.py`, which points at labkit's solutions, or at the learner's stubs in
`exercises/` when `LABKIT_EXERCISES=1`; `python -m labkit grade` (what `make grade` runs) prints
one line per exercise. The graders live in labkit/graders/, one module per chapter: each compares
against a small reference written there and, when the answer is wrong, says which part is off: a
hint names a known mistake only when that mistake, and no other, reproduces every wrong result.
tests/test_graders_reject.py lists the mistakes each grader must reject.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass

from labkit.graders import (
    ch00_welcome,
    ch01_roofline,
    ch02_batching,
    ch03_quantization,
    ch04_flash_attention,
    ch05_paged_attention,
    ch06_gpu_bubble,
    ch07_pipelined,
    ch08_capstone,
)


class ExerciseNotDone(AssertionError):
    """The learner's function still raises NotImplementedError."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: where its stub lives and the grader that checks any implementation."""

    name: str
    module: str  # the stub lives in exercises/<module>.py
    grader: Callable[[Callable], str]


# every exercise, in the order `make grade` lists them
EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (
    Exercise("rms_norm", "ch00_welcome", ch00_welcome.grade_rms_norm),
    Exercise("top_p_filter", "ch00_welcome", ch00_welcome.grade_top_p),
    Exercise("matmul_intensity", "ch01_roofline", ch01_roofline.grade_matmul_intensity),
    Exercise("decode_step_flops", "ch01_roofline", ch01_roofline.grade_decode_step_flops),
    Exercise("decode_step_bytes", "ch01_roofline", ch01_roofline.grade_decode_step_bytes),
    Exercise("admit_fcfs", "ch02_batching", ch02_batching.grade_admit_fcfs),
    Exercise("chunk_prefills", "ch02_batching", ch02_batching.grade_chunk_prefills),
    Exercise("latency_percentiles", "ch02_batching", ch02_batching.grade_latency_percentiles),
    Exercise("quantize_int8", "ch03_quantization", ch03_quantization.grade_quantize_int8),
    Exercise("dequantize_int8", "ch03_quantization", ch03_quantization.grade_dequantize_int8),
    Exercise("pack_int4", "ch03_quantization", ch03_quantization.grade_pack_int4),
    Exercise("unpack_int4", "ch03_quantization", ch03_quantization.grade_unpack_int4),
    Exercise("awq_scale", "ch03_quantization", ch03_quantization.grade_awq_scale),
    Exercise("online_softmax_update", "ch04_flash_attention",
             ch04_flash_attention.grade_online_softmax_update),
    Exercise("merge_partials", "ch04_flash_attention", ch04_flash_attention.grade_merge_partials),
    Exercise("tiled_attention", "ch04_flash_attention", ch04_flash_attention.grade_tiled_attention),
    Exercise("blocks_needed", "ch05_paged_attention", ch05_paged_attention.grade_blocks_needed),
    Exercise("translate", "ch05_paged_attention", ch05_paged_attention.grade_translate),
    Exercise("CowPages", "ch05_paged_attention", ch05_paged_attention.grade_cow_pages),
    Exercise("bubble_fraction", "ch06_gpu_bubble", ch06_gpu_bubble.grade_bubble_fraction),
    Exercise("cost_model", "ch06_gpu_bubble", ch06_gpu_bubble.grade_cost_model),
    Exercise("commit_row", "ch07_pipelined", ch07_pipelined.grade_commit_row),
    Exercise("can_release", "ch07_pipelined", ch07_pipelined.grade_can_release),
    Exercise("run_pipelined", "ch07_pipelined", ch07_pipelined.grade_run_pipelined),
    Exercise("predict_wall", "ch08_capstone", ch08_capstone.grade_predict_wall),
    Exercise("relay", "ch08_capstone", ch08_capstone.grade_relay),
)}


def grade(name: str, fn: Callable) -> str:
    """Grade `fn` as the answer to exercise `name`; returns a pass line, raises with a hint."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; known: {sorted(EXERCISES)}")
    try:
        message = EXERCISES[name].grader(fn)
    except NotImplementedError as err:
        task = inspect.getdoc(fn) or str(err)
        raise ExerciseNotDone(
            f"exercises/{EXERCISES[name].module}.py::{name} is not implemented yet.\n"
            f"The task:\n{task}") from None
    line = f"✓ {name}: {message}"
    print(line)
    return line


def grade_line(name: str, fn: Callable) -> str:
    """One line for `name`: ✓ and what passed, · not attempted, or ✗ and the grader's message."""
    try:
        return grade(name, fn)
    except ExerciseNotDone:
        return f"· {name}: not attempted (exercises/{EXERCISES[name].module}.py)"
    except Exception as err:  # a learner's bug is a grade, not a crash of the grading run
        text = " ".join(str(err).split())
        if not isinstance(err, AssertionError):
            text = f"raised {type(err).__name__}: {text}"
        return f"✗ {name}: {text}"


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit grade [NAME ...]`: grade the answers in exercises/, one line each."""
    names = list(argv or []) or list(EXERCISES)
    unknown = [n for n in names if n not in EXERCISES]
    if unknown:
        print(f"error: no exercise named {unknown[0]!r}; known: {', '.join(EXERCISES)}",
              file=sys.stderr)
        return 2
    lines = []
    for name in names:
        ex = EXERCISES[name]
        fn = getattr(importlib.import_module(f"exercises.{ex.module}"), name)
        with contextlib.redirect_stdout(io.StringIO()):  # grade() prints its pass line itself
            lines.append(grade_line(name, fn))
        print(lines[-1], flush=True)
    passed = sum(line.startswith("✓") for line in lines)
    todo = sum(line.startswith("·") for line in lines)
    print(f"{passed} passed, {len(lines) - passed - todo} wrong, {todo} not attempted")
    return 0 if passed + todo == len(lines) else 1

"""Graders for the exercises: the same checks grade labkit's solutions and a learner's code.

A notebook's check cell calls `check.grade_chapter("ch01_roofline")`: it reads
`exercises/ch01_roofline.py` of the notebook's own repository, as the file is saved now (no
kernel restart, and on a hub where many clones share one venv, each learner's own file), and
grades every exercise in it, one line each. `check.grade("rms_norm", my_rms_norm)` grades one
function. The test suite calls every grader on `tests/adapters.py`, which points at labkit's
solutions, or at the learner's stubs in `exercises/` when `LABKIT_EXERCISES=1`; `python -m labkit
grade` (what `make grade` runs) prints one line per exercise and a summary. The graders live
in labkit/graders/, one module per chapter: each compares against a small reference written
there and, when the answer is wrong, says which part is off: a hint names a known mistake only
when that mistake, and no other, reproduces every wrong result.
tests/test_graders_reject.py lists the mistakes each grader must reject.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import io
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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
    ch09_speculative,
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
    Exercise("expected_tokens", "ch09_speculative", ch09_speculative.grade_expected_tokens),
    Exercise("accept_greedy", "ch09_speculative", ch09_speculative.grade_accept_greedy),
    Exercise("accept_sampled", "ch09_speculative", ch09_speculative.grade_accept_sampled),
    Exercise("rollback", "ch09_speculative", ch09_speculative.grade_rollback),
)}


def _raises_only_not_implemented(body: list[ast.stmt]) -> bool:
    """A function body that is a docstring (optional) and `raise NotImplementedError(...)`."""
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def is_untouched_stub(fn: Callable) -> bool:
    """Whether `fn` is still a stub, read from its source: a function whose body only raises
    NotImplementedError, or a class whose every method does. Checked before a grader builds
    anything (a model, the kernels), so that an untouched stub costs nothing to grade."""
    if inspect.isclass(fn):  # by its methods: a class's own source is found through
        methods = [m for m in vars(fn).values() if inspect.isfunction(m)]  # sys.modules
        return bool(methods) and all(is_untouched_stub(m) for m in methods)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source to read (a builtin, a partial)
        return False
    node = tree.body[0] if tree.body else None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _raises_only_not_implemented(node.body)
    return False


def _not_done(name: str, fn: Callable, err: BaseException | None = None) -> ExerciseNotDone:
    task = inspect.getdoc(fn) or str(err or "")
    return ExerciseNotDone(f"exercises/{EXERCISES[name].module}.py::{name} is not implemented "
                           f"yet.\nThe task:\n{task}")


def grade(name: str, fn: Callable) -> str:
    """Grade `fn` as the answer to exercise `name`; returns a pass line, raises with a hint."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; known: {sorted(EXERCISES)}")
    if is_untouched_stub(fn):
        raise _not_done(name, fn)
    try:
        message = EXERCISES[name].grader(fn)
    except NotImplementedError as err:
        raise _not_done(name, fn, err) from None
    line = f"✓ {name}: {message}"
    print(line)
    return line


def grade_line(name: str, fn: Callable) -> str:
    """One line for `name`: ✓ and what passed, · not attempted, or ✗ and the grader's message."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # grade() prints its pass line itself
            return grade(name, fn)
    except ExerciseNotDone:
        return f"· {name}: not attempted (exercises/{EXERCISES[name].module}.py)"
    except Exception as err:  # a learner's bug is a grade, not a crash of the grading run
        text = " ".join(str(err).split())
        if not isinstance(err, AssertionError):
            text = f"raised {type(err).__name__}: {text}"
        return f"✗ {name}: {text}"


def exercises_dir(start: str | Path | None = None) -> Path:
    """The `exercises/` folder of the repository at or above `start` (default: the working
    directory, which Jupyter sets to the notebook's folder). Never the installed package's: on
    a hub where many clones share one venv, that is the first clone's."""
    here = Path.cwd() if start is None else Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / "exercises" / "ch00_welcome.py").is_file():
            return folder / "exercises"
    raise FileNotFoundError(f"no exercises/ folder in {here} or above it: run this in your "
                            "clone of the course (its root or notebooks/)")


def load_exercises(module: str, start: str | Path | None = None) -> ModuleType:
    """`exercises/<module>.py` of this repository, executed afresh from the file as it is saved
    now: each call sees the learner's latest edit, without a kernel restart or a reload."""
    path = exercises_dir(start) / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"exercises.{module}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no exercise file {path}")
    mod = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(spec.name)
    # a dataclass in the file looks its module up while it is built; afterwards the name goes
    # back to what it was, so that this clone's file never stands in for another's import
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        if previous is None:
            sys.modules.pop(spec.name, None)
        else:
            sys.modules[spec.name] = previous
    return mod


def _load_error(module: str, err: BaseException) -> str:
    """One ✗ line for an exercise file that does not run (a syntax error, a bad import)."""
    if isinstance(err, SyntaxError):
        where = f"line {err.lineno}: " if err.lineno else ""
        return f"✗ exercises/{module}.py does not load: {where}SyntaxError: {err.msg}"
    text = " ".join(str(err).split())
    return f"✗ exercises/{module}.py does not load: {type(err).__name__}: {text}"


def _grade_names(names: list[str], start: str | Path | None, emit: Callable[[str], None]
                 ) -> list[str]:
    """Grade `names`, loading each chapter's file once; one line each (one for a file that
    does not load), passed to `emit` as it comes; returns the lines and a summary line."""
    lines: list[str] = []
    chapters: dict[str, list[str]] = {}
    for name in names:
        chapters.setdefault(EXERCISES[name].module, []).append(name)
    for module, in_file in chapters.items():
        try:
            mod = load_exercises(module, start)
        except Exception as err:  # one ✗ line for the file; the other chapters still grade
            lines.append(_load_error(module, err))
            emit(lines[-1])
            continue
        for name in in_file:
            fn = getattr(mod, name, None)
            if fn is None:
                lines.append(f"✗ {name}: exercises/{module}.py no longer defines {name}")
            else:
                lines.append(grade_line(name, fn))
            emit(lines[-1])
    passed = sum(line.startswith("✓") for line in lines)
    todo = sum(line.startswith("·") for line in lines)
    lines.append(f"{passed} passed, {len(lines) - passed - todo} wrong, {todo} not attempted")
    emit(lines[-1])
    return lines


def grade_chapter(module: str, start: str | Path | None = None) -> list[str]:
    """Grade every exercise of `exercises/<module>.py` (e.g. "ch01_roofline") as the file is
    saved now, printing one line each (✓ passed, · not attempted, ✗ what is wrong) and a
    summary; a wrong answer never stops the others. Returns the lines."""
    names = [n for n, ex in EXERCISES.items() if ex.module == module]
    if not names:
        raise KeyError(f"no exercises in {module!r}; chapters: "
                       f"{sorted({ex.module for ex in EXERCISES.values()})}")
    return _grade_names(names, start, lambda line: print(line, flush=True))


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit grade [NAME ...]`: grade the answers in exercises/, one line each."""
    from labkit.cli_parser import command_parser

    p = command_parser("python -m labkit grade",
                       "Grade your answers in exercises/: one line per exercise (✓ passed, · not "
                       "attempted, ✗ what the grader found wrong), then a summary. Each "
                       "chapter's file is read as it is saved now; a file that does not load "
                       "is one ✗ line, and the other chapters are still graded.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"exercises to grade (default: all): {', '.join(EXERCISES)}")
    p.add_argument("--root", default=None,
                   help="the clone whose exercises/ to grade (default: the working directory, "
                        "or the first folder above it that holds exercises/)")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 if an answer is wrong (for scripts; by default "
                        "grading exits 0, since a wrong answer is a grade, not an error)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in EXERCISES]
    if unknown:
        p.error(f"no exercise named {unknown[0]!r}; known: {', '.join(EXERCISES)}")
    try:
        exercises_dir(args.root)
    except FileNotFoundError as err:
        p.error(str(err))
    lines = _grade_names(args.names or list(EXERCISES), args.root,
                         lambda line: print(line, flush=True))
    wrong = any(line.startswith("✗") for line in lines)
    return 1 if args.strict and wrong else 0

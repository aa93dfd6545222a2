"""Grading as a learner meets it: in a notebook's check cell and with `make grade`.

Each test works on a clone of its own (a copy of exercises/ under tmp_path), edits the files the
way a learner does, and grades them through `labkit.graders.check`, the code the check cells
and `python -m labkit grade` call.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit.graders import check

ROOT = Path(__file__).resolve().parent.parent

RIGHT_BLOCKS = '''
def blocks_needed(num_tokens, block_size):
    """Pages for num_tokens tokens."""
    return -(-num_tokens // block_size)
'''
WRONG_TRANSLATE = '''
def translate(block_table, pos, block_size):
    """Always slot 0: wrong."""
    return 0
'''


def clone(tmp_path: Path, name: str = "clone") -> Path:
    """A learner's clone: exercises/ as shipped, and a notebooks/ folder to work from."""
    root = tmp_path / name
    shutil.copytree(ROOT / "exercises", root / "exercises",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "notebooks").mkdir()
    return root


def replace_function(path: Path, name: str, source: str) -> None:
    """Replace `def name(...)` (up to the next top-level statement) by `source`."""
    text = path.read_text()
    match = re.search(rf"^def {name}\(.*?(?=^\S)", text + "\n#end\n", re.S | re.M)
    assert match, name
    path.write_text(text[:match.start()] + source.lstrip() + "\n\n" + text[match.end():])


def test_a_check_cell_sees_the_file_as_saved_now(tmp_path):
    root = clone(tmp_path)
    first = check.load_exercises("ch05_paged_attention", root / "notebooks")
    assert check.is_untouched_stub(first.blocks_needed)
    replace_function(root / "exercises" / "ch05_paged_attention.py", "blocks_needed",
                     RIGHT_BLOCKS)  # the learner saves an edit; no reload, no restart
    again = check.load_exercises("ch05_paged_attention", root / "notebooks")
    assert again.blocks_needed(17, 16) == 2
    assert check.grade("blocks_needed", again.blocks_needed).startswith("✓")


def test_every_exercise_of_a_chapter_is_graded_past_a_wrong_one(tmp_path, capsys):
    root = clone(tmp_path)
    path = root / "exercises" / "ch05_paged_attention.py"
    replace_function(path, "translate", WRONG_TRANSLATE)  # the chapter's second exercise
    replace_function(path, "blocks_needed", RIGHT_BLOCKS)
    lines = check.grade_chapter("ch05_paged_attention", root / "notebooks")
    assert [line[0] for line in lines[:3]] == ["✓", "✗", "·"], lines
    assert lines[1].startswith("✗ translate:") and "CowPages: not attempted" in lines[2]
    assert lines[-1] == "1 passed, 1 wrong, 1 not attempted"
    assert capsys.readouterr().out.splitlines() == lines  # the learner sees every line


def test_each_clone_grades_its_own_exercises(tmp_path, monkeypatch):
    """A hub: one venv (one installed `exercises`), many clones; each notebook's own file."""
    done, untouched = clone(tmp_path, "alice"), clone(tmp_path, "bob")
    replace_function(done / "exercises" / "ch05_paged_attention.py", "blocks_needed",
                     RIGHT_BLOCKS)
    monkeypatch.chdir(done / "notebooks")  # Jupyter runs a notebook in its own folder
    assert check.grade_chapter("ch05_paged_attention")[0].startswith("✓ blocks_needed")
    monkeypatch.chdir(untouched / "notebooks")
    assert check.grade_chapter("ch05_paged_attention")[0].startswith("· blocks_needed")
    monkeypatch.chdir(done)  # a terminal at the clone's root: `make grade`
    assert check.load_exercises("ch05_paged_attention").__file__ == str(
        done / "exercises" / "ch05_paged_attention.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no exercises/ folder"):
        check.exercises_dir()


def test_a_syntax_error_is_one_line_and_the_other_chapters_are_graded(tmp_path, capsys):
    root = clone(tmp_path)
    broken = root / "exercises" / "ch01_roofline.py"
    broken.write_text(broken.read_text() + "\ndef oops(:\n")
    replace_function(root / "exercises" / "ch05_paged_attention.py", "translate",
                     WRONG_TRANSLATE)
    assert check.main(["--root", str(root)]) == 0  # a wrong answer is a grade, not an error
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if "ch01_roofline" in line]
    assert len(bad) == 1 and bad[0].startswith("✗ exercises/ch01_roofline.py does not load: "
                                               "line ") and "SyntaxError" in bad[0], bad
    assert any(line.startswith("· rms_norm") for line in out)  # before it
    assert any(line.startswith("✗ translate") for line in out)  # and after it
    untouched = len(check.EXERCISES) - 3 - 1  # all but ch01's three and translate
    assert out[-1] == f"0 passed, 2 wrong, {untouched} not attempted", out[-1]
    assert check.main(["--root", str(root), "--strict"]) == 1


def test_grade_help_and_bad_names(capsys):
    from labkit.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["grade", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m labkit grade") and "--strict" in out
    with pytest.raises(SystemExit) as exit_:
        main(["grade", "rms_nrom"])
    assert exit_.value.code == 2 and "no exercise named 'rms_nrom'" in capsys.readouterr().err


def test_make_grade_ends_with_the_summary_not_an_error(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    proc = subprocess.run(["make", "-s", "grade", "NAMES=rms_norm blocks_needed"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].endswith("not attempted"), proc.stdout
    assert "Error" not in proc.stderr


def test_an_untouched_stub_is_not_attempted_before_its_grader_builds_anything(monkeypatch):
    """The ch07 grader builds an engine (and the kernels): an untouched stub must not pay it."""
    from tests import adapters

    def never(fn):
        raise AssertionError("the grader ran on an untouched stub")

    for name, ex in check.EXERCISES.items():
        assert check.is_untouched_stub(adapters.stub(ex.module, name)), name
        monkeypatch.setitem(check.EXERCISES, name, check.Exercise(name, ex.module, never))
        with pytest.raises(check.ExerciseNotDone):
            check.grade(name, adapters.stub(ex.module, name))
    monkeypatch.undo()
    for name, fn in adapters.solutions().items():
        assert not check.is_untouched_stub(fn), f"labkit's {name} reads as a stub"


def test_a_half_done_function_is_attempted():
    def started(x):
        """Doc."""
        y = x + 1  # noqa: F841
        raise NotImplementedError

    def unfinished_class_body():
        raise NotImplementedError("later")

    assert not check.is_untouched_stub(started)
    assert check.is_untouched_stub(unfinished_class_body)
    assert not check.is_untouched_stub(len)  # no source: the grader decides


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_grades_its_own_chapter_file_as_saved(path):
    module = next(ex.module for ex in check.EXERCISES.values() if ex.module[2:4] == path.stem[:2])
    cells = code_cells(path)
    graded = [i for i, src in enumerate(cells) if f'check.grade_chapter("{module}")' in src]
    assert graded, f"{path.name}: no cell calls check.grade_chapter({module!r})"
    imports = [src for src in cells if re.search(r"^\s*(from|import) exercises\b", src, re.M)]
    assert not imports, (f"{path.name} imports the installed `exercises` package (on a shared "
                         f"hub, the first clone's files): use check.load_exercises")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_answer_is_printed_before_its_exercise(path):
    """labkit's solution to an exercise is shown after the check cell, never before it."""
    from tests import adapters

    solutions = adapters.solutions()
    chapter = [n for n, ex in check.EXERCISES.items() if ex.module[2:4] == path.stem[:2]]
    answers = {getattr(solutions[n], "__name__", n) for n in chapter}
    cells = code_cells(path)
    at = next(i for i, src in enumerate(cells) if "check.grade_chapter(" in src)
    for i, src in enumerate(cells[:at]):
        for shown in re.findall(r"getsource\(([\w.]+)\)", src):
            assert shown.split(".")[-1] not in answers, (
                f"{path.name}: code cell {i} prints {shown}'s source, the answer to one of the "
                "chapter's exercises, before the exercises ask for it")

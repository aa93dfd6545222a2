"""Grade every exercise: labkit's solutions must pass; untouched stubs must fail helpfully."""

import pytest

from labkit.graders import check
from tests import adapters

SOLUTIONS = adapters.solutions()


@pytest.mark.parametrize("name", sorted(check.EXERCISES))
def test_exercise(name):
    assert name in SOLUTIONS, f"tests/adapters.py has no entry for exercise {name!r}"
    assert check.grade(name, SOLUTIONS[name]).startswith("✓")


@pytest.mark.skipif(adapters.USE_EXERCISES, reason="grading the learner's own answers")
@pytest.mark.parametrize("name", sorted(check.EXERCISES))
def test_untouched_stub_fails_with_its_task(name):
    ex = check.EXERCISES[name]
    stub = adapters.stub(ex.module, name)
    with pytest.raises(check.ExerciseNotDone) as info:
        check.grade(name, stub)
    message = str(info.value)
    assert f"exercises/{ex.module}.py::{name}" in message
    assert stub.__doc__.strip().splitlines()[0] in message  # the task itself is shown


def test_every_stub_has_a_grader():
    import importlib
    import inspect
    import pathlib

    for path in sorted(pathlib.Path("exercises").glob("ch*.py")):
        mod = importlib.import_module(f"exercises.{path.stem}")
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ == mod.__name__ and not name.startswith("_"):
                assert name in check.EXERCISES, (
                    f"{path}::{name} has no grader in labkit/graders/check.py")


def test_the_readme_names_every_exercise_file():
    # a learner finds the exercises from the README's list: it must not miss a chapter
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    files = sorted(p.name for p in (root / "exercises").glob("ch*.py"))
    assert len(files) >= 9
    missing = [f for f in files if f"`{f}`" not in readme]
    assert not missing, f"README's exercise list misses {missing}"

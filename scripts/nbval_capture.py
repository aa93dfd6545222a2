"""A pytest plugin: keep what nbval's run of the notebooks printed and drew, for the book.

    python -m pytest -p scripts.nbval_capture --book-run build/book/executed --nbval-lax notebooks/

writes each notebook that nbval executes into `--book-run`, with the outputs of that very run
(text, tables, plots), so that `scripts/build_book.py` turns them into the course's book
without executing the notebooks a second time: `make test` runs them once, for the tests and
the book alike. It reads two attributes of nbval's cell items (pinned in requirements.txt):
`cell`, the notebook's own cell, and `test_outputs`, what the kernel sent back for it.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

_RUNS = pytest.StashKey[dict]()  # notebook node id -> (nbval's notebook item, cells run)


def pytest_addoption(parser):
    parser.addoption("--book-run", default=None, metavar="DIR",
                     help="write each executed notebook, with its outputs, into DIR")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    out = item.config.getoption("book_run")
    if not out or call.when != "call" or not hasattr(item, "test_outputs"):
        return
    if not hasattr(item, "cell"):
        raise RuntimeError("scripts/nbval_capture.py: nbval's cell item has no `cell`; "
                           "this nbval is not the one requirements.txt pins")
    notebook = item.parent
    runs = item.config.stash.setdefault(_RUNS, {})
    count = runs.get(notebook.nodeid, (None, 0))[1] + 1
    runs[notebook.nodeid] = (notebook, count)
    item.cell.outputs = [nbformat.from_dict(o) for o in item.test_outputs or []]
    item.cell.execution_count = count
    for o in item.cell.outputs:  # a result carries its cell's count, as a saved notebook has
        if o.get("output_type") == "execute_result":
            o["execution_count"] = count


def pytest_sessionfinish(session):
    out = session.config.getoption("book_run")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    for notebook, _ in session.config.stash.get(_RUNS, {}).values():
        # a cell that never ran keeps execution_count None: build_book.py refuses that page
        nbformat.write(notebook.nb, str(Path(out) / Path(str(notebook.path)).name))

"""Running a benchmark's `main` the way its tests do: its JSON rows, or its exit 2 on a bad value.

Every `python -m labkit bench ...` prints JSON lines on stdout with `--json` and refuses a bad
value with exit code 2 and a line on stderr before any model loads (labkit/bench/report.py).
"""

import json
from collections.abc import Callable

import pytest


def json_rows(main: Callable[[list[str]], int], argv: list[str], capsys
              ) -> tuple[list[dict], str]:
    """Run `main(argv)`, which must exit 0: (its JSON rows from stdout, its stderr)."""
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return [json.loads(line) for line in out.out.splitlines()], out.err


def refuses(main: Callable[[list[str]], int], argv: list[str], words: str, capsys,
            monkeypatch) -> None:
    """`main(argv)` exits 2 before any model loads, and its stderr says `words`."""
    import labkit.loading

    monkeypatch.setattr(labkit.loading, "load_model", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err

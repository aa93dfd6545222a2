"""How a benchmark reports: JSON lines for programs, a table for people, one line for a failure.

Every `python -m labkit bench ...` ends the same way: the rows it measured go to stdout, one
JSON object per line with `--json` (progress and logs go to stderr, so stdout stays parseable),
else as a table; an error the user can fix (a bad value, a missing file) is one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable


def report_rows(measure: Callable[[], list[dict]], as_json: bool,
                table: Callable[[list[dict]], None]) -> int:
    """Run `measure`, print its rows (JSON lines or `table(rows)`); the exit code."""
    try:
        rows = measure()
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        table(rows)
    return 0

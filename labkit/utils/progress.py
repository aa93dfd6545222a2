"""Progress of long work (a first model load, a benchmark, a measurement), always on stderr.

Work that takes more than a few seconds says so while it runs, so that nobody waits on a
silent terminal wondering whether it hangs. Progress goes to stderr and never to stdout, so
that `--json` output stays one clean JSON object per line; in a notebook the same bar is a
widget (`tqdm.auto`). `LABKIT_PROGRESS=0` silences every bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None,
             unit: str = "it", leave: bool = True):
    """A tqdm bar on stderr (a widget in a notebook); use as an iterable or a context manager."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=sys.stderr,
                dynamic_ncols=True, disable=os.environ.get("LABKIT_PROGRESS") == "0")

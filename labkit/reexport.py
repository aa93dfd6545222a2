"""Keeping an import path when a module is split: the names that moved, found where they live.

When a module outgrows a screen it is split by concept (STYLE, rule 14), and every
`from labkit.<old> import X` written against it must keep working. The new modules import from
the old one, so the old one cannot import them back at its top (a cycle). Instead it lists what
moved and where, and Python, asked for a name the module lacks, calls the module's
`__getattr__` (PEP 562), which imports the new home and hands the name over:

    __getattr__, __dir__ = reexport(__name__, {"Vocab": "labkit.vocab"})

The name is looked up anew on every access, so it is always the object its new module holds
(also after a test replaced it there).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def reexport(module: str, moved: dict[str, str]
             ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `module`, serving each name in `moved` from its module."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(moved[name]), name)

    def __dir__() -> list[str]:  # for dir() and tab completion
        return sorted({*vars(sys.modules[module]), *moved})

    return __getattr__, __dir__

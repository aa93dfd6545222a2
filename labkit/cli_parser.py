"""The argument parser every `python -m labkit ...` command builds its options with.

Two habits of argparse surprise a newcomer, so every command turns them off in one place:

- prefix matching: by default `--max-new-token 5` silently means `--max-new-tokens 5`, and a
  later option that shares the prefix changes what an old command line means
  (`allow_abbrev=False`);
- silent defaults: `--help` lists options without the values they take when left out (each
  option's help ends with `(default: ...)`, unless it has no default or says it itself).
"""

from __future__ import annotations

import argparse


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, unless X is None or False or the help
    already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or (
                "default" in text):
            return text
        return super()._get_help_string(action) or ""


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with no prefix matching, whose --help shows every default."""
    return argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                   formatter_class=_DefaultsFormatter)

"""`python -m labkit COMMAND ...`: the course's command-line entry points.

Each command lives in the module that owns its idea; this file only dispatches, importing the
module lazily so that `python -m labkit info` does not pay for loading everything.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("labkit.cli", "generate_main", "generate text with the engine"),
    "info": ("labkit.cli", "info_main", "versions, threads, device, model cache"),
    "bench": ("labkit.bench.cli", "main", "benchmarks (`bench SUB --help`):"),
    "roofline": ("labkit.cli", "roofline_main", "roofline analysis of a model on a device"),
    "serve": ("labkit.serving.server", "serve_main",
              "an OpenAI-compatible HTTP server over the engine"),
    "grade": ("labkit.graders.check", "main", "grade your answers in exercises/, one line each"),
    "eval": ("labkit.bench.eval_ppl", "main",
             "evaluate a model: `eval ppl` (perplexity on a text)"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command's own `main(argv)`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        from labkit.bench.cli import SUBCOMMANDS  # names only: no benchmark is imported

        lines = [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
        at = list(COMMANDS).index("bench") + 1
        lines[at:at] = [f"    {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("usage: python -m labkit COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(lines),
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

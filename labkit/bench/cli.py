"""`python -m labkit bench SUB ...`: dispatch to the benchmark named SUB.

Each benchmark lives in its own module of this package and has a `main(argv)`; this file only
names them, importing a benchmark's module when it runs.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("labkit.bench.generate", "labkit against transformers' generate, tokens/s"),
    "decode": ("labkit.bench.decode", "blocking against pipelined decoding, ms per step"),
    "attention": ("labkit.bench.attention", "naive vs flash vs SDPA attention: time, peak memory"),
    "serve": ("labkit.bench.serve", "TTFT, TPOT, goodput under arrivals, by batching"),
    "paged": ("labkit.bench.paged", "KV cache policies at equal memory: concurrency"),
    "step": ("labkit.bench.step", "a decode step by phase; engine step vs bare forward"),
    "quant": ("labkit.bench.quant", "fp32 against int8/int4 weights: step ms, tokens/s, NLL"),
    "ablation": ("labkit.bench.ablation", "the whole engine, each feature off in turn"),
    "spec": ("labkit.bench.spec", "speculative decoding (int4 draft, prompt lookup) vs plain"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `python -m labkit bench SUB ...`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        usage = "usage: python -m labkit bench SUB [ARGS ...]\n\nbenchmarks:\n" + "\n".join(
            f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{usage}\n\nerror: unknown benchmark {argv[0]!r}", file=sys.stderr)
            return 2
        print(usage)
        return 0
    return int(importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:]) or 0)

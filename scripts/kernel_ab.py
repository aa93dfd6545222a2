"""This tree's CPU kernels against another revision's, side by side in one process: a SmolLM2
step's linears (every layer's, then the head) on the same weights, called from C++ as the
engine's DecoderStack calls them (`linear_pass`), in alternating turns, beside the read probe
over the same bytes and the DRAM's own rate (`labkit.bench.linear_rate`).

    .venv/bin/python scripts/kernel_ab.py --against HEAD~1 [--quant int4] [--rows 1,2]

The revision's `labkit/kernels` sources are built with labkit's own flags beside this tree's
(their DecoderStack renamed, so both modules load). Both must read the layouts this tree
builds: after a change of layout, compare the two layouts in one harness instead (results/
cpu-kernels-2026-12-05j.md did). The weights are the model's own, so where their pages lie
favours neither side; the machine's memory may be quiet or busy from one minute to the next,
so each run prints the DRAM's rate beside its figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def build_at(rev: str, where: Path):
    """labkit's kernels as they were at `rev`, built into `where`."""
    from labkit.kernels import cpu as cpu_kernels

    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    src = where / f"src_{sha}"
    src.mkdir(parents=True, exist_ok=True)
    for name in cpu_kernels.SOURCES:
        text = subprocess.run(["git", "show", f"{sha}:labkit/kernels/{name}"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout
        (src / name).write_text(text)
    flags = [*cpu_kernels.CFLAGS, *cpu_kernels._flags(), "-DDecoderStack=DecoderStackAB"]
    return sha, cpu_kernels.build_extension(f"labkit_kernels_ab_{sha}",
                                            [src / n for n in cpu_kernels.SOURCES], flags,
                                            ["-fopenmp"], root=where / "build")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="a git revision (HEAD~1, a commit)")
    p.add_argument("--quant", default="int4", help="labkit.quant's scheme, or none")
    p.add_argument("--rows", default="1", help="rows of x, comma-separated")
    p.add_argument("--turns", type=int, default=30)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]

    from labkit.bench import linear_rate
    from labkit.bench.quant import alternate
    from labkit.kernels import cpu as cpu_kernels
    from labkit.loading import load_model

    here = cpu_kernels.kernels()
    if here is None:
        print(f"labkit's kernels are not built here: {cpu_kernels.status()}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        sha, there = build_at(args.against, Path(tmp))
        model, _ = load_model("smollm2-135m", quant=args.quant)
        _, order = linear_rate._step_linears(model)
        with torch.inference_mode():
            pair = linear_rate._Pair(order)
        dram = linear_rate.dram_rate()
        print(linear_rate.format_dram(dram))
        for m in rows:
            calls = [(kind, torch.randn(m, x.shape[1]), a, b) for kind, x, a, b in pair.calls]
            try:
                there.linear_pass(calls[:1], 1)
            except RuntimeError as err:
                print(f"{sha}'s kernels do not read this tree's layouts ({err}); compare the "
                      "two layouts in one harness instead", file=sys.stderr)
                return 2
            sides = {"this tree": lambda c=calls: here.linear_pass(c, 1),
                     sha: lambda c=calls: there.linear_pass(c, 1), "probe": pair.read}
            with torch.inference_mode():
                took = alternate(sides, rounds=args.turns, steps=1)  # ms per turn
            ratio = [a / b for a, b in zip(took[sha], took["this tree"])]
            print(f"{m} row(s), {len(calls)} linears, {pair.nbytes / 1e6:.0f} MB: " + ", ".join(
                f"{k} {pair.nbytes / statistics.median(v) / 1e6:.1f} GB/s" for k, v in took.items())
                + f"; this tree {statistics.median(ratio):.3f}x as fast as {sha} "
                f"({min(ratio):.3f}-{max(ratio):.3f} over {args.turns} turns)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""int8_linear_dot against the int8 kernels before it, side by side in one process
(results/cpu-kernels-2026-12-06.md). Needs a build with the integer dot product (AVX512-VNNI).

    .venv/bin/python scripts/int8_dot_compare.py [--rows 1,2,4,8,32] [--turns 20]
        [--against 18b9e1c]

1. A SmolLM2 step's 121 int8 linears (the model's own codes; every layer's, then the head),
   called from C++ as the engine's DecoderStack calls them (`linear_pass`), in alternating
   turns beside the read probe over the same bytes: `int8_linear_dot` on `int8_dot_layout`,
   `int8_linear` on the codes as they are, and with `--against REV` that revision's
   `int8_linear_tiled` on its tiles of 6 rows (its sources built beside this tree's, as
   scripts/kernel_ab.py builds them). Each layout is copied into a buffer of its own on 2 MiB
   pages, in the step's order, so neither inherits the model's placement. Checks first that
   the kernels agree (this tree's two: the same bits).
2. The whole bare forward at batch 1 (context 64), the model built with LABKIT_INT8_DOT=0
   (int8_linear) and 1, alternating turns of 5 forwards.
The machine's memory may be quiet or busy from one minute to the next: each run prints the
DRAM's own rate (`labkit.bench.linear_rate.dram_rate`) beside its figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from labkit.bench.quant import alternate

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tiles_of(codes: torch.Tensor) -> torch.Tensor:
    """The layout int8_linear_tiled read: [ceil(N/6), ceil(K/32), 6, 32], each 32 codes of 6
    rows side by side (zeros past N and K)."""
    n, k = codes.shape
    padded = torch.nn.functional.pad(codes, (0, -k % 32, 0, -n % 6))
    return padded.reshape(-1, 6, padded.shape[1] // 32, 32).transpose(1, 2).contiguous()


def linears(rows: list[int], turns: int, against: str | None, tmp: Path) -> None:
    from labkit.bench import linear_rate
    from labkit.kernels import cpu as cpu_kernels
    from labkit.loading import load_model
    from labkit.utils.pages import copied_together

    def placed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return copied_together(tensors)[1]  # (the copies keep their buffer alive)

    mod = cpu_kernels.kernels()
    model, _ = load_model("smollm2-135m", quant="int8")
    _, order = linear_rate._step_linears(model)
    codes = [lin.canonical()[:2] for lin in order]
    dot = placed([cpu_kernels.int8_dot_layout(q) for q, _ in codes])
    plain = placed([q for q, _ in codes])
    nbytes = sum(t.numel() for t in dot)
    sides = {"int8_linear_dot": (mod, 4, dot), "int8_linear": (mod, 1, plain)}
    if against:
        from kernel_ab import build_at

        sha, there = build_at(against, tmp)  # (its kind 4 was int8_linear_tiled)
        sides[f"{sha} int8_linear_tiled"] = (there, 4, placed([tiles_of(q) for q, _ in codes]))
    with torch.inference_mode():
        probe = linear_rate._Pair(order)
    print(linear_rate.format_dram(linear_rate.dram_rate()))
    for m in rows:
        xs = [torch.randn(m, q.shape[1]) for q, _ in codes]
        calls = {name: [(kind, x, w, s) for x, w, (_, s) in zip(xs, ws, codes)]
                 for name, (_, kind, ws) in sides.items()}
        first = [mod.int8_linear_dot(x, w, s) for _, x, w, s in calls["int8_linear_dot"]]
        for name, (m_, _, _) in sides.items():  # the same products (this tree's: the same bits)
            for y, (_, x, w, s) in zip(first, calls[name]):
                got = (m_.int8_linear(x, w, s) if name == "int8_linear" else
                       m_.int8_linear_dot(x, w, s) if name == "int8_linear_dot" else
                       m_.int8_linear_tiled(x, w, s))
                assert (torch.equal(got, y) if not name.endswith("tiled") else
                        torch.allclose(got, y, rtol=1e-3, atol=1e-3 * float(y.abs().max()))), name
        fns = {name: (lambda f=m_.linear_pass, c=calls[name]: f(c, 1))
               for name, (m_, _, _) in sides.items()}
        fns["probe"] = probe.read
        with torch.inference_mode():
            took = alternate(fns, rounds=turns, steps=1)  # ms per turn
        base = took["int8_linear_dot"]
        print(f"{m} row(s), {len(xs)} linears, {nbytes / 1e6:.0f} MB: " + ", ".join(
            f"{n} {nbytes / statistics.median(v) / 1e6:.1f} GB/s" for n, v in took.items()))
        for name in took:
            if name not in ("int8_linear_dot", "probe"):
                r = [b / a for a, b in zip(base, took[name])]
                print(f"  int8_linear_dot {statistics.median(r):.3f}x as fast as {name} "
                      f"({min(r):.2f}-{max(r):.2f} over {turns} turns)")


def forwards(turns: int) -> None:
    from labkit.bench.quant import decode_step
    from labkit.loading import load_model

    steps = {}
    for dot in ("0", "1"):
        os.environ["LABKIT_INT8_DOT"] = dot  # read as each QuantLinear builds its layout
        model, _ = load_model("smollm2-135m", quant="int8", fuse=True)
        steps["int8_linear_dot" if dot == "1" else "int8_linear"] = decode_step(model, 1, 64)
    with torch.inference_mode():
        res = alternate(steps, turns, 5)  # each turn: the median ms of 5 forwards
    med = {n: statistics.median(v) for n, v in res.items()}
    gain = statistics.median(a / b for a, b in zip(res["int8_linear"], res["int8_linear_dot"]))
    print(f"bare forward at batch 1: int8_linear {med['int8_linear']:.3f} ms, int8_linear_dot "
          f"{med['int8_linear_dot']:.3f} ms; int8_linear_dot {gain:.3f}x as fast per turn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,32", help="rows of x, comma-separated")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--against", help="a revision whose int8_linear_tiled to time too")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from labkit.kernels import cpu as cpu_kernels

    built = cpu_kernels.kernels()
    if built is None or not built.has_int8_dot():
        raise SystemExit(f"int8_linear_dot needs a build with AVX512-VNNI: {cpu_kernels.status()}")
    with tempfile.TemporaryDirectory() as tmp:
        linears([int(r) for r in args.rows.split(",")], args.turns, args.against, Path(tmp))
    forwards(args.turns)


if __name__ == "__main__":
    main()

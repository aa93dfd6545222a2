"""int8 on labkit's tiles against int8 on the codes as they are, side by side in one process
(results/cpu-kernels-2026-12-05b.md). Needs a build with the integer dot product (AVX512-VNNI).

    .venv/bin/python scripts/int8_tiles_compare.py [--rounds 11]

1. A SmolLM2 step's 121 int8 linears at 1, 2 and 4 rows: `int8_linear` on the codes [N, K],
   `int8_linear_tiled` on `int8_tiled_layout`'s tiles, and the read probe over the tiles tensor
   by tensor (the same calls, so the same per-call costs), in alternating turns. Checks first
   that the two kernels give the same bits.
2. The whole bare forward at batch 1 (context 64), the model built with LABKIT_INT8_TILES=0 and
   with 1, alternating turns of 5 forwards.
Turns alternate as every labkit benchmark's (`labkit.bench.quant.alternate`); medians; "per
round" ratios are the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from labkit.bench.quant import alternate


def linears(rounds: int) -> None:
    from labkit.kernels import cpu as cpu_kernels
    from labkit.loading import load_model
    from labkit.quant import QuantLinear

    mod = cpu_kernels.kernels()
    model, _ = load_model("smollm2-135m", quant="int8", fuse=True)
    lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    ops = [(lin.canonical()[0], lin.kweight, lin.kscale) for lin in lins]
    nbytes = sum(t.numel() for _, t, _ in ops)
    for m in (1, 2, 4):
        xs = [torch.randn(m, lin.in_features) for lin in lins]
        for (q, t, s), x in zip(ops, xs):
            assert torch.equal(mod.int8_linear(x, q, s), mod.int8_linear_tiled(x, t, s))
        calls = list(zip(ops, xs))
        res = alternate({  # ms per turn of one pass
            "rows": lambda calls=calls: [mod.int8_linear(x, q, s) for (q, _, s), x in calls],
            "tiles": lambda calls=calls: [mod.int8_linear_tiled(x, t, s)
                                          for (_, t, s), x in calls],
            "probe": lambda: [mod.read_probe(t) for _, t, _ in ops]}, rounds, 1)
        med = {n: statistics.median(v) / 1e3 for n, v in res.items()}
        gain = statistics.median(a / b for a, b in zip(res["rows"], res["tiles"]))
        rate = {n: f"{v * 1e3:.3f} ms ({nbytes / v / 1e9:.1f} GB/s)" for n, v in med.items()}
        print(f"{len(ops)} linears, {m} row(s): rows {rate['rows']}, tiles {rate['tiles']}, "
              f"probe {rate['probe']}; tiles {gain:.2f}x faster per round, "
              f"{med['probe'] / med['tiles']:.2f}x the probe's rate")


def forwards(rounds: int) -> None:
    from labkit.bench.quant import decode_step
    from labkit.loading import load_model

    steps = {}
    for tiles in ("0", "1"):
        os.environ["LABKIT_INT8_TILES"] = tiles  # read as each QuantLinear builds its layout
        model, _ = load_model("smollm2-135m", quant="int8", fuse=True)
        step = decode_step(model, 1, 64)
        steps["tiles" if tiles == "1" else "rows"] = step
    with torch.inference_mode():
        res = alternate(steps, rounds, 5)  # each turn: the median ms of 5 forwards
    med = {n: statistics.median(v) for n, v in res.items()}
    gain = statistics.median(a / b for a, b in zip(res["rows"], res["tiles"]))
    print(f"bare forward at batch 1: rows {med['rows']:.3f} ms, tiles {med['tiles']:.3f} ms; "
          f"tiles {gain:.3f}x faster per round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from labkit.kernels import cpu as cpu_kernels

    built = cpu_kernels.kernels()
    if built is None or not built.has_int8_dot():
        raise SystemExit("int8_linear_tiled needs a build with AVX512-VNNI: "
                         f"{cpu_kernels.status()}")
    linears(args.rounds)
    forwards(args.rounds)


if __name__ == "__main__":
    main()

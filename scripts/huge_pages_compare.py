"""A model's weights in 2 MiB pages (labkit.utils.pages) against the same weights where loading
left them (4 KiB pages), side by side in one process (results/cpu-kernels-2026-12-05c.md).

    .venv/bin/python scripts/huge_pages_compare.py [--rounds 9] [--quant int4,int8,none]

1. The read probe (labkit's C++ `read_probe`) over 540 MB in 4 KiB pages and in 2 MiB pages,
   in one call and in 121 calls of equal parts (a step's count of linears).
2. For each quantization: the model loaded with LABKIT_HUGE_PAGES=0 (the weights where the
   cache's memory map or the heap put them) and a deep copy of it placed by
   `place_weights`; checks that they give the same logits, then times the whole bare forward
   at batch 1 (context 64) in alternating turns of 5 forwards.
3. With --pairs N (and nothing else): notebook 03 section 7's claim, one thread over the int4
   step's 84 MB (`labkit.bench.pages.read_gain`), N estimates with 4 KiB buffers against 2 MiB
   ones (A/B) and N with both kinds in 4 KiB pages (A/A: what luck alone gives), with one
   buffer of each kind and with three (the notebook's).
Turns alternate as every labkit benchmark's (`labkit.bench.quant.alternate`); medians; "per
round": the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch

from labkit.bench.quant import alternate


def probe(rounds: int) -> None:
    from labkit.kernels import cpu as cpu_kernels
    from labkit.utils import pages

    read = cpu_kernels.kernels().read_probe
    nbytes = 540_000_000
    bufs = {"4 KiB": torch.ones(nbytes, dtype=torch.uint8),
            "2 MiB": pages.empty(nbytes).fill_(1)}
    print(f"the probe over {nbytes / 1e6:.0f} MB ({pages.huge_bytes(bufs['2 MiB']) / 1e6:.0f} "
          "MB of the second buffer in huge pages)")
    for calls in (1, 121):
        part = nbytes // calls
        views = {k: [b[i * part:(i + 1) * part] for i in range(calls)] for k, b in bufs.items()}
        ms = alternate({k: (lambda vs=vs: [read(v) for v in vs]) for k, vs in views.items()},
                       rounds, 3)
        line = "  ".join(f"{k} {nbytes / statistics.median(v) / 1e6:5.1f} GB/s"
                         for k, v in ms.items())
        ratio = statistics.median(a / b for a, b in zip(ms["4 KiB"], ms["2 MiB"]))
        print(f"  {calls:3d} call(s): {line}  2 MiB faster by {ratio:.3f}x per round")


def forward(quant: str, rounds: int) -> None:
    from labkit.bench.quant import decode_step
    from labkit.loading import load_model
    from labkit.utils import pages

    os.environ["LABKIT_HUGE_PAGES"] = "0"
    try:
        as_loaded, _ = load_model("smollm2-135m", quant=None if quant == "none" else quant,
                                  fuse=True)
    finally:
        del os.environ["LABKIT_HUGE_PAGES"]
    placed = copy.deepcopy(as_loaded)
    done = pages.place_weights(placed)
    assert done["skipped"] is None, done["skipped"]
    with torch.inference_mode():
        steps = {"4 KiB": decode_step(as_loaded, 1, 64), "2 MiB": decode_step(placed, 1, 64)}
        # the same token over the same (zeroed) context: the same logits, bit for bit
        assert torch.equal(steps["4 KiB"](), steps["2 MiB"]()), "placing changed the logits"
        ms = alternate(steps, rounds, 5)
    med = {k: statistics.median(v) for k, v in ms.items()}
    ratio = statistics.median(a / b for a, b in zip(ms["4 KiB"], ms["2 MiB"]))
    print(f"  {quant:5s} bare forward at batch 1: 4 KiB {med['4 KiB']:.2f} ms, 2 MiB "
          f"{med['2 MiB']:.2f} ms ({done['huge_bytes'] / 1e6:.0f} of {done['bytes'] / 1e6:.0f} "
          f"MB in huge pages): {ratio:.3f}x per round")


def pairs(trials: int, nbytes: int = 84_000_000) -> None:
    from labkit import claims
    from labkit.bench.pages import read_gain

    print(f"one thread over {nbytes / 1e6:.0f} MB (labkit.bench.pages.read_gain), 7 turns an "
          f"estimate; the medians of {trials} estimates (4 KiB's time over 2 MiB's):")
    for buffers in (1, 4):
        for control in (True, False):
            with claims.torch_threads(1):
                got = sorted(read_gain(nbytes, buffers, control=control).gain.median
                             for _ in range(trials))
            name = "A/A (4 KiB, 4 KiB)" if control else "A/B (4 KiB, 2 MiB)"
            print(f"  {buffers} of each, {name}: {got[0]:.3f} .. {got[-1]:.3f}  "
                  f"({', '.join(f'{x:.3f}' for x in got)})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quant", default="int4,int8,none")
    p.add_argument("--pairs", type=int, default=0, help="trials of section 7's claim (0: none)")
    args = p.parse_args()
    if args.pairs:
        pairs(args.pairs)
        return
    torch.set_num_threads(2)
    probe(args.rounds)
    print("the same logits, bit for bit; the bare forward (context 64) in alternating turns:")
    for q in args.quant.split(","):
        forward(q, args.rounds)


if __name__ == "__main__":
    main()

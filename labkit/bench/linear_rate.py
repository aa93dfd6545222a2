"""How fast a quantized linear reads its weights at batch 1, held against how fast this CPU
reads the same number of bytes and does nothing else (`bench step` prints it).

At batch 1 a decode step reads every weight once and does little arithmetic per byte, so a
linear's figure of merit is its *effective rate*: the bytes it reads (codes plus scales and
zeros, `QuantLinear.weight_bytes`) over its time. Its ceiling is measured, not quoted: labkit's
C++ `read_probe` reads a buffer of the same size with the same threads (`at::parallel_for`, so
the same wake-up cost), 64 bytes a load and nothing else. A buffer that fits the cache is read
at the cache's rate, one that does not at memory's, for the probe as for the kernel.

Two views, each timed in alternating turns with the probe (medians of the turns):
- per shape: layer 0's linears and the head, each called again and again on one row of x
  (its bytes stay in cache between calls, as the probe's do);
- a step's linears: every layer's, then the head, in the model's order (a whole model's bytes,
  read as a step reads them), against one probe buffer of their total size.
Both call the kernel itself (`QuantLinear._labkit_kernel`), not the module: the module adds a
few microseconds of Python a call, which the step's phase table counts.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from labkit.kernels import cpu as cpu_kernels

# a layer's linears in the order a step calls them, fused (fuse_projections) or not
LAYER_ORDER = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj",
               "up_proj", "down_proj")
TURN_S = 2e-3  # one turn's length: many calls of a small linear, one or two of the head


def _call(lin) -> tuple:
    """(kernel, its arguments) for one row of x through `lin` (a QuantLinear)."""
    mod = cpu_kernels.kernels()
    x = torch.randn(1, lin.in_features)  # x: [1, K]
    if lin._labkit_kernel == "int8_linear":
        return mod.int8_linear, (x, lin.qweight, lin.scale)
    return getattr(mod, lin._labkit_kernel), (x, lin.kweight, lin.kscale)


def _turns(calls: list[tuple], nbytes: int, turns: int) -> tuple[float, float]:
    """Median seconds of one pass over `calls`, and of one probe read of `nbytes` bytes, from
    alternating turns of `reps` passes each."""
    probe = cpu_kernels.kernels().read_probe
    buf = torch.ones(nbytes, dtype=torch.uint8)  # ones: pages really mapped, not the zero page

    def one_pass():
        for fn, args in calls:
            fn(*args)

    def timed(f, reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t0) / reps

    one_pass(), probe(buf)  # warm: first touches, the thread pool started
    reps = max(1, int(TURN_S / max(timed(one_pass, 1), 1e-7)))
    kern, read = [], []
    for i in range(turns):  # alternating: a drifting machine slows both alike; who goes
        if i % 2:  # first changes every turn, so neither always inherits the other's cache
            read.append(timed(lambda: probe(buf), reps))
        kern.append(timed(one_pass, reps))
        if not i % 2:
            read.append(timed(lambda: probe(buf), reps))
    return statistics.median(kern), statistics.median(read)


def _row(name: str, lins: list, turns: int) -> dict:
    nbytes = sum(lin.weight_bytes for lin in lins)
    kern_s, read_s = _turns([_call(lin) for lin in lins], nbytes, turns)
    first = lins[0]
    return {"linear": name, "shape": f"{first.out_features}x{first.in_features}",
            "kernel": first._labkit_kernel, "bytes": nbytes, "us": kern_s * 1e6,
            "gb_per_s": nbytes / kern_s / 1e9, "probe_us": read_s * 1e6,
            "probe_gb_per_s": nbytes / read_s / 1e9, "over_probe": read_s / kern_s,
            "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def linear_rates(model, turns: int = 15) -> list[dict]:
    """Effective GB/s of `model`'s quantized linears at batch 1 beside the read probe of the
    same bytes: one row per linear of layer 0 and the head, then "step linears" (all of them
    in order). [] where labkit's kernels do not serve them (not built, or not quantized)."""
    from labkit.quant import QuantLinear

    if cpu_kernels.kernels() is None:
        return []
    order = [m for m in model.modules()
             if isinstance(m, QuantLinear) and m._labkit_kernel is not None]
    if not order:
        return []
    layer0 = [(name, getattr(model.layers[0], name, None)) for name in LAYER_ORDER]
    layer0 = [(name, m) for name, m in layer0
              if isinstance(m, QuantLinear) and m._labkit_kernel is not None]
    if isinstance(model.lm_head, QuantLinear) and model.lm_head._labkit_kernel is not None:
        layer0.append(("lm_head", model.lm_head))
    with torch.inference_mode():
        rows = [_row(name, [m], turns) for name, m in layer0]
        rows.append(_row("step linears", order, max(5, turns // 3)))
    rows[-1]["shape"] = f"{len(order)} linears"
    return rows


def format_rates(rows: list[dict]) -> str:
    """The rows as a table: each linear's us and GB/s, the probe's, their ratio, and the
    machine's load average when the row was measured (a busy machine slows both)."""
    head = (f"  {'linear':<14}{'N x K':>12}{'MB':>8}{'us':>9}{'GB/s':>8}"
            f"{'probe us':>10}{'probe GB/s':>12}{'kernel/probe':>14}{'load':>6}  kernel")
    lines = [head]
    for r in rows:
        load = "" if r["load_avg"] is None else f"{r['load_avg']:.1f}"
        lines.append(f"  {r['linear']:<14}{r['shape']:>12}{r['bytes'] / 1e6:>8.2f}"
                     f"{r['us']:>9.1f}{r['gb_per_s']:>8.1f}{r['probe_us']:>10.1f}"
                     f"{r['probe_gb_per_s']:>12.1f}{r['over_probe']:>13.2f}x{load:>6}"
                     f"  {r['kernel']}")
    lines.append(f"  ({rows[0]['threads']} threads; kernel/probe: the probe's time over the "
                 "kernel's, 1.00x = reading as fast as the CPU reads)" if rows else "")
    return "\n".join(lines)

"""How fast a linear reads its weights at batch 1, held against how fast this CPU
reads the same number of bytes and does nothing else (`bench step` prints it).

At batch 1 a decode step reads every weight once and does little arithmetic per byte, so a
linear's figure of merit is its *effective rate*: the bytes it reads (codes plus scales and
zeros, `QuantLinear.weight_bytes`) over its time. Its ceiling is measured, not quoted: labkit's
C++ `read_probe` reads the same bytes where they lie (`_Pair`), with the same threads
(`at::parallel_for`, so the same wake-up cost), 64 bytes a load and nothing else. Bytes that fit
the cache are read at the cache's rate, bytes that do not at memory's, for the probe as for the
kernel.
A quantized linear runs its labkit kernel (int8, int4); an fp32 one (and a tied head, the
embedding matrix) runs `fp32_linear`, labkit's kernel for steps of a few rows.

Three views, each timed in alternating turns with the probe (medians of the turns):
- per shape: layer 0's linears and the head, each called again and again on one row of x
  (its bytes stay in cache between calls, as the probe's do);
- a step's linears: every layer's, then the head, in the model's order (a whole model's bytes,
  read as a step reads them), against the probe over the same bytes (one call a span);
- the whole bare forward against the probe over those bytes: its memory floor (`forward_floor`).
Beside them, the DRAM's own rate (`dram_rate`): the probe over a buffer eight times this CPU's
last-level cache. A step's weights, read again every step, come partly from that cache even
when they are larger than it (measured on this course's VM, 32 MB L3: the probe over one
buffer read again and again, 84 MB at 43-44 GB/s, 400 MB at 32-35; results/
cpu-kernels-2026-12-05j.md), so the probe over them can read faster than the DRAM does, and
a kernel bound by its arithmetic falls behind it there.
The first two call the kernel itself (`_kernel`: the one that serves the linear), not the
module (which adds a few microseconds of Python a call, counted by the step's phase table),
from C++ as the engine's DecoderStack calls it (`linear_pass`). (Measured on this course's VM,
a SmolLM2 step's linears called one by one from Python took 0.94-0.99x the C++ pass's time:
the calls' Python costs no time the kernels' joins had not already lost; results/
cpu-kernels-2026-12-05i.md.)
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from labkit.kernels import cpu as cpu_kernels
from labkit.utils import pages

# a layer's linears in the order a step calls them, fused (fuse_projections) or not
LAYER_ORDER = tuple(n for n in pages.READ_ORDER if n.endswith("_proj"))
TURN_S = 2e-3  # one turn's length: many calls of a small linear, one or two of the head
DRAM_MIN_BYTES = 256 << 20  # dram_rate's buffer: 8x the last-level cache, at least this
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache() -> int | None:
    """Bytes of this CPU's largest cache, as Linux's sysfs gives it (None elsewhere)."""
    sizes = []
    for entry in _CACHES.glob("index*/size"):
        text = entry.read_text().strip().upper()  # "32768K"
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def dram_rate(nbytes: int | None = None, reads: int = 9) -> dict | None:
    """The read probe over a buffer too large for any cache: eight times the last-level cache
    (at least DRAM_MIN_BYTES), in 2 MiB pages, the median of `reads` reads with the caller's
    threads: the rate the DRAM itself gives. None where labkit's kernels are not built."""
    built = cpu_kernels.kernels()
    if built is None:
        return None
    llc = last_level_cache()
    nbytes = nbytes or max(DRAM_MIN_BYTES, 8 * (llc or 0))
    buf = pages.empty(nbytes).fill_(1)  # written: its pages really mapped
    built.read_probe(buf)
    took = statistics.median(_timed(lambda: built.read_probe(buf)) for _ in range(reads))
    return {"bytes": nbytes, "gb_per_s": nbytes / took / 1e9, "llc_bytes": llc,
            "threads": torch.get_num_threads()}


def format_dram(d: dict) -> str:
    """dram_rate's row as a sentence."""
    cache = (f"{d['bytes'] / d['llc_bytes']:.0f}x this CPU's {d['llc_bytes'] / 2**20:.0f} MiB "
             "last-level cache" if d["llc_bytes"] else "a size no cache holds")
    return (f"the DRAM: the same probe over {d['bytes'] / 2**20:.0f} MiB ({cache}) reads "
            f"{d['gb_per_s']:.1f} GB/s with {d['threads']} threads; weights read again every "
            "step come partly from that cache, so the probe over them can read faster")


def _kernel(lin) -> str | None:
    """The labkit kernel that serves `lin` at one row: a QuantLinear's own, `fp32_linear` for
    an fp32 nn.Linear or a bare [N, K] weight (a tied head); None where none does."""
    if isinstance(lin, torch.Tensor):
        lin_w = lin
    elif type(lin) is torch.nn.Linear:
        lin_w = lin.weight
    else:
        return getattr(lin, "_labkit_kernel", None)
    return "fp32_linear" if lin_w.dtype == torch.float32 and lin_w.is_contiguous() else None


def _shape(lin) -> tuple[int, int, int]:
    """(N, K, bytes read per call) of a linear, as `_kernel` takes it."""
    w = lin if isinstance(lin, torch.Tensor) else getattr(lin, "weight", None)
    if w is not None and _kernel(lin) == "fp32_linear":
        return w.shape[0], w.shape[1], w.numel() * w.element_size()
    return lin.out_features, lin.in_features, lin.weight_bytes


def _call(lin) -> tuple:
    """(kind, x, a, b): one row of x through `lin` as `linear_pass` (decoder_stack.cpp) takes
    it, its kind and weights as the DecoderStack has them (`labkit.kernels.stack`; a tied head,
    a bare [N, K] weight, as the stack's ends take it)."""
    from labkit.kernels.stack import _NONE, _linear_args

    kind, a, b, _ = (0, lin, _NONE, _NONE) if isinstance(lin, torch.Tensor) else _linear_args(lin)
    return kind, torch.randn(1, _shape(lin)[1]), a, b  # x: [1, K]


MERGE_GAP = 64 << 10  # weights this close in one buffer are read as one span (a norm between)
MAX_SPANS = 8  # more spans than this: the weights were not placed together; a buffer instead


def _spans(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """uint8 views of the memory `tensors` lie in, in their order: a tensor that starts in the
    same storage at most MERGE_GAP bytes after the previous one ends extends that view (the
    gap, a norm's few KB or a cache line's padding, is read with it)."""
    runs: list[list] = []  # [storage, first byte, end byte]
    for t in tensors:
        st = t.untyped_storage()
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        last = runs[-1] if runs else None
        if last and last[0].data_ptr() == st.data_ptr() and 0 <= start - last[2] <= MERGE_GAP:
            last[2] = end
        else:
            runs.append([st, start, end])
    return [torch.empty(0, dtype=torch.uint8).set_(st, a, (e - a,)) for st, a, e in runs]


class _Pair:
    """`lins` as a step calls their kernels (one row of x each), beside the read probe over the
    same bytes: the two sides every measurement here alternates.

    The probe reads the very memory the kernels' weights lie in (load_model places a model's
    weights in one buffer in the step's order, the head apart: a few spans, read one call
    each), so where those pages lie cannot favour either side: two buffers of one size can sit
    in memory of different speed (0.87-1.13x, results/cpu-kernels-2026-12-05e.md). Its time
    is scaled to the weights' bytes (`read_scale`: a span holds a norm or padding besides).
    Weights not placed together (more than MAX_SPANS spans) are read instead as one buffer of
    their size, in 2 MiB pages; `probe` says which."""

    def __init__(self, lins: list):
        self.calls = [_call(lin) for lin in lins]
        self.nbytes = sum(_shape(lin)[2] for lin in lins)
        self.probe_fn = cpu_kernels.kernels().read_probe
        self.pass_fn = cpu_kernels.kernels().linear_pass
        self.spans = _spans([t for _, _, a, b in self.calls for t in (a, b) if t.numel()])
        if len(self.spans) > MAX_SPANS:
            # in the pages labkit keeps weights in (2 MiB where the kernel gives them: the
            # fastest read this CPU makes), written so the pages are really mapped
            self.spans = [pages.empty(self.nbytes).fill_(1)]
            self.probe = "a buffer of the same bytes"
        else:
            n = len(self.spans)
            self.probe = f"the weights' own memory, {n} span{'s' if n > 1 else ''}"
        self.read_scale = self.nbytes / sum(s.numel() for s in self.spans)
        self.one_pass(), self.read()  # warm: first touches, the thread pool started

    def one_pass(self) -> None:
        self.pass_fn(self.calls, 1)

    def read(self) -> None:
        for span in self.spans:
            self.probe_fn(span)


def _timed(f, reps: int = 1) -> float:
    """Seconds of one call of f, over `reps` calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps


def _alternate(a, b, turns: int, reps: int = 1) -> tuple[list[float], list[float]]:
    """Seconds of one call of a and of b in each of `turns` turns of `reps` calls. Alternating:
    a drifting machine slows both alike; who goes first changes every turn, so neither always
    inherits the other's cache."""
    ta, tb = [], []
    for i in range(turns):
        if i % 2:
            tb.append(_timed(b, reps))
        ta.append(_timed(a, reps))
        if not i % 2:
            tb.append(_timed(b, reps))
    return ta, tb


def _turns(pair: _Pair, turns: int) -> tuple[float, float]:
    """Median seconds of one pass over the pair's linears, and of one probe read of their
    bytes, from alternating turns of `reps` passes each."""
    reps = max(1, int(TURN_S / max(_timed(pair.one_pass), 1e-7)))
    kern, read = _alternate(pair.one_pass, pair.read, turns, reps)
    return statistics.median(kern), statistics.median(read) * pair.read_scale


def _row(name: str, lins: list, turns: int) -> dict:
    pair = _Pair(lins)
    nbytes = pair.nbytes
    kern_s, read_s = _turns(pair, turns)
    n, k, _ = _shape(lins[0])
    return {"linear": name, "shape": f"{n}x{k}",
            "kernel": _kernel(lins[0]), "bytes": nbytes, "us": kern_s * 1e6,
            "gb_per_s": nbytes / kern_s / 1e9, "probe_us": read_s * 1e6,
            "probe_gb_per_s": nbytes / read_s / 1e9, "over_probe": read_s / kern_s,
            "threads": torch.get_num_threads(), "probe": pair.probe,
            "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _step_linears(model) -> tuple[list[tuple[str, object]], list] | None:
    """(layer 0's linears by name with the head last, every linear of a step in order with the
    head last); the head of a tied model is the embedding matrix. None where labkit's kernels
    do not serve every one of them (not built, a layout of torch's)."""
    if cpu_kernels.kernels() is None:
        return None
    head = model.embed.weight if model.lm_head is None else model.lm_head
    layers = [[(name, m) for name in LAYER_ORDER
               if (m := getattr(layer, name, None)) is not None] for layer in model.layers]
    order = [m for layer in layers for _, m in layer] + [head]
    if any(_kernel(m) is None for m in order):
        return None
    return [*layers[0], ("lm_head", head)], order


def linear_rates(model, turns: int = 15) -> list[dict]:
    """Effective GB/s of `model`'s linears at batch 1 beside the read probe of the same bytes:
    one row per linear of layer 0 and the head, then "step linears" (all of them in order, the
    head last). [] where labkit's kernels do not serve every one of them."""
    linears = _step_linears(model)
    if linears is None:
        return []
    first, order = linears
    with torch.inference_mode():
        rows = [_row(name, [m], turns) for name, m in first]
        rows.append(_row("step linears", order, max(5, turns // 3)))
    rows[-1]["shape"] = f"{len(order)} linears"
    return rows


def forward_floor(model, context: int, turns: int = 15) -> dict | None:
    """The whole bare forward at batch 1 (`decode_step`, `context` tokens of KV) against its
    memory floor: the probe reading the bytes of every linear's weights and the head, what a
    decode step must read whatever engine runs it (the KV rows it also reads are left out).
    Alternating turns; `over_floor` is the median of each turn's forward over its probe read.
    None where labkit's kernels do not serve every linear."""
    linears = _step_linears(model)
    if linears is None:
        return None
    from labkit.bench.quant import decode_step

    step = decode_step(model, 1, context)
    with torch.inference_mode():
        pair = _Pair(linears[1])
        step()
        fwd, read = _alternate(step, pair.read, turns)
        read = [r * pair.read_scale for r in read]
    return {"forward_ms": statistics.median(fwd) * 1e3,
            "floor_ms": statistics.median(read) * 1e3, "bytes": pair.nbytes,
            "over_floor": statistics.median(f / r for f, r in zip(fwd, read)),
            "context": context, "threads": torch.get_num_threads(), "probe": pair.probe}


def step_read_ratio(model):
    """A sampler for `claims.measure`: each call times one pass over a step's linears at batch 1
    (every layer's, then the head) and one probe read of the same bytes, the order swapped
    every call, and returns the probe's time over the pass's (1.0: the kernels read their
    weights as fast as this CPU reads bytes and does nothing else). None where labkit's kernels
    do not serve every linear."""
    linears = _step_linears(model)
    if linears is None:
        return None
    with torch.inference_mode():
        pair = _Pair(linears[1])
    calls = [0]

    def sample() -> float:
        calls[0] += 1
        with torch.inference_mode():
            if calls[0] % 2:
                kern, read = _timed(pair.one_pass), _timed(pair.read)
            else:
                read, kern = _timed(pair.read), _timed(pair.one_pass)
        return read * pair.read_scale / kern

    return sample


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
                 "kernel's, 1.00x = reading as fast as the CPU reads; the step's probe read "
                 f"{rows[-1]['probe']})" if rows else "")
    return "\n".join(lines)

"""This machine's ceilings, measured: the roofline's two numbers without a datasheet.

The peak FLOP/s is the best rate of square matmuls in each dtype (2 n^3 FLOPs over the time);
the bandwidth is the best rate of a large copy into a buffer that already exists (bytes read +
bytes written, over the time). A ceiling is the best the machine achieves, not its average, so
each number is the fastest of repeated timings within a budget of a few seconds. The result is
a `Hardware`, like the datasheet presets in `labkit/roofline.py`, cached in memory and on disk
($LABKIT_CACHE, else ~/.cache/labkit); a measurement taken while other processes kept the cores
busy is labelled and not cached. `measure_decode_step` times a real model's decode step, to hold
against the floor that `roofline.step_cost` predicts from these ceilings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

from labkit import claims
from labkit.model import ModelConfig
from labkit.roofline import TORCH_DTYPES, Hardware, _hw_key, get_hardware, step_cost
from labkit.utils import pages
from labkit.utils.cache import cache_dir
from labkit.utils.progress import progress

# ---------------------------------------------------------------------------------------------
# measured ceilings of this machine

_CEILINGS: dict[str, Hardware] = {}  # in-process cache, keyed like the files on disk
_CEILINGS_VERSION = 3  # bump when the measurement changes: cached files go stale


def device_name(device: torch.device) -> str:
    """The CPU model or GPU name, for the cache key and the sources."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, where work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of fn: CUDA events on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner  # elapsed_time is in ms
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _best_of(fn: Callable[[], object], device: torch.device, budget_s: float, inner: int = 1,
             min_reps: int = 3) -> tuple[float, int]:
    """The fastest of repeated timings within a time budget: a ceiling is the best achieved."""
    deadline = time.perf_counter() + budget_s
    best, reps = math.inf, 0
    while reps < min_reps or (time.perf_counter() < deadline and reps < 200):
        best, reps = min(best, _timed(fn, device, inner)), reps + 1
    return best, reps


class _CopyProbe:
    """The bandwidth ceiling's measurement: a large copy into a preallocated buffer, counted as
    (bytes read + bytes written) / time. The ceiling, its staleness check and the probe beside
    each decode step (`StepOverFloor`) all time this one copy, so their numbers compare."""

    def __init__(self, device: torch.device):
        # the buffers must dwarf the last-level cache (32 MiB on this course's CPUs, 50 MiB L2
        # on an H100); both are allocated and touched before timing: a fresh allocation
        # (clone()) would time the page faults of new memory, not the memory itself
        self.device = device
        self.mib = 1024 if device.type == "cuda" else 128
        # (on a CPU in the pages labkit keeps a model's weights in: labkit.utils.pages)
        nbytes = self.mib * 2**20
        if device.type == "cpu":
            self.src = pages.empty(nbytes).view(torch.float32).fill_(1.0)
            self.dst = pages.empty(nbytes).view(torch.float32).fill_(0.0)
        else:
            self.src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
            self.dst = torch.empty_like(self.src).fill_(0.0)
        self.copy()  # warm-up
        _sync(device)

    def copy(self) -> None:
        self.dst.copy_(self.src)

    def rate(self, seconds: float) -> float:
        """Bytes/s of one copy that took `seconds`: it read and wrote the buffer once each."""
        return 2 * self.src.numel() * 4 / seconds

    def once(self) -> float:
        """Bytes/s of one timed copy, now."""
        return self.rate(_timed(self.copy, self.device))


def _measure_bandwidth(device: torch.device, budget_s: float) -> tuple[float, str]:
    """Bytes/s of a large copy into a preallocated buffer: (bytes read + written) / time."""
    probe = _CopyProbe(device)
    seconds, reps = _best_of(probe.copy, device, budget_s)
    source = (f"measured: copy of {probe.mib} MiB into a preallocated buffer, (bytes read + "
              f"bytes written) / time, best of {reps}")
    return probe.rate(seconds), source


STALE_BANDWIDTH = 1.15  # a quick copy this much faster than the cached ceiling: measure again


def _quick_bandwidth(device: torch.device) -> float:
    """The ceiling's copy, best of three: the cached ceiling's sanity check."""
    probe = _CopyProbe(device)
    return max(probe.once() for _ in range(3))


def _matmul_call(n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
                 ) -> Callable[[], torch.Tensor]:
    """A zero-argument call of an [n, n] @ [n, n] matmul into a preallocated output."""
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)  # a, b, c: [n, n]
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    c = torch.empty(n, n, dtype=dtype, device=device)
    return lambda: torch.matmul(a, b, out=c)


def _measure_matmul(device: torch.device, dtype: str, budget_s: float) -> tuple[float, str]:
    """FLOP/s of a square matmul in one dtype: 2 n^3 FLOPs over the best time."""
    tdt = TORCH_DTYPES[dtype]
    max_n = 8192 if device.type == "cuda" else 2048
    inner = 10 if device.type == "cuda" else 1  # one GPU matmul is too short to time alone
    gen = torch.Generator(device=device).manual_seed(0)  # on the device: no host copies
    cuda = device.type == "cuda"
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else False
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"  # fp32 means true fp32
    try:
        # the dtype's first matmul (library set-up, kernel generation) is not charged to the
        # budget: on a busy machine it once took the whole budget, and bf16 was cached at n=128
        _matmul_call(128, tdt, device, gen)()
        _sync(device)
        deadline = time.perf_counter() + budget_s
        n, prev_rate, best = 128, 0.0, (0.0, 0, 0)  # best: (FLOP/s, n, timed calls)
        while True:
            call = _matmul_call(n, tdt, device, gen)
            call()  # warm-up: kernel selection, lazy init
            t = min(_timed(call, device, inner) for _ in range(3))  # one slow call decides less
            rate = 2 * n**3 / t
            best = max(best, (rate, n, 3))
            # grow n while one call of the next size (8x the work) fits in the budget, and
            # either this call is too short to time well or the rate still climbs: small
            # matmuls pay fixed costs (thread wake-ups; on a busy machine, whole scheduler
            # slices). Sized by time, not FLOPs, because some dtypes run 100x slower on a CPU
            # without native support (bf16 without AVX512-BF16 or AMX).
            if (n >= max_n or 8 * t * inner > deadline - time.perf_counter()
                    or (t * inner > 0.02 and rate < 1.3 * prev_rate)):
                break
            n, prev_rate = n * 2, rate
        seconds, reps = _best_of(call, device, max(0.0, deadline - time.perf_counter()), inner,
                                 min_reps=1)
        best = max(best, (2 * n**3 / seconds, n, reps + 3))
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    rate, n, reps = best
    return rate, f"{dtype}: {n}x{n} matmul, best of {reps}"


def _memory_size(device: torch.device) -> tuple[float | None, str]:
    """Bytes of memory of the device (GPU) or of the machine (CPU), and how we know."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total), "torch.cuda.get_device_properties().total_memory"
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return float(total), "os.sysconf: physical pages x page size"
    except (AttributeError, ValueError, OSError):
        return None, "unknown on this OS"


def measure_ceilings(device: str | torch.device = "cpu", dtypes: Sequence[str] | None = None,
                     budget_s: float = 3.0, refresh: bool = False) -> Hardware:
    """This machine's ceilings, measured once in a few seconds, then cached (memory, disk)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("measure_ceilings('cuda'): no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"measure_ceilings: device must be cpu or cuda, got {dev}")
    if dtypes is None:
        dtypes = ("fp32", "bf16") if dev.type == "cpu" else ("fp32", "tf32", "bf16", "fp16")
    dtypes = tuple(dtypes)
    for dt in dtypes:
        if dt not in TORCH_DTYPES or (dt == "tf32" and dev.type != "cuda"):
            raise ValueError(f"measure_ceilings: cannot measure {dt!r} on {dev.type}")
    # the numbers depend on the chip, the thread count and the library versions
    # (and on the pages the copy reads: 2 MiB or 4 KiB, labkit.utils.pages)
    ident = json.dumps([_CEILINGS_VERSION, dev.type, device_name(dev), torch.get_num_threads(),
                        torch.__version__, dtypes, budget_s, pages.huge_pages() is None])
    key = f"ceilings-{dev.type}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    path = cache_dir() / f"{key}.json"
    if not refresh:
        if key in _CEILINGS:
            return _CEILINGS[key]
        try:
            cached = Hardware(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            cached = None  # not measured yet on this machine (or an unreadable file)
        # a ceiling is the best the machine does; one measured while a neighbour we cannot see
        # (another VM on the host) held the memory stays low for good, and every floor built
        # on it is too high (seen: 12.8 GB/s cached, 20.5 measured quiet). Three copies (a
        # fraction of a second) tell: clearly faster than the cache, and it is measured again
        if cached is not None and _quick_bandwidth(dev) <= STALE_BANDWIDTH * cached.bandwidth:
            _CEILINGS[key] = cached
            return cached
    # other processes competing for the cores make every number low: such a measurement is
    # used, labelled, but not written to disk for later runs
    start = claims.cpu_seconds() if dev.type == "cpu" else None
    # a few seconds: say so while it runs (stderr, or a widget in a notebook and the explorer)
    with progress(desc=f"measuring this machine's ceilings ({dev.type}, about {budget_s:g} s)",
                  total=1 + len(dtypes), unit="ceiling", leave=False) as bar:
        bandwidth, bw_source = _measure_bandwidth(dev, 0.35 * budget_s)
        bar.update()
        flops = {}
        for dt in dtypes:
            flops[dt] = _measure_matmul(dev, dt, 0.55 * budget_s / len(dtypes))
            bar.update()
    busy = claims.busy_elsewhere(start)
    busy = busy if busy > 0.25 else 0.0  # a quarter core: background noise
    memory, mem_source = _memory_size(dev)
    where = (f"{device_name(dev)}, torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads" if dev.type == "cpu" else f"{device_name(dev)}, CUDA events")
    note = f" [other processes kept {busy:.1f} cores busy: low numbers, not cached]" if busy \
        else ""

    hw = Hardware(
        name=f"this machine ({dev.type})", peak_flops={dt: f for dt, (f, _) in flops.items()},
        bandwidth=bandwidth, memory=memory,
        flops_source=f"measured on {where}: " + "; ".join(s for _, s in flops.values()) + note,
        bandwidth_source=f"{bw_source} ({where}){note}", memory_source=mem_source)
    _CEILINGS[key] = hw
    if busy:
        return hw
    try:  # write atomically: a concurrent reader sees the old file or the new one, never half
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(hw.as_dict(), f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory costs a re-measurement next time, nothing else
    return hw


# ---------------------------------------------------------------------------------------------
# measuring a real decode step


class _RandomKVAttention:
    """Decode-only attention over a preallocated random KV context (for timing a step)."""

    def __init__(self, cfg: ModelConfig, batch: int, context_len: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, cfg.num_kv_heads, context_len, cfg.head_dim)  # [B, Hkv, L, D]
        self.k = [torch.randn(shape, generator=gen).to(device, dtype)
                  for _ in range(cfg.num_layers)]
        self.v = [torch.randn(shape, generator=gen).to(device, dtype)
                  for _ in range(cfg.num_layers)]
        self.cfg = cfg

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Write the new K, V into the last slot; attend each sequence's query over it all."""
        # q: [B, H, D]; k, v: [B, Hkv, D] (one new token per sequence)
        cfg, b = self.cfg, q.shape[0]
        k_cache, v_cache = self.k[layer], self.v[layer]  # [B, Hkv, L, D]
        k_cache[:, :, -1] = k
        v_cache[:, :, -1] = v
        # query head h uses KV head h // G: a group's G query heads attend as G rows of one head,
        # so each KV head is read once, as a GQA kernel does
        g = cfg.num_heads // cfg.num_kv_heads
        qg = q.view(b, cfg.num_kv_heads, g, cfg.head_dim)  # [B, Hkv, G, D]
        o = F.scaled_dot_product_attention(qg, k_cache, v_cache)  # [B, Hkv, G, D]
        return o.reshape(b, cfg.num_heads, cfg.head_dim)  # [B, H, D]


def measure_decode_step(model: torch.nn.Module, batch: int = 1, context_len: int = 1024,
                        repeats: int = 5) -> float:
    """Median seconds of the model's forward for one decode token per sequence."""
    if batch < 1 or context_len < 1 or repeats < 1:
        raise ValueError("batch, context_len and repeats must be >= 1")
    cfg = model.cfg
    param = next(model.parameters())
    attn = _RandomKVAttention(cfg, batch, context_len, param.dtype, param.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(cfg.vocab_size, (batch,), generator=gen).to(param.device)  # [B]
    positions = torch.full((batch,), context_len - 1, device=param.device)  # [B]
    model(ids, positions, attn)  # warm-up: allocator, kernel selection
    times = []
    for _ in range(repeats):
        _sync(param.device)
        t0 = time.perf_counter()
        model(ids, positions, attn)
        _sync(param.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StepOverFloor:
    """A sampler for `claims.measure`: one decode step's time over its floor, where the floor
    uses the memory bandwidth measured *in the same pair*.

    Each call times one bandwidth probe (the ceiling's own copy) and one decode step, in
    alternating order, and computes the floor at the bandwidth the probe achieved just now.
    Another program's load then slows both sides alike, and a cached ceiling measured at a
    busy (or unusually quiet) moment does not decide the floor.
    """

    def __init__(self, model: torch.nn.Module, hw: Hardware, batch: int = 1,
                 context_len: int = 1024, dtype: str = "fp32"):
        self.step_cost = lambda bandwidth: step_cost(
            model.cfg, batch, context_len, "decode", dtype, dtype,
            dataclasses.replace(hw, bandwidth=bandwidth))
        self.hw = hw
        self.device = next(model.parameters()).device
        self.step = lambda: measure_decode_step(model, batch, context_len, repeats=1)
        self.copy_probe = _CopyProbe(self.device)
        self.calls = 0
        self.bandwidths: list[float] = []  # bytes/s of each pair's probe

    def _probe(self) -> float:
        return self.copy_probe.once()  # bytes read + written, as the ceiling

    def __call__(self) -> float:
        """step seconds / floor seconds at this pair's bandwidth."""
        first = self.calls % 2 == 0
        self.calls += 1
        bw = self._probe() if first else None
        step_s = self.step()
        bw = self._probe() if bw is None else bw
        # the floor uses the bandwidth of this moment, as measured beside the step, even above
        # the cached ceiling: a ceiling measured while a neighbour (another VM on the host, no
        # load this machine can see) shared the memory stays low, and capping at it once put a
        # step at 0.85x its floor (ceiling 12.8 GB/s, probes ~19). The probe still binds the
        # claim: a step faster than its bytes at the probe's own rate fails it
        self.bandwidths.append(bw)
        return step_s / self.step_cost(bw).floor_s


def resolve_hardware(name: str | Hardware) -> Hardware:
    """A preset by name, or "this" (also "this machine", "measured"): this machine's measured
    ceilings, CUDA if present."""
    if isinstance(name, str) and _hw_key(name) in ("THIS", "THISMACHINE", "MEASURED"):
        return measure_ceilings("cuda" if torch.cuda.is_available() else "cpu")
    return get_hardware(name)

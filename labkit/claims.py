"""Timing claims that survive a busy machine and can still fail (STYLE rule 15).

A notebook's timing claim is held against a number measured many times over, each sample from
one *pair* of runs taken in alternating order (A then B, then B then A), so that another
program's load hits both sides alike. `measure` keeps drawing samples until the median's band
(about two robust standard errors wide on each side, drawn from the samples' own spread) is
narrow enough to decide, or a cap is reached; `hold` asserts the claim against that band, with
a message that says what was measured and why it falls outside.

    est = measure(lambda: one_pair_difference(), n=5, max_n=12, width=0.5 * extra_ms)
    hold(est, 0.9 * extra_ms, 1.1 * extra_ms, "step growth (ms)", below="...", above="...")

Alternating turns cannot fix one thing: a computation split over more threads than there are
free cores. Every operator waits at its end for its slowest thread, and a thread that shares a
core with another program is descheduled for whole time slices, so a step of a few hundred
small operators slows by several times, and unevenly. Beside one busy core, SmolLM2's fp32
decode step took 156 ms at 2 threads and 59 ms at 1; with torch's int4 kernel (more parallel
sections per byte than an fp32 matmul) an int4 step was 4x slower than fp32 at 2 threads and
1.6x faster at 1. `timing_threads` counts the cores other programs keep busy, and
`torch_threads` runs a measurement on the cores that are left.

Nor can it fix a measurement taken while other programs kept the cores busy for most of it:
both sides slow, but not alike when one side runs more threads or more small operators. So
`measure` records how many cores other processes kept busy while it sampled, and when `hold`
finds a claim false on such a loaded estimate, it says so and measures again (up to
`REMEASURES` times): the claim fails only when a quiet-enough measurement, or every one of the
re-measurements, finds it false; one that holds settles it. A false claim still fails, loaded
or not; a true one is no longer failed by one busy minute.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

# a measurement during which other processes kept at least this many cores busy (on average)
# is "under load": a false verdict from it is re-measured rather than trusted
LOADED_CORES = 0.5
REMEASURES = 3  # at most this many re-measurements of a claim found false under load


@dataclass(frozen=True)
class Estimate:
    """Samples of one quantity; their median and a band around it from their spread.

    `busy`: the cores other processes kept busy while the samples were drawn (None: unknown);
    `remeasure`: draws a fresh estimate the same way (None: it cannot be re-measured).
    """

    samples: tuple[float, ...]
    busy: float | None = None
    remeasure: Callable[[], Estimate] | None = field(default=None, compare=False, repr=False)

    @property
    def loaded(self) -> bool:
        """Whether other processes kept the cores busy while it was measured."""
        return self.busy is not None and self.busy >= LOADED_CORES

    @property
    def median(self) -> float:
        """The median sample: what one busy moment cannot drag far."""
        return statistics.median(self.samples)

    @property
    def halfwidth(self) -> float:
        """Two robust standard errors of the median: 2 x 1.25 x 1.48 MAD / sqrt(n)."""
        mad = statistics.median(abs(x - self.median) for x in self.samples)
        return 2 * 1.253 * 1.4826 * mad / math.sqrt(len(self.samples))

    @property
    def band(self) -> tuple[float, float]:
        """(low, high): the median plus or minus its half-width."""
        return self.median - self.halfwidth, self.median + self.halfwidth

    def __str__(self) -> str:
        lo, hi = self.band
        return (f"median {self.median:.4g} (band {lo:.4g} to {hi:.4g} over {len(self.samples)} "
                f"samples, from {min(self.samples):.4g} to {max(self.samples):.4g})")


def measure(sample: Callable[[], float], n: int = 5, max_n: int = 15,
            width: float | None = None) -> Estimate:
    """Draw `n` samples, then more (up to `max_n`) while the band is wider than `width`
    on either side of the median (None: no re-measuring). The estimate records the cores other
    processes kept busy meanwhile, and how to measure it again (at this torch thread count)."""
    threads = torch.get_num_threads()
    start = cpu_seconds()
    xs = [float(sample()) for _ in range(n)]
    while width is not None and len(xs) < max_n and Estimate(tuple(xs)).halfwidth > width:
        xs.append(float(sample()))

    def again() -> Estimate:
        with torch_threads(threads):
            return measure(sample, n, max_n, width)

    return Estimate(tuple(xs), busy=busy_elsewhere(start) if start else None, remeasure=again)


def load_note() -> str:
    """The machine's load, for a message: a failed timing claim should say how busy it was."""
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except OSError:
        return f"{os.cpu_count()} CPUs"


def refutes(est: Estimate, low: float, high: float) -> bool:
    """Whether `est` says, beyond its own spread, that the value is outside [low, high]."""
    lo, hi = est.band
    return hi < low or lo > high or (not low <= est.median <= high and hi - lo < high - low)


def _busy_note(est: Estimate) -> str:
    return "" if est.busy is None else f"other processes kept {est.busy:.1f} cores busy"


def hold(est: Estimate, low: float, high: float, what: str, below: str = "",
         above: str = "", remeasures: int = REMEASURES) -> None:
    """Assert the claim `low <= value <= high` on a measured estimate.

    It holds when the median's band overlaps [low, high] and the median itself is inside it
    or the band is too narrow to exclude it; it fails when the band lies wholly outside: the
    measurement says, beyond its own spread, that the claim is false. A false verdict from an
    estimate measured under load (other processes kept `LOADED_CORES` or more busy) is
    inconclusive: it is printed, with the load, and the claim is measured again, up to
    `remeasures` times. It fails when a quiet-enough estimate refutes it, or every re-measure
    does. `below` / `above`: what a value on that side would mean, for the message.
    """
    tried = [est]
    while refutes(est, low, high) and est.loaded and est.remeasure is not None and (
            len(tried) <= remeasures):
        print(f"{what}: measured {est} while {_busy_note(est)}: inconclusive under load, "
              f"measuring again ({len(tried)} of {remeasures})", flush=True)
        est = est.remeasure()
        tried.append(est)
    if refutes(est, low, high):
        side, why = ("below", below) if est.median < low else ("above", above)
        history = ""
        if len(tried) > 1:
            history = (f"; measured {len(tried)} times, every time outside (medians "
                       + ", ".join(f"{t.median:.4g}" for t in tried) + ")")
        busy = f"; {_busy_note(est)}" if est.busy is not None else ""
        raise AssertionError(
            f"{what}: measured {est}, {side} the claim's range {low:.4g} to {high:.4g}"
            + (f": {why}" if why else "") + f" ({load_note()}{busy}{history})")
    if len(tried) > 1:
        print(f"{what}: the re-measure holds: {est}", flush=True)


def cpu_seconds() -> tuple[float, float, float] | None:
    """(CPU-seconds all cores spent busy, of them by this process and its children, wall
    clock); None off Linux. Children count as this program's own: the simulated device is a
    child process, and its work is the measurement, not another program's load."""
    try:  # /proc/stat: cpu user nice system idle iowait irq softirq steal ... (in clock ticks)
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # steal counts as busy: the host gave it away
    hz = os.sysconf("SC_CLK_TCK")
    return busy / hz, time.process_time() + children_cpu_s(hz), time.perf_counter()


def children_cpu_s(hz: int) -> float:
    """CPU seconds of this process's live descendants (from /proc/<pid>/stat: utime, stime):
    children and theirs (a simulated device forked by the fork server is a grandchild)."""
    me = os.getpid()
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # after the command's ")": state ppid ... utime (12th) stime (13th)
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
        pid = int(entry.name)
        kids.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / hz
    total, todo = 0.0, list(kids.get(me, ()))
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += kids.get(pid, ())
    return total


def busy_elsewhere(since: tuple[float, float, float] | None) -> float:
    """Cores kept busy by other processes since `since` (0 if unknown)."""
    now = cpu_seconds()
    if since is None or now is None:
        return 0.0
    return max(0.0, ((now[0] - since[0]) - (now[1] - since[1])) / (now[2] - since[2]))


def timing_threads(wanted: int | None = None, window_s: float = 0.5) -> int:
    """Threads a timing should use: `wanted` (default: torch's count), less one per core that
    other programs kept busy over the last `window_s` seconds (at least 1)."""
    wanted = torch.get_num_threads() if wanted is None else wanted
    start = cpu_seconds()
    time.sleep(window_s)
    free = (os.cpu_count() or 1) - busy_elsewhere(start)
    return max(1, min(wanted, math.floor(free + 0.25)))  # a core 75% busy is not free


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with `n` torch threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)

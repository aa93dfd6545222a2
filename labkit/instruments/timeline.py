"""Seeing the bubble: spans of every step on three lanes, a Gantt plot, the bubble fraction.

Lanes: `host` (plan, the prefill/decode/mixed launch, wait, commit, and the sample-and-copy
launch, as measured by the decoder),
`compute` (the device's forwards and samples) and `copy` (device-to-host copies). Device spans
come from the device itself: the simulated accelerator process records them in shared memory,
a GPU from CUDA events. The *bubble fraction* is the share of the run's wall time in which the
compute lane is idle.

    with Timeline.record(engine) as tl:
        labkit.run(engine, "blocking")
    tl.plot(); print(tl.bubble_fraction())
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """One interval of work on one lane."""

    lane: str  # "host", "compute", "copy", or "link" (a command's travel to the device)
    label: str
    step: int
    t0: float  # seconds, time.perf_counter() clock (shared by the host and device processes)
    t1: float

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.t1 - self.t0


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def idle_fraction(busy: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Share of the window [t0, t1] that no busy interval covers (intervals may overlap)."""
    return 1.0 - union_length(busy) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class Timeline:
    """All spans of a recorded run."""

    spans: list[Span] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0

    def add(self, lane: str, label: str, step: int, t0: float, t1: float) -> None:
        """Record a span."""
        self.spans.append(Span(lane, label, step, t0, t1))

    @staticmethod
    @contextlib.contextmanager
    def record(engine):
        """Record host spans during the block, then collect the device's spans."""
        tl = Timeline()
        engine.device.spans()  # drop anything recorded before
        engine.timeline = tl
        tl.t_start = time.perf_counter()
        try:
            yield tl
        finally:
            tl.t_end = time.perf_counter()
            engine.timeline = None
            for lane, op, step, t0, t1 in engine.device.spans():
                tl.add(lane, op, step, t0, t1)

    def lane(self, lane: str) -> list[Span]:
        """Spans of one lane, in time order."""
        return sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.t0)

    def busy(self, lane: str) -> float:
        """Seconds the lane was doing something."""
        return union_length([(s.t0, s.t1) for s in self.lane(lane)])

    @property
    def wall(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        if not self.spans:
            return 0.0
        return max(s.t1 for s in self.spans) - min(s.t0 for s in self.spans)

    def bubble_fraction(self) -> float:
        """Share of the wall time the compute lane sat idle."""
        if not self.spans:
            return 0.0
        t0, t1 = min(s.t0 for s in self.spans), max(s.t1 for s in self.spans)
        return idle_fraction([(s.t0, s.t1) for s in self.lane("compute")], t0, t1)

    def per_step(self) -> dict[str, float]:
        """Mean host work and device seconds per step (host: not counting waits)."""
        steps = {s.step for s in self.spans if s.lane == "compute"}
        n = max(1, len(steps))
        host = union_length([(s.t0, s.t1) for s in self.lane("host") if s.label != "wait"])
        return {"host_s": host / n, "device_s": self.busy("compute") / n, "steps": len(steps)}

    def plot(self, ax=None, title: str = "", window: tuple[int, int] | None = None):
        """A Gantt chart of the three lanes, device idle time shaded; returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(11, 2.6))
        lanes = ["copy", "compute", "host"]
        spans = [s for s in self.spans if s.lane in lanes]  # not the link's travel spans
        if window is not None:  # only steps window[0] <= step < window[1]
            spans = [s for s in spans if window[0] <= s.step < window[1]]
        if not spans:
            return ax
        t0 = min(s.t0 for s in spans)
        t1 = max(s.t1 for s in spans)
        colors = {"forward": "tab:blue", "sample": "tab:cyan", "recv": "slategray",
                  "unpack": "lightsteelblue", "dispatch": "silver", "copy": "tab:purple",
                  "plan": "gold", "decode": "tab:orange", "prefill": "tab:brown",
                  "mixed": "chocolate",
                  "commit": "tab:red", "wait": "lightgray"}
        for s in spans:
            y = lanes.index(s.lane)
            ax.barh(y, (s.t1 - s.t0) * 1e3, left=(s.t0 - t0) * 1e3, height=0.6,
                    color=colors.get(s.label, "tab:green"), edgecolor="none")
        # shade the compute lane's idle gaps: the bubble
        busy = sorted((s.t0, s.t1) for s in spans if s.lane == "compute")
        end = t0
        for a, b in busy:
            if a > end:
                ax.axvspan((end - t0) * 1e3, (a - t0) * 1e3, ymin=0.36, ymax=0.64,
                           color="red", alpha=0.15)
            end = max(end, b)
        ax.set_yticks(range(3), lanes)
        ax.set_xlabel("ms")
        ax.set_xlim(0, (t1 - t0) * 1e3)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        handles.append(plt.Rectangle((0, 0), 1, 1, color="red", alpha=0.15))
        ax.legend(handles, [*colors, "device idle"], ncol=7, fontsize=7, loc="upper right",
                  bbox_to_anchor=(1, 1.32))
        ax.set_title(title, fontsize=9, loc="left")
        return ax

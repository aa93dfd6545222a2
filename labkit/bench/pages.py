"""The same bytes read from 2 MiB pages and from 4 KiB pages (labkit.utils.pages), by labkit's
read probe: notebook 03 section 7's claim and `scripts/huge_pages_compare.py --pairs`.

Where the kernel puts a buffer's pages is luck, and the luck lasts as long as the buffer: two
buffers both in 4 KiB pages, read with one thread on the course's VM, differ by up to 1.17x
(the one allocated first mostly the slower), and which of them is the slow one does not change
from turn to turn (results/cpu-kernels-2026-12-05d.md). One buffer of each kind then measures
the luck as much as the page size. So `read_gain` holds `buffers` of each kind, each kind
allocated first as often as the other (for an even count), and reads all of them every turn,
forth then back (A1 B1 B2 A2 .. A2 B2 B1 A1): a turn's ratio is the 4 KiB buffers' summed time
over the 2 MiB ones'. With four of each, two kinds of 4 KiB buffer read 0.98-1.07x apart, quiet
or beside a busy core, while 4 KiB against 2 MiB read 1.17-1.43x: in a loop of calls every
other one gave 1.17-1.21x, likely because its 4 KiB buffers took the memory the call before's
2 MiB pages had just freed, physically contiguous (a walk is cheaper over such pages).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from labkit import claims


@dataclass(frozen=True)
class PageGain:
    """`gain`: 4 KiB's time over 2 MiB's, turn by turn (claims.Estimate); `rates`: {kind: GB/s}
    (the median turn); `huge`: the least share of a "2 MiB" buffer the kernel gave in 2 MiB
    pages (with `control`, those buffers are in 4 KiB pages for certain: 0)."""

    gain: claims.Estimate
    rates: dict[str, float]
    huge: float


def read_gain(nbytes: int, buffers: int = 4, reads: int = 3, n: int = 7,
              control: bool = False) -> PageGain:
    """Measure how much faster `nbytes` read from 2 MiB pages than from 4 KiB pages, with the
    caller's torch threads. `control`: both kinds in 4 KiB pages (what luck alone gives: the
    claim on the real comparison must clear it). Raises where it cannot compare (no 2 MiB
    pages here, or labkit's kernels not built), saying why."""
    from labkit.kernels import cpu as cpu_kernels
    from labkit.utils import pages

    if pages.huge_pages() is not None and not control:
        raise RuntimeError(f"no 2 MiB pages to compare: {pages.huge_pages()}")
    built = cpu_kernels.kernels()
    if built is None:
        raise RuntimeError("labkit's C++ kernels (the read probe) are not built here")
    if buffers < 1 or reads < 1 or nbytes < 1:
        raise ValueError(f"buffers, reads and nbytes must be positive: {buffers}, {reads}, "
                         f"{nbytes}")
    def buffer(huge: bool):  # written, so its pages are really mapped
        def make():
            # where memory is fragmented the kernel may give a buffer no 2 MiB pages at all:
            # ask again (its compaction runs meanwhile), up to 3 times, and keep the best
            tries = [pages.empty(nbytes, huge=huge).fill_(1)]
            while huge and len(tries) < 3 and pages.huge_bytes(tries[-1]) < nbytes // 2:
                tries.append(pages.empty(nbytes, huge=True).fill_(1))
            return max(tries, key=pages.huge_bytes)
        return make

    make = {"4 KiB": buffer(False), "2 MiB": buffer(not control)}
    bufs = []
    for i in range(buffers):  # which kind is allocated first alternates
        for kind in (list(make) if i % 2 == 0 else list(make)[::-1]):
            bufs.append((kind, make[kind]()))
    huge = min(min(1.0, pages.huge_bytes(b) / nbytes) for k, b in bufs if k == "2 MiB")
    turns: dict[str, list[float]] = {k: [] for k in make}  # seconds per buffer read, per turn

    def sample() -> float:
        took = dict.fromkeys(make, 0.0)
        for kind, buf in bufs + bufs[::-1]:
            t0 = time.perf_counter()
            for _ in range(reads):
                built.read_probe(buf)
            took[kind] += time.perf_counter() - t0
        for kind in make:
            turns[kind].append(took[kind] / (2 * buffers * reads))
        return took["4 KiB"] / took["2 MiB"]

    gain = claims.measure(sample, n=n)
    rates = {k: nbytes / statistics.median(v) / 1e9 for k, v in turns.items()}
    return PageGain(gain, rates, huge)

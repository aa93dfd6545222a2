"""Chapter 06's graders: the bubble fraction of a timeline and the cost model of a blocking step."""

from __future__ import annotations

from collections.abc import Callable

from labkit.graders.common import diagnose


def _covered(intervals: list[tuple[float, float]], presorted: bool = False) -> float:
    """Length covered by intervals (merged after sorting them, unless `presorted`)."""
    total, end = 0.0, float("-inf")
    for a, b in (intervals if presorted else sorted(intervals)):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def grade_bubble_fraction(fn: Callable) -> str:
    """Grade an answer to exercise `bubble_fraction` (exercises/ch06_gpu_bubble.py)."""
    runs = [  # (busy intervals of the compute lane, unsorted and overlapping; window t0, t1)
        ([(0.5, 1.0), (0.0, 0.2), (0.8, 1.3), (1.5, 1.6)], 0.0, 2.5),
        ([(1.1, 1.9), (1.2, 1.4), (3.0, 3.5), (0.2, 0.6)], -0.5, 4.0),
        ([(2.0, 2.5), (2.5, 3.0), (5.0, 6.0)], 1.0, 7.0),
        ([], 0.0, 1.0),
    ]
    cases = []
    for busy, t0, t1 in runs:
        got = float(fn(list(busy), t0, t1))
        width = t1 - t0
        # the reference: the share of [t0, t1] that no busy interval covers
        want = 1 - _covered(busy) / width
        first_last = (max(b for _, b in busy) - min(a for a, _ in busy)) if busy else width
        cases.append((f"({busy}, {t0}, {t1})", got, want, {
            "Summed the spans' lengths: overlapping spans count once (merge them, or measure "
            "their union).": 1 - sum(b - a for a, b in busy) / width,
            "That is the busy share: the bubble is the idle share, 1 - busy / wall.":
                _covered(busy) / width,
            "Merged the spans without sorting them first: sort by start time.":
                1 - _covered(busy, presorted=True) / width,
            "Measured the wall from the first span to the last: the window is t0 to t1.":
                1 - _covered(busy) / first_last,
            "A percentage: return a fraction in [0, 1].": 100 * want,
        }))
    diagnose("bubble_fraction", cases)
    return "exact on unsorted, overlapping and empty lanes"


def grade_cost_model(fn: Callable) -> str:
    """Grade an answer to exercise `cost_model` (exercises/ch06_gpu_bubble.py)."""
    runs = [  # (decode launch times of a blocking run, host work and device busy of each step)
        ([0.0, 5.0e-3, 10.5e-3, 15.0e-3, 20.5e-3], [2.0e-3, 2.2e-3, 1.8e-3, 2.0e-3, 4.0e-3],
         [2.5e-3, 2.6e-3, 2.4e-3, 2.5e-3, 1.0e-3]),
        ([0.0, 2.0e-3, 4.2e-3, 6.1e-3], [1.5e-3, 1.6e-3, 1.4e-3, 0.9e-3],
         [0.3e-3, 0.2e-3, 0.4e-3, 0.9e-3]),
        ([1.0, 1.004, 1.0079, 1.0121, 1.016, 1.0201], [1e-3, 1.1e-3, 0.9e-3, 1e-3, 1e-3, 3e-3],
         [2.5e-3, 2.4e-3, 2.6e-3, 2.5e-3, 2.5e-3, 0.5e-3]),
    ]
    terms = {"t_host": [], "t_device": [], "predicted": []}
    for launch, host, device in runs:
        got = fn(list(launch), list(host), list(device))
        if not (isinstance(got, tuple | list) and len(got) == 3):
            raise AssertionError(f"cost_model returned {got!r}; return a tuple (t_host, "
                                 "t_device, predicted)")
        n = len(launch) - 1  # periods between launches: the last step's own period is unknown
        step = (launch[-1] - launch[0]) / n
        t_host, t_dev = sum(host[:n]) / n, sum(device[:n]) / n  # the steps that begin them
        want = (t_host, t_dev, step / max(t_host, t_dev))
        host_all, dev_all = sum(host) / len(host), sum(device) / len(device)
        step_n = (launch[-1] - launch[0]) / len(launch)
        label = f"(launch_s={launch}, host_s={host}, device_s={device})"
        last = ("Averaged every step: the last launch begins no measured period, so leave its "
                "{} out.")
        wrong = [{last.format("host work"): host_all}, {last.format("device time"): dev_all}, {
            "Divided the launch-to-launch span by the number of steps: n launches make n - 1 "
            "periods.": step_n / max(t_host, t_dev),
            "Divided by the shorter term: a pipelined step costs the longer of the two, "
            "max(T_host, T_device).": step / min(t_host, t_dev),
            "A blocking step is the whole period, round trips included, not T_host + T_device: "
            "the pipeline hides the round trips too.": (t_host + t_dev) / max(t_host, t_dev),
            "That is the pipelined step's share of the blocking one, the inverse of the speedup.":
                max(t_host, t_dev) / step,
        }]
        for i, key in enumerate(terms):
            terms[key].append((label, float(got[i]), want[i], wrong[i]))
    for key, cases in terms.items():
        diagnose(f"cost_model's {key} ", cases)
    return "T_host, T_device and the predicted speedup exact on three blocking runs"

"""Chapter 06 exercises: measure the bubble and predict what a pipeline can win. Fill in each
function, then run `make grade` (or the check cell in notebooks/06_gpu_bubble.ipynb). The
graders are the same tests that check labkit's own solutions."""


def bubble_fraction(busy: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Return the share of the window [t0, t1] in which the device's compute lane sat idle.

    `busy`: the (start, end) seconds of every span the compute lane ran (forwards, samples),
    in any order; spans may overlap (count overlapping time once). Every span lies inside the
    window, and t1 > t0. Return a fraction in [0, 1]: 1 - (time covered by some span) /
    (t1 - t0). labkit's version: labkit/instruments/timeline.py::idle_fraction.
    """
    raise NotImplementedError("bubble_fraction: see the docstring for the task")


def cost_model(launch_s: list[float], host_s: list[float],
               device_s: list[float]) -> tuple[float, float, float]:
    """Return (T_host, T_device, predicted speedup) of a blocking run, from its measured spans.

    `launch_s`: the time (s) at which each of n consecutive decode steps was launched;
    `host_s`: the host's own work (s) in each of those steps (plan, launch, sample launch,
    commit: its spans, not counting the wait); `device_s`: the device's busy time (s) in each
    (forward, sample). A blocking step lasts from one launch to the next, so n launches
    measure n - 1 periods, begun by the first n - 1 steps: T_host and T_device are the means of
    those steps. A blocking step is the whole period (host work, device work, and the round
    trips between them); a perfect pipeline overlaps all of it but the longer of the two
    terms, so the prediction is mean period / max(T_host, T_device). labkit's version:
    labkit/bench/decode.py::cost_model.
    """
    raise NotImplementedError("cost_model: see the docstring for the task")

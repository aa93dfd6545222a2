"""Chapter 06 exercises: measure the bubble and predict what a pipeline can win. Fill in each
function, then run `make grade` (or the check cell in notebooks/06_gpu_bubble.ipynb). The
graders are the same tests that check labkit's own solutions."""


def bubble_fraction(busy: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Return the share of the window [t0, t1] in which the device's compute lane sat idle.

    `busy`: the (start, end) seconds of every span the compute lane ran (forwards, samples),
    in any order; spans may overlap (count overlapping time once). Every span lies inside the
    window, and t1 > t0. Return a fraction in [0, 1]: 1 - (time covered by some span) /
    (t1 - t0). labkit's version: labkit/timeline.py::idle_fraction.
    """
    raise NotImplementedError("bubble_fraction: see the docstring for the task")


def cost_model(launch_s: list[float], host_s: list[float]) -> tuple[float, float, float]:
    """Return (T_host, T_device, predicted speedup) of a blocking run, from its measured spans.

    `launch_s`: the time (s) at which each of n consecutive decode steps was launched;
    `host_s`: the host's own work (s) in each of those n steps (plan, launch, sample launch,
    commit: the host spans, not counting the wait). A blocking step lasts from one launch to
    the next, so n launches measure n - 1 periods, begun by the first n - 1 steps. T_host: the
    mean host work of those n - 1 steps. T_device: the mean period minus T_host (the device's
    compute, its own command handling and the copy: what the host waits for). The prediction
    of chapter 06's cost model: (T_host + T_device) / max(T_host, T_device). labkit's version:
    labkit/bench_decode.py::cost_model.
    """
    raise NotImplementedError("cost_model: see the docstring for the task")

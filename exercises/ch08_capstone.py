"""Chapter 08 exercises: predict the ablation from measured spans, and serve a request that can
be abandoned. Fill in each function, then run `make grade` (or the check cells in
notebooks/08_capstone.ipynb). The graders are the same tests that check labkit's solutions."""


def predict_wall(steps: int, tokens: int, a: float, b: float, h: float, pipelined: bool,
                 fixed_scale: float = 1.0) -> float:
    """Predict a run's wall seconds from its counts and the step costs measured on a timeline.

    The run makes `steps` launches that compute `tokens` tokens in all. One launch costs the
    device `a * fixed_scale + b * (its tokens)` seconds (a: reading the weights once per launch;
    fixed_scale: how many times more bytes those weights take than the ones `a` was measured
    with, e.g. 4 for fp32 against int8; b: each token's compute) and the host `h` seconds of its
    own work. The blocking loop waits for each, so the two add up; the pipelined loop overlaps
    them, so the longer of the two totals sets the wall. labkit's version:
    `labkit.bench.ablation.predict_wall`.
    """
    raise NotImplementedError("predict_wall: see the docstring for the task")


def relay(next_event, is_disconnected, cancel, poll_s: float = 0.25):
    """Collect one request's streamed text for its HTTP client; cancel it if the client leaves.

    `next_event(timeout)` returns ("text", piece), ("done", completion), or None when nothing
    came within `timeout` seconds. Append each piece; on ("done", value) return
    (pieces, value). After each piece, and whenever nothing came, ask `is_disconnected()`
    (while tokens flow nothing is ever quiet, so asking only when idle never asks): if the
    client has gone, call `cancel()` exactly once and return None. Never cancel a request that
    has finished: the engine has already released its pages, and a second release is the
    double free on abort.
    labkit's version: `labkit.serving.server.relay`.
    """
    raise NotImplementedError("relay: see the docstring for the task")

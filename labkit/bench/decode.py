"""`python -m labkit bench decode`: blocking against pipelined decoding, side by side.

For each stream count, the same requests (one short chat prompt per stream, `--tokens` new
tokens each, greedy, run to length) are decoded by the blocking and the pipelined loop on the
same device *taking turns*: `--segment` steps of one, then as many of the other, until the
requests are done, `--repeats` workloads in all. Each adjacent pair of turns is one sample, its
ms per step measured in steady state (launch to launch); the table reports means over the
pairs, in the shape of Photon's table. Turns, not whole runs, because a shared machine changes
speed within seconds: two runs a second apart can differ by more than the pipeline wins.

From the blocking turn of each pair come the terms of the cost model, each booked where it is
spent: T_host (the host's own work per step: everything but its wait for the tokens: plan,
launch, sample launch, commit and the loop's Python between them), T_device (the device's
forward and sample, first command to last, from its spans) and T_other (the rest of the blocking
step: the round trips between them, command, wake-up, copy). The pipeline turns the
whole blocking step into the longest of three chains: the device's work; the host's work plus
one round trip (the host commits step t only once its tokens have arrived, and the device
samples step t+1 only once the command built from that commit has arrived: the round trip sits
on the host's side); and both works over the cores free for them (overlap needs a core for each
side; another program holding one of two cores leaves one for both):

    predicted speedup = (T_host + T_device + T_other)
                        / max(T_device, T_host + T_other, (T_host + T_device) / cores)
    gain share        = (speedup - 1) / (predicted - 1)

Chapter 06's best case, `max(T_host, T_device)`, hides the round trips too; it is the same
whenever the device's work is the longest chain, as on a GPU and here. The time the pipeline can
save per step is then `min(T_host, T_device) + T_other`: the shorter of the two kinds of work,
now overlapped with the longer, and the round trips, now behind the device's next step. `hidden:
host | trips` splits that saving between the two: on a GPU (and on the simulated device, whose
round trip is GPU-like) the saving is mostly the host's bookkeeping, as in Photon; a device with
slow round trips would show them instead.

The gain share is how much of the predicted gain the pipeline delivered. The zombie tax
is the share of decode rows a whole pipelined run spent on sequences that had already finished
(one per sequence: 1/110 at one stream for 110-token sequences).
"""

from __future__ import annotations

import bisect
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

from labkit import claims
from labkit.cli_parser import add_engine_flags, command_parser, engine_kwargs
from labkit.decoders import run
from labkit.utils.progress import progress

# Photon's published figures, for the table: (hardware, streams, blocking ms/step, pipelined
# ms/step, the speedup as published). Source: Moondream's Photon write-up (shared/seeds). The
# published speedups are quoted as given; they do not all equal blocking / pipelined - 1.
PHOTON = [("RTX 3090", 1, 5.44, 5.10, 6.5), ("RTX 3090", 32, 11.74, 10.52, 11.6),
          ("B200", 1, 3.11, 2.63, 17.6), ("B200", 32, 5.55, 3.98, 35.4)]

PROMPTS = ["Name three uses of a paperclip.", "Why is the sky blue?", "Describe a quiet city.",
           "Give me a haiku about rain.", "What is a prime number?", "Explain a hash map.",
           "Suggest a name for a cat.", "How do birds navigate?"]


def predicted_speedup(t_host: float, t_device: float, t_other: float = 0.0,
                      cores: float = 2.0, t_sample: float = 0.0) -> float:
    """The cost model: a blocking step costs T_host + T_device + T_other (the round trips
    between them); a pipelined step costs the longest of three chains. The device's work,
    T_device. The host's: its own work, one round trip and the sample, T_host + T_other +
    T_sample: the host commits step t only once step t's tokens have reached it, and the
    device samples step t+1 (forward first, then sample) only once the command built from
    that commit has reached it, so the round trip and the sample (`t_sample`, the device's
    time from that command's arrival to its tokens) sit on the host's side of the loop.
    Chapter 06's best case, max(T_host, T_device), hides both. And both works over the cores
    free for them: overlap needs a core for each side."""
    period = max(t_device, t_host + t_other + t_sample,
                 (t_host + t_device) / min(max(cores, 1.0), 2.0))
    return (t_host + t_device + t_other) / period


def hidden_shares(t_host: float, t_device: float, t_other: float) -> tuple[float, float]:
    """(host bookkeeping, round trips): the shares of the time a pipeline can save per step,
    `min(T_host, T_device) + T_other`, that each of them is."""
    saved = min(t_host, t_device) + max(t_other, 0.0)
    if saved <= 0:
        return float("nan"), float("nan")
    return min(t_host, t_device) / saved, max(t_other, 0.0) / saved


def pair_bound(pair: dict) -> float:
    """The cost model's speedup for one pair of turns (`predicted_speedup`), from the blocking
    turn's T_host and T_other, the device's work per step as the *pipelined* turn measured it,
    and the cores free during the pair (`free_cores`, 1 to 2: when another program keeps one
    of two cores busy, the host's work and the device's share the other, and no loop overlaps
    them).

    On a busy machine the OS treats a device that sleeps between steps (blocking) differently
    from one that never does (pipelined): the same forward measured 4.4 ms a step in a blocking
    turn and 3.6 ms in the pipelined turn beside it. No overlap beats the pipelined device's own
    time per step, so that is the device time the pipelined loop is held to."""
    host, device = pair["t_host_ms"], pair["pipelined_device_ms"]
    other = max(pair["blocking_ms"] - host - pair["t_device_ms"], 0.0)
    cores = min(max(pair.get("free_cores", 2.0), 1.0), 2.0)
    chain = host + other + pair.get("t_sample_ms", 0.0)
    return pair["blocking_ms"] / max(device, chain, (host + device) / cores)


def free_cores(busy_elsewhere: float) -> float:
    """Cores left for the host and the device while other programs kept `busy_elsewhere`
    busy (at least 1)."""
    return max(1.0, (os.cpu_count() or 1) - busy_elsewhere)


def gain_share(speedup: float, predicted: float) -> float:
    """The share of the predicted gain a pipeline delivered: (speedup - 1) / (predicted - 1).

    1 when it won all the cost model promised, 0 when it won nothing, negative when it lost;
    nan when nothing was predicted. Not speedup / predicted: +50% against +84% is 0.60 of the
    gain, while the ratio 1.50 / 1.84 = 0.82 would credit a pipeline that gains nothing 0.54.
    """
    return (speedup - 1) / (predicted - 1) if predicted > 1 + 1e-9 else float("nan")


def cost_model(launch_s: list[float], host_s: list[float],
               device_s: list[float]) -> tuple[float, float, float]:
    """(T_host, T_device, predicted speedup) of a blocking run, from its measured spans.

    launch_s: when each consecutive decode step was launched [n]; host_s: the host's own work
    (plan, launch, sample launch, commit; not the wait) in each of those steps [n]; device_s:
    the device's busy time in each [n]. The n - 1 launch-to-launch periods begin at the first
    n - 1 launches, whose means are T_host and T_device. A blocking step is the whole period:
    host work, device work and the round trips between them; a perfect pipeline overlaps all
    of it but the longer term, so it predicts period / max(T_host, T_device).
    """
    n = len(launch_s) - 1  # periods between launches
    t_step = (launch_s[-1] - launch_s[0]) / n
    t_host, t_device = sum(host_s[:n]) / n, sum(device_s[:n]) / n
    return t_host, t_device, t_step / max(t_host, t_device)


def decode_ms_per_step(timeline) -> tuple[float, float, int]:
    """(wall ms per decode step, device ms per decode step, decode steps) of a recorded run."""
    decode_launches = [s for s in timeline.lane("host") if s.label == "decode"]
    steps = {s.step for s in decode_launches}
    start = decode_launches[0].t0
    wall = timeline.t_end - start
    device = sum(s.duration for s in timeline.lane("compute") if s.step in steps)
    return wall / len(steps) * 1e3, device / len(steps) * 1e3, len(steps)


CONSTRAINTS = {"point": {"point": {"min": 0, "max": 1, "decimals": 3}},
               "box": {"box": {"min": 0, "max": 1, "decimals": 3}}}


def submit_workload(engine, prompt_ids: list[list[int]], tokens: int,
                    constraint=None) -> list[int]:
    """One request per prompt. Unconstrained: greedy, `tokens` new tokens each (EOS ignored).
    Constrained (a `labkit.constraints` object): seeded sampling (temperature 1, seed = the
    request's index, so the answers differ) until the answer is complete, as real constrained
    requests run: every step the host advances each row's automaton and builds its mask."""
    from labkit.sampling import SamplingParams

    ids_out = []
    for i, ids in enumerate(prompt_ids):
        if constraint is None:
            params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        else:
            params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i)
        ids_out.append(engine.submit(ids, params, constraint=constraint))
    return ids_out


def run_once(engine, prompt_ids: list[list[int]], tokens: int, decoder: str,
             constraint=None) -> dict:
    """Decode the requests once with one decoder; ms/step and the counters of the run."""
    from labkit.instruments.timeline import Timeline

    zombies0, rows0 = engine.zombie_rows, engine.decode_rows
    ids = submit_workload(engine, prompt_ids, tokens, constraint)
    with Timeline.record(engine) as tl:
        run(engine, decoder)
    engine.check_all_released()
    for rid in ids:
        engine.forget(rid)
    ms, dev_ms, steps = decode_ms_per_step(tl)
    return {"ms": ms, "device_ms": dev_ms, "steps": steps,
            "zombie_rows": engine.zombie_rows - zombies0, "rows": engine.decode_rows - rows0,
            "timeline": tl}


HOST_WAITS = ("wait",)  # the host's spans that are not work: it waits for the device's tokens


def step_terms(timeline, skip: int = 2, envelope: bool = True
               ) -> tuple[list[float], list[float], list[float]] | None:
    """Per decode step of one segment, in steady state: (periods, host work, device) in
    seconds, one entry per launch-to-launch period after the first `skip` (a pipelined segment
    starts empty and needs two launches to fill).

    Host work: the whole period but the host's waits for tokens: its spans (plan, launch,
    sample launch, commit) and the loop's own Python between them, which is bookkeeping too
    (on tiny at one stream, a fifth of the host's part). Device: with `envelope` (a blocking
    run), from the start of the step's first command on the device to the end of its last:
    the device runs a step's commands back to back, and the gaps between them are its own
    dispatch (a GPU's between kernels), not a round trip; without it (a pipelined run, whose
    device may wait between a step's forward and its sample), the sum of its spans (its
    "dispatch" spans included). None if the segment is too short to have a steady state.
    """
    decodes = [s for s in timeline.lane("host") if s.label == "decode"]
    if len(decodes) < skip + 2:
        return None
    launches = [s.t0 for s in decodes[skip:]]
    counted = [s.step for s in decodes[skip:-1]]

    def per_step(lane):
        return [sum(s.duration for s in timeline.lane(lane) if s.step == step)
                for step in counted]

    periods = [b - a for a, b in zip(launches, launches[1:])]
    waits = [0.0] * len(periods)
    for s in timeline.lane("host"):
        if s.label in HOST_WAITS:
            i = bisect.bisect_right(launches, s.t0) - 1
            if 0 <= i < len(periods):
                waits[i] += s.duration

    def device_envelope():
        spans = {}
        for s in timeline.lane("compute"):
            a, b = spans.get(s.step, (s.t0, s.t1))
            spans[s.step] = (min(a, s.t0), max(b, s.t1))
        return [spans[step][1] - spans[step][0] if step in spans else 0.0 for step in counted]

    device = device_envelope() if envelope else per_step("compute")
    return periods, [p - w for p, w in zip(periods, waits)], device


def steady_ms_per_step(timeline, skip: int = 2, envelope: bool = True
                       ) -> tuple[float, float, float] | None:
    """(wall ms, host work ms, device ms) per decode step of one segment, in steady state:
    the means of `step_terms` (same arguments), so that wall = host + device + the rest."""
    terms = step_terms(timeline, skip, envelope)
    if terms is None:
        return None
    return tuple(statistics.fmean(x) * 1e3 for x in terms)


def typical_ms_per_step(timelines, skip: int = 2) -> tuple[float, float, float]:
    """(T_host, T_device, T_other) in ms of the *typical* blocking step: per-step medians over
    the steady steps of every timeline given. Where the means (`steady_ms_per_step`) book every
    millisecond, including the time slices another program takes from a waiting process, the
    medians show what the mechanism itself costs in a step nobody interrupted."""
    host, device, other = [], [], []
    for tl in timelines:
        terms = step_terms(tl, skip, envelope=True)
        if terms is None:
            continue
        for period, h, d in zip(*terms):
            host.append(h)
            device.append(d)
            other.append(period - h - d)
    if not host:
        raise ValueError("no blocking run long enough to have a steady step")
    return tuple(statistics.median(x) * 1e3 for x in (host, device, other))


def round_trip_ms_per_step(timelines, skip: int = 2) -> tuple[float, float]:
    """(command, return) in ms: the round trip of the typical blocking decode step, measured
    directly (medians over the steady steps of every timeline given).

    Command: the step's first command's travel from the host's send to the device taking it
    (the device's "link" span; recorded when the device was idle, as it is in a blocking loop).
    Return: from the end of the device's copy of the step's tokens to the end of the host's
    wait for them, its wake-up and the wait's own bookkeeping. Zeros where a device records no
    travel (in-process, CUDA: a launch there is a function call or a driver's ring write)."""
    command, back = [], []
    for tl in timelines:
        steps = [s.step for s in tl.lane("host") if s.label == "decode"][skip:]
        link = {}
        for s in tl.lane("link"):
            link.setdefault(s.step, s)  # the step's first command: its forward
        copies = {s.step: s for s in tl.lane("copy")}
        waits = {s.step: s for s in tl.lane("host") if s.label == "wait"}
        for step in steps:
            if step in link and step in copies and step in waits:
                command.append(link[step].duration)
                back.append(waits[step].t1 - copies[step].t1)
    if not command:
        return 0.0, 0.0
    return statistics.median(command) * 1e3, statistics.median(back) * 1e3


# the cores another program may keep busy while the round trip is still held to a third of
# T_host: a waiter that shares its core gives up its spin and is woken by the operating system,
# and a busy loop beside the notebook's kernel (host, device and torch threads all runnable)
# was measured at 0.4 of a core and still doubled the round trip, so "quiet" is strict here
ROUND_TRIP_QUIET = 0.25


def measure_round_trip(engine, prompt_ids: list[list[int]], tokens: int, runs: int = 2,
                       attempts: int = 3) -> dict:
    """The typical blocking step's round trip, held the course's way under load: `runs`
    blocking runs of the prompts, their round trip and terms from `round_trip_ms_per_step` and
    `typical_ms_per_step`, and the cores other programs kept busy meanwhile. While the round
    trip looks like more than a third of T_host it is measured again, `attempts` times at most:
    the host may have waited for another program's time slice, or, on a shared VM, for a
    neighbour's that no count of this machine's programs sees (one quiet attempt in the
    course's runs measured 27 us against a host step of 60); a round trip truly that slow
    fails every attempt. Returns the attempt that met the bound, else the least loaded:
    {command_ms, back_ms, host_ms, device_ms, busy, quiet, attempts}, `quiet` saying whether
    other programs stayed under `ROUND_TRIP_QUIET` of a core."""
    tried = []
    while len(tried) < attempts:
        start = claims.cpu_seconds()
        tls = [run_once(engine, prompt_ids, tokens, "blocking")["timeline"] for _ in range(runs)]
        (command, back), (host, device, _) = round_trip_ms_per_step(tls), typical_ms_per_step(tls)
        tried.append({"command_ms": command, "back_ms": back, "host_ms": host,
                      "device_ms": device, "busy": claims.busy_elsewhere(start)})
        if command + back < host / 3:
            break
    best = min(tried, key=lambda t: (t["command_ms"] + t["back_ms"] >= t["host_ms"] / 3,
                                     t["busy"]))
    return {**best, "quiet": best["busy"] < ROUND_TRIP_QUIET, "attempts": len(tried)}


def sample_ms_per_step(timeline, skip: int = 2, launches: tuple[str, ...] = ("decode",)
                       ) -> float:
    """The device's time per step (of the host's `launches`, after the first `skip`) from the
    arrival of the step's last command (its sample, launched after the host's commit) to the
    end of the sample: the part of the device's work on the host's side of the pipelined
    loop. 0 if the device records no sample span (its sample is not a separate command)."""
    steps = [s.step for s in timeline.lane("host") if s.label in launches][skip:]
    by_step: dict[int, list] = {}
    for s in timeline.lane("compute"):
        by_step.setdefault(s.step, []).append(s)
    chains = []
    for step in steps:
        spans = sorted(by_step.get(step, []), key=lambda s: s.t0)
        sample = [s for s in spans if s.label == "sample"]
        if not sample:
            continue
        recv = [s for s in spans if s.label == "recv" and s.t0 <= sample[-1].t0]
        chains.append(sample[-1].t1 - (recv[-1].t0 if recv else sample[-1].t0))
    return statistics.fmean(chains) * 1e3 if chains else 0.0


def paired_segments(engine, prompt_ids: list[list[int]], tokens: int, segment: int,
                    blocking_first: bool, constraint=None) -> list[dict]:
    """One workload, decoded by the two loops taking turns every `segment` steps.

    This VM's cores change speed by up to 2x within seconds (other tenants), so whole runs
    one after the other compare different machines. Turns of ~0.1 s put the two loops side
    by side on the same machine state; each adjacent (blocking, pipelined) pair is one sample.
    """
    from labkit.instruments.timeline import Timeline

    ids = submit_workload(engine, prompt_ids, tokens, constraint)
    order = ("blocking", "pipelined") if blocking_first else ("pipelined", "blocking")
    turns: list[tuple[str, tuple[float, float, float] | None, float]] = []
    busy = []  # cores other programs kept busy during each turn
    while not engine.scheduler.idle():
        decoder = order[len(turns) % 2]
        start = claims.cpu_seconds()
        with Timeline.record(engine) as tl:
            run(engine, decoder, max_steps=segment)
        busy.append(claims.busy_elsewhere(start))
        turns.append((decoder, steady_ms_per_step(tl, envelope=decoder == "blocking"),
                      sample_ms_per_step(tl)))
    engine.check_all_released()
    for rid in ids:
        engine.forget(rid)
    pairs = []
    for k, ((first, a, sample_a), (_, b, sample_b)) in enumerate(zip(turns[::2], turns[1::2])):
        if a is None or b is None:  # a turn too short to time (the workload's last)
            continue
        pair_busy = (busy[2 * k] + busy[2 * k + 1]) / 2
        blocking, pipelined = (a, b) if first == "blocking" else (b, a)
        t_sample = sample_a if first == "blocking" else sample_b
        # the cost model's terms come from the blocking turn: the host's own work, the
        # device's, and the rest (round trips: command, wake-up, copy)
        pairs.append({"blocking_ms": blocking[0], "pipelined_ms": pipelined[0],
                      "t_host_ms": blocking[1], "t_device_ms": blocking[2],
                      "pipelined_host_ms": pipelined[1], "pipelined_device_ms": pipelined[2],
                      "t_sample_ms": t_sample, "busy": pair_busy,
                      "free_cores": free_cores(pair_busy)})
    return pairs


def bench_streams(engine, tok, streams: int, tokens: int, repeats: int,
                  segment: int = 12, constraint: str | None = None,
                  on_progress: Callable[[], None] = lambda: None) -> dict:
    """One row of the table: blocking and pipelined at `streams` concurrent requests.

    The timing comes from `repeats` workloads each decoded by the two loops in alternating
    turns (`paired_segments`); every figure is the mean over all pairs. One whole run of
    each loop gives the timelines (for plots) and the zombie count. `constraint`: None, or a
    key of `CONSTRAINTS` (every request answers with a point or a box). `on_progress` is
    called after the whole runs and after each timed workload (`repeats` + 1 calls).
    """
    from labkit.constraints_json import parse_constraint

    fsm = parse_constraint(CONSTRAINTS[constraint], engine.vocab) if constraint else None
    vocab = engine.model.cfg.vocab_size
    # `tiny` knows only SmolLM2's first tokens; its weights are random, so only a prompt's
    # length matters and out-of-range ids are folded into range
    prompt_ids = [[t % vocab for t in tok.encode(PROMPTS[i % len(PROMPTS)], chat=True)]
                  for i in range(streams)]
    run_once(engine, prompt_ids, min(tokens, 8), "pipelined", fsm)  # warm up both paths
    run_once(engine, prompt_ids, min(tokens, 8), "blocking", fsm)
    whole = {d: run_once(engine, prompt_ids, tokens, d, fsm) for d in ("blocking", "pipelined")}
    on_progress()
    pairs = []
    for r in range(repeats):  # who goes first alternates too, so drift favours neither
        pairs += paired_segments(engine, prompt_ids, tokens, segment, r % 2 == 0, fsm)
        on_progress()
    if not pairs:
        raise ValueError(f"--tokens {tokens} is too few to time: each turn of {segment} steps "
                         "needs a steady state of at least one step after two to fill")

    def mean(key):
        return statistics.fmean(p[key] for p in pairs)

    # means over pairs (not medians), so that the row is self-consistent: speedup is exactly
    # blocking / pipelined, the prediction exactly the cost model of the T_host and T_device shown
    blocking, pipelined = mean("blocking_ms"), mean("pipelined_ms")
    t_host, t_device = mean("t_host_ms"), mean("t_device_ms")
    t_other = blocking - t_host - t_device
    cores = statistics.fmean(p["free_cores"] for p in pairs)
    t_sample = mean("t_sample_ms")
    predicted = predicted_speedup(t_host, t_device, t_other, cores, t_sample)
    last = whole["pipelined"]
    command_ms, back_ms = round_trip_ms_per_step([whole["blocking"]["timeline"]])
    return {
        "streams": streams, "blocking_ms": blocking, "pipelined_ms": pipelined,
        "speedup": blocking / pipelined, "t_host_ms": t_host, "t_device_ms": t_device,
        "t_other_ms": t_other, "predicted_speedup": predicted,
        "round_trip_ms": {"command": command_ms, "back": back_ms},  # typical blocking step
        "hidden_host_share": hidden_shares(t_host, t_device, t_other)[0],
        "hidden_trip_share": hidden_shares(t_host, t_device, t_other)[1],
        "pair_speedups": [p["blocking_ms"] / p["pipelined_ms"] for p in pairs],
        "pair_bounds": [pair_bound(p) for p in pairs],
        "busy": statistics.fmean(p["busy"] for p in pairs),  # cores other programs kept busy
        "free_cores": cores, "t_sample_ms": t_sample,
        "gain_share": gain_share(blocking / pipelined, predicted),
        "pairs": len(pairs),
        "zombie_rows": last["zombie_rows"], "zombie_tax": last["zombie_rows"] / last["rows"],
        "timelines": {d: whole[d]["timeline"] for d in whole},
    }


def main(argv: list[str]) -> int:
    """Entry point of `python -m labkit bench decode`."""
    p = command_parser("python -m labkit bench decode",
                       "Blocking vs pipelined decoding, side by side.")
    p.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    p.add_argument("--device", choices=("auto", "process", "cuda", "inprocess"),
                   default="auto", help="auto: cuda when present, else the simulated process")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights and KV cache (bfloat16: what a GPU serves in)")
    p.add_argument("--tokens", type=int, default=110, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="workloads timed per row")
    p.add_argument("--segment", type=int, default=12,
                   help="steps per turn before the other decoder takes over")
    p.add_argument("--constraint", choices=sorted(CONSTRAINTS),
                   help="every request answers with a constrained point or box (real host "
                        "work: automata and masks); sampled, to completion")
    p.add_argument("--extra-host-ms", type=float, default=0.0,
                   help="WHAT-IF: add this much pure-Python host work to every commit")
    # no --decoder: it runs both loops, taking turns
    add_engine_flags(p, decoder=None, batching=False, kv_tokens="enough for every stream")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    try:
        engine_kw = engine_kwargs(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        streams = [int(s) for s in args.streams.split(",")]
        if any(s < 1 for s in streams):
            raise ValueError
    except ValueError:
        print(f"error: --streams must be positive integers like 1,32 (got {args.streams!r})",
              file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1 (got {args.repeats})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU on this machine; use "
              "--device auto (the simulated accelerator process here)", file=sys.stderr)
        return 2
    if args.segment < 4 or args.tokens < args.segment + 1:
        print(f"error: --segment must be >= 4 (got {args.segment}) and --tokens at least "
              f"--segment + 1 (got {args.tokens}): a turn needs two steps to fill the "
              "pipeline and more to time", file=sys.stderr)
        return 2
    from labkit.engine import Engine
    from labkit.loading import load_model

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "process"
    try:
        model, tok = load_model(args.model, getattr(torch, args.dtype),
                                quant=engine_kw["quant"], fuse=True)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine = Engine(model, tok, device=device, max_seqs=max(streams),
                    kv_tokens=args.kv_tokens or max(streams) * (args.tokens + 64) + 256,
                    block_size=16, attention=args.attention,
                    max_step_tokens=args.max_step_tokens)
    engine.extra_host_work_s = args.extra_host_ms / 1e3
    gc.collect()
    gc.freeze()  # a collector pause of ~100 ms on this heap would land in some random step
    hardware = (torch.cuda.get_device_name(0) if device == "cuda"
                else engine.device.name)
    # one tick per whole run pair and per timed workload, on stderr (stdout: the table or JSON)
    bar = progress(desc="bench decode", total=len(streams) * (args.repeats + 1), unit="workload")
    try:
        rows = []
        for s in streams:
            bar.set_postfix_str(f"{s} streams")
            rows.append(bench_streams(engine, tok, s, args.tokens, args.repeats, args.segment,
                                      args.constraint, on_progress=bar.update))
    finally:
        bar.close()
        engine.close()
    for r in rows:
        r.pop("timelines")
        r.pop("pair_speedups")
        r.update(device=hardware, model=args.model, dtype=args.dtype, tokens=args.tokens,
                 constraint=args.constraint, extra_host_ms=args.extra_host_ms,
                 attention=args.attention, quant=args.quant)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'hardware':<34} {'streams':>7} {'blocking ms':>11} {'pipelined ms':>12} "
          f"{'speedup':>8} {'T_host':>7} {'T_dev':>7} {'T_other':>7} {'predicted':>9} "
          f"{'gain share':>10} {'hidden: host | trips':>20} "
          f"{'zombie tax':>10}")
    for r in rows:
        print(f"{r['device'][:34]:<34} {r['streams']:>7} {r['blocking_ms']:>11.2f} "
              f"{r['pipelined_ms']:>12.2f} {100 * (r['speedup'] - 1):>+7.1f}% "
              f"{r['t_host_ms']:>7.2f} {r['t_device_ms']:>7.2f} {r['t_other_ms']:>7.2f} "
              f"{100 * (r['predicted_speedup'] - 1):>+8.1f}% {100 * r['gain_share']:>9.0f}% "
              f"{100 * r['hidden_host_share']:>12.0f}% | {100 * r['hidden_trip_share']:>3.0f}% "
              f"{100 * r['zombie_tax']:>9.2f}%")
    for hw, s, b, pl, gain in PHOTON:
        print(f"{'Photon ' + hw + ' (published)':<34} {s:>7} {b:>11.2f} {pl:>12.2f} "
              f"{gain:>+7.1f}%")
    for r in rows:
        trip = r["round_trip_ms"]
        if trip["command"] or trip["back"]:
            print(f"{r['streams']} streams, the typical blocking step's round trip, measured: "
                  f"command {trip['command'] * 1e3:.1f} us + tokens back {trip['back'] * 1e3:.1f} "
                  f"us = {(trip['command'] + trip['back']) / r['t_host_ms']:.0%} of T_host")
    note = (f"model {args.model} ({args.dtype}), {args.tokens} tokens per request; means over "
            f"{', '.join(str(r['pairs']) for r in rows)} pairs of {args.segment}-step turns; "
            f"zombie tax = decode rows run for finished sequences (Photon: ~1% at 1 stream)")
    if args.constraint:
        note += (f"; every request a constrained {args.constraint} (sampled, to completion: "
                 "the tokens per request vary)")
    if args.extra_host_ms:
        note += f"; WHAT-IF: +{args.extra_host_ms} ms of artificial host work per commit"
    print(note)
    return 0

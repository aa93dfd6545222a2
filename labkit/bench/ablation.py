"""`python -m labkit bench ablation`: the whole engine, then each feature off in turn.

Every setup (`labkit.whole_engine`: the whole engine, and one row per feature turned off) runs
the same offline workload: requests sharing a system prompt, of varied output lengths, more of
them than the rows a step holds, in a KV pool too small to reserve every request's maximum at
once. The setups take turns (`--rounds R`, the order reversed every other round) on the
simulated accelerator (`device="process"`, so that the pipelined decoder has a device to
overlap), each turn on a fresh engine closed after it, and each row reports the median wall
time over rounds. Every setup that quantizes
shares one quantized copy of the weights, and every fp32 setup one fused copy of the fp32
weights (`EngineSetup.build(quantized=...)`): the setups then differ only in what they switch,
not in where their weights landed in memory.

Each row also carries the **prediction** of the chapters' cost models. Its terms are measured
on the whole engine's blocking twin (the `- pipelined decoder` row), where nothing overlaps and
each is seen alone, by the chapter that introduced it:

- the device's time per launch, fitted as `a + b * tokens` (a: reading the weights once per
  launch, chapter 01; b: each token's compute);
- the host's own work per launch `h` (chapter 06), the round trip `r` per launch: the
  blocking run's wall less the host's work and the device's (chapter 06's T_other), and the
  device's sample time `s` per launch (from its sample command's arrival to its tokens);
- with quantization off, fp32's extra cost per launch (bytes, chapter 03) and per token
  (arithmetic), from one step of 1 row and one of a chunk's rows in each format.

Every setup's own counts then give its prediction: launches S and tokens computed N (static
batching and max-length reservation make more launches, chapters 02 and 05; preemption
recomputes tokens; prefix sharing computes fewer; chunking changes how they are cut).

Predicted wall: `S*(h + r) + S*a + N*b` for the blocking loop, and for the pipelined one
(chapter 07) the longest of three chains: the device's `S*a + N*b`; the host's `S*(h + r + s)`,
its work, the round trip and the device's sample time s (the host commits step t only after
its tokens arrive, the device samples t+1 only after the command built from that commit does);
and `(S*h + S*a + N*b) / cores`, both works over the cores free for them (overlap needs a core
for each side). Where a launch is
mostly dispatch (the tiny model), int8 is predicted to buy little; where it is mostly bytes
(SmolLM2), a lot. Flash attention is predicted to change nothing at these context lengths
(chapter 04: it saves memory, a decode row's scores are one row, and on a CPU both backends are
labkit's C++). A feature's predicted speedup is the ablated setup's predicted wall over the
whole engine's; its measured speedup is the median over rounds of the same ratio of walls
measured in one round (`ratios`); `gain_share` holds one against the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from labkit import claims
from labkit.bench.decode import free_cores, gain_share, sample_ms_per_step
from labkit.claims import Estimate
from labkit.cli_parser import command_parser
from labkit.decoders import run
from labkit.instruments.timeline import Timeline
from labkit.quant import weight_bytes
from labkit.whole_engine import FEATURES, EngineSetup

SYSTEM_PREFIX_LEN = 48  # tokens every request shares (three 16-token pages)
AGAIN = "whole engine, again"  # the A/A row: the whole engine once more, predicted 1.00x


def ablation_workload(n: int, vocab_size: int, quick: bool, seed: int = 0
                      ) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) of `n` requests: a shared prefix, a private suffix of 8-40
    tokens, outputs cycling over a few lengths (the long ones keep static batches waiting)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, vocab_size, (SYSTEM_PREFIX_LEN,), generator=gen).tolist()
    lengths = (8, 24, 12, 40) if quick else (16, 64, 32, 96, 24, 48)
    out = []
    for i in range(n):
        suffix = torch.randint(100, vocab_size, (8 + (i * 13) % 33,), generator=gen).tolist()
        out.append((prefix + suffix, lengths[i % len(lengths)]))
    return out


def run_setup(engine, decoder: str, work: list[tuple[list[int], int]]) -> dict:
    """One timed run of the workload: wall seconds, counts, and the timeline."""
    from labkit.sampling import SamplingParams

    engine.stats.reset()
    ids = [engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in work]
    start = claims.cpu_seconds()
    with Timeline.record(engine) as tl:
        t0 = time.perf_counter()
        run(engine, decoder)
        wall = time.perf_counter() - t0
    busy = claims.busy_elsewhere(start)
    engine.check_all_released()
    tokens = sum(len(engine.seqs[r].output_ids) for r in ids)
    for r in ids:
        engine.forget(r)
    s = engine.stats
    return {"wall_s": wall, "tokens": tokens, "steps": s.steps, "step_tokens": list(s.step_tokens),
            "step_rows": list(s.step_rows),
            "prefill_tokens_saved": s.prefill_tokens_saved, "preemptions": s.preemptions,
            "padding_rows": s.padding_rows, "peak_running": s.peak_running, "timeline": tl,
            "busy": busy}


def launch_envelopes(timeline: Timeline) -> dict[int, float]:
    """Device seconds per launch: from the start of its first command on the device to the
    end of its last (the device runs a launch's commands back to back; the gaps between them
    are its own dispatch, chapter 06's T_device, not a round trip)."""
    spans: dict[int, tuple[float, float]] = {}
    for s in timeline.lane("compute"):
        t0, t1 = spans.get(s.step, (s.t0, s.t1))
        spans[s.step] = (min(t0, s.t0), max(t1, s.t1))
    return {k: t1 - t0 for k, (t0, t1) in sorted(spans.items())}


def host_work_s(timeline: Timeline) -> float:
    """The host's own work in a run: its spans but the waits."""
    return sum(s.duration for s in timeline.lane("host") if s.label != "wait")


def fit_step_cost(timeline: Timeline, step_tokens: list[int]) -> tuple[float, float, float]:
    """(a, b, h) in seconds: device time per launch = a + b * tokens (least squares over the
    run's launches, each launch's envelope), and the host's own work per launch h."""
    device = launch_envelopes(timeline)
    xs = step_tokens[-len(device):] if len(step_tokens) >= len(device) else []
    ys = list(device.values())
    h = host_work_s(timeline) / max(len(device), 1)
    if len(xs) != len(ys) or len(set(xs)) < 2:  # nothing to fit a slope on: all fixed cost
        return statistics.fmean(ys), 0.0, h
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b, h


def fit_launch_cost(timeline: Timeline, step_tokens: list[int], step_rows: list[int]
                    ) -> tuple[float, float, float, float]:
    """(a, c, b, h) in seconds: device time per launch = a + c * rows + b * tokens, least squares
    over the run's launches (a coefficient the data makes negative is dropped, and the rest
    refitted), and the host's own work per launch h. A launch's fixed cost has a part per row
    (each row's metadata, sampling and commit): a launch of four decode rows and one of a
    single prefill chunk differ in more than their tokens."""
    device = launch_envelopes(timeline)
    n = len(device)
    h = host_work_s(timeline) / max(n, 1)
    if len(step_tokens) < n or len(step_rows) < n or n < 3:
        a, b, _ = fit_step_cost(timeline, step_tokens)
        return a, 0.0, b, h
    y = torch.tensor(list(device.values()), dtype=torch.float64)
    cols = {"a": torch.ones(n, dtype=torch.float64),
            "c": torch.tensor(step_rows[-n:], dtype=torch.float64),
            "b": torch.tensor(step_tokens[-n:], dtype=torch.float64)}
    names = list(cols)
    while True:
        x = torch.stack([cols[k] for k in names], dim=1)
        coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
        fit = dict(zip(names, coef.tolist()))
        negative = [k for k in names if fit[k] < 0 and k != "a"]
        if not negative:
            break
        names.remove(negative[0])
    return max(fit.get("a", 0.0), 0.0), fit.get("c", 0.0), fit.get("b", 0.0), h


def blocking_round_trip_s(timeline: Timeline, wall_s: float) -> float:
    """T_other per launch of a *blocking* run (chapter 06): the run's wall time less the
    host's own work and the device's, per launch. Nothing overlaps in the blocking loop, so
    what is left is the round trips between the two: a command reaching the device, tokens
    reaching the host."""
    device = launch_envelopes(timeline)
    rest = wall_s - host_work_s(timeline) - sum(device.values())
    return max(0.0, rest / max(len(device), 1))


def predict_wall(steps: int, tokens: int, a: float, b: float, h: float, pipelined: bool,
                 fixed_scale: float = 1.0, round_trip: float = 0.0, cores: float = 2.0,
                 sample: float = 0.0) -> float:
    """The cost model's wall seconds: `steps` launches computing `tokens` tokens in all, each
    launch costing the device a * fixed_scale + b * its tokens and the host h; the blocking
    loop adds the two (and each launch's round trip), the pipelined one overlaps them (the
    chapter-08 exercise's reference; `round_trip` is the bench's addition).

    Where a round trip sits on the pipelined loop's critical path: on the host's side. The
    host commits step t only once step t's tokens have reached it, and the device samples
    step t+1 (forward first, then sample) only once the host's sample command, built from that
    commit, has reached it; so per launch the host's chain is its own work, the round trip and
    the device's `sample` time, and that chain overlaps the device's work. Overlap needs a
    core for each side: with `cores` free for the two (1 when another program keeps one of two
    busy), their work shares them.
    """
    device = steps * a * fixed_scale + tokens * b  # fixed_scale: weight bytes, chapter 03
    host = steps * (h + round_trip + (sample if pipelined else 0.0))
    if pipelined:
        return max(host, device, (steps * h + device) / min(max(cores, 1.0), 2.0))
    return host + device


def quant_step_split(fp32_model, quant_model, tokens: int = 64, rows: int = 1,
                     rounds: int = 7, steps: int = 10) -> tuple[float, float, float, float]:
    """(extra seconds per launch, extra seconds per token) that fp32 weights cost over the
    quantized ones, and a 1-row step's seconds in each format: decode steps of `rows` rows (the
    run's typical decode launch) and of `tokens` rows (a prefill chunk's) in each format, in
    alternating turns on one thread (the simulated device's), the difference fitted as a line
    through the two. The per-launch part is the weights' extra bytes over the bandwidth the
    kernels reach (chapter 03); the per-token part is what the two formats' arithmetic costs
    each row (at a prefill chunk's rows, fp32's matmul can beat a quantized kernel that
    converts every weight it reads). The line goes through the launches a run makes most: a
    quantized kernel reading its codes at one row and multiplying them at four are not on one
    line with a chunk of 64 (with int8 on tiles, the line through 1 row booked fp32's extra
    cost so dear that notebook 08's full-mode ablation measured 0.85-0.88 of the predicted
    gain of quantizing, results/cpu-kernels-2026-12-05b.md)."""
    from labkit.bench.quant import alternate, decode_step
    from labkit.claims import torch_threads

    shapes = sorted({1, rows, tokens})
    with torch_threads(1), torch.inference_mode():
        turns = alternate({(fmt, n): decode_step(m, n) for n in shapes
                           for fmt, m in (("fp32", fp32_model), ("quant", quant_model))},
                          rounds, steps)
    t = {k: statistics.median(v) / 1e3 for k, v in turns.items()}
    d_r, d_n = t["fp32", rows] - t["quant", rows], t["fp32", tokens] - t["quant", tokens]
    per_token = (d_n - d_r) / (tokens - rows)
    return d_r - per_token * rows, per_token, t["fp32", 1], t["quant", 1]


def typical_decode_rows(step_tokens: list[int], step_rows: list[int]) -> int:
    """The median rows of a run's decode launches (each row one token), 1 if it made none."""
    decode = [r for t, r in zip(step_tokens, step_rows) if t == r]
    return max(1, round(statistics.median(decode))) if decode else 1


def bench_ablation(model_name: str = "tiny", requests: int = 8, rounds: int = 2,
                   quick: bool = True, quant: str = "int8", max_seqs: int = 4,
                   device: str = "process", log=print) -> list[dict]:
    """One row per setup: the whole engine first, then each feature off; medians over rounds.

    The cost model's terms come from the whole engine's blocking twin (the `- pipelined
    decoder` row), where nothing overlaps and each term is seen alone: the device's time per
    launch (a + b * tokens), the host's own work h, and the rest, the round trip r. Every row
    is then predicted from its own counts with those terms; its measured speedup is the median
    over rounds of its wall over the whole engine's in the same round (`ratios`).
    """
    from labkit.loading import load_model

    model, tok = load_model(model_name)
    whole = EngineSetup.whole(quant=None if quant in (None, "none") else quant)
    whole = dataclasses.replace(whole, max_step_tokens=64)  # below the prompts: chunks happen
    # the whole engine twice (an A/A pair): how far two identical setups' walls differ is the
    # measurement's own noise, the resolution any feature's row is read with
    setups = ([("whole engine", whole), (AGAIN, whole)]
              + [(f"- {f}", whole.without(f)) for f in FEATURES])
    twin = "- pipelined decoder"
    work = ablation_workload(requests, model.cfg.vocab_size, quick)
    # a pool that holds every request's pages as they grow, but not every maximum at once
    need = [len(p) + n for p, n in work]
    kv_tokens = max(sum(sorted(need)[-max_seqs:]) * 2 // 3, max(need) + 64)
    runs: dict[str, list[dict]] = {name: [] for name, _ in setups}
    quantized: dict = {}  # one quantized copy for every setup that quantizes: the same weights
    for rnd in range(rounds):
        order = setups if rnd % 2 == 0 else setups[::-1]
        for name, setup in order:
            # a fresh engine (and device process) for every turn, closed after it: a process's
            # own luck (where its pool and buffers landed) is then one round's noise, not a
            # bias that lasts the whole run, and one device is alive at a time
            engine = setup.build(model, tok, quantized=quantized, kv_tokens=kv_tokens,
                                 max_seqs=max_seqs, device=device)
            try:
                # warm-up: the whole workload once (a fresh process's first pass through a
                # workload runs measurably slower: its allocators and caches fill), then the
                # timed run from a cold prefix cache, as the first run found it
                run_setup(engine, setup.decoder, work)
                engine.clear_prefix_cache()
                r = run_setup(engine, setup.decoder, work)
            finally:
                engine.close()
            del engine
            log(f"  round {rnd + 1}/{rounds} {name:<22} {r['tokens']} tokens in "
                f"{r['wall_s']:.2f} s ({r['steps']} launches)")
            tl = r.pop("timeline")
            if name == twin:  # the cost model's terms, seen one at a time
                sample = sample_ms_per_step(tl, 0, ("decode", "mixed", "prefill")) / 1e3
                r["fit"] = (*fit_launch_cost(tl, r["step_tokens"], r["step_rows"]),
                            blocking_round_trip_s(tl, r["wall_s"]), sample)
            runs[name].append(r)
    quant_model = quantized.get(whole.quant)
    fp32_model = quantized.get(None, model)  # what the fp32 setups ran: the fused copy
    quant_bytes, fp32_bytes = weight_bytes(quant_model or model), weight_bytes(fp32_model)
    a, c, b, h, r_trip, sample = (statistics.median(r["fit"][i] for r in runs[twin])
                                  for i in range(6))
    busy = statistics.median(r["busy"] for got in runs.values() for r in got)
    cores = free_cores(busy)
    extra_a = extra_b = t_f = t_q = 0.0
    split_rows = typical_decode_rows(runs["whole engine"][0]["step_tokens"],
                                     runs["whole engine"][0]["step_rows"])
    if whole.quant:  # fp32's extra cost: bytes per launch, arithmetic per token
        extra_a, extra_b, t_f, t_q = quant_step_split(fp32_model, quant_model,
                                                      whole.max_step_tokens,
                                                      min(split_rows, whole.max_step_tokens - 1))
    rows = []
    for name, setup in setups:
        got = runs[name]
        wall = statistics.median(r["wall_s"] for r in got)
        fp32 = setup.quant is None and whole.quant is not None
        steps, n_rows = got[0]["steps"], sum(got[0]["step_rows"])
        # a row's fixed cost booked per launch: c * rows / launches on top of a
        per_launch = a + c * n_rows / max(steps, 1) + (extra_a if fp32 else 0.0)
        pred = predict_wall(steps, sum(got[0]["step_tokens"]), per_launch,
                            max(b + (extra_b if fp32 else 0.0), 0.0),
                            h, setup.decoder == "pipelined", 1.0, r_trip, cores, sample)
        rows.append({"setup": name, "wall_s": wall, "tok_s": got[0]["tokens"] / wall,
                     "steps": got[0]["steps"], "tokens_computed": sum(got[0]["step_tokens"]),
                     "prefill_tokens_saved": got[0]["prefill_tokens_saved"],
                     "preemptions": got[0]["preemptions"], "peak_running":
                     got[0]["peak_running"], "predicted_wall_s": pred,
                     "walls_s": [r["wall_s"] for r in got]})
    w_pred = rows[0]["predicted_wall_s"]
    for r in rows:  # what the feature gave: the ablated setup's time over the whole engine's
        r["ratios"] = [w / base for w, base in zip(r["walls_s"], rows[0]["walls_s"])]
        r["measured_speedup"] = statistics.median(r["ratios"])
        r["predicted_speedup"] = r["predicted_wall_s"] / w_pred
        r["gain_share"] = gain_share(r["measured_speedup"], r["predicted_speedup"])
    rows[0]["busy"], rows[0]["free_cores"] = busy, cores
    rows[0]["fit_ms"] = {"a": a * 1e3, "c": c * 1e3, "b": b * 1e3, "h": h * 1e3,
                         "round_trip": r_trip * 1e3,
                         "sample": sample * 1e3,
                         "fp32_extra_a": extra_a * 1e3, "fp32_extra_b": extra_b * 1e3,
                         "step_fp32": t_f * 1e3, "step_quant": t_q * 1e3,
                         "split_rows": split_rows}
    if t_f > t_q:  # t = dispatch + bytes / bandwidth, solved from the two formats
        bw = (fp32_bytes - quant_bytes) / (t_f - t_q)
        rows[0]["fit_ms"]["dispatch"] = (t_q - quant_bytes / bw) * 1e3
        rows[0]["fit_ms"]["bandwidth_gb_s"] = bw / 1e9
    return rows


def noise(rows: list[dict]) -> float:
    """The measurement's resolution: how far from 1 the A/A row's median wall ratio lands (the
    whole engine against an identical engine; the rounds' spread around a median is the
    claims' band's business, this is what remains after it)."""
    again = next(r for r in rows if r["setup"] == AGAIN)
    return abs(statistics.median(again["ratios"]) - 1)


def row_estimates(run: Callable[[], list[dict]]) -> tuple[list[dict], dict[str, Estimate]]:
    """Run the ablation (`run()` returns `bench_ablation`'s rows), and hold each row to its
    prediction: (rows, {setup: estimate}), each estimate the row's measured speedup over its
    predicted one, one sample per round, that `claims.hold` can measure again. A re-measure
    runs the whole ablation once more, and every row's next re-measure shares that run."""
    runs: list[tuple[list[dict], float]] = []

    def nth(k: int) -> tuple[list[dict], float]:
        while len(runs) <= k:
            rows = run()
            runs.append((rows, rows[0]["busy"]))
        return runs[k]

    def estimate(name: str, k: int) -> Estimate:
        rows, busy = nth(k)
        r = next(r for r in rows if r["setup"] == name)
        return Estimate(tuple(x / r["predicted_speedup"] for x in r["ratios"]), busy=busy,
                        remeasure=lambda: estimate(name, k + 1))

    rows, _ = nth(0)
    return rows, {r["setup"]: estimate(r["setup"], 0) for r in rows[1:]}


def _log(line: str) -> None:
    """Progress, on stderr (stdout holds the table)."""
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    """`python -m labkit bench ablation ...`; returns the exit code."""
    p: argparse.ArgumentParser = command_parser(
        "python -m labkit bench ablation", "The whole engine, then each feature off in turn: "
        "measured against the chapters' cost models.")
    p.add_argument("--model", default="tiny", help="tiny or smollm2-135m")
    p.add_argument("--requests", type=int, default=8, help="requests in the workload")
    p.add_argument("--rounds", type=int, default=3, help="turns of every setup, alternating")
    p.add_argument("--quant", default="int8", help="the whole engine's weights")
    p.add_argument("--max-seqs", type=int, default=4, help="rows a step holds")
    p.add_argument("--full", action="store_true", help="longer outputs (16-96 tokens)")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.max_seqs < 1:
        p.error("--requests, --rounds and --max-seqs must be >= 1")
    try:
        rows = bench_ablation(args.model, args.requests, args.rounds, not args.full,
                              args.quant, args.max_seqs, log=_log)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    f = rows[0]["fit_ms"]
    print(f"terms measured on the blocking twin: device a={f['a']:.2f} ms + c={f['c']:.3f} "
          f"ms/row + b={f['b']:.3f} ms/token, host h={f['h']:.2f} ms/launch, round trip "
          f"r={f['round_trip']:.3f} ms/launch, sample s={f['sample']:.3f} ms/launch")
    print(f"other programs kept {rows[0]['busy']:.1f} cores busy: {rows[0]['free_cores']:.1f} "
          "free for the host and the device")
    if "dispatch" in f:
        print(f"a batch-1 step: fp32 {f['step_fp32']:.2f} ms, quantized {f['step_quant']:.2f} ms "
              f"= dispatch {f['dispatch']:.2f} ms + bytes at {f['bandwidth_gb_s']:.1f} GB/s; "
              f"fp32 costs {f['fp32_extra_a']:+.2f} ms/launch {f['fp32_extra_b']:+.4f} ms/token "
              f"(a line through decode steps of {f['split_rows']} rows and the chunk)")
    print(f"{'setup':<24}{'wall s':>8}{'tok/s':>8}{'launch':>8}{'tokens':>8}{'saved':>7}"
          f"{'preempt':>8}{'measured':>10}{'predicted':>10}{'gain':>7}")
    for r in rows:
        print(f"{r['setup']:<24}{r['wall_s']:>8.2f}{r['tok_s']:>8.1f}{r['steps']:>8}"
              f"{r['tokens_computed']:>8}{r['prefill_tokens_saved']:>7}{r['preemptions']:>8}"
              f"{r['measured_speedup']:>9.2f}x{r['predicted_speedup']:>9.2f}x"
              f"{r['gain_share']:>7.2f}")
    return 0

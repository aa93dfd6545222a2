"""`python -m labkit bench ablation`: the whole engine, then each feature off in turn.

Every setup (`labkit.whole_engine`: the whole engine, and one row per feature turned off) runs
the same offline workload: requests sharing a system prompt, of varied output lengths, more of
them than the rows a step holds, in a KV pool too small to reserve every request's maximum at
once. The setups take turns (`--rounds R`, the order reversed every other round) on the
simulated accelerator (`device="process"`, so that the pipelined decoder has a device to
overlap), and each row reports the median wall time over rounds.

Each row also carries the **prediction** of the chapters' cost models, built from two things:

- the step cost measured on the whole engine's timeline, fitted as `t_device = a + b * tokens`
  (a: reading the weights once per launch, chapter 01; b: each token's compute), and the host's
  own work per step `h` (chapter 06);
- the counts each setup's scheduler produced: launches S and tokens computed N (chapters 02
  and 05: static batching and max-length reservation make more launches, prefix sharing fewer
  tokens).

Predicted wall: `S*(h + r) + S*a' + N*b` for the blocking loop, `max(S*h, S*a' + N*b)` for
the pipelined one (chapter 07), where r is the round trip per launch (command and copy, measured
on the whole engine's timeline: what the pipelined loop hides besides the host's work), and
`a' = a` except with quantization off. There the launch's fixed cost splits into dispatch and
weight bytes over the bandwidth the kernels reach (chapter 03), measured by one batch-1 step of
each format, t_q and t_fp32: `a' = a + (t_fp32 - t_q)`. Where a launch is mostly dispatch (the
tiny model), int8 is predicted to buy little; where it is mostly bytes (SmolLM2), a lot. Flash
attention is predicted to change nothing at these context lengths (chapter 04: it saves memory,
a decode row's scores are one row, and on a CPU both backends are labkit's C++). A feature's
predicted speedup is the ablated setup's predicted wall over the whole engine's; its measured
speedup the same ratio of measured walls; `gain_share` holds one against the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from labkit.bench.decode import gain_share
from labkit.cli_parser import command_parser
from labkit.decoders import run
from labkit.instruments.timeline import Timeline
from labkit.quant import weight_bytes
from labkit.whole_engine import FEATURES, EngineSetup

SYSTEM_PREFIX_LEN = 48  # tokens every request shares (three 16-token pages)


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
    with Timeline.record(engine) as tl:
        t0 = time.perf_counter()
        run(engine, decoder)
        wall = time.perf_counter() - t0
    engine.check_all_released()
    tokens = sum(len(engine.seqs[r].output_ids) for r in ids)
    for r in ids:
        engine.forget(r)
    s = engine.stats
    return {"wall_s": wall, "tokens": tokens, "steps": s.steps, "step_tokens": list(s.step_tokens),
            "prefill_tokens_saved": s.prefill_tokens_saved, "preemptions": s.preemptions,
            "padding_rows": s.padding_rows, "peak_running": s.peak_running, "timeline": tl}


def fit_step_cost(timeline: Timeline, step_tokens: list[int]) -> tuple[float, float, float]:
    """(a, b, h) in seconds: device time per launch = a + b * tokens (least squares over the
    run's launches), and the host's own work per launch h (its spans but the waits)."""
    steps = sorted({s.step for s in timeline.lane("compute")})
    device = {k: 0.0 for k in steps}
    for s in timeline.lane("compute"):
        device[s.step] += s.duration
    host = sum(s.duration for s in timeline.lane("host") if s.label != "wait")
    xs = step_tokens[-len(steps):] if len(step_tokens) >= len(steps) else []
    ys = [device[k] for k in steps]
    h = host / max(len(steps), 1)
    if len(xs) != len(ys) or len(set(xs)) < 2:  # nothing to fit a slope on: all fixed cost
        return statistics.fmean(ys), 0.0, h
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b, h


def predict_wall(steps: int, tokens: int, a: float, b: float, h: float, pipelined: bool,
                 fixed_scale: float = 1.0, round_trip: float = 0.0) -> float:
    """The cost model's wall seconds: `steps` launches computing `tokens` tokens in all, each
    launch costing the device a * fixed_scale + b * its tokens and the host h; the blocking
    loop adds the two (and each launch's round trip), the pipelined one overlaps them (the
    chapter-08 exercise's reference; `round_trip` is the bench's addition)."""
    device = steps * a * fixed_scale + tokens * b  # fixed_scale: weight bytes, chapter 03
    host = steps * h
    return max(host, device) if pipelined else host + device + steps * round_trip


def predicted_wall(setup: EngineSetup, counts: dict, a: float, b: float, h: float,
                   fixed_scale: float = 1.0, round_trip: float = 0.0) -> float:
    """`predict_wall` for a setup's measured counts."""
    return predict_wall(counts["steps"], sum(counts["step_tokens"]), a, b, h,
                        setup.decoder == "pipelined", fixed_scale, round_trip)


def round_trip_s(timeline: Timeline) -> float:
    """Seconds per launch of round trip on a pipelined timeline: the device's wait for a
    command it could have started on (its last span ended before the host's launch did), and
    the host's wait for tokens already copied; medians over the launches."""
    host = {}
    for s in timeline.lane("host"):
        host.setdefault(s.step, {})[s.label] = s
    first_dev, copied = {}, {}
    for s in timeline.lane("compute"):
        first_dev[s.step] = min(first_dev.get(s.step, s.t0), s.t0)
    for s in timeline.lane("copy"):
        copied[s.step] = s.t1
    dev_ends = sorted(s.t1 for s in timeline.lane("compute"))
    command, wake = [], []
    for step, spans in host.items():
        launch = next((spans[k] for k in ("decode", "mixed", "prefill") if k in spans), None)
        if launch is not None and step in first_dev:
            idle_since = max((t for t in dev_ends if t <= first_dev[step]), default=launch.t1)
            if idle_since <= launch.t1:  # the device waited for this command
                command.append(max(0.0, first_dev[step] - launch.t1))
        wait = spans.get("wait")
        if wait is not None and step in copied and wait.t0 <= copied[step]:
            wake.append(max(0.0, wait.t1 - copied[step]))
    med = statistics.median
    return (med(command) if command else 0.0) + (med(wake) if wake else 0.0)


def quant_step_ms(fp32_model, quant_model, rounds: int = 3, steps: int = 5) -> tuple[float, float]:
    """(fp32 ms, quantized ms) of one batch-1 decode step, in alternating turns on one thread
    (the simulated device's), for the launch's split into dispatch and weight bytes."""
    from labkit.bench.quant import alternate, decode_step
    from labkit.claims import torch_threads

    with torch_threads(1), torch.inference_mode():
        turns = alternate({"fp32": decode_step(fp32_model, 1),
                           "quant": decode_step(quant_model, 1)}, rounds, steps)
    return statistics.median(turns["fp32"]), statistics.median(turns["quant"])


def bench_ablation(model_name: str = "tiny", requests: int = 8, rounds: int = 2,
                   quick: bool = True, quant: str = "int8", max_seqs: int = 4,
                   device: str = "process", log=print) -> list[dict]:
    """One row per setup: the whole engine first, then each feature off; medians over rounds."""
    from labkit.loading import load_model

    model, tok = load_model(model_name)
    whole = EngineSetup.whole(quant=None if quant in (None, "none") else quant)
    whole = dataclasses.replace(whole, max_step_tokens=64)  # below the prompts: chunks happen
    setups = [("whole engine", whole)] + [(f"- {f}", whole.without(f)) for f in FEATURES]
    work = ablation_workload(requests, model.cfg.vocab_size, quick)
    # a pool that holds every request's pages as they grow, but not every maximum at once
    need = [len(p) + n for p, n in work]
    kv_tokens = max(sum(sorted(need)[-max_seqs:]) * 2 // 3, max(need) + 64)
    engines = {}
    for name, setup in setups:
        engines[name] = setup.build(model, tok, kv_tokens=kv_tokens, max_seqs=max_seqs,
                                    device=device)
        run_setup(engines[name], setup.decoder, work[:2])  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name, _ in setups}
    try:
        for rnd in range(rounds):
            order = setups if rnd % 2 == 0 else setups[::-1]
            for name, setup in order:
                r = run_setup(engines[name], setup.decoder, work)
                log(f"  round {rnd + 1}/{rounds} {name:<22} {r['tokens']} tokens in "
                    f"{r['wall_s']:.2f} s ({r['steps']} launches)")
                runs[name].append(r)
        quant_model = engines["whole engine"].model
        quant_bytes, fp32_bytes = weight_bytes(quant_model), weight_bytes(model)
    finally:
        for e in engines.values():
            e.close()
    base = runs["whole engine"][0]
    a, b, h = fit_step_cost(base["timeline"], base["step_tokens"])
    r_trip = round_trip_s(base["timeline"])
    t_f = t_q = 0.0
    if whole.quant:  # the launch's split: dispatch + bytes over the kernels' bandwidth
        t_f, t_q = (t / 1e3 for t in quant_step_ms(model, quant_model))
    rows = []
    for name, setup in setups:
        got = runs[name]
        wall = statistics.median(r["wall_s"] for r in got)
        scale = (a + max(t_f - t_q, 0.0)) / a if setup.quant is None and whole.quant and a else 1.0
        pred = predicted_wall(setup, got[0], a, b, h, scale, r_trip)
        rows.append({"setup": name, "wall_s": wall, "tok_s": got[0]["tokens"] / wall,
                     "steps": got[0]["steps"], "tokens_computed": sum(got[0]["step_tokens"]),
                     "prefill_tokens_saved": got[0]["prefill_tokens_saved"],
                     "preemptions": got[0]["preemptions"], "peak_running":
                     got[0]["peak_running"], "predicted_wall_s": pred,
                     "walls_s": [r["wall_s"] for r in got]})
    w_meas, w_pred = rows[0]["wall_s"], rows[0]["predicted_wall_s"]
    for r in rows:  # what the feature gave: the ablated setup's time over the whole engine's
        r["measured_speedup"] = r["wall_s"] / w_meas
        r["predicted_speedup"] = r["predicted_wall_s"] / w_pred
        r["gain_share"] = gain_share(r["measured_speedup"], r["predicted_speedup"])
    rows[0]["fit_ms"] = {"a": a * 1e3, "b": b * 1e3, "h": h * 1e3, "round_trip": r_trip * 1e3,
                         "step_fp32": t_f * 1e3, "step_quant": t_q * 1e3}
    if t_f > t_q:  # t = dispatch + bytes / bandwidth, solved from the two formats
        bw = (fp32_bytes - quant_bytes) / (t_f - t_q)
        rows[0]["fit_ms"]["dispatch"] = (t_q - quant_bytes / bw) * 1e3
        rows[0]["fit_ms"]["bandwidth_gb_s"] = bw / 1e9
    return rows


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
    print(f"step cost fitted on the whole engine: a={f['a']:.2f} ms + b={f['b']:.3f} ms/token, "
          f"host h={f['h']:.2f} ms/launch, round trip r={f['round_trip']:.3f} ms/launch")
    if "dispatch" in f:
        print(f"a batch-1 step: fp32 {f['step_fp32']:.2f} ms, quantized {f['step_quant']:.2f} ms "
              f"= dispatch {f['dispatch']:.2f} ms + bytes at {f['bandwidth_gb_s']:.1f} GB/s")
    print(f"{'setup':<24}{'wall s':>8}{'tok/s':>8}{'launch':>8}{'tokens':>8}{'saved':>7}"
          f"{'preempt':>8}{'measured':>10}{'predicted':>10}{'gain':>7}")
    for r in rows:
        print(f"{r['setup']:<24}{r['wall_s']:>8.2f}{r['tok_s']:>8.1f}{r['steps']:>8}"
              f"{r['tokens_computed']:>8}{r['prefill_tokens_saved']:>7}{r['preemptions']:>8}"
              f"{r['measured_speedup']:>9.2f}x{r['predicted_speedup']:>9.2f}x"
              f"{r['gain_share']:>7.2f}")
    return 0

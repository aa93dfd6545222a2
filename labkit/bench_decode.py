"""`python -m labkit bench decode`: blocking against pipelined decoding, side by side.

For each stream count, the same requests (one short chat prompt per stream, `--tokens` new
tokens each, greedy, run to length) are decoded by the blocking and the pipelined loop on the
same device, alternating, `--repeats` times each; the median ms per decode step of each is
reported in the shape of Photon's table. From the blocking run's timeline come the two terms of
the cost model: T_device (the device's forward + sample per step) and T_host (everything else a
blocking step costs: commit, plan, launch, and the round trip), so the pipeline can at best
turn `T_host + T_device` into `max(T_host, T_device)`:

    predicted speedup = (T_host + T_device) / max(T_host, T_device)

The zombie tax is the share of decode rows the pipelined loop ran for sequences that had
already finished (one per sequence: 1/110 at one stream for 110-token sequences).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

import torch

# Photon's published figures, for the table: (hardware, streams, blocking ms/step, pipelined
# ms/step, the speedup as published). Source: Moondream's Photon write-up (shared/seeds). The
# published speedups are quoted as given; they do not all equal blocking / pipelined - 1.
PHOTON = [("RTX 3090", 1, 5.44, 5.10, 6.5), ("RTX 3090", 32, 11.74, 10.52, 11.6),
          ("B200", 1, 3.11, 2.63, 17.6), ("B200", 32, 5.55, 3.98, 35.4)]

PROMPTS = ["Name three uses of a paperclip.", "Why is the sky blue?", "Describe a quiet city.",
           "Give me a haiku about rain.", "What is a prime number?", "Explain a hash map.",
           "Suggest a name for a cat.", "How do birds navigate?"]


def predicted_speedup(t_host: float, t_device: float) -> float:
    """The cost model: a blocking step costs T_host + T_device, a pipelined one the larger."""
    return (t_host + t_device) / max(t_host, t_device)


def decode_ms_per_step(timeline) -> tuple[float, float, int]:
    """(wall ms per decode step, device ms per decode step, decode steps) of a recorded run."""
    decode_launches = [s for s in timeline.lane("host") if s.label == "decode"]
    steps = {s.step for s in decode_launches}
    start = decode_launches[0].t0
    wall = timeline.t_end - start
    device = sum(s.duration for s in timeline.lane("compute") if s.step in steps)
    return wall / len(steps) * 1e3, device / len(steps) * 1e3, len(steps)


def run_once(engine, prompt_ids: list[list[int]], tokens: int, decoder: str) -> dict:
    """Decode the requests once with one decoder; ms/step and the counters of the run."""
    from labkit.sampling import SamplingParams
    from labkit.timeline import Timeline

    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    zombies0, rows0 = engine.zombie_rows, engine.decode_rows
    for ids in prompt_ids:
        engine.submit(ids, params)
    with Timeline.record(engine) as tl:
        engine.run(decoder)
    engine.check_all_released()
    ms, dev_ms, steps = decode_ms_per_step(tl)
    return {"ms": ms, "device_ms": dev_ms, "steps": steps,
            "zombie_rows": engine.zombie_rows - zombies0, "rows": engine.decode_rows - rows0,
            "timeline": tl}


def bench_streams(engine, tok, streams: int, tokens: int, repeats: int) -> dict:
    """One row of the table: blocking and pipelined at `streams` concurrent requests."""
    vocab = engine.model.cfg.vocab_size
    # `tiny` knows only SmolLM2's first tokens; its weights are random, so only a prompt's
    # length matters and out-of-range ids are folded into range
    prompt_ids = [[t % vocab for t in tok.encode(PROMPTS[i % len(PROMPTS)], chat=True)]
                  for i in range(streams)]
    run_once(engine, prompt_ids, min(tokens, 8), "pipelined")  # warm up both paths
    run_once(engine, prompt_ids, min(tokens, 8), "blocking")
    runs: dict[str, list[dict]] = {"blocking": [], "pipelined": []}
    for _ in range(repeats):  # alternate, so drift on a shared machine hits both alike
        for decoder in ("blocking", "pipelined"):
            runs[decoder].append(run_once(engine, prompt_ids, tokens, decoder))
    blocking = statistics.median(r["ms"] for r in runs["blocking"])
    pipelined = statistics.median(r["ms"] for r in runs["pipelined"])
    t_device = statistics.median(r["device_ms"] for r in runs["blocking"])
    t_host = max(blocking - t_device, 0.0)
    last = runs["pipelined"][-1]
    return {
        "streams": streams, "blocking_ms": blocking, "pipelined_ms": pipelined,
        "speedup": blocking / pipelined, "t_host_ms": t_host, "t_device_ms": t_device,
        "predicted_speedup": predicted_speedup(t_host, t_device),
        "zombie_rows": last["zombie_rows"], "zombie_tax": last["zombie_rows"] / last["rows"],
        "timelines": {d: runs[d][-1]["timeline"] for d in runs},
    }


def main(argv: list[str]) -> int:
    """Entry point of `python -m labkit bench decode`."""
    p = argparse.ArgumentParser(prog="python -m labkit bench decode",
                                description="Blocking vs pipelined decoding, side by side.")
    p.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--device", choices=("auto", "process", "cuda", "inprocess"),
                   default="auto", help="auto: cuda when present, else the simulated process")
    p.add_argument("--tokens", type=int, default=110, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra-host-ms", type=float, default=0.0,
                   help="WHAT-IF: add this much pure-Python host work to every commit")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    try:
        streams = [int(s) for s in args.streams.split(",")]
        if any(s < 1 for s in streams) or args.tokens < 1 or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"error: --streams must be positive integers like 1,32 (got {args.streams!r}); "
              "--tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    from labkit.engine import Engine
    from labkit.loading import load_model

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "process"
    try:
        model, tok = load_model(args.model)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine = Engine(model, tok, device=device, max_seqs=max(streams),
                    kv_tokens=max(streams) * (args.tokens + 64) + 256, block_size=16)
    engine.extra_host_work_s = args.extra_host_ms / 1e3
    gc.collect()
    gc.freeze()  # a collector pause of ~100 ms on this heap would land in some random step
    hardware = (torch.cuda.get_device_name(0) if device == "cuda"
                else engine.device.name)
    try:
        rows = [bench_streams(engine, tok, s, args.tokens, args.repeats) for s in streams]
    finally:
        engine.close()
    for r in rows:
        r.pop("timelines")
        r.update(device=hardware, model=args.model, tokens=args.tokens,
                 extra_host_ms=args.extra_host_ms)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'hardware':<34} {'streams':>7} {'blocking ms':>11} {'pipelined ms':>12} "
          f"{'speedup':>8} {'T_host':>7} {'T_dev':>7} {'predicted':>9} {'zombie tax':>10}")
    for r in rows:
        print(f"{r['device'][:34]:<34} {r['streams']:>7} {r['blocking_ms']:>11.2f} "
              f"{r['pipelined_ms']:>12.2f} {100 * (r['speedup'] - 1):>+7.1f}% "
              f"{r['t_host_ms']:>7.2f} {r['t_device_ms']:>7.2f} "
              f"{100 * (r['predicted_speedup'] - 1):>+8.1f}% {100 * r['zombie_tax']:>9.2f}%")
    for hw, s, b, pl, gain in PHOTON:
        print(f"{'Photon ' + hw + ' (published)':<34} {s:>7} {b:>11.2f} {pl:>12.2f} "
              f"{gain:>+7.1f}%")
    note = (f"model {args.model}, {args.tokens} tokens per request, median of {args.repeats}; "
            f"zombie tax = decode rows run for finished sequences (Photon: ~1% at 1 stream)")
    if args.extra_host_ms:
        note += f"; WHAT-IF: +{args.extra_host_ms} ms of artificial host work per commit"
    print(note)
    return 0

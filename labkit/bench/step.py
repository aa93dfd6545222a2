"""`python -m labkit bench step`: where one decode step's time goes, by phase.

The engine's whole decode step (plan, launch, forward, sample, copy, commit; the blocking
decoder, the in-process device) is timed beside the bare model forward at the same batch and
context (`ceilings.measure_decode_step`: the model and a plain attention over a preallocated
KV, nothing else), in alternating turns, and the ratio of medians is reported: what the engine
adds around the model.

Then the bare forward split: its layers as one C++ call (`labkit.kernels.stack`, the default
where labkit's kernels serve) against the Python layers, in alternating turns, and how much of
the C++ forward is spent in kernels (timed inside the stack, the final norm and the head
among them where the whole forward is one call) and how much between them (RoPE's rows, the
one call); and the kernels' time by kind: the linears (the head among them), attention (with
its KV write) and the row ops (norms, residual adds, RoPE, SiLU times up). Where the linears
read at the memory's speed, what is left of a forward is mostly the other two.

Then a per-phase table (of the Python layers) from timed sections of profiled steps: the bench
wraps the engine's, the runner's and the model's pieces on *this engine instance* with timers
(plan, metadata, KV write + attention, q/k/v/o projections, MLP, head, sample, commit; "other"
is what the forward spends outside them: embedding, norms, RoPE, residual adds). Timers cost a
few microseconds each, so the profiled steps are not the ones the ratio uses.

A quantized model's row at batch 1 also carries its linears' effective read rate, each shape's
and a whole step's, beside labkit's read probe over the same bytes where they lie
(`linear_rate`): how close the kernels come to reading their weights as fast as this CPU can
read bytes; and the DRAM's own rate (the probe over a buffer no cache holds), since weights
read again every step come partly from the last-level cache.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext

from labkit import model as model_mod
from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser

PHASES = ("plan", "metadata", "kv write + attention", "qkvo proj", "mlp", "head",
          "other forward", "sample", "commit")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and validate everything before any model loads (bad values exit 2)."""
    p = command_parser("python -m labkit bench step",
                       "A decode step by phase, and the engine's whole "
                       "step against the bare model forward.")
    p.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps of each kind")
    p.add_argument("--model", default="smollm2-135m", help="a model name (tiny, smollm2-135m)")
    p.add_argument("--quant", default="none",
                   help="weights: none, int8, int4[-gN][-awq] (labkit.quant; every model runs "
                        "with q/k/v and gate/up fused, as the engine's entry points load it)")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout")
    args = p.parse_args(argv)
    from labkit.quant import QuantScheme
    try:
        QuantScheme.parse(args.quant)
    except ValueError as err:
        p.error(f"--quant: {err}")
    try:
        args.batch = [int(b) for b in args.batch.split(",")]
    except ValueError:
        p.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if any(b < 1 for b in args.batch) or args.context < 1 or args.steps < 1:
        p.error("--batch, --context and --steps must be >= 1")
    return args


class _Timers:
    """Accumulated seconds per phase label, from wrapped callables."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, label: str, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[label] += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def _instrument(engine, timers: _Timers) -> Iterator[None]:
    """Put timers around the pieces of this one engine (its instance attributes, and the
    layers' linears: `labkit.model.linear`, put back after the block)."""
    runner = engine.device.runner
    backend, model = runner.backend, runner.model
    for name in ("plan_decode", "plan_step"):  # whichever planning piece the engine has
        if hasattr(engine, name):
            setattr(engine, name, timers.wrap("plan", getattr(engine, name)))
    engine.commit = timers.wrap("commit", engine.commit)
    runner._meta = timers.wrap("metadata", runner._meta)
    runner.sample = timers.wrap("sample", runner.sample)
    runner.forward = timers.wrap("forward", runner.forward)
    # the whole attention call: the write of the new k, v, the read of the context (on the CPU
    # one kernel call does both, in place; elsewhere two index_copy_, a gather and SDPA)
    backend.attend = timers.wrap("kv write + attention", backend.attend)
    labels = {}  # id(linear module) -> phase
    for layer in model.layers:
        for label, names in (("qkvo proj", ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "gate_up_proj", "down_proj"))):
            for name in names:  # separate or fused (LlamaModel.fuse_projections)
                m = getattr(layer, name, None)
                if m is not None:
                    labels[id(m)] = label
    plain = model_mod.linear
    wrapped = {label: timers.wrap(label, plain) for label in set(labels.values())}

    def linear(lin, x):  # every layer calls its linears through labkit.model.linear
        return wrapped[labels[id(lin)]](lin, x) if id(lin) in labels else plain(lin, x)

    model_mod.linear = linear
    try:
        with _timed_head(model, timers):
            yield
    finally:
        model_mod.linear = plain


@contextlib.contextmanager
def _timed_head(model, timers: _Timers) -> Iterator[None]:
    """Time every `model.head` call in the block as the phase "head": the head timed where the
    forward runs it, after the layers' weights went through the caches (timed alone, in a loop
    of its own, its weights stay warm and it runs faster than in a step)."""
    model.head = timers.wrap("head", model.head)  # an instance attribute over the method
    try:
        yield
    finally:
        del model.head


def forward_split(model, batch: int, context: int, steps: int) -> dict:
    """One decode forward at `batch` rows: its layers through the C++ decoder stack and through
    the Python layers, in alternating turns (ms, medians), and where the stack's forward goes:
    kernels (timed inside the stack, plus the head where the forward calls it) against what
    runs between them, each profiled forward against its own kernels (medians of the pairs: a
    noisy moment moves both sides of a pair)."""
    import torch

    from labkit.bench.quant import decode_step
    from labkit.kernels import stack as decoder_stack

    step = decode_step(model, batch, context)
    with torch.inference_mode():
        step()
        served = decoder_stack._STACKS.get(model) is not None and decoder_stack.enabled()
        times: dict[str, list[float]] = {"stack": [], "python": []}
        for r in range(steps):
            for name in (("stack", "python") if r % 2 == 0 else ("python", "stack")):
                with decoder_stack.disabled() if name == "python" else nullcontext():
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
        kernels, between, share = [], [], []  # each profiled forward against its own kernels
        kinds: dict[str, list[float]] = {k: [] for k in decoder_stack.SPLIT}
        head = _Timers()
        head.on = True
        for _ in range(steps):
            head.s.clear()
            with decoder_stack.profiling() as prof, _timed_head(model, head):
                t0 = time.perf_counter()
                step()
                wall = time.perf_counter() - t0
            # the kernels timed inside the stack (the head among them where the whole forward
            # is one C++ call, `for_logits`), plus the head where Python called it
            inside = prof["kernel_s"] + head.s.get("head", 0.0)
            kernels.append(inside)
            for k, sec in prof["split"].items():
                kinds[k].append(sec + (head.s.get("head", 0.0) if k == "linears" else 0.0))
            between.append(max(wall - inside, 0.0))
            share.append(between[-1] / wall)
    fwd = statistics.median(times["stack"])
    return {"stack_served": served, "forward_ms": fwd * 1e3,
            "python_layers_ms": statistics.median(times["python"]) * 1e3,
            "kernels_ms": statistics.median(kernels) * 1e3,
            "kernels_by_kind_ms": {k: statistics.median(v) * 1e3 for k, v in kinds.items()},
            "between_ms": statistics.median(between) * 1e3,
            "between_share": statistics.median(share)}


def bench_step(model, batch: int, context: int, steps: int) -> dict:
    """One batch size: engine step vs bare forward (alternating), and the phase table."""
    from labkit.ceilings import measure_decode_step
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.sampling import SamplingParams

    total = context + 3 * steps + 8
    engine = Engine(model, None, kv_tokens=batch * (total + 32), max_seqs=batch,
                    block_size=16)
    gen = __import__("random").Random(0)
    vocab = model.cfg.vocab_size
    for _ in range(batch):
        engine.submit([gen.randrange(min(100, vocab - 1), vocab) for _ in range(context)],
                      SamplingParams(max_new_tokens=3 * steps + 4, ignore_eos=True))
    seqs = list(engine.seqs.values())
    while not all(s.output_ids for s in seqs):  # prefill (chunked or not) until all decode
        run(engine, "blocking", max_steps=1)

    def engine_step() -> float:
        t0 = time.perf_counter()
        run(engine, "blocking", max_steps=1)
        return time.perf_counter() - t0

    engine_s, bare_s = [], []
    for _ in range(steps):  # alternating turns: a drifting machine slows both alike
        engine_s.append(engine_step())
        bare_s.append(measure_decode_step(model, batch, context, repeats=1))
    from labkit.kernels import stack as decoder_stack

    timers = _Timers()
    with _instrument(engine, timers), decoder_stack.disabled():  # the Python layers' pieces
        timers.on = True
        t0 = time.perf_counter()
        for _ in range(steps):
            run(engine, "blocking", max_steps=1)
        profiled = (time.perf_counter() - t0) / steps
        timers.on = False
    engine.close()
    per = {k: v / steps for k, v in timers.s.items()}
    inside = sum(per.get(k, 0.0) for k in ("metadata", "kv write + attention", "qkvo proj",
                                           "mlp", "head"))
    per["other forward"] = max(0.0, per.pop("forward", 0.0) - inside)
    phases = {k: per.get(k, 0.0) * 1e3 for k in PHASES}
    from labkit.bench.paths import kernel_paths

    return {"batch": batch, "context": context, "steps": steps,
            "kernel_paths": kernel_paths(model, "paged"),  # the engine's default backend
            "engine_step_ms": statistics.median(engine_s) * 1e3,
            "bare_forward_ms": statistics.median(bare_s) * 1e3,
            "engine_over_forward": statistics.median(engine_s) / statistics.median(bare_s),
            "profiled_step_ms": profiled * 1e3, "phases_ms": phases,
            "forward_split": forward_split(model, batch, context, steps)}


def log(line: str) -> None:
    """Progress, on stderr (stdout holds the rows)."""
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    """`python -m labkit bench step ...`; returns the exit code."""
    args = parse_args(argv)
    import torch

    from labkit.bench.linear_rate import dram_rate, forward_floor, linear_rates
    from labkit.loading import load_model

    log(f"bench step: model {args.model} (quant {args.quant}), context {args.context}, "
        f"{args.steps} steps each, {torch.get_num_threads()} torch threads")
    def measure() -> list[dict]:
        model, _ = load_model(args.model, quant=args.quant, fuse=True)
        rows = []
        for b in args.batch:
            log(f"  batch {b} ...")
            rows.append(bench_step(model, b, args.context, args.steps))
            if b == 1:  # the kernels' read rate at batch 1
                log("  linears at batch 1 against the read probe ...")
                rows[-1]["linear_rates"] = linear_rates(model, turns=max(3, args.steps))
                rows[-1]["forward_floor"] = forward_floor(model, args.context,
                                                          turns=max(5, args.steps))
                rows[-1]["dram"] = dram_rate()
        return rows

    return report_rows(measure, args.json, _table)


def _table(rows: list[dict]) -> None:
    print(f"{'phase (ms)':<24}" + "".join(f"{'batch ' + str(r['batch']):>12}" for r in rows))
    for k in PHASES:
        print(f"{k:<24}" + "".join(f"{r['phases_ms'][k]:>12.2f}" for r in rows))
    for label, key in (("profiled step", "profiled_step_ms"), ("engine step", "engine_step_ms"),
                       ("bare forward", "bare_forward_ms")):
        print(f"{label:<24}" + "".join(f"{r[key]:>12.2f}" for r in rows))
    print(f"{'engine / forward':<24}" + "".join(f"{r['engine_over_forward']:>11.2f}x"
                                               for r in rows))
    print("the forward's layers in one C++ call (labkit.kernels.stack) and in Python:")
    for label, key in (("forward, C++ layers", "forward_ms"),
                       ("forward, Python layers", "python_layers_ms"),
                       ("  in kernels", "kernels_ms"), ("  between kernels", "between_ms")):
        print(f"{label:<24}" + "".join(f"{r['forward_split'][key]:>12.2f}" for r in rows))
    print(f"{'  between / forward':<24}" + "".join(
        f"{100 * r['forward_split']['between_share']:>11.1f}%" for r in rows))
    print("the C++ forward's kernels by kind (ms; row ops: norms, residual adds, RoPE, SiLU*up):")
    for kind in rows[0]["forward_split"]["kernels_by_kind_ms"]:
        print(f"{'  ' + kind:<24}" + "".join(
            f"{r['forward_split']['kernels_by_kind_ms'][kind]:>12.2f}" for r in rows))
    if not all(r["forward_split"]["stack_served"] for r in rows):
        print("(the C++ layers did not serve this model here: both rows ran the Python layers)")
    from labkit.bench.linear_rate import format_dram, format_rates
    from labkit.bench.paths import format_paths

    print("kernels each op ran on:\n" + format_paths(rows[0]["kernel_paths"]))
    for r in rows:
        if r.get("linear_rates"):
            print(f"linears at batch {r['batch']}: bytes read / time, beside the read probe "
                  "of the same bytes (labkit.bench.linear_rate)\n"
                  + format_rates(r["linear_rates"]))
        if r.get("forward_floor"):
            f = r["forward_floor"]
            print(f"bare forward at batch 1 (context {f['context']}) against its floor, the "
                  f"probe reading its {f['bytes'] / 1e6:.0f} MB of weights ({f['probe']}): "
                  f"{f['forward_ms']:.2f} ms / {f['floor_ms']:.2f} ms = {f['over_floor']:.2f}x "
                  "its floor")
        if r.get("dram"):
            print(format_dram(r["dram"]))
            if r.get("linear_rates"):
                step = r["linear_rates"][-1]
                print(f"  the step's linears read {step['gb_per_s'] / r['dram']['gb_per_s']:.2f}x "
                      "the DRAM's rate")

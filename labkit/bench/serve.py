"""`python -m labkit bench serve`: latency and throughput under arrivals, per batching policy.

A seeded Poisson workload (`labkit.serving.workload`: prompts of 20-400 tokens, outputs of 10-500,
long-tailed) is replayed in wall time into an engine for each setting: each `--batching`
policy at each `--rate` and `--max-step-tokens` budget. Requests arrive between steps as their
time comes (`ArrivalFeeder` as `engine.on_step`), greedy, each running to its stated length.
One JSON row per setting:

    {batching, rate, requests, max_step_tokens, throughput_tok_s, ttft_p50_ms, ttft_p99_ms,
     tpot_p50_ms, tpot_p99_ms, goodput}

Latency percentiles are over requests (`labkit.serving.metrics`); goodput is the share of requests
meeting `--slo-ttft-ms` and `--slo-tpot-ms`. With `--rounds R` the settings take turns R times
(the order reversed every other round, so a machine's drift hits all alike) and each field is
the median over rounds; `range` holds each field's [min, max] over the rounds (the band a
comparison must clear). Progress goes to stderr.

`--url http://host:port` sends the same seeded workload over HTTP to any OpenAI-compatible
server instead (labkit's `python -m labkit serve`, vLLM, SGLang; `labkit.serving.client`) and
reports the same row, with `batching` "url" and the server's own settings unknown (None). The
prompts are token ids below `--vocab-size` (by default the vocabulary of `--model`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser
from labkit.serving.metrics import SLO, request_latency, summarize
from labkit.serving.workload import LengthDist, poisson_workload

SHORT_PROMPTS = LengthDist(8, 64, median=20, sigma=0.6)  # --short: quick runs, same shape
SHORT_OUTPUTS = LengthDist(4, 48, median=12, sigma=0.7)
KNOWN_VOCAB = {"smollm2-135m": 49152, "tiny": 8192}  # labkit's models (loading.TINY_VOCAB)


def _csv(kind, name: str):
    """An argparse type: a comma-separated list of `kind` ('none' means no budget)."""
    def parse(text: str):
        out = []
        for part in text.split(","):
            part = part.strip()
            if name == "max-step-tokens" and part.lower() == "none":
                out.append(None)
                continue
            try:
                out.append(kind(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"--{name}: {part!r} is not a "
                                                 f"{kind.__name__}") from None
        return out
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and validate everything before any model loads (bad values exit 2)."""
    p = command_parser("python -m labkit bench serve",
                       "TTFT, TPOT, throughput and goodput under Poisson "
                       "arrivals, static against continuous batching.")
    p.add_argument("--rate", type=_csv(float, "rate"), default=[2.0],
                   help="arrivals per second (comma-separated for a sweep)")
    p.add_argument("--requests", type=int, default=32, help="requests per run")
    p.add_argument("--batching", type=_csv(str, "batching"), default=["static", "continuous"],
                   help="static, continuous, or both (comma-separated)")
    p.add_argument("--max-step-tokens", type=_csv(int, "max-step-tokens"), default=[512],
                   help="per-step token budget(s); 'none' for no budget")
    p.add_argument("--model", default="smollm2-135m", help="a model name (tiny, smollm2-135m)")
    p.add_argument("--max-seqs", type=int, default=16, help="sequences running at once")
    p.add_argument("--kv-tokens", type=int, default=16384, help="KV pool size in tokens")
    p.add_argument("--decoder", choices=("blocking", "pipelined"), default="pipelined",
                   help="the decode loop")
    p.add_argument("--device", choices=("inprocess", "process"), default="inprocess",
                   help="where the model runs: this process or a simulated accelerator process")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput's TPOT bound")
    p.add_argument("--rounds", type=int, default=1, help="turns of every setting, alternating")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--short", action="store_true",
                   help="short requests (prompts 8-64, outputs 4-48 tokens) for quick runs")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server (http://host:port) "
                   "to send the workload to, instead of an engine in this process")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --url: prompt ids are below this (default: --model's vocabulary)")
    args = p.parse_args(argv)
    if args.url is not None:
        from labkit.serving.client import Endpoint

        try:
            args.endpoint = Endpoint.parse(args.url)
        except ValueError as err:
            p.error(str(err))
        if args.vocab_size is None:
            args.vocab_size = KNOWN_VOCAB.get(args.model)
            if args.vocab_size is None:
                p.error(f"--url with --model {args.model!r}: give --vocab-size (prompt ids "
                        f"must be below the served model's vocabulary)")
    if args.vocab_size is not None and args.vocab_size < 200:
        p.error(f"--vocab-size must be >= 200, got {args.vocab_size}")
    if any(not r > 0 for r in args.rate):
        p.error(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.requests < 1:
        p.error(f"--requests must be >= 1, got {args.requests}")
    if any(b is not None and b < 1 for b in args.max_step_tokens):
        p.error(f"--max-step-tokens must be >= 1 (or 'none'), got {args.max_step_tokens}")
    bad = [b for b in args.batching if b not in ("static", "continuous")]
    if bad:
        p.error(f"--batching must be static or continuous, got {bad[0]!r}")
    for name in ("max_seqs", "kv_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0):
        p.error("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    return args


def serve_once(model, tok, requests, *, batching: str, max_step_tokens: int | None,
               max_seqs: int, kv_tokens: int, decoder: str, device: str, slo: SLO) -> dict:
    """Replay `requests` in wall time through one engine setting; the summary row."""
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.serving.workload import ArrivalFeeder

    engine = Engine(model, tok, kv_tokens=kv_tokens, max_seqs=max_seqs, device=device,
                    max_step_tokens=max_step_tokens, batching=batching)
    try:
        feeder = ArrivalFeeder(list(requests))
        engine.on_step = feeder
        t0 = time.perf_counter()
        feeder.start_s = t0
        run(engine, decoder)
        wall = time.perf_counter() - t0
        engine.check_all_released()
        lat = [request_latency(engine.completion(feeder.ids[r.index]), feeder.lag_s[r.index])
               for r in requests]
    finally:
        engine.close()
    return summarize(lat, wall, slo).row()


def engine_step_s(model, *, batch: int = 4, steps: int = 32, repeats: int = 3) -> float:
    """Median seconds per launch of an engine running `batch` sequences for `steps` tokens each
    (prefill launches included, as in any run): the unit a load is set against.

    An arrival rate loads an engine only relative to its step: 16 requests/s keeps a CPU's
    SmolLM2 busy and leaves the tiny model idle. `rate = 1 / (k * engine_step_s(model))` brings
    one request every k steps on whatever machine runs it."""
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.sampling import SamplingParams

    if batch < 1 or steps < 1 or repeats < 1:
        raise ValueError(f"batch, steps and repeats must be >= 1, got {batch}, {steps}, "
                         f"{repeats}")
    times = []
    for _ in range(repeats):
        # a pool for this work (prompts of 20, `steps` new tokens, a zombie row's one more),
        # not the default server-sized one: allocated whole, it would cost more than the run
        engine = Engine(model, None, kv_tokens=batch * (20 + steps + 32), max_seqs=batch,
                        max_step_tokens=None)
        try:
            for i in range(batch):
                engine.submit(list(range(100 + i, 120 + i)),
                              SamplingParams(max_new_tokens=steps, ignore_eos=True))
            t0 = time.perf_counter()
            run(engine, "pipelined")
            times.append((time.perf_counter() - t0) / engine.stats.steps)
            engine.check_all_released()
        finally:
            engine.close()
    return statistics.median(times)


def serve_url(args: argparse.Namespace, log=print) -> list[dict]:
    """The workload of each rate over HTTP to `args.endpoint`, `args.rounds` alternating turns;
    median rows (the same fields as an in-process run's)."""
    from labkit.serving.client import replay

    kw = {"prompt": SHORT_PROMPTS, "output": SHORT_OUTPUTS} if args.short else {}
    work = {r: poisson_workload(args.requests, r, seed=args.seed, vocab_size=args.vocab_size,
                                **kw) for r in args.rate}
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    model = args.endpoint.model_name()
    runs: dict[float, list[dict]] = {r: [] for r in args.rate}
    for rnd in range(args.rounds):
        order = args.rate if rnd % 2 == 0 else args.rate[::-1]
        for r in order:
            log(f"  round {rnd + 1}/{args.rounds}: {args.url} ({model}) rate={r:g}/s ...")
            lat, wall = replay(args.endpoint, work[r], model)
            row = summarize(lat, wall, slo).row()
            log(f"    {row['throughput_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms"
                f", TPOT p99 {row['tpot_p99_ms']:.0f} ms, goodput {row['goodput']:.0%}")
            runs[r].append(row)
    return [{"batching": "url", "rate": r, "requests": args.requests, "max_step_tokens": None,
             **{k: statistics.median(g[k] for g in got) for k in got[0]},
             "url": args.url, "model": model} for r, got in runs.items()]


def bench_serve(args: argparse.Namespace, log=print) -> list[dict]:
    """Every (batching, rate, budget) setting, `args.rounds` alternating turns; median rows."""
    from labkit.loading import load_model

    if getattr(args, "url", None) is not None:
        return serve_url(args, log)
    model, tok = load_model(args.model, fuse=True)
    prompt, output = (SHORT_PROMPTS, SHORT_OUTPUTS) if args.short else (None, None)
    settings = [(b, r, t) for r in args.rate for t in args.max_step_tokens
                for b in args.batching]
    work = {}
    for r in args.rate:
        kw = {"prompt": prompt, "output": output} if args.short else {}
        work[r] = poisson_workload(args.requests, r, seed=args.seed,
                                   vocab_size=model.cfg.vocab_size, **kw)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    runs: dict[tuple, list[dict]] = {s: [] for s in settings}
    for rnd in range(args.rounds):
        order = settings if rnd % 2 == 0 else settings[::-1]
        for i, (b, r, t) in enumerate(order):
            log(f"  round {rnd + 1}/{args.rounds}, {i + 1}/{len(order)}: batching={b} "
                f"rate={r:g}/s max_step_tokens={t} ...")
            row = serve_once(model, tok, work[r], batching=b, max_step_tokens=t,
                             max_seqs=args.max_seqs, kv_tokens=args.kv_tokens,
                             decoder=args.decoder, device=args.device, slo=slo)
            log(f"    {row['throughput_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms"
                f", TPOT p99 {row['tpot_p99_ms']:.0f} ms, goodput {row['goodput']:.0%}")
            runs[(b, r, t)].append(row)
    rows = []
    for (b, r, t), got in runs.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        spread = {k: [min(g[k] for g in got), max(g[k] for g in got)] for k in got[0]}
        rows.append({"batching": b, "rate": r, "requests": args.requests,
                     "max_step_tokens": t, **med, "range": spread})
    return rows


def log(line: str) -> None:
    """Progress, on stderr (stdout holds the rows)."""
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    """`python -m labkit bench serve ...`; returns the exit code."""
    args = parse_args(argv)
    log(f"bench serve: {args.requests} requests, "
        + (f"to {args.url}" if args.url else f"model {args.model}, decoder {args.decoder}"))
    return report_rows(lambda: bench_serve(args, log), args.json, _table)


def _table(rows: list[dict]) -> None:
    print(f"{'batching':<11}{'rate':>6}{'budget':>7}{'tok/s':>8}{'TTFT p50':>10}"
          f"{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'goodput':>9}")
    for r in rows:
        print(f"{r['batching']:<11}{r['rate']:>6g}{str(r['max_step_tokens']):>7}"
              f"{r['throughput_tok_s']:>8.1f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>8.0f}"
              f"{r['tpot_p50_ms']:>10.1f}{r['tpot_p99_ms']:>8.1f}{r['goodput']:>9.0%}")

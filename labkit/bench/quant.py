"""`python -m labkit bench quant`: what int8 and int4 buy (speed) and cost (NLL), side by side.

For each scheme (fp32 first, then `--schemes`), one row per batch size:

- `weight_bytes`: what one decode step reads of the weights (labkit.quant.weight_bytes);
- `step_ms`: one decode step's forward (B sequences, one new token each, at a context of
  `--context` tokens), timed in alternating turns: every round runs `--steps` steps of every
  scheme, in an order that reverses each round, and keeps each turn's median; a scheme's
  `speedup_vs_fp32` is the median over rounds of fp32's turn / its turn in the same round;
- `tok_s_single_stream`: one greedy request of `--gen-tokens` tokens through the engine
  (the whole step: sampling, commit, detokenizing), also in alternating turns, from submission
  to the last token, so the prompt's prefill is in it; `tok_s_decode`: the same request's
  tokens after the first (1 / its mean inter-token time), decode alone, as llama.cpp's "tg"
  figure is; `gen_speedup_vs_fp32`, `decode_speedup_vs_fp32`: turn-against-turn medians;
- `nll`, `nll_delta_pct`: mean token NLL on the start of the default text (labkit.perplexity).

Every model, fp32 included, runs with q/k/v and gate/up fused (`--no-fuse`: separate linears).

The roofline prediction for a batch-1 step is fp32's weight bytes over the scheme's: what the
step would gain if it were all weight reads; the per-op overhead of ~15 eager ops per layer
and the activation casts the packed kernels need are what keep a CPU step from it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser

DEFAULT_SCHEMES = "int8,int4-g32,int4-g64,int4-g32-awq"


def decode_step(model, batch: int, context: int = 64, block_size: int = 16):
    """A function that runs one decode step's forward: `batch` rows at `context` tokens each."""
    from labkit.attention import BACKENDS, AttentionMeta
    from labkit.paged_kv import PagedKVCache

    dtype = next(model.parameters()).dtype
    pages = -(-(context + 1) // block_size)  # ceil: room for the new token
    cache = PagedKVCache(model.cfg, batch * pages, block_size, dtype)
    backend = BACKENDS["paged"](cache)
    tables = torch.arange(batch * pages).reshape(batch, pages)  # [B, pages]
    meta = AttentionMeta.build(torch.ones(batch, dtype=torch.long),
                               torch.full((batch,), context), tables, block_size)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), generator=torch.Generator()
                        .manual_seed(0))  # [B]

    def step() -> torch.Tensor:
        backend.begin_step(meta)
        return model(ids, meta.positions, backend, logit_rows=meta.last_rows)  # [B, V]
    return step


def _turn_ms(fn, steps: int) -> float:
    """Median ms of `steps` calls of fn."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def alternate(fns: dict[str, object], rounds: int, steps: int) -> dict[str, list[float]]:
    """{name: [ms per turn]}: every round runs each fn `steps` times, order reversed each round."""
    names = list(fns)
    for fn in fns.values():  # warm up: first calls allocate
        fn()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            out[n].append(_turn_ms(fns[n], steps))
    return out


def _ratios(base: list[float], other: list[float]) -> float:
    """Median over rounds of base / other: a speedup measured turn against turn."""
    return statistics.median(b / o for b, o in zip(base, other))


def bench_quant(model_name: str = "smollm2-135m", schemes: list[str] | None = None,
                batches: tuple[int, ...] = (1, 32), rounds: int = 5, steps: int = 10,
                gen_tokens: int = 32, nll_tokens: int = 1024, log=print, fuse: bool = True
                ) -> list[dict]:
    """Rows {quant, batch, weight_bytes, step_ms, speedup_vs_fp32, tok_s_single_stream, nll,
    nll_delta_pct, predicted_speedup} for fp32 and each scheme."""
    import labkit
    from labkit.ceilings import device_name
    from labkit.loading import load_model
    from labkit.perplexity import default_text, nll
    from labkit.quant import QuantScheme, weight_bytes
    from labkit.sampling import SamplingParams

    names = ["none"] + [QuantScheme.parse(s).name for s in (schemes or
                                                            DEFAULT_SCHEMES.split(","))]
    models = {}
    for n in names:
        t0 = time.perf_counter()
        models[n], tok = load_model(model_name, quant=None if n == "none" else n, fuse=fuse)
        log(f"  loaded {model_name} quant={n} in {time.perf_counter() - t0:.1f} s")
    ids = torch.tensor(tok.encode(default_text())[:nll_tokens])
    nlls = {}
    for n, m in models.items():
        nlls[n] = nll(m, ids)[0]
        log(f"  NLL {n}: {nlls[n]:.4f} over {len(ids) - 1} tokens")
    step_ms, speedup = {}, {}
    for b in batches:
        turns = alternate({n: decode_step(m, b) for n, m in models.items()}, rounds, steps)
        for n in names:
            step_ms[n, b] = statistics.median(turns[n])
            speedup[n, b] = _ratios(turns["none"], turns[n])
        log(f"  batch {b}: " + ", ".join(f"{n} {step_ms[n, b]:.2f} ms" for n in names))
    prompt = tok.encode("Write a short story about a lighthouse keeper.", chat=True)
    params = SamplingParams(max_new_tokens=gen_tokens, ignore_eos=True)
    engines = {n: labkit.Engine(m, tok, max_seqs=1, kv_tokens=1024) for n, m in models.items()}

    tpots: dict[str, list[float]] = {n: [] for n in names}  # each turn's mean inter-token s

    def gen(n, engine):
        def turn():
            tpots[n].append(labkit.generate([prompt], params, engine=engine)[0].tpot_s)
        return turn
    gen_turns = alternate({n: gen(n, e) for n, e in engines.items()}, max(rounds // 2, 2), 1)
    for n in names:
        del tpots[n][0]  # alternate()'s warm-up call, not a turn
    rows = []
    for n in names:
        tok_s = gen_tokens / (statistics.median(gen_turns[n]) / 1e3)
        for b in batches:
            rows.append({
                "quant": n, "batch": b, "weight_bytes": weight_bytes(models[n]),
                "step_ms": step_ms[n, b], "speedup_vs_fp32": speedup[n, b],
                "predicted_speedup": weight_bytes(models["none"]) / weight_bytes(models[n]),
                "tok_s_single_stream": tok_s,
                "gen_speedup_vs_fp32": _ratios(gen_turns["none"], gen_turns[n]),
                # the tokens after the first: decode alone, without the prompt's prefill
                "tok_s_decode": 1.0 / statistics.median(tpots[n]),
                "decode_speedup_vs_fp32": _ratios(tpots["none"], tpots[n]),
                "nll": nlls[n], "nll_delta_pct": 100 * (nlls[n] / nlls["none"] - 1),
                "model": model_name, "threads": torch.get_num_threads(), "fused": fuse,
                # the gain depends on the CPU's vector unit: AVX-512 speeds up torch's fp32
                # matmuls, not labkit's int kernels (results/cpu-avx512-2026-12-02.md)
                "cpu": device_name(torch.device("cpu")),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "rounds": rounds, "nll_tokens": len(ids) - 1})
    return rows


def main(argv: list[str]) -> int:
    """Entry point of `python -m labkit bench quant`."""
    p = command_parser("python -m labkit bench quant",
                       "fp32 against int8/int4 weights: step time, tokens/s "
                       "and NLL, measured in alternating turns.")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma-separated quant schemes")
    p.add_argument("--batches", default="1,32", help="comma-separated decode batch sizes")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--steps", type=int, default=10, help="steps per turn")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens of the single stream")
    p.add_argument("--nll-tokens", type=int, default=1024, help="tokens of text scored")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--no-fuse", action="store_true",
                   help="keep q/k/v and gate/up as separate linears in every model")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)

    def measure() -> list[dict]:
        batches = tuple(int(b) for b in args.batches.split(","))
        if any(b < 1 for b in batches) or args.rounds < 1 or args.steps < 1:
            raise ValueError("--batches, --rounds and --steps must be positive")
        if args.threads:
            torch.set_num_threads(args.threads)
        log = (lambda s: print(s, file=sys.stderr)) if args.json else print
        return bench_quant(args.model, args.schemes.split(","), batches, args.rounds,
                           args.steps, args.gen_tokens, args.nll_tokens, log, not args.no_fuse)

    return report_rows(measure, args.json, lambda rows: _table(rows, args.rounds))


def _table(rows: list[dict], rounds: int) -> None:
    print(f"{'quant':<14} {'batch':>5} {'weight MB':>9} {'step ms':>8} {'speedup':>8} "
          f"{'predicted':>9} {'tok/s 1x':>8} {'gen x':>6} {'decode':>7} {'dec x':>6} "
          f"{'NLL':>7} {'dNLL %':>7}")
    for r in rows:
        print(f"{r['quant']:<14} {r['batch']:>5} {r['weight_bytes'] / 1e6:>9.1f} "
              f"{r['step_ms']:>8.2f} {r['speedup_vs_fp32']:>7.2f}x {r['predicted_speedup']:>8.2f}x "
              f"{r['tok_s_single_stream']:>8.1f} {r['gen_speedup_vs_fp32']:>5.2f}x "
              f"{r['tok_s_decode']:>7.1f} {r['decode_speedup_vs_fp32']:>5.2f}x "
              f"{r['nll']:>7.4f} {r['nll_delta_pct']:>+7.2f}")
    print(f"{rows[0]['model']} on {rows[0]['cpu']} ({rows[0]['cpu_capability']}), "
          f"{rows[0]['threads']} torch threads, "
          f"{'fused' if rows[0]['fused'] else 'separate'} q/k/v and gate/up; speedups are "
          f"medians over {rounds} rounds of turn-against-turn ratios; predicted = fp32 "
          "weight bytes / the scheme's (a step made only of weight reads)")

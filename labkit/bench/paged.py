"""`python -m labkit bench paged`: what a KV cache policy does with the same memory.

Three policies get the same KV memory (`--kv-tokens` token slots) and the same seeded
workload (`labkit.serving.workload`: prompts of 20-400 tokens, outputs of 10-500, long-tailed), all
requests queued at once:

- `contiguous`: one max-length region per sequence (`Engine(cache="contiguous")`, as many
  regions as the memory holds for the longest prompt + `--max-new`);
- `reserve`: pages, all of prompt + max_new_tokens taken at admission
  (`Engine(kv_reserve="max")`);
- `on_demand`: pages as sequences grow (`Engine(kv_reserve="on_demand")`).

Every request asks for `--max-new` tokens, as a client that does not know the answer's length
must, and stops at its sampled output length (the bench cancels it there, standing in for an
EOS). Between steps the bench records how many sequences run and, for each, the slots it holds
against the tokens it has written and will write (`labkit.instruments.kv_sim`'s accounting).
One row per policy: {policy, kv_bytes, max_concurrent, throughput_tok_s, reserved_unused_pct,
internal_waste_pct}, the percentages being time-averaged shares of the memory held. The
`predicted_concurrent` field is `kv_sim.simulate_pool` on the same lengths.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser
from labkit.instruments.kv_sim import simulate_pool
from labkit.serving.workload import OUTPUT_LENGTHS, PROMPT_LENGTHS, LengthDist, poisson_workload

POLICY_KWARGS = {  # the engine settings of each policy
    "contiguous": {"cache": "contiguous"},
    "reserve": {"cache": "paged", "kv_reserve": "max"},
    "on_demand": {"cache": "paged", "kv_reserve": "on_demand"},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and validate everything before any model loads (bad values exit 2)."""
    p = command_parser("python -m labkit bench paged",
                       "Concurrency, throughput and KV waste of three "
                       "cache policies at equal memory.")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV memory, in token slots")
    p.add_argument("--requests", type=int, default=48, help="requests in the workload")
    p.add_argument("--max-new", type=int, default=500, help="max_new_tokens every request asks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page")
    p.add_argument("--max-seqs", type=int, default=128, help="sequence slots (paged policies)")
    p.add_argument("--model", default="smollm2-135m", help="a model name (tiny, smollm2-135m)")
    p.add_argument("--policies", default="contiguous,reserve,on_demand",
                   help="comma-separated subset of contiguous, reserve, on_demand")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink every length by this factor (0 < s <= 1) for quick runs")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout")
    args = p.parse_args(argv)
    for name in ("kv_tokens", "requests", "max_new", "block_size", "max_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = [s for s in args.policies if s not in POLICY_KWARGS]
    if bad or not args.policies:
        p.error(f"--policies: unknown {bad or args.policies}; choose from "
                f"{', '.join(POLICY_KWARGS)}")
    lengths = workload_lengths(args)
    longest = max(p for p, _, _ in lengths) + lengths[0][2]
    if longest > args.kv_tokens:
        p.error(f"--kv-tokens {args.kv_tokens} cannot hold one request of {longest} tokens "
                "(the longest prompt + --max-new)")
    return args


def _scaled(d: LengthDist, s: float) -> LengthDist:
    lo, hi = max(1, round(d.lo * s)), max(1, round(d.hi * s))
    return LengthDist(lo, hi, min(hi, max(lo, d.median * s)), d.sigma)


def workload_lengths(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(prompt_len, output_len, max_new) per request of the bench's seeded workload."""
    max_new = max(1, round(args.max_new * args.scale))
    reqs = poisson_workload(args.requests, float("inf"), seed=args.seed,
                            prompt=_scaled(PROMPT_LENGTHS, args.scale),
                            output=_scaled(OUTPUT_LENGTHS, args.scale))
    return [(r.prompt_len, min(r.max_new_tokens, max_new), max_new) for r in reqs]


class PoolWatcher:
    """`engine.on_step`: stops each request at its output length, and books the pool."""

    def __init__(self, targets: dict[int, tuple[int, int]], held_slots):
        self.targets = targets  # request id -> (prompt_len, output_len)
        self.held_slots = held_slots  # seq -> slots it holds now
        self.max_running = 0
        self.samples = 0
        self.shares = [0.0, 0.0, 0.0]  # used, reserved-unused, internal (of held)

    def __call__(self, engine) -> None:
        """Cancel the requests that reached their length; record concurrency and waste."""
        for seq in list(engine.scheduler.running):
            p, f = self.targets[seq.request_id]
            if not seq.finalized and len(seq.output_ids) >= f:
                engine.cancel(seq.request_id)
        live = engine.scheduler.live()  # running, not finished, not preempted
        self.max_running = max(self.max_running, len(live))
        used = reserved = internal = 0
        for s in live:
            p, f = self.targets[s.request_id]
            held, tokens = self.held_slots(s), s.num_tokens
            used += min(tokens, held)
            reserved += max(0, min(held, p + f) - tokens)
            internal += max(0, held - max(p + f, tokens))
        total = used + reserved + internal
        if total:
            self.samples += 1
            for i, v in enumerate((used, reserved, internal)):
                self.shares[i] += v / total


def run_policy(model, policy: str, lengths, args) -> dict:
    """One policy on the workload: the bench row."""
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.sampling import SamplingParams

    bs, max_new = args.block_size, lengths[0][2]
    if policy == "contiguous":  # as many max-length regions as the memory holds
        region = max(p for p, _, _ in lengths) + max_new
        max_seqs = max(1, args.kv_tokens // region)
        held = lambda s: region  # noqa: E731
    else:
        max_seqs = args.max_seqs
        held = lambda s: len(s.block_table) * bs  # noqa: E731
    # one attention backend for every policy (it reads either cache), so that throughput
    # compares the memory policies, not the contiguous cache's default Python-loop reference
    engine = Engine(model, None, kv_tokens=args.kv_tokens, block_size=bs, max_seqs=max_seqs,
                    prefix_caching=False, attention="paged", **POLICY_KWARGS[policy])
    rng = random.Random(args.seed)
    vocab = model.cfg.vocab_size
    targets = {}
    try:
        for p, f, _ in lengths:
            ids = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(p)]
            rid = engine.submit(ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
            targets[rid] = (p, f)
        watcher = PoolWatcher(targets, held)
        engine.on_step = watcher
        t0 = time.perf_counter()
        run(engine, "blocking")
        wall = time.perf_counter() - t0
        engine.check_all_released()
        tokens = sum(len(engine.completion(rid).output_ids) for rid in targets)
    finally:
        engine.close()
    n = max(1, watcher.samples)
    kv_bytes = args.kv_tokens * model.cfg.kv_bytes_per_token(4)
    return {"policy": policy, "kv_bytes": kv_bytes, "max_concurrent": watcher.max_running,
            "throughput_tok_s": tokens / wall,
            "reserved_unused_pct": 100 * watcher.shares[1] / n,
            "internal_waste_pct": 100 * watcher.shares[2] / n}


def log(line: str) -> None:
    """Progress, on stderr (stdout holds the rows)."""
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    """`python -m labkit bench paged ...`; returns the exit code."""
    args = parse_args(argv)
    lengths = workload_lengths(args)
    log(f"bench paged: {args.requests} requests, {args.kv_tokens} KV token slots, "
        f"max_new {lengths[0][2]}, model {args.model}")
    from labkit.loading import load_model

    def measure() -> list[dict]:
        model, _ = load_model(args.model, fuse=True)
        rows = []
        for policy in args.policies:
            region = None
            if policy == "contiguous":
                region = max(p for p, _, _ in lengths) + lengths[0][2]
            predicted = simulate_pool(lengths, args.kv_tokens, policy, block_size=args.block_size,
                                      max_len=region, max_seqs=args.max_seqs)
            log(f"  {policy}: predicted {predicted.max_concurrent} concurrent; running ...")
            row = run_policy(model, policy, lengths, args)
            row["predicted_concurrent"] = predicted.max_concurrent
            log(f"    {row['max_concurrent']} concurrent, {row['throughput_tok_s']:.1f} tok/s")
            rows.append(row)
        return rows

    return report_rows(measure, args.json, _table)


def _table(rows: list[dict]) -> None:
    print(f"{'policy':<11}{'KV MB':>7}{'concurrent':>11}{'predicted':>10}{'tok/s':>8}"
          f"{'reserved %':>11}{'internal %':>11}")
    for r in rows:
        print(f"{r['policy']:<11}{r['kv_bytes'] / 1e6:>7.1f}{r['max_concurrent']:>11}"
              f"{r['predicted_concurrent']:>10}{r['throughput_tok_s']:>8.1f}"
              f"{r['reserved_unused_pct']:>11.1f}{r['internal_waste_pct']:>11.1f}")


"""`python -m labkit bench spec`: speculative decoding against plain decoding, one stream.

For each proposer (`--proposers`: int4 / int8, a quantized copy of the model drafting; ngram,
prompt lookup) and each k (`--k`), one greedy request of `--gen-tokens` tokens runs plain and
speculative in alternating turns (the order reverses each round), on the same engine:

- `acceptance`: drafted tokens the target accepted / drafted tokens (alpha);
- `tokens_per_step`: tokens committed per verify step, the decode tokens over the decode steps;
- `speedup`: the median over rounds of the plain turn's decode time / the speculative turn's
  (decode: from the first token to the last, so the shared prefill is left out);
- `predicted_speedup`: the roofline's. A batch-1 step on a CPU is memory-bound, so its time is
  its bytes over the bandwidth (labkit.roofline.step_cost): a plain step reads the fp32
  weights once; a speculative step runs k draft steps (the draft's weight bytes each; 0 for
  prompt lookup) and one verify of k + 1 rows (the fp32 weights once, k + 1 rows of
  activations and logits), and commits E = (1 - alpha^(k+1)) / (1 - alpha) tokens, with the
  alpha measured. The bandwidth cancels: only bytes enter the ratio;
- `cost_model_speedup`: the same formula with the step times this run measured instead of
  bytes (plain step, draft step, verify step): what the formula says when its inputs are right;
- `same_tokens`: the speculative answer is token for token the plain one;
- `draft_rerank`: a draft model's head candidates rescored with the target's head rows per
  row (`--draft-rerank`, labkit.speculative.RerankedHead; 0 for prompt lookup).

`best_k_predicted` and `best_k_found` name the k each proposer's predicted and measured
speedups peak at. Self-speculation's request is a chat question; prompt lookup's is a
summary of a passage, where the answer repeats phrases of its input (`--prompt` replaces both).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser

QUESTION = "Explain in a few sentences how a refrigerator keeps food cold."
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system. It is composed of over "
    "2,900 individual reefs and 900 islands stretching for over 2,300 kilometres over an area "
    "of approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. The Great Barrier Reef can be seen from outer space and "
    "is the world's biggest single structure made by living organisms. This reef structure is "
    "composed of and built by billions of tiny organisms, known as coral polyps. It supports a "
    "wide diversity of life and was selected as a World Heritage Site in 1981.")
SUMMARY = f"{PASSAGE}\n\nRepeat the main facts of the text above in a short summary."


def roofline_speedup(cfg, alpha: float, k: int, draft_dtype: str | None, context: int) -> float:
    """The predicted speedup from bytes: E(alpha, k) plain steps' bytes over k draft steps'
    and one verify's of k + 1 rows (a memory-bound step's time is its bytes / bandwidth)."""
    from labkit.roofline import step_cost
    from labkit.speculative import expected_tokens

    def nbytes(weights: str, rows: int) -> float:
        # a verify of k + 1 rows reads the weights once, like a decode step of k + 1 rows; the
        # decode step's KV counts every row's context, the verify reads it once: take one row's
        # (bytes only: the bandwidth cancels in the ratio, so any preset's step_cost serves)
        one = step_cost(cfg, 1, context, "decode", weights, "fp32", "H200", "fp32")
        many = step_cost(cfg, rows, context, "decode", weights, "fp32", "H200", "fp32")
        return many.nbytes - (rows - 1) * one.kv_read_bytes

    draft = 0.0 if draft_dtype is None else nbytes(draft_dtype, 1)
    return expected_tokens(alpha, k) * nbytes("fp32", 1) / (k * draft + nbytes("fp32", k + 1))


def bench_spec(model_name: str, proposers: list[str], ks: list[int], gen_tokens: int,
               rounds: int, prompt: str | None, log, draft_rerank: int | None = None
               ) -> list[dict]:
    """One row per (proposer, k); see the module docstring."""
    import labkit
    from labkit.ceilings import device_name
    from labkit.loading import load_model
    from labkit.speculative import RERANK, expected_tokens

    draft_rerank = RERANK if draft_rerank is None else draft_rerank
    target, tok = load_model(model_name, fuse=True)
    drafts = {}
    for name in proposers:
        if name in ("int4", "int8"):
            drafts[name] = load_model(model_name, quant=name)[0]
        elif name != "ngram":
            raise ValueError(f"--proposers: {name!r} is not one of int4, int8, ngram")
    engine = labkit.Engine(target, tok, max_seqs=1, kv_tokens=4096, drafts=drafts,
                           draft_rerank=draft_rerank)
    rows = []
    for name in proposers:
        text = prompt or (SUMMARY if name == "ngram" else QUESTION)
        ids = tok.encode(text, chat=True)
        base = labkit.SamplingParams(max_new_tokens=gen_tokens, ignore_eos=True)
        for k in ks:
            spec = labkit.SamplingParams(max_new_tokens=gen_tokens, ignore_eos=True,
                                         speculative=f"{name}:{k}")
            turns: dict[str, list[dict]] = {"plain": [], "spec": []}
            for r in range(rounds + 1):  # round 0 warms up and is dropped
                order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
                for which in order:
                    engine.stats.reset()
                    out = labkit.generate([ids], base if which == "plain" else spec,
                                          engine=engine)[0]
                    st = engine.stats
                    t = out.token_times_s
                    if r:
                        turns[which].append({
                            "decode_s": t[-1] - t[0], "tokens": out.output_ids,
                            "steps": st.steps, "draft_s": st.draft_s,
                            "accepted": st.accepted_tokens, "drafted": st.draft_tokens,
                            "verify": st.verify_rows})
            plain, sp = turns["plain"], turns["spec"]
            drafted = sum(t["drafted"] for t in sp)
            alpha = sum(t["accepted"] for t in sp) / drafted if drafted else 0.0
            decode_steps = statistics.median(t["steps"] - 1 for t in sp)  # less the prefill
            speedup = statistics.median(p["decode_s"] / s["decode_s"] for p, s in zip(plain, sp))
            plain_step = statistics.median(p["decode_s"] / (p["steps"] - 1) for p in plain)
            draft_step = statistics.median(s["draft_s"] / max(s["verify"], 1) for s in sp) / k
            verify_step = statistics.median((s["decode_s"] - s["draft_s"]) / (s["steps"] - 1)
                                            for s in sp)
            e = expected_tokens(min(alpha, 1.0), k)
            row = {
                "proposer": name, "k": k, "acceptance": alpha,
                "tokens_per_step": (gen_tokens - 1) / decode_steps,
                "expected_tokens_per_step": e,
                "predicted_speedup": roofline_speedup(target.cfg, alpha, k, None if name ==
                                                      "ngram" else name, len(ids) + gen_tokens),
                "cost_model_speedup": e * plain_step / (k * draft_step + verify_step),
                "speedup": speedup,
                "same_tokens": all(s["tokens"] == plain[0]["tokens"] for s in plain + sp),
                "plain_step_ms": plain_step * 1e3, "draft_step_ms": draft_step * 1e3,
                "verify_step_ms": verify_step * 1e3, "gen_tokens": gen_tokens,
                "prompt_tokens": len(ids), "rounds": rounds,
                "draft_rerank": 0 if name == "ngram" else draft_rerank, "model": model_name,
                "threads": torch.get_num_threads(), "cpu": device_name(torch.device("cpu")),
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}
            log(f"{name}:{k}  alpha {alpha:.2f}  {row['tokens_per_step']:.2f} tok/step  "
                f"speedup {speedup:.2f}x (predicted {row['predicted_speedup']:.2f}x, cost "
                f"model {row['cost_model_speedup']:.2f}x)  same tokens {row['same_tokens']}")
            rows.append(row)
    for name in proposers:
        mine = [r for r in rows if r["proposer"] == name]
        best_p = max(mine, key=lambda r: r["predicted_speedup"])["k"]
        best_m = max(mine, key=lambda r: r["speedup"])["k"]
        for r in mine:
            r["best_k_predicted"], r["best_k_found"] = best_p, best_m
    engine.close()
    return rows


def main(argv: list[str]) -> int:
    """Entry point of `python -m labkit bench spec`."""
    p = command_parser("python -m labkit bench spec",
                       "Speculative decoding (int4/int8 drafts, prompt lookup) against plain "
                       "decoding, one greedy stream, in alternating turns.")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--proposers", default="int4,ngram", help="comma-separated: int4, int8, ngram")
    p.add_argument("--k", default="1,2,3,4,6,8", help="comma-separated draft lengths")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens each turn generates")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (after a warm-up)")
    p.add_argument("--prompt", default=None,
                   help="one prompt for every proposer (default: a question for the drafts, "
                        "a summary of a passage for prompt lookup)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--draft-rerank", type=int, default=None, metavar="N",
                   help="a draft model's top N candidates per row rescored with the target's "
                        "head rows (default: labkit.speculative.RERANK; 0: the draft's own "
                        "head alone)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)

    def measure() -> list[dict]:
        try:
            ks = [int(k) for k in args.k.split(",")]
        except ValueError:
            raise ValueError(f"--k must be comma-separated integers, got {args.k!r}") from None
        if any(not 1 <= k <= 16 for k in ks):
            raise ValueError(f"--k: each k must be in 1..16, got {args.k!r}")
        if args.gen_tokens < 2 or args.rounds < 1 or args.threads < 1:
            raise ValueError("--gen-tokens must be >= 2, --rounds and --threads >= 1")
        if args.draft_rerank is not None and args.draft_rerank < 0:
            raise ValueError(f"--draft-rerank must be >= 0, got {args.draft_rerank}")
        torch.set_num_threads(args.threads)
        log = (lambda s: print(s, file=sys.stderr)) if args.json else print
        t0 = time.perf_counter()
        rows = bench_spec(args.model, args.proposers.split(","), ks, args.gen_tokens,
                          args.rounds, args.prompt, log, args.draft_rerank)
        log(f"measured in {time.perf_counter() - t0:.0f} s")
        return rows

    return report_rows(measure, args.json, _table)


def _table(rows: list[dict]) -> None:
    print(f"{'proposer':<8} {'k':>2} {'alpha':>6} {'tok/step':>8} {'E':>5} {'predicted':>9} "
          f"{'cost model':>10} {'speedup':>8} {'same':>5}")
    for r in rows:
        print(f"{r['proposer']:<8} {r['k']:>2} {r['acceptance']:>6.2f} "
              f"{r['tokens_per_step']:>8.2f} {r['expected_tokens_per_step']:>5.2f} "
              f"{r['predicted_speedup']:>8.2f}x {r['cost_model_speedup']:>9.2f}x "
              f"{r['speedup']:>7.2f}x {str(r['same_tokens']):>5}")
    r = rows[0]
    print(f"{r['model']} on {r['cpu']} ({r['cpu_capability']}), {r['threads']} torch threads, "
          f"{r['gen_tokens']} tokens a turn, medians over {r['rounds']} rounds; best k "
          + ", ".join(f"{x['proposer']} predicted {x['best_k_predicted']} found "
                      f"{x['best_k_found']}" for x in rows if x['k'] == rows[0]['k']))
    reranks = {x["draft_rerank"] for x in rows if x["proposer"] != "ngram"}
    if reranks:
        (n,) = reranks
        print("draft models choose with their own head alone" if n == 0 else
              f"draft models rescore their head's top {n} candidates with the target's head rows")

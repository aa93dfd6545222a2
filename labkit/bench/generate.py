"""`python -m labkit bench generate`: labkit against transformers' `generate`.

It answers the first question anyone asks of a hand-written engine: is it any
faster than `transformers`? Both generate for the same 32 chat requests (varied instructions,
`max_new_tokens` cycling 16, 32, ... 96), greedy, fp32, with the same torch thread count, in the
same process, one right after the other after a warm-up of each (with `--rounds R`, R times,
the order reversed every other round), so that a machine shared with other work slows both
alike. Throughput is generated tokens / wall seconds.

What makes the comparison fair, and where it leans:

- **The same tokens.** Each request produces exactly its `max_new_tokens`: labkit with
  `SamplingParams(ignore_eos=True)`, transformers with `min_new_tokens=max_new_tokens` (which
  masks EOS until then). An EOS that labkit samples counts as a token; transformers picks the
  next best instead, so their texts may part there, but the work is the same.
- **transformers' batching, at its best.** `generate` cannot retire a row early: a batch runs as
  long as its longest request, and a shorter row's extra tokens are wasted. A user has two
  honest ways to batch the 32 requests: one left-padded batch per distinct `max_new_tokens`
  (no waste, smaller batches), or one left-padded batch of all 32 run to the longest (full
  batch, wasted rows). Both are measured; `hf_tok_s` is the better of the two, counting only
  the tokens requested.
- **A cold start every round.** labkit's prefix cache keeps prompt pages between requests; a
  timed round starts with it emptied (`Engine.clear_prefix_cache`), so a later round does not
  reuse what an earlier one computed. Within a round the 32 requests share their chat
  template's full pages, as any serving engine's would; the output says how many prompt tokens
  labkit computed against transformers' all.
- **labkit does more host work**: it detokenizes every token as it streams (transformers
  returns ids), checks stop conditions, and schedules continuously (a request leaves the batch
  the step it finishes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from labkit.bench.paths import format_paths
from labkit.bench.report import report_rows
from labkit.cli_parser import add_engine_flags, command_parser, engine_kwargs
from labkit.utils.progress import progress

# 32 short, varied instructions: the prompts of `bench generate` (each wrapped in the chat
# template, so 30-45 tokens)
INSTRUCTIONS = [
    "Explain why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses for a paperclip.",
    "What is a prime number? Give an example.",
    "Describe the water cycle in simple terms.",
    "Suggest a name for a friendly robot.",
    "How do bees make honey?",
    "Give me a tip for learning a new language.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "Explain what a hash map is to a beginner.",
    "Why do cats purr?",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the three states of matter?",
    "Give a recipe idea using rice and eggs.",
    "How does a rainbow form?",
    "Write a limerick about a programmer.",
    "What causes the seasons on Earth?",
    "Name five animals that live in the ocean.",
    "Explain gravity to a ten-year-old.",
    "What is photosynthesis?",
    "Give three tips for better sleep.",
    "Describe a quiet morning in a small town.",
    "What does a compiler do?",
    "Why is exercise good for the brain?",
    "Write a two-line poem about the moon.",
    "How do airplanes stay in the air?",
    "What is the capital of Japan, and what is it known for?",
    "Explain recursion with a simple example.",
    "Give a fun fact about octopuses.",
    "How should I prepare for a job interview?",
    "What is the Pythagorean theorem?",
]
OUTPUT_LENGTHS = (16, 32, 48, 64, 80, 96)  # max_new_tokens of request i: OUTPUT_LENGTHS[i % 6]
QUICK_LENGTHS = (4, 8, 12, 16)  # --quick: 8 requests, shorter outputs


# ---------------------------------------------------------------------------------------------
# the transformers reference model


def hf_reference_model(dtype: torch.dtype = torch.float32):
    """transformers' own SmolLM2 from the packaged GGUF (its dequantization, not labkit's).

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` takes ~40 s on two cores (it
    parses the GGUF twice), so its result is saved once as plain safetensors next to labkit's
    cache entry for the same file, and later calls load that in under a second.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from labkit.utils.cache import build_atomically, cache_entry, packaged_gguf

    gguf = packaged_gguf()
    entry = cache_entry(gguf) / "hf-reference"

    def build(tmp: Path) -> None:
        try:
            with progress(desc="building transformers' reference model from the GGUF (first "
                               "time only)", total=1, unit="model") as bar:
                hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32)
                bar.update()
        except ValueError as err:
            if "accelerate" in str(err):
                raise RuntimeError("transformers reads GGUF files only with `accelerate` "
                                   "installed: .venv/bin/pip install accelerate") from err
            raise
        config = hf.config.to_dict()
        config.pop("quantization_config", None)  # the weights are saved dequantized, in fp32
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        hf.generation_config.save_pretrained(tmp)
        state = hf.state_dict()
        if hf.config.tie_word_embeddings:  # stored once, as the embedding (save_pretrained's way)
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))

    build_atomically(entry, build)
    return AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, local_files_only=True).eval()


# ---------------------------------------------------------------------------------------------
# bench generate


def chat_workload(tok, n: int, lengths: tuple[int, ...] = OUTPUT_LENGTHS
                  ) -> list[tuple[list[int], int]]:
    """(chat prompt ids, max_new_tokens) for the first `n` instructions."""
    if not 1 <= n <= len(INSTRUCTIONS):
        raise ValueError(f"streams must be in 1..{len(INSTRUCTIONS)}, got {n}")
    return [(tok.encode(INSTRUCTIONS[i], chat=True), lengths[i % len(lengths)])
            for i in range(n)]


def run_labkit(engine, work: list[tuple[list[int], int]],
               on_tokens: Callable[[int], object] | None = None, decoder: str = "blocking",
               speculative: str | None = None) -> tuple[float, int, list[list[int]]]:
    """All requests through the engine at once: (seconds, tokens, output ids per request).

    `on_tokens(1)` is called for each piece of text detokenized (a progress bar's update);
    `speculative`: every request decodes speculatively ("int4:4", "ngram:3").
    """
    import labkit

    params = [labkit.SamplingParams(max_new_tokens=n, ignore_eos=True, speculative=speculative)
              for _, n in work]
    on_text = None if on_tokens is None else (lambda i, text: on_tokens(1))
    engine.clear_prefix_cache()  # cold, as a fresh engine: no reuse of an earlier round
    t0 = time.perf_counter()
    outs = labkit.generate([ids for ids, _ in work], params, engine=engine, on_text=on_text,
                           decoder=decoder)
    seconds = time.perf_counter() - t0
    engine.check_all_released()
    return seconds, sum(len(o.output_ids) for o in outs), [o.output_ids for o in outs]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, as transformers' batched generate wants."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # ids: [B, W]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # mask: [B, W], 1 on real tokens
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _hf_batches(work: list[tuple[list[int], int]], batching: str
                ) -> list[tuple[int, list[int]]]:
    """transformers' batches: (max_new_tokens, request indices) for each generate call."""
    if batching == "grouped":
        groups: dict[int, list[int]] = {}
        for i, (_, n) in enumerate(work):
            groups.setdefault(n, []).append(i)
        return [(n, rows) for n, rows in groups.items()]
    if batching == "padded":
        return [(max(n for _, n in work), list(range(len(work))))]
    raise ValueError(f"batching must be 'grouped' or 'padded', got {batching!r}")


def _hf_ticks(on_tokens: Callable[[int], object]):
    """A stopping criterion that never stops: it reports each step's tokens (one per row)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Ticks(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            on_tokens(input_ids.shape[0])  # input_ids: [B, W + t]
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Ticks()])


@torch.inference_mode()
def run_hf(hf, work: list[tuple[list[int], int]], pad_id: int, batching: str,
           on_tokens: Callable[[int], object] | None = None
           ) -> tuple[float, int, list[list[int]]]:
    """transformers' generate: (seconds, requested tokens, output ids per request).

    batching="grouped": one batch per distinct max_new_tokens; "padded": one batch of all,
    run to the longest (a shorter request's extra tokens are generated, then discarded).
    `on_tokens(B)` is called after each step of a batch of B rows (a progress bar's update).
    """
    batches = _hf_batches(work, batching)
    stopping = None if on_tokens is None else _hf_ticks(on_tokens)
    outputs: list[list[int]] = [[] for _ in work]
    t0 = time.perf_counter()
    for n, rows in batches:
        ids, mask = _left_pad([work[i][0] for i in rows], pad_id)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=pad_id,
                          stopping_criteria=stopping)
        for j, i in enumerate(rows):  # out: [B, W + n]
            outputs[i] = out[j, ids.shape[1]:ids.shape[1] + work[i][1]].tolist()
    seconds = time.perf_counter() - t0
    return seconds, sum(n for _, n in work), outputs


def _agree_until_eos(ours: list[int], theirs: list[int], eos: int) -> bool:
    """Same tokens up to labkit's first EOS (after it, transformers was made to go on)."""
    cut = ours.index(eos) if eos in ours else len(ours)
    return ours[:cut] == theirs[:cut]


def bench_generate(streams: int = 32, threads: int | None = None, model: str = "smollm2-135m",
                   quick: bool = False, rounds: int = 1, log: Callable[[str], None] = print,
                   attention: str = "paged", quant: str | None = None,
                   decoder: str = "blocking", kv_tokens: int = 16384,
                   max_step_tokens: int | None = 512, speculative: str | None = None,
                   lengths: tuple[int, ...] | None = None) -> dict:
    """labkit against transformers on the same requests; throughput of each and the ratio.

    `lengths`: the requests' `max_new_tokens`, cycled (default OUTPUT_LENGTHS, or QUICK_LENGTHS
    with `quick`, which also caps the requests at 8).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import labkit
    from labkit.bench.paths import kernel_paths
    from labkit.loading import load_model

    hf_logging.set_verbosity_error()  # generate() warns about its own defaults; not ours to fix
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    if quick:
        streams = min(streams, 8)
    m, tok = load_model(model, quant=quant, fuse=True)  # as the engine's entry points load it
    if model == "smollm2-135m":
        hf = hf_reference_model()
    elif Path(model).is_dir():
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                  local_files_only=True).eval()
    else:
        raise ValueError(f"bench generate compares against transformers: --model must be "
                         f"smollm2-135m or a Hugging Face checkpoint directory, got {model!r}")
    pad_id = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else tok.eos_id
    work = chat_workload(tok, streams, lengths or (QUICK_LENGTHS if quick else OUTPUT_LENGTHS))
    draft = labkit.SamplingParams(speculative=speculative).draft if speculative else None
    drafts = ({draft[0]: load_model(model, quant=draft[0])[0]}
              if draft and draft[0] != "ngram" else {})
    # the pipelined loop plans around finishes by length, as EngineSetup has it (whole_engine)
    engine = labkit.Engine(m, tok, max_seqs=max(streams, 1), attention=attention,
                           kv_tokens=kv_tokens, max_step_tokens=max_step_tokens, drafts=drafts,
                           foresee_finishes=decoder == "pipelined")

    warm = [(ids, 4) for ids, _ in work[:2]]  # first calls pay for allocation and dispatch
    run_labkit(engine, warm, decoder=decoder, speculative=speculative)
    run_hf(hf, warm, pad_id, "grouped")
    totals = {"labkit": [0.0, 0], "grouped": [0.0, 0], "padded": [0.0, 0]}
    outputs = {}
    per_round: list[dict[str, float]] = []  # each round's tok/s of each side
    computed = []  # prompt tokens labkit computed per round (the rest shared within it)
    for r in range(rounds):
        # alternate which goes first, so slow drift on a shared machine hits both alike
        order = ("labkit", "grouped", "padded") if r % 2 == 0 else ("padded", "grouped", "labkit")
        per_round.append({})
        for who in order:
            # a bar per run, on stderr: a run takes up to a minute; the per-token update costs
            # microseconds against steps of tens of milliseconds, on both sides alike
            label = "labkit" if who == "labkit" else f"transformers ({who})"
            total = (sum(n for _, n in work) if who != "padded"
                     else sum(n * len(rows) for n, rows in _hf_batches(work, who)))
            with progress(desc=f"round {r + 1}/{rounds}: {label}", total=total, unit="tok",
                          leave=False) as bar:
                if who == "labkit":
                    before = engine.stats.prefill_tokens
                    s, n, outs = run_labkit(engine, work, bar.update, decoder, speculative)
                    computed.append(engine.stats.prefill_tokens - before)
                else:
                    s, n, outs = run_hf(hf, work, pad_id, who, bar.update)
            totals[who][0] += s
            totals[who][1] += n
            per_round[-1][who] = n / s
            outputs[who] = outs
            log(f"  round {r + 1}: {who:<7} {n} tokens in {s:6.2f} s = {n / s:7.1f} tok/s")
    rate = {who: n / s for who, (s, n) in totals.items()}
    # each round's labkit tok/s over transformers' better batching in that round
    round_ratios = [x["labkit"] / max(x["grouped"], x["padded"]) for x in per_round]
    hf_best = max(("grouped", "padded"), key=rate.get)
    agree = sum(_agree_until_eos(a, b, tok.eos_id)
                for a, b in zip(outputs["labkit"], outputs["grouped"]))
    return {
        "labkit_tok_s": rate["labkit"], "hf_tok_s": rate[hf_best],
        "ratio": rate["labkit"] / rate[hf_best], "streams": streams, "threads": threads,
        "tokens": totals["labkit"][1] // rounds, "rounds": rounds, "hf_batching": hf_best,
        "hf_grouped_tok_s": rate["grouped"], "hf_padded_tok_s": rate["padded"],
        "same_tokens_as_hf": agree, "model": model, "quant": quant or "none",
        "decoder": decoder, "attention": attention, "torch": torch.__version__,
        "speculative": speculative,
        "round_ratios": round_ratios, "round1_ratio": round_ratios[0],
        "kernel_paths": kernel_paths(m, attention),
        "prompt_tokens": sum(len(ids) for ids, _ in work),
        "labkit_prompt_tokens_computed": computed,
    }


def main(argv: list[str]) -> int:
    """`python -m labkit bench generate`: labkit's engine against transformers' generate."""
    p = command_parser("python -m labkit bench generate",
                       "labkit against transformers' generate on the same chat requests "
                       "(greedy, same thread count). The engine flags set labkit's side; "
                       "transformers stays fp32. The whole engine (EngineSetup.whole()): "
                       "--quant int8 --attention flash --decoder pipelined.")
    p.add_argument("--streams", type=int, default=32, help=f"requests (1..{len(INSTRUCTIONS)})")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch threads for both (default {torch.get_num_threads()})")
    p.add_argument("--rounds", type=int, default=1, help="timed runs of each, alternating")
    p.add_argument("--quick", action="store_true", help="8 requests, 4-16 new tokens each")
    add_engine_flags(p, batching=False,
                     model_help="smollm2-135m or a Hugging Face checkpoint directory")
    p.add_argument("--speculative", default=None, metavar="PROPOSER:K",
                   help="labkit decodes speculatively: int4:K, int8:K or ngram:K "
                        "(blocking decoder)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    try:
        engine_kw = engine_kwargs(args)
    except ValueError as err:
        p.error(str(err))
    if args.speculative is not None:
        from labkit.sampling import parse_speculative

        try:
            parse_speculative(args.speculative)
        except ValueError as err:
            p.error(f"--speculative: {err}")
        if args.decoder != "blocking":
            p.error("--speculative needs --decoder blocking (the pipelined decoder plans a "
                    "step before the previous one's accepted tokens are known)")
    if not 1 <= args.streams <= len(INSTRUCTIONS):
        p.error(f"--streams must be in 1..{len(INSTRUCTIONS)}")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    log(f"bench generate: {args.streams if not args.quick else min(args.streams, 8)} requests, "
        f"greedy, {args.threads or torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} cores")
    def measure() -> list[dict]:
        return [bench_generate(args.streams, args.threads, args.model, args.quick, args.rounds,
                               log, args.attention, engine_kw["quant"], args.decoder,
                               args.kv_tokens, args.max_step_tokens, args.speculative)]

    def table(rows: list[dict]) -> None:
        (res,) = rows
        print(f"labkit        {res['labkit_tok_s']:8.1f} tok/s\n"
              f"transformers  {res['hf_tok_s']:8.1f} tok/s  ({res['hf_batching']} batching; "
              f"grouped {res['hf_grouped_tok_s']:.1f}, padded {res['hf_padded_tok_s']:.1f})\n"
              f"ratio         {res['ratio']:8.2f}x  (labkit / transformers, {res['streams']} "
              f"streams, {res['threads']} threads; greedy tokens identical for "
              f"{res['same_tokens_as_hf']}/{res['streams']} requests)\n"
              f"round 1       {res['round1_ratio']:8.2f}x; every round starts with labkit's "
              f"prefix cache cold: it computed {res['labkit_prompt_tokens_computed']} of "
              f"{res['prompt_tokens']} prompt tokens per round (the chat template's pages "
              "shared between requests), transformers all of them")
        print("labkit's kernels, op by op:\n" + format_paths(res["kernel_paths"]))

    return report_rows(measure, args.json, table)

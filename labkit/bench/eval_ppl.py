"""`python -m labkit eval ppl`: a model's perplexity on a text, plain or quantized.

    python -m labkit eval ppl [--file F] [--quant Q] [--max-tokens N] [--json]

prints {file, tokens, nll, ppl, quant}; the scoring itself is labkit.perplexity.
"""

from __future__ import annotations

import math
import time

import torch

from labkit.bench.report import report_rows
from labkit.cli_parser import command_parser
from labkit.perplexity import DEFAULT_TEXT, default_text, nll, read_text


def evaluate(model_name: str = "smollm2-135m", quant: str | None = None, file: str | None = None,
             max_tokens: int = 4096, window: int = 512, stride: int = 256) -> dict:
    """{file, tokens, nll, ppl, quant} of a model on a text (the default one if file is None)."""
    from labkit.loading import load_model

    text = default_text() if file is None else read_text(file)
    model, tok = load_model(model_name, quant=quant)
    ids = torch.tensor(tok.encode(text)[:max_tokens])
    if len(ids) < 2:
        raise ValueError(f"{file or DEFAULT_TEXT}: fewer than 2 tokens, nothing to score")
    mean, n = nll(model, ids, window, stride)
    return {"file": file or DEFAULT_TEXT, "tokens": n, "nll": mean, "ppl": math.exp(mean),
            "quant": quant or "none", "model": model_name}


def main(argv: list[str]) -> int:
    """`python -m labkit eval ppl ...`: perplexity of a model, plain or quantized, on a text."""
    p = command_parser("python -m labkit eval",
                       "Evaluate a model: `eval ppl` (perplexity).")
    p.add_argument("what", choices=("ppl",), help="ppl: mean token NLL and perplexity")
    p.add_argument("--file", default=None, help=f"a UTF-8 text file (default: {DEFAULT_TEXT})")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--quant", default="none", help="none|int8|int4[-gN][-awq]")
    p.add_argument("--max-tokens", type=int, default=4096, help="score the first N tokens")
    p.add_argument("--window", type=int, default=512, help="tokens per forward")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    t0 = time.perf_counter()

    def measure() -> list[dict]:
        from labkit.quant import QuantScheme

        scheme = QuantScheme.parse(args.quant)
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
        if args.file is not None:
            read_text(args.file)  # a bad file costs no model load
        return [evaluate(args.model, scheme.name if scheme else None, args.file,
                         args.max_tokens, args.window, args.stride)]

    def table(rows: list[dict]) -> None:
        (res,) = rows
        print(f"{res['file']}: {res['tokens']} tokens, NLL {res['nll']:.4f} nats, "
              f"perplexity {res['ppl']:.3f} ({res['model']}, quant {res['quant']}, "
              f"{time.perf_counter() - t0:.0f} s)")

    return report_rows(measure, args.json, table)

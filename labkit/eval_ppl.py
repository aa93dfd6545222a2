"""Perplexity: how well a model predicts a text, the yardstick every quantization is held to.

The mean negative log-likelihood (NLL) of each token given the ones before it, in nats; the
perplexity is exp(NLL). A text longer than the window is read in windows of `window` tokens that
start every `stride` tokens; each window scores only the tokens the previous one did not, so
every token is scored once, with at least `window - stride` tokens of context (the usual
sliding-window evaluation). The default text ships with every Python: `pydoc_data.topics`,
about 465 KB of English help pages.

    python -m labkit eval ppl [--file F] [--quant Q] [--max-tokens N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

DEFAULT_TEXT = "pydoc_data.topics"


class CausalAttention:
    """Attention for one whole sequence from position 0, no KV cache (evaluation only)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            is_causal=True, enable_gqa=True)  # [H, T, D]
        return out.transpose(0, 1).to(q.dtype)


def default_text() -> str:
    """The help topics of `pydoc_data.topics`, in key order, as one text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; ValueError with one clear line if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path}: the file is empty, there is nothing to score")
    if b"\x00" in data[:65536]:
        raise ValueError(f"{path}: not a text file (it holds NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def calibration_ids(tokenizer, tokens: int = 512) -> torch.Tensor:
    """Calibration tokens for AWQ: the END of the default text (evaluation reads its start)."""
    text = default_text()
    ids = tokenizer.encode(text[-8 * tokens:])  # ~4 characters per token, with room
    return torch.tensor(ids[-tokens:])


@torch.inference_mode()
def nll(model, ids: torch.Tensor, window: int = 512, stride: int = 256) -> tuple[float, int]:
    """(mean NLL in nats, tokens scored) of ids [T] under the model, in sliding windows."""
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    window = min(window, model.cfg.max_position)
    total, count, scored_to = 0.0, 0, 1  # the first token has nothing to be predicted from
    for begin in range(0, max(len(ids) - 1, 1), stride):
        end = min(begin + window, len(ids))
        chunk = ids[begin:end]
        logits = model(chunk, torch.arange(len(chunk)), CausalAttention())  # [n, V]
        # logits[j] predicts chunk[j + 1]; score targets at absolute positions >= scored_to
        first = scored_to - begin - 1
        targets = chunk[first + 1:]
        total += F.cross_entropy(logits[first:-1].float(), targets, reduction="sum").item()
        count += len(targets)
        scored_to = end
        if end == len(ids):
            break
    return total / count, count


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
    p = argparse.ArgumentParser(prog="python -m labkit eval",
                                description="Evaluate a model: `eval ppl` (perplexity).")
    p.add_argument("what", choices=("ppl",), help="ppl: mean token NLL and perplexity")
    p.add_argument("--file", default=None, help=f"a UTF-8 text file (default: {DEFAULT_TEXT})")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a path")
    p.add_argument("--quant", default="none", help="none|int8|int4[-gN][-awq]")
    p.add_argument("--max-tokens", type=int, default=4096, help="score the first N tokens")
    p.add_argument("--window", type=int, default=512, help="tokens per forward")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    try:
        from labkit.quant import QuantScheme

        scheme = QuantScheme.parse(args.quant)
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
        if args.file is not None:
            read_text(args.file)  # a bad file costs no model load
        t0 = time.perf_counter()
        res = evaluate(args.model, scheme.name if scheme else None, args.file, args.max_tokens,
                       args.window, args.stride)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['file']}: {res['tokens']} tokens, NLL {res['nll']:.4f} nats, "
              f"perplexity {res['ppl']:.3f} ({res['model']}, quant {res['quant']}, "
              f"{time.perf_counter() - t0:.0f} s)")
    return 0

"""Perplexity: how well a model predicts a text, the yardstick every quantization is held to.

The mean negative log-likelihood (NLL) of each token given the ones before it, in nats; the
perplexity is exp(NLL). A text longer than the window is read in windows of `window` tokens that
start every `stride` tokens; each window scores only the tokens the previous one did not, so
every token is scored once, with at least `window - stride` tokens of context (the usual
sliding-window evaluation). The default text ships with every Python: `pydoc_data.topics`,
about 465 KB of English help pages. The command line is labkit.bench.eval_ppl.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

DEFAULT_TEXT = "pydoc_data.topics"
HEAD_ROWS = 64  # rows of logits alive at once while scoring (64 x 49,152 floats: 12 MB)


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


def calibration_ids(tokenizer, tokens: int = 256) -> torch.Tensor:
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
        hidden = model.hidden(chunk, torch.arange(len(chunk)), CausalAttention())  # [n, d]
        # logits of row j predict chunk[j + 1]; score targets at absolute positions >= scored_to
        first = scored_to - begin - 1
        targets = chunk[first + 1:]
        for a in range(first, len(chunk) - 1, HEAD_ROWS):  # logits a few rows at a time
            b = min(a + HEAD_ROWS, len(chunk) - 1)
            logits = model.head(hidden[a:b]).float()  # [rows, V]
            total += F.cross_entropy(logits, chunk[a + 1:b + 1], reduction="sum").item()
        count += len(targets)
        scored_to = end
        if end == len(ids):
            break
    return total / count, count

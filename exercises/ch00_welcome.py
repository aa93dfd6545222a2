"""Chapter 00 exercises. Fill in each function, then run `make grade` (or the check cell in the
notebook). The graders are the same tests that check labkit's own solutions."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Implement RMSNorm, the normalisation every Llama layer applies twice.

    x: [..., d]; weight: [d]. Return x / sqrt(mean(x**2 over the last dim) + eps) * weight.
    Unlike LayerNorm, RMSNorm does not subtract the mean. labkit's version: labkit/model.py.
    """
    raise NotImplementedError("rms_norm: see the docstring for the task")


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Implement nucleus (top-p) filtering for a batch of rows.

    logits: [B, V]; top_p: [B], each in (0, 1]. Return logits where every token outside the
    row's nucleus is set to -inf. The nucleus: sort tokens by probability, descending, and keep
    a token while the probability mass of the tokens ranked above it is below p (so the most
    likely token is always kept). labkit's version: labkit/sampling.py.
    """
    raise NotImplementedError("top_p_filter: see the docstring for the task")

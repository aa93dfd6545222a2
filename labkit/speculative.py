"""Speculative decoding (chapter 09): guess k tokens cheaply, check them in one step of the
real model, keep the longest correct prefix.

A decode step is bound by reading the weights (chapters 01 and 03), so a step over the last
committed token and k guesses costs about one step, not k + 1. The rules every speculative step
follows are here, as pure functions the chapter's exercises mirror:

- `expected_tokens(alpha, k)`: tokens a step commits when each guess is right with probability
  alpha: (1 - alpha^(k+1)) / (1 - alpha);
- `accept_greedy(draft, target)`: the agreeing prefix, then the target's own token;
- `accept_sampled(draft, q, p, uniform, sample)`: speculative sampling's rejection rule, whose
  committed tokens are distributed exactly as the target's;
- `rollback(kv_len, accepted, pages, block_size)`: the KV entries and pages a verify leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# ---- the rules chapter 09's exercises mirror (pure functions: no engine, no model) ----------


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step commits on average, when each draft token is accepted with
    probability `alpha`, independently, and a rejection ends the run: the accepted prefix
    plus one token from the target (the bonus after k acceptances, or the resample at the
    first rejection), 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha); k + 1 at
    alpha = 1."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"alpha must be in [0, 1] and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The tokens a greedy verify step commits. `target[i]` is the target model's greedy token
    after the chunk's first i + 1 inputs (the last committed token, then draft[:i]): k + 1 of
    them for k drafts. The longest prefix of `draft` that equals `target`, then the target's
    own token at the first mismatch, or its bonus token target[k] when every draft matched."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"a verify of {len(draft)} drafts yields {len(draft) + 1} target "
                         f"tokens, got {len(target)}")
    out = []
    for d, t in zip(draft, target):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target[len(draft)]]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejected position resamples from: max(0, p - q), normalised [V]."""
    r = (p - q).clamp_(min=0.0)
    total = r.sum()
    return r / total if total > 0 else p  # p == q: nothing is ever rejected; p for safety


def accept_sampled(draft: list[int], q: torch.Tensor, p: torch.Tensor,
                   uniform: Callable[[], float], sample: Callable[[torch.Tensor], int]
                   ) -> list[int]:
    """Speculative sampling's rejection rule (Leviathan et al. 2023; Chen et al. 2023).

    draft: k tokens, draft[i] drawn from the draft model's distribution q[i] ([k, V]); p: the
    target's distributions at the k + 1 positions of the verify chunk ([k + 1, V]). In order,
    accept draft[i] when uniform() < min(1, p[i, x] / q[i, x]); at the first rejection, return
    the accepted tokens and one token sampled from residual(p[i], q[i]); when all k are
    accepted, one more (the bonus) sampled from p[k]. Each committed token is then distributed
    exactly as the target alone would have sampled it."""
    if p.shape[0] != len(draft) + 1 or q.shape[0] != len(draft):
        raise ValueError(f"{len(draft)} drafts need q of {len(draft)} rows and p of "
                         f"{len(draft) + 1}, got {q.shape[0]} and {p.shape[0]}")
    out = []
    for i, x in enumerate(draft):
        if uniform() < min(1.0, float(p[i, x]) / float(q[i, x])):
            out.append(x)
            continue
        return out + [sample(residual(p[i], q[i]))]
    return out + [sample(p[len(draft)])]


def rollback(kv_len: int, accepted: int, pages: list[int], block_size: int
             ) -> tuple[int, list[int], list[int]]:
    """After a verify chunk wrote KV at positions kv_len .. kv_len + k (its inputs: the last
    committed token, then k drafts) and `accepted` drafts were accepted: (the KV length that
    stays valid, the pages kept, the pages to free). The last committed token's entry and the
    accepted drafts' stay, kv_len + 1 + accepted of them; a rejected draft's entry must go
    (its position will hold another token), and a page that holds only rejected entries
    returns to the pool. The committed token that ends the step (the bonus or the resample)
    has no entry yet: the next step writes it, as for any sampled token."""
    if accepted < 0:
        raise ValueError(f"accepted must be >= 0, got {accepted}")
    valid = kv_len + 1 + accepted
    keep = -(-valid // block_size)  # ceil: a page with any valid entry stays
    if keep > len(pages):
        raise ValueError(f"{valid} valid entries need {keep} pages of {block_size}, the "
                         f"sequence holds {len(pages)}")
    return valid, list(pages[:keep]), list(pages[keep:])

"""Chapter 00's graders: RMSNorm and the top-p (nucleus) filter."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.graders.common import only_hint, tensor_diagnose


def _rms_variants(x: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """What each known mistake in RMSNorm gives on (x, w, eps)."""
    ms = (x * x).mean(-1, keepdim=True)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    return {
        "this is LayerNorm (it subtracts the mean); RMSNorm only divides by "
        "sqrt(mean(x^2) + eps)": (x - mu) / torch.sqrt(var + eps) * w,
        "the normalisation is right but the learned `weight` scale is missing":
            x / torch.sqrt(ms + eps),
        "eps is added outside the square root: x / (sqrt(mean(x^2)) + eps); it belongs inside, "
        "sqrt(mean(x^2) + eps)": x / (torch.sqrt(ms) + eps) * w,
        "no eps: x / sqrt(mean(x^2)) blows up on rows near zero; add eps inside the root":
            x / torch.sqrt(ms) * w,
        "a fixed eps of 1e-6 instead of the `eps` argument": x / torch.sqrt(ms + 1e-6) * w,
        "a fixed eps of 1e-5 instead of the `eps` argument": x / torch.sqrt(ms + 1e-5) * w,
        "the mean of squares must be over the last dimension only (each token's own vector)":
            x / torch.sqrt((x * x).mean() + eps) * w,
        "divided by mean(x^2) + eps without the square root": x / (ms + eps) * w,
    }


def grade_rms_norm(fn: Callable) -> str:
    """Grade an answer to exercise `rms_norm` (exercises/ch00_welcome.py)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(16, generator=gen) + 0.5
    inputs = [  # (label, x, eps): small rows make eps matter, a larger eps makes its place matter
        ("a [3, 5, 16] input of scale 3", torch.randn(3, 5, 16, generator=gen) * 3, 1e-5),
        ("rows of scale 1e-3 (mean square 1e-6, below eps=1e-5)",
         torch.randn(4, 16, generator=gen) * 1e-3, 1e-5),
        ("rows of scale 0.05 with eps=1e-3", torch.randn(2, 16, generator=gen) * 0.05, 1e-3),
    ]
    cases = []
    for label, x, eps in inputs:
        got = fn(x.clone(), w.clone(), eps)
        # the reference: divide by the root of the mean square over the last dimension, then scale
        want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
        cases.append((label, torch.as_tensor(got), want, _rms_variants(x, w, eps)))
    tensor_diagnose("rms_norm", cases, atol=1e-5, rtol=1e-4)  # fp32 rounding only
    return "matches the reference on large, tiny (eps-dominated) and small rows"


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor, descending: bool = True,
             inclusive: bool = False) -> torch.Tensor:
    """Keep mask [B, V] of the reference rule (or a mistaken variant of it)."""
    probs = torch.softmax(logits, -1)
    order = probs.argsort(-1, descending=descending)
    sorted_probs = probs.gather(-1, order)
    cum = sorted_probs.cumsum(-1)
    # the rule: keep a token while the mass ranked above it is below p
    keep_sorted = (cum < top_p[:, None]) if inclusive else (cum - sorted_probs < top_p[:, None])
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _top_p_variants(logits: torch.Tensor, top_p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keep masks known mistakes in top-p produce."""
    probs = torch.softmax(logits, -1)
    correct = _nucleus(logits, top_p)
    k = correct.sum(-1, keepdim=True)
    positions = torch.arange(logits.shape[-1])[None, :]
    return {
        "no sorting: the cumulative mass must run over tokens ranked by probability, not in "
        "vocabulary order": (probs.cumsum(-1) - probs) < top_p[:, None],
        "the keep mask was computed in sorted order but applied to the unsorted logits: "
        "scatter it back through the sort's indices": positions < k,
        "one p for the whole batch (the first row's): each row has its own top_p[i]":
            _nucleus(logits, top_p[:1].expand_as(top_p)),
        "dropped the token whose probability carries the mass past p: keep a token while the "
        "mass ranked *above* it is below p": _nucleus(logits, top_p, inclusive=True),
        "sorted ascending: the nucleus is the most likely tokens":
            _nucleus(logits, top_p, descending=False),
        "kept the tail and dropped the nucleus (the mask is inverted)": ~correct,
    }


def grade_top_p(fn: Callable) -> str:
    """Grade an answer to exercise `top_p_filter` (exercises/ch00_welcome.py)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 12, generator=gen) * 1.5  # unsorted, no ties, no p within 0.01
    top_p = torch.tensor([0.3, 0.55, 0.8, 0.93])  # a different p per row
    want_keep = _nucleus(logits, top_p)
    got = torch.as_tensor(fn(logits.clone(), top_p.clone()))
    if got.shape != logits.shape:
        raise AssertionError(f"top_p_filter: shape {tuple(got.shape)}, expected "
                             f"{tuple(logits.shape)} (one row per sequence)")
    kept = got != float("-inf")
    # nothing is -inf: name the mistake only if the nucleus itself came back untouched and every
    # other token changed (dropped to 0, -1e9, ...); all values changed is another mistake
    if (torch.equal(kept, torch.ones_like(kept)) and torch.equal(got[want_keep], logits[want_keep])
            and bool((got[~want_keep] != logits[~want_keep]).all())):
        vals = got[~want_keep].unique().tolist()[:3]
        raise AssertionError(f"top_p_filter: dropped tokens must become -inf (got {vals} "
                             "where tokens should be dropped): softmax then gives them exactly 0")
    if torch.equal(kept, torch.ones_like(kept)) and not torch.equal(got, logits):
        raise AssertionError("top_p_filter: no token became -inf and the logits changed: return "
                             "the logits themselves (not probabilities, not renormalised), with "
                             "-inf outside the nucleus")
    if not torch.equal(kept, want_keep):
        hint = only_hint([{h: torch.equal(kept, m) for h, m in
                            _top_p_variants(logits, top_p).items()}])
        rows = [r for r in range(len(top_p)) if not torch.equal(kept[r], want_keep[r])]
        r = rows[0]
        raise AssertionError(
            f"top_p_filter: row {r} (p={top_p[r]:.2f}) kept {kept[r].int().tolist()}, expected "
            f"{want_keep[r].int().tolist()} ({len(rows)} of {len(top_p)} rows wrong). "
            + (hint or "Rank tokens by probability; keep a token while the probability mass of "
               "the tokens ranked above it is below p (so the top token is always kept)."))
    if not torch.equal(got[kept], logits[kept]):
        raise AssertionError("top_p_filter: the kept logits changed; return the logits "
                             "themselves (not probabilities, not renormalised), -inf elsewhere")
    # ties: which of equal tokens survive is arbitrary, only how many and from where is not
    tied = torch.tensor([[2.0, 0.0, 2.0, 0.5, 2.0, -1.0, 2.0, 1.0]])
    got = torch.as_tensor(fn(tied.clone(), torch.tensor([0.5])))
    kept = (got != float("-inf"))[0]
    if int(kept.sum()) != 3 or not bool((tied[0][kept] == 2.0).all()):
        raise AssertionError(
            f"top_p_filter on {tied[0].tolist()} with p=0.5: kept {kept.int().tolist()}; expected "
            "any 3 of the four tokens with logit 2.0 (each holds 0.21 of the mass: 0, 0.21, 0.42 "
            "ranked above the first three, 0.63 above the fourth)")
    return "keeps exactly the nucleus on unsorted rows with a p per row, and any tie-break"

"""Speculative decoding: draft k tokens cheaply, verify them with the model in one launch.

A decode step of a small model on one stream reads every weight to make one token: its cost is
memory traffic, nearly the same for 1 token as for 9. So a cheap *proposer* guesses the next k
tokens, and the model (the *target*) runs the last committed token plus the k guesses as one
chunk of k + 1 query tokens, through the same engine, paged KV and scheduler as any row. Its
logits at every position say what it would have chosen there:

- greedy requests keep the longest prefix of the draft that matches the target's argmax, plus
  the target's own token after it (the correction, or the *bonus* when all k matched): the
  output is token for token what plain decoding gives;
- sampled requests use the rejection rule (`labkit.sampling.rejection_sample`): the draft's
  token is kept with probability min(1, p/q), and the first rejected one is redrawn from
  max(0, p - q), normalised, so the output is distributed exactly as the target's.

Either way one verify launch commits between 1 and k + 1 tokens. If each draft token is
accepted with probability alpha (independently), the expected number is

    E[tokens per step] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

and the step costs k draft steps plus one verify of k + 1 rows (`predicted_speedup`). The KV the
target wrote for rejected positions is discarded: the sequence's length rolls back, and pages
that hold only rejected positions return to the pool at commit (`Scheduler.rollback`).

Two proposers share one signature, `propose(seqs) -> {request id: Proposal}`:

- `PromptLookup` ("ngram"): the continuation of the longest earlier n-gram of the context
  that matches its tail; no model at all (summaries and code edits repeat their input);
- `DraftModel` ("int4", "int8"): a quantized copy of the model drafts k tokens with its own
  paged KV cache, the same block size and pool size as the target's. Its choice among the
  quantized head's top `RERANK` candidates is made with the target's own head rows
  (`RerankedHead`): the head is where a quantized copy parts from its model most.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from labkit.paged_kv import BlockAllocator, blocks_needed
from labkit.runner import ModelRunner, StepPlan
from labkit.sampling import (
    SamplingBatch,
    SamplingParams,
    draft_seed,
    gumbel_noise,
    shaped_logits,
)

MAX_NGRAM = 8  # prompt lookup tries tails of MAX_NGRAM tokens first, then shorter ones
# a draft model's logits: the top RERANK of its quantized head's, per row, recomputed with the
# target's head rows (RerankedHead)
RERANK = 16


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step commits on average: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"expected_tokens: alpha must be in [0, 1] and k >= 0, got "
                         f"alpha={alpha}, k={k}")
    if alpha == 1:
        return k + 1.0  # the limit of the geometric sum
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, draft_s: float, verify_s: float,
                      plain_s: float) -> float:
    """Speedup over plain decoding: expected tokens per step times the plain step's time,
    over one speculative step (k draft steps of `draft_s` plus one verify of `verify_s`)."""
    return expected_tokens(alpha, k) * plain_s / (k * draft_s + verify_s)


def accept_greedy(draft: list[int], choices: list[int]) -> list[int]:
    """The tokens a verify step commits: the longest prefix of `draft` that matches the
    target's `choices` at the same positions, then the target's choice after it."""
    # choices: k + 1 tokens, the target's at positions 0..k (position j follows draft[:j])
    if len(choices) != len(draft) + 1:
        raise ValueError(f"accept_greedy: {len(choices)} choices for {len(draft)} draft tokens "
                         "(the target chooses at every draft position and the bonus one)")
    a = 0
    while a < len(draft) and draft[a] == choices[a]:
        a += 1
    return list(draft[:a]) + [choices[a]]


@dataclass
class Proposal:
    """A proposer's guess for one sequence: the tokens, and for a sampled request the
    distribution each was drawn from (None: drawn deterministically, a one-hot q)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] float: q of each draft position


def one_hot_probs(tokens: list[int], vocab: int) -> torch.Tensor:
    """q of a deterministic proposer: all mass on the drafted token, [k, V]."""
    q = torch.zeros(len(tokens), vocab)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


class PromptLookup:
    """Drafts by prompt lookup: find the most recent earlier occurrence of the context's
    longest tail n-gram (n = MAX_NGRAM down to 1), and propose the k tokens that followed it."""

    name = "ngram"

    def __init__(self, vocab_size: int, max_ngram: int = MAX_NGRAM):
        self.vocab_size, self.max_ngram = vocab_size, max_ngram

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens continuing the latest earlier match of the context's tail."""
        ctx = np.asarray(context, dtype=np.int64)
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            # windows starting at i = 0 .. n_ctx - n - 1: every n-gram but the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # [n_ctx - n, n]
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the token after the most recent match
                return ctx[start:start + k].tolist()
        return []

    def propose(self, seqs: list[tuple[object, int]]) -> dict[int, Proposal]:
        """A proposal for each (sequence, k) whose context has an earlier match."""
        out = {}
        for seq, k in seqs:
            tokens = self.lookup(seq.context, k)
            if tokens:
                out[seq.request_id] = Proposal(tokens, None if seq.params.greedy else
                                               one_hot_probs(tokens, self.vocab_size))
        return out

    def release(self, live: set[int]) -> None:
        """Nothing is held per sequence."""

    def pages_held(self) -> int:
        """No KV pages: prompt lookup has no model."""
        return 0


class RerankedHead(torch.nn.Module):
    """A draft model whose head's top `rerank` logits per row are recomputed with exact rows.

    SmolLM2's GGUF stores every linear of its layers as Q4_1 (4-bit codes, a scale and a minimum
    per 32 weights) and its embedding, which is also its head, as Q8_0. labkit's int4-g32 finds
    the layers' own codes again, so an int4 copy's layers compute nearly what the fp32 model's
    do; its head, quantized from 8 bits to 4, does not, and it is the head that picks the
    token. So the draft keeps its cheap head (a 4-bit read of 49,152 rows) to find the likely
    tokens, then scores those few with the target's own head rows (`head`: [V, d], a few
    hundred dot products): the draft's greedy choice is the target head's choice among them.
    For a sampled request its distribution q is the softmax of these logits, whatever they
    are, so the rejection rule stays exact. The target's head is shared, not copied.
    """

    def __init__(self, model, head: torch.Tensor, rerank: int = RERANK):
        super().__init__()
        if head.shape != (model.cfg.vocab_size, model.cfg.hidden_size):
            raise ValueError(f"RerankedHead: head rows {tuple(head.shape)} do not match the "
                             f"draft's vocabulary and width ({model.cfg.vocab_size}, "
                             f"{model.cfg.hidden_size})")
        self.model, self.cfg = model, model.cfg
        self.rows = head  # an attribute, not a buffer: the target owns it
        self.rerank = min(rerank, model.cfg.vocab_size)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's logits [R, V], each row's top `rerank` recomputed with `head`."""
        x = self.model.hidden(input_ids, positions, attn)  # [T, d], final-normed
        if logit_rows is not None:
            x = x[logit_rows]  # [R, d]
        logits = self.model.head(x)  # [R, V]
        top = logits.topk(self.rerank, dim=-1).indices  # [R, r]
        rows = self.rows[top].to(x.dtype)  # [R, r, d]
        return logits.scatter_(-1, top, torch.bmm(rows, x[:, :, None])[..., 0])


def exact_head(model, draft) -> torch.Tensor | None:
    """`model`'s head rows [V, d] for `draft`'s RerankedHead: where they are plain weights (the
    tied embedding, or an unquantized head) of the draft's shape, on its device; else None (a
    quantized head, another width)."""
    w = model.embed.weight if model.lm_head is None else getattr(model.lm_head, "weight", None)
    fits = (isinstance(w, torch.Tensor) and w.is_floating_point()
            and w.shape == (draft.cfg.vocab_size, draft.cfg.hidden_size)
            and w.device == next(draft.parameters()).device)
    return w if fits else None


@dataclass
class _DraftState:
    table: list[int]  # the draft pool's pages of this sequence
    tokens: list[int]  # the tokens whose KV those pages hold, positions 0..len - 1


class DraftModel:
    """Drafts with a smaller copy of the model (its int4 or int8 quantization), which keeps its
    own paged KV cache: per sequence, the tokens it has computed. Each call catches up on what
    the target committed since (the accepted tokens and the correction: a chunk of a few
    tokens), then decodes k - 1 more, all sequences batched in each of its k launches.

    `head`: the target's head rows, where they are plain weights (`exact_head`): the draft's
    logits then come through `RerankedHead` (None: the draft's own head alone)."""

    def __init__(self, name: str, model, num_blocks: int, block_size: int, max_seqs: int,
                 attention: str | None = None, head: torch.Tensor | None = None,
                 rerank: int = RERANK):
        self.name = name
        self.model = model
        self.block_size, self.max_seqs = block_size, max_seqs
        self.allocator = BlockAllocator(num_blocks)
        runs = model if head is None or rerank < 1 else RerankedHead(model, head, rerank)
        self.runner = ModelRunner(runs, num_blocks, block_size, max_seqs, "paged",
                                  attention=attention)
        self.vocab_size = model.cfg.vocab_size
        self._state: dict[int, _DraftState] = {}
        self.steps = 0  # draft launches (for the cost model)

    def release(self, live: set[int]) -> None:
        """Return the pages of sequences no longer running (ids not in `live`)."""
        for rid in [r for r in self._state if r not in live]:
            self.allocator.free(self._state.pop(rid).table)

    def pages_held(self) -> int:
        """Draft KV pages in use."""
        return self.allocator.num_used

    def propose(self, seqs: list[tuple[object, int]]) -> dict[int, Proposal]:
        """k draft tokens for each (sequence, k), in max(k) batched launches of the draft."""
        jobs = []  # (seq, k, state, first position to compute)
        for seq, k in seqs:
            ctx = seq.context
            st = self._state.setdefault(seq.request_id, _DraftState([], []))
            valid = 0  # positions whose draft KV holds this context's tokens
            limit = min(len(st.tokens), len(ctx) - 1)  # the last token is fed again: logits
            while valid < limit and st.tokens[valid] == ctx[valid]:
                valid += 1
            need = blocks_needed(len(ctx) + k - 1, self.block_size) - len(st.table)
            if need > self.allocator.num_free:
                continue  # the draft pool is full: this sequence decodes plainly this step
            st.table += self.allocator.allocate(max(need, 0))
            st.tokens = st.tokens[:valid]
            jobs.append((seq, k, st, valid))
        drafts = {seq.request_id: [] for seq, *_ in jobs}
        probs = {seq.request_id: [] for seq, *_ in jobs}
        for r in range(max((k for _, k, _, _ in jobs), default=0)):
            active = [j for j in jobs if j[1] > r]
            tokens, qlens, starts, params = [], [], [], []
            for seq, _, st, valid in active:
                ctx = seq.context
                new = ctx[valid:] if r == 0 else drafts[seq.request_id][-1:]
                start = valid if r == 0 else len(ctx) - 1 + r
                tokens += new
                qlens.append(len(new))
                starts.append(start)
                st.tokens += new
                params.append(seq.params)
            for i in range(0, len(active), self.max_seqs):  # at most max_seqs rows a launch
                part = slice(i, i + self.max_seqs)
                n_tok = sum(qlens[:i])
                rows = active[part]
                plan = StepPlan(self.steps, "prefill", list(range(len(rows))), qlens[part],
                                starts[part], [st.table for _, _, st, _ in rows],
                                tokens[n_tok:n_tok + sum(qlens[part])], params[part])
                self.steps += 1
                logits = self.runner.forward(plan)  # [B, V]
                chosen, q = self._choose(logits, params[part], plan.counters)
                for (seq, *_), tok, qi in zip(rows, chosen, q):
                    drafts[seq.request_id].append(tok)
                    probs[seq.request_id].append(qi)
        return {rid: Proposal(toks, None if probs[rid][0] is None else torch.stack(probs[rid]))
                for rid, toks in drafts.items()}

    @torch.inference_mode()
    def _choose(self, logits: torch.Tensor, params: list[SamplingParams], counters: list[int]
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's draft token: the argmax for a greedy request; for a sampled one a draw
        from q, the draft's own distribution under the request's settings, on the draft seed
        stream (returned with q, which the rejection rule needs)."""
        # logits: [B, V]
        logits = logits.float()
        tokens = logits.argmax(-1)
        q: list[torch.Tensor | None] = [None] * len(params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            ps = [dataclasses.replace(params[i], seed=draft_seed(params[i].seed))
                  for i in sampled]
            batch = SamplingBatch.build(ps, [counters[i] for i in sampled], self.vocab_size)
            shaped = shaped_logits(logits[sampled], batch)  # [S, V]
            drawn = (shaped + gumbel_noise(batch, self.vocab_size)).argmax(-1)
            tokens[sampled] = drawn
            for j, i in enumerate(sampled):
                q[i] = torch.softmax(shaped[j], -1)
        return tokens.tolist(), q


Proposer = PromptLookup | DraftModel


# ---- the rules as chapter 09's exercises state them: one token at a time --------------------
# (`accept_greedy` and `expected_tokens` above are the engine's own; the sampled rule runs
# batched on the device as `labkit.sampling.rejection_sample`, and the rollback of pages in
# `Scheduler.rollback`: these two are their readable, one-sequence statements)


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

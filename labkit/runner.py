"""ModelRunner: turns a planned step into device tensors, runs the forward, samples.

The scheduler speaks in Python lists (which sequences, their block tables); the runner owns every
tensor that lives on the device: the model, the KV cache, and `last_tokens`, the most recent
token sampled for each device row. A decode step reads its input tokens from `last_tokens`, on
the device, so launching step t+1 never waits for the host to see the tokens of step t — the
property the pipelined decoder is built on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from labkit.attention import BACKENDS, AttentionMeta
from labkit.model import LlamaModel
from labkit.paged_kv import ContiguousKVCache, PagedKVCache
from labkit.sampling import (
    Drafts,
    History,
    Penalties,
    SamplingBatch,
    SamplingParams,
    accept_seed,
    gumbel_noise,
    rejection_sample,
    sample,
    shaped_logits,
    token_logprobs,
    uniform_noise,
)


def max_seq_len(cfg, cache: str, num_blocks: int, block_size: int, max_seqs: int) -> int:
    """The longest sequence an engine can hold: the model's context when paged (a request
    larger than the pool is refused by the scheduler), one row's slab when contiguous."""
    if cache == "paged":
        return cfg.max_position
    return min(cfg.max_position, contiguous_row_len(num_blocks, block_size, max_seqs))


def contiguous_row_len(num_blocks: int, block_size: int, max_seqs: int) -> int:
    """Tokens per row of a contiguous cache holding as much as the paged pool would."""
    return max(1, num_blocks * block_size // max_seqs)


@dataclass
class StepPlan:
    """What one launch computes, in plain lists (cheap to build, to pickle, to print).

    A row is one sequence's slice: a prefill chunk (its tokens sent in `tokens`) or a decode
    row (one token, read on the device from `last_tokens[row]`, marked in `from_device`). A
    launch of decode rows only is "decode", of chunks only "prefill", of both "mixed".

    Speculative decoding adds a *verify row* (labkit.speculative): a chunk of k + 1 tokens,
    the last committed one and k drafted ones, sent from the host, whose logits at all k + 1
    positions are sampled (`verify[i]` = k + 1; None: one position for every row), so that
    the step returns `sum(verify)` tokens, each row's in order.

    Parallel sampling adds a *fork row*: no tokens (query length 0), it samples from the
    logits of the row that prefilled its prompt (`sample_from`). `copies`: pages to copy
    before the forward, (source, destination), the copy-on-write of a shared page that a row
    of this step writes into.
    """

    step: int
    kind: str  # "prefill", "decode" or "mixed"
    rows: list[int]  # device row of each sequence in the batch
    query_lens: list[int]  # new tokens per sequence (1 for decode)
    starts: list[int]  # tokens already cached per sequence
    block_tables: list[list[int]]
    tokens: list[int] | None  # the packed new tokens (0 where read on the device); decode: None
    params: list[SamplingParams]
    from_device: list[bool] | None = None  # mixed: rows whose input is the last sampled token
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) page
    sample_from: list[int] | None = None  # each row's logits row (None: every row its own)
    verify: list[int] | None = None  # positions each row samples (None: its last only)

    def __post_init__(self) -> None:
        n = len(self.rows)
        assert n and len(self.query_lens) == len(self.starts) == len(self.block_tables) == n
        assert self.kind in ("prefill", "decode", "mixed"), self.kind
        assert (self.kind == "decode") == (self.tokens is None), "decode reads last_tokens"
        assert self.kind != "mixed" or (self.from_device is not None
                                        and len(self.from_device) == n)
        assert self.verify is None or (len(self.verify) == n and all(
            1 <= v <= max(q, 1) for v, q in zip(self.verify, self.query_lens))), self.verify

    @property
    def batch_size(self) -> int:
        """Sequences in the step."""
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (its share of the step's token budget)."""
        return sum(self.query_lens)

    def computed(self) -> StepPlan:
        """The rows the forward computes: this plan without its fork rows (query length 0)."""
        if self.sample_from is None:
            return self
        keep = [i for i, q in enumerate(self.query_lens) if q > 0]

        def pick(xs):
            return None if xs is None else [xs[i] for i in keep]
        return dataclasses.replace(
            self, rows=pick(self.rows), query_lens=pick(self.query_lens),
            starts=pick(self.starts), block_tables=pick(self.block_tables),
            params=pick(self.params), from_device=pick(self.from_device), copies=[],
            sample_from=None, verify=pick(self.verify))

    def logits_index(self) -> list[int] | None:
        """For each row, its logits' row in the forward's output (which has no fork rows)."""
        if self.sample_from is None:
            return None
        at, n = {}, 0
        for i, q in enumerate(self.query_lens):
            if q > 0:
                at[i], n = n, n + 1
        return [at[j] for j in self.sample_from]

    @property
    def counters(self) -> list[int]:
        """Position of the token each row samples: the per-request sampling counter."""
        return [s + q for s, q in zip(self.starts, self.query_lens)]

    @property
    def num_samples(self) -> int:
        """Tokens the step samples: one per row, k + 1 per verify row."""
        return len(self.rows) if self.verify is None else sum(self.verify)

    def sampled_rows(self) -> list[tuple[int, int]]:
        """(row, counter) of each token the step samples, in order: a verify row's k + 1
        positions sample the tokens that follow each of its query tokens."""
        v = self.verify or [1] * len(self.rows)
        return [(i, c - n + 1 + j) for i, (c, n) in enumerate(zip(self.counters, v))
                for j in range(n)]


def logprobs_width(plan: StepPlan) -> int | None:
    """The most alternatives any row of the step asked for; None if no row wants logprobs."""
    asked = [p.logprobs for p in plan.params if p.logprobs is not None]
    return max(asked) if asked else None


class ModelRunner:
    """Owns the model, the KV cache and the device rows; runs forward and sample."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_seqs: int,
                 cache: str = "paged", device: torch.device | str = "cpu",
                 attention: str | None = None):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        if cache == "paged":
            # one page more than the scheduler hands out: the scratch page that padding rows
            # (and a CUDA graph's padded rows) write into, which no sequence ever owns
            self.scratch_page = num_blocks
            self.cache = PagedKVCache(cfg, num_blocks + 1, block_size, dtype, self.device)
        elif cache == "contiguous":
            # the same memory as the paged pool, cut into one fixed slab per row: the layout
            # paging replaces (every row reserves the longest sequence it might hold)
            row_len = contiguous_row_len(num_blocks, block_size, max_seqs)
            self.cache = ContiguousKVCache(cfg, max_seqs, row_len, dtype, self.device)
        else:
            raise ValueError(f"cache must be 'paged' or 'contiguous', got {cache!r}")
        # the backend defaults to the cache's natural partner; any backend reads either cache
        attention = attention or ("paged" if cache == "paged" else "naive")
        if attention not in BACKENDS:
            raise ValueError(f"attention must be one of {sorted(BACKENDS)}, got {attention!r}")
        self.backend = BACKENDS[attention](self.cache)
        self.attention = attention
        self.cache_kind = cache
        self.last_tokens = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.last_logprobs: torch.Tensor | None = None  # of the last sample, if asked for

    def to_device(self, values: list) -> torch.Tensor:
        """A host list as a device tensor, without making the host wait for the device."""
        if self.device.type == "cuda":  # pinned staging, so the copy is asynchronous
            return torch.tensor(values, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values)

    def _meta(self, plan: StepPlan) -> AttentionMeta:
        if self.cache_kind == "contiguous":
            tables = self.to_device(plan.rows)[:, None]  # one page per row
            block_size = self.cache.max_len
        else:
            width = max(len(t) for t in plan.block_tables)
            tables = self.to_device([t + [0] * (width - len(t)) for t in plan.block_tables])
            block_size = self.cache.block_size
        max_ctx = max(s + q for s, q in zip(plan.starts, plan.query_lens))
        # every length the build needs comes from the plan's host lists: nothing reads the
        # device back, so a launch only enqueues (labkit/attention.py); flash's meta has no
        # [B, L] slots and no mask
        return self.backend.meta_type.build(
            self.to_device(plan.query_lens), self.to_device(plan.starts), tables, block_size,
            max(plan.query_lens), max_ctx, host_query_lens=plan.query_lens,
            host_starts=plan.starts)

    @torch.inference_mode()
    def forward(self, plan: StepPlan, on_staged: Callable[[], object] | None = None
                ) -> torch.Tensor:
        """Run the step's forward; logits of each sequence's last new token: [B, V].

        `on_staged()`, if given, runs once the inputs are enqueued and before the model's
        first kernel: where a device starts timing the forward (host staging is not device
        time)."""
        self.copy_pages(plan.copies)
        plan = plan.computed()  # fork rows compute nothing: they sample a sibling's logits
        meta = self._meta(plan)
        if plan.tokens is None:
            input_ids = self.last_tokens[self.to_device(plan.rows)]  # [B] read on the device
        else:
            input_ids = self.to_device(plan.tokens)  # [T]
            if plan.kind == "mixed":  # decode rows: their token is on the device already
                packed, rows, first = [], [], 0
                for row, q, dev in zip(plan.rows, plan.query_lens, plan.from_device):
                    if dev:
                        packed.append(first)
                        rows.append(row)
                    first += q
                if rows:
                    input_ids[self.to_device(packed)] = self.last_tokens[self.to_device(rows)]
        if on_staged is not None:
            on_staged()
        self.backend.begin_step(meta)
        logit_rows = meta.last_rows
        if plan.kind == "decode":
            logit_rows = None  # decode rows only: every row's one token is its last (no gather)
        elif plan.verify is not None:  # verify rows: the logits of their last k + 1 tokens
            ends = torch.tensor(plan.query_lens).cumsum(0).tolist()
            logit_rows = self.to_device([e - v + j for e, v in zip(ends, plan.verify)
                                         for j in range(v)])
        return self.model(input_ids, meta.positions, self.backend, logit_rows=logit_rows)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write, on the device, in launch order: each (source, destination) page."""
        if copies:
            src, dst = zip(*copies)
            self.cache.copy_pages(self.to_device(list(src)), self.to_device(list(dst)))

    @torch.inference_mode()
    def sample(self, plan: StepPlan, logits: torch.Tensor, allowed: torch.Tensor | None = None,
               on_staged: Callable[[], object] | None = None, history: History | None = None,
               drafts: Drafts | None = None) -> torch.Tensor:
        """Choose each row's next token on the device and remember it in last_tokens: [B]
        (`on_staged` as in `forward`; `history`: the used tokens of rows with penalties).

        Rows that asked for log-probabilities leave them in `last_logprobs` ([B, 1 + 2k],
        see `token_logprobs`; None when no row asked), for the copy to the host.
        """
        if plan.verify is not None:
            return self._sample_verify(plan, logits, allowed, history, on_staged, drafts)
        index = plan.logits_index()
        if index is not None:  # fork rows draw from their prompt's logits
            logits = logits[self.to_device(index)]
        vocab = logits.shape[-1]
        # every row greedy (known on the host): the argmax reads no setting, so none is packed
        # into tensors (five small uploads a step; at batch 1 on a CPU ~0.04 ms of a 3.4 ms
        # int4 step, on caches the weights had just swept)
        greedy = all(p.greedy for p in plan.params)
        batch = None if greedy else SamplingBatch.build(plan.params, plan.counters, vocab,
                                                        self.to_device)
        penalties = Penalties.build(history, plan.params, vocab, self.device, self.to_device)
        rows = self.to_device(plan.rows)
        if on_staged is not None:
            on_staged()
        tokens = sample(logits, batch, allowed, all_greedy=greedy, penalties=penalties)
        self.last_tokens[rows] = tokens
        k = logprobs_width(plan)
        self.last_logprobs = None if k is None else token_logprobs(logits, tokens, k)
        return tokens

    def _sample_verify(self, plan: StepPlan, logits: torch.Tensor, allowed: torch.Tensor | None,
                       history: History | None, on_staged: Callable[[], object] | None,
                       drafts: Drafts | None) -> torch.Tensor:
        """`sample` for a step with verify rows: every position of a verify row is sampled
        like a row of its own (its own counter), then a sampled request's positions are
        replaced by the rejection rule's choices (`drafts`: its draft tokens and their q).
        Returns [plan.num_samples] tokens; `last_tokens` gets each row's last one."""
        # logits: [sum(verify of computed rows), V], each computed row's positions in order
        which = plan.sampled_rows()  # (row, counter) per sampled position
        if plan.sample_from is not None:  # fork rows draw from their prompt row's last logits
            first = torch.tensor([0] + [v for v, q in zip(plan.verify, plan.query_lens)
                                        if q > 0]).cumsum(0).tolist()  # of computed rows
            index = plan.logits_index()
            logits = logits[self.to_device(
                [first[index[i]] + j if plan.sample_from[i] == i else first[index[i] + 1] - 1
                 for i, j in _positions(plan.verify)])]
        rows_of = [i for i, _ in which]
        params = [plan.params[i] for i in rows_of]
        vocab = logits.shape[-1]
        batch = SamplingBatch.build(params, [c for _, c in which], vocab, self.to_device)
        last = torch.tensor(plan.verify).cumsum(0).sub(1).tolist()  # each row's last position
        # masks and penalties belong to rows that are not verify rows (the engine refuses
        # them with speculation): their one position is their row's last
        if allowed is not None:
            allowed = allowed[self.to_device(rows_of)]
        if history:
            history = {last[i]: h for i, h in history.items()}
        penalties = Penalties.build(history, params, vocab, self.device, self.to_device)
        if on_staged is not None:
            on_staged()
        tokens = sample(logits, batch, allowed, penalties=penalties)  # [S]
        for i, (draft, q) in (drafts or {}).items():
            k = plan.verify[i] - 1
            pos = slice(last[i] - k, last[i] + 1)
            sub = SamplingBatch.build([plan.params[i]] * (k + 1),
                                      [c for _, c in which[pos]], vocab, self.to_device)
            p = torch.softmax(shaped_logits(logits[pos].float(), sub), -1)  # [k + 1, V]
            seeds = self.to_device([accept_seed(plan.params[i].seed)] * k)
            u = uniform_noise(seeds, sub.counter[:k], 1)[:, 0]  # [k] in (0, 1)
            tokens[pos] = rejection_sample(p, q, self.to_device(draft), u,
                                           gumbel_noise(sub, vocab))
        # each row's next input: a verify row's is the choice after its accepted run (the rule
        # the host applies at commit, `labkit.speculative.accepted`), so that a decode row
        # that follows it reads the committed token
        chosen = list(last)
        at = 0
        for i, (v, q) in enumerate(zip(plan.verify, plan.query_lens)):
            at += q
            if v > 1:
                draft = self.to_device(plan.tokens[at - v + 1:at])  # [k]
                agree = (tokens[last[i] - v + 1:last[i]] == draft).long().cumprod(0)  # [k]
                chosen[i] = last[i] - v + 1 + int(agree.sum())
        self.last_tokens[self.to_device(plan.rows)] = tokens[self.to_device(chosen)]
        k = logprobs_width(plan)
        self.last_logprobs = None if k is None else token_logprobs(
            logits[self.to_device(last)], tokens[self.to_device(last)], k)
        return tokens


def _positions(verify: list[int]) -> list[tuple[int, int]]:
    """(row, j) of each sampled position: j = 0 .. verify[row] - 1."""
    return [(i, j) for i, v in enumerate(verify) for j in range(v)]

"""ModelRunner: turns a planned step into device tensors, runs the forward, samples.

The scheduler speaks in Python lists (which sequences, their block tables); the runner owns every
tensor that lives on the device: the model, the KV cache, and `last_tokens`, the most recent
token sampled for each device row. A decode step reads its input tokens from `last_tokens`, on
the device, so launching step t+1 never waits for the host to see the tokens of step t — the
property the pipelined decoder is built on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.attention import BACKENDS, AttentionMeta
from labkit.model import LlamaModel
from labkit.paged_kv import ContiguousKVCache, PagedKVCache
from labkit.sampling import SamplingBatch, SamplingParams, sample


@dataclass
class StepPlan:
    """What one launch computes, in plain lists (cheap to build, to pickle, to print)."""

    step: int
    kind: str  # "prefill" or "decode"
    rows: list[int]  # device row of each sequence in the batch
    query_lens: list[int]  # new tokens per sequence (1 for decode)
    starts: list[int]  # tokens already cached per sequence
    block_tables: list[list[int]]
    tokens: list[int] | None  # prefill: the packed new tokens; decode: None (from last_tokens)
    params: list[SamplingParams]

    def __post_init__(self) -> None:
        n = len(self.rows)
        assert n and len(self.query_lens) == len(self.starts) == len(self.block_tables) == n
        assert self.kind in ("prefill", "decode"), self.kind
        assert self.kind == "prefill" or self.tokens is None, "decode reads last_tokens"

    @property
    def batch_size(self) -> int:
        """Sequences in the step."""
        return len(self.rows)

    @property
    def counters(self) -> list[int]:
        """Position of the token each row samples: the per-request sampling counter."""
        return [s + q for s, q in zip(self.starts, self.query_lens)]


class ModelRunner:
    """Owns the model, the KV cache and the device rows; runs forward and sample."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_seqs: int,
                 cache: str = "paged", device: torch.device | str = "cpu"):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        if cache == "paged":
            self.cache = PagedKVCache(cfg, num_blocks, block_size, dtype, self.device)
            self.backend = BACKENDS["paged"](self.cache)
        elif cache == "contiguous":
            # the same memory as the paged pool, cut into one fixed slab per row: the layout
            # paging replaces (every row reserves the longest sequence it might hold)
            row_len = max(1, num_blocks * block_size // max_seqs)
            self.cache = ContiguousKVCache(cfg, max_seqs, row_len, dtype, self.device)
            self.backend = BACKENDS["naive"](self.cache)
        else:
            raise ValueError(f"cache must be 'paged' or 'contiguous', got {cache!r}")
        self.cache_kind = cache
        # the longest sequence the engine can hold: the model's context when paged (a
        # request larger than the pool is refused by the scheduler), a row when contiguous
        self.max_seq_len = (cfg.max_position if cache == "paged"
                            else min(cfg.max_position, self.cache.max_len))
        self.last_tokens = torch.zeros(max_seqs, dtype=torch.long, device=self.device)

    def _meta(self, plan: StepPlan) -> AttentionMeta:
        dev = self.device
        if self.cache_kind == "contiguous":
            tables = torch.tensor(plan.rows, device=dev)[:, None]  # one page per row
            block_size = self.cache.max_len
        else:
            width = max(len(t) for t in plan.block_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in plan.block_tables],
                                  device=dev)
            block_size = self.cache.block_size
        return AttentionMeta.build(torch.tensor(plan.query_lens, device=dev),
                                   torch.tensor(plan.starts, device=dev), tables, block_size)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the step's forward; logits of each sequence's last new token: [B, V]."""
        meta = self._meta(plan)
        if plan.tokens is not None:
            input_ids = torch.tensor(plan.tokens, device=self.device)  # [T]
        else:
            input_ids = self.last_tokens[torch.tensor(plan.rows, device=self.device)]  # [B]
        self.backend.begin_step(meta)
        return self.model(input_ids, meta.positions, self.backend, logit_rows=meta.last_rows)

    @torch.inference_mode()
    def sample(self, plan: StepPlan, logits: torch.Tensor,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Choose each row's next token on the device and remember it in last_tokens: [B]."""
        batch = SamplingBatch.build(plan.params, plan.counters, logits.shape[-1], self.device)
        tokens = sample(logits, batch, allowed,
                        all_greedy=all(p.greedy for p in plan.params))
        self.last_tokens[torch.tensor(plan.rows, device=self.device)] = tokens
        return tokens

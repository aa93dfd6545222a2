"""Attention backends: every one stores the new keys and values, then attends over the cache.

A step's batch is packed: T new tokens from B sequences laid end to end. `AttentionMeta` turns
the step's block tables into index tensors once per step (every layer reuses them):

- `write_slots [T]`: the cache slot each new token's k and v go to;
- `ctx_slots [B, L]`: the slots of each sequence's whole context, in order (padded);
- `mask [B, Tq, L]`: which context token each new token may see (causal, and within its own
  sequence's length).

The contiguous cache is the special case of one page per sequence holding `max_len` tokens, so
both caches share this metadata. The backends share one signature and one test:

- `NaiveAttention`: a Python loop over sequences with the softmax written out; the reference.
- `PagedAttention`: one batched gather over the block tables, then fused scaled-dot-product
  attention, with grouped-query heads folded into the query rows so K and V are never repeated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from labkit.paged_kv import KVStore


@dataclass
class AttentionMeta:
    """Index tensors for one step, shared by every layer."""

    write_slots: torch.Tensor  # [T] cache slot of each new token
    positions: torch.Tensor  # [T] position of each new token in its sequence
    ctx_slots: torch.Tensor  # [B, L] slots of each sequence's context (0 where padded)
    ctx_lens: torch.Tensor  # [B] context length after this step's tokens
    query_lens: torch.Tensor  # [B] new tokens of each sequence in this step
    q_index: torch.Tensor  # [B, Tq] packed index of each sequence's j-th new token
    unpad_index: torch.Tensor  # [T] index into the flattened [B * Tq] padded queries
    mask: torch.Tensor  # [B, Tq, L] True where a query may attend to a key
    last_rows: torch.Tensor  # [B] packed index of each sequence's last new token
    # the same lengths as host lists, when the builder knew them: a backend that loops over
    # sequences in Python reads these, never the device (int(t) on a GPU waits for it)
    host_query_lens: list[int] | None = None
    host_ctx_lens: list[int] | None = None

    @staticmethod
    def _host_to(values: list[int], dev: torch.device) -> torch.Tensor:
        """A host list on `dev`; on CUDA through pinned memory, so the copy does not block."""
        t = torch.tensor(values, dtype=torch.long)
        if dev.type == "cuda":
            return t.pin_memory().to(dev, non_blocking=True)
        return t.to(dev)

    @staticmethod
    def build(query_lens: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor,
              block_size: int, max_q: int | None = None, max_ctx: int | None = None, *,
              host_query_lens: Sequence[int] | None = None,
              host_starts: Sequence[int] | None = None) -> AttentionMeta:
        """Metadata for B sequences: `query_lens[b]` new tokens after `starts[b]` cached ones.

        Nothing here reads a device tensor back, so on a GPU the build only enqueues work:
        `max_q`, `max_ctx` (the largest query and context lengths) and, for a prefill step,
        `host_query_lens` (the same lengths as a host list) must come from the caller, which
        knows them on the host (the runner does). On the CPU, anything missing is read from
        the tensors. `host_starts` lets a Python-loop backend skip reading lengths per row.
        """
        # query_lens, starts: [B]; block_tables: [B, nb] page ids (padded with any page id)
        dev = block_tables.device
        on_cpu = dev.type == "cpu"
        if not on_cpu and (max_q is None or max_ctx is None):
            raise ValueError(f"AttentionMeta.build on {dev.type}: pass max_q and max_ctx (known "
                             "on the host); reading them from the device would stall it")
        b = query_lens.shape[0]
        ctx_lens = starts + query_lens  # [B]
        seq_len = int(ctx_lens.max()) if max_ctx is None else max_ctx
        tq = int(query_lens.max()) if max_q is None else max_q
        if host_query_lens is None and on_cpu and tq > 1:
            host_query_lens = query_lens.tolist()  # a CPU tensor: no device to wait for
        pos = torch.arange(seq_len, device=dev)  # [L]
        # token pos of a sequence lives in page table[pos // block_size] at offset pos % bs
        page_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1).expand(b, seq_len)
        ctx_slots = block_tables.gather(1, page_idx) * block_size + pos % block_size
        valid_k = pos[None, :] < ctx_lens[:, None]  # [B, L]
        ctx_slots = torch.where(valid_k, ctx_slots, 0)
        j = torch.arange(tq, device=dev)
        q_pos = starts[:, None] + j[None, :]  # [B, Tq]
        valid_q = j[None, :] < query_lens[:, None]  # [B, Tq]
        first = torch.cumsum(query_lens, 0) - query_lens  # packed index of each first token
        q_index = torch.where(valid_q, first[:, None] + j[None, :], 0)
        write_slots = ctx_slots.gather(1, q_pos.clamp(max=seq_len - 1))
        mask = (pos[None, None, :] <= q_pos[:, :, None]) & valid_k[:, None, :]  # causal
        if tq == 1:  # decode: every query is real, the packed order is the padded one
            unpad_index = torch.arange(b, device=dev)  # [T = B]
            write_slots, q_pos = write_slots.view(b), q_pos.view(b)
        else:
            if host_query_lens is None:
                raise ValueError("AttentionMeta.build: a prefill step on a GPU needs "
                                 "host_query_lens (boolean indexing by a device mask syncs)")
            # a padded query row must see something, or softmax over nothing is NaN (dropped)
            mask[:, :, 0] |= ~valid_q
            # the packed order, listed on the host where the lengths are known: [T] indices
            # into the padded [B * Tq] (a device mask would need nonzero(), a sync, to do this)
            unpad_index = AttentionMeta._host_to(
                [i * tq + k for i, n in enumerate(host_query_lens) for k in range(n)], dev)
            write_slots = write_slots.reshape(-1)[unpad_index]  # [T]
            q_pos = q_pos.reshape(-1)[unpad_index]  # [T]
        host_ctx = (None if host_starts is None or host_query_lens is None
                    else [s + n for s, n in zip(host_starts, host_query_lens)])
        return AttentionMeta(write_slots, q_pos, ctx_slots, ctx_lens, query_lens,
                             q_index, unpad_index, mask, first + query_lens - 1,
                             None if host_query_lens is None else list(host_query_lens),
                             host_ctx)


class AttentionBackend:
    """Common part: the store, the step's metadata, and the write of new k and v."""

    def __init__(self, store: KVStore):
        self.store = store
        self.meta: AttentionMeta | None = None

    def begin_step(self, meta: AttentionMeta) -> None:
        """Set the metadata the next forward's layers will use."""
        self.meta = meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Store k, v ([T, Hkv, D]) then attend q ([T, H, D]) over the context: [T, H, D]."""
        assert self.meta is not None, "begin_step(meta) must come before the forward"
        self.store.write(layer, self.meta.write_slots, k, v)
        return self._attend(layer, q)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class NaiveAttention(AttentionBackend):
    """One sequence at a time, softmax(q k^T / sqrt(D) + mask) v written out: the reference."""

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        m = self.meta
        out = torch.empty_like(q)
        h, d = q.shape[1], q.shape[2]
        # lengths from the host lists (one read of the device per layer at worst, never one
        # per row: int() of a GPU tensor waits for the GPU)
        ctx_lens = m.host_ctx_lens if m.host_ctx_lens is not None else m.ctx_lens.tolist()
        q_lens = m.host_query_lens if m.host_query_lens is not None else m.query_lens.tolist()
        for b in range(m.ctx_slots.shape[0]):
            n_ctx, n_q = ctx_lens[b], q_lens[b]
            tok = m.q_index[b, :n_q]  # [n_q] packed indices of this sequence's new tokens
            slots = m.ctx_slots[b, :n_ctx]
            kb = self.store.k[layer][slots]  # [L, Hkv, D]
            vb = self.store.v[layer][slots]
            group = h // kb.shape[1]
            kb = kb.repeat_interleave(group, dim=1)  # [L, H, D]: query head i uses KV head i//G
            vb = vb.repeat_interleave(group, dim=1)
            qb = q[tok].float()  # [n_q, H, D]
            scores = torch.einsum("qhd,khd->hqk", qb, kb.float()) / math.sqrt(d)  # [H, n_q, L]
            visible = m.mask[b, :n_q, :n_ctx]  # [n_q, L]: causal within this sequence
            scores = scores.masked_fill(~visible[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[tok] = torch.einsum("hqk,khd->qhd", probs, vb.float()).to(q.dtype)
        return out


class PagedAttention(AttentionBackend):
    """All sequences at once: gather the context through the block tables, then fused SDPA."""

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        m = self.meta
        b, tq = m.q_index.shape
        t, h, d = q.shape
        kv_heads = self.store.k.shape[2]
        group = h // kv_heads
        k = self.store.k[layer][m.ctx_slots]  # [B, L, Hkv, D]
        v = self.store.v[layer][m.ctx_slots]
        qp = q[m.q_index]  # [B, Tq, H, D]
        # fold the G query heads of each KV head into the query rows: [B, Hkv, G*Tq, D]
        qg = qp.view(b, tq, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(
            b, kv_heads, group * tq, d)
        mask = m.mask[:, None, None].expand(b, 1, group, tq, m.mask.shape[-1]).reshape(
            b, 1, group * tq, m.mask.shape[-1])
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)  # [B, Hkv, G*Tq, D]
        o = o.view(b, kv_heads, group, tq, d).permute(0, 3, 1, 2, 4).reshape(b * tq, h, d)
        return o[m.unpad_index]  # [T, H, D]


BACKENDS = {"naive": NaiveAttention, "paged": PagedAttention}

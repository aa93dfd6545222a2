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
- `FlashAttention` (below, with the chapter-04 functions `flash_attention`, `merge_partials`,
  `flash_decode`): the KV pool a tile of pages at a time with an online softmax; its
  `FlashMeta` holds no [B, L] slots and no mask. On the CPU, labkit's C++ kernel runs the tile
  loop (`FlashAttention.reference` is it in PyTorch); on CUDA, labkit.kernels.attention_triton's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import torch
from torch.nn import functional as F

from labkit.kernels import attention_triton
from labkit.kernels import cpu as cpu_kernels
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
        q = _Queries.layout(query_lens, starts, dev, max_q, max_ctx, host_query_lens,
                            "AttentionMeta")
        b, seq_len = query_lens.shape[0], q.max_ctx
        kernels = cpu_kernels.usable_for_indices(block_tables) if q.decode else None
        if kernels is not None:  # the slots below in one call of labkit's (the same integers)
            write_slots, ctx_slots, valid_k = kernels.paged_decode_slots(
                starts, block_tables, block_size, seq_len)
        else:
            pos = torch.arange(seq_len, device=dev)  # [L]
            # token pos of a sequence lives in page table[pos // block_size] at offset pos % bs
            page_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1).expand(
                b, seq_len)
            ctx_slots = block_tables.gather(1, page_idx) * block_size + pos % block_size
            valid_k = pos[None, :] < q.ctx_lens[:, None]  # [B, L]
            ctx_slots = torch.where(valid_k, ctx_slots, 0)
            write_slots = q.packed(ctx_slots.gather(1, q.pos.clamp(max=seq_len - 1)))  # [T]
        if q.decode:  # the one query is the last key: causal is valid_k itself
            mask = valid_k[:, None, :]
        else:
            mask = (pos[None, None, :] <= q.pos[:, :, None]) & valid_k[:, None, :]  # causal
        if q.tq > 1:  # a padded query row must see something, or softmax over nothing is NaN
            mask[:, :, 0] |= ~q.valid  # (its output is dropped)
        return AttentionMeta(write_slots, q.packed(q.pos), ctx_slots, q.ctx_lens,
                             query_lens, q.index, q.unpad_index, mask, q.last_rows,
                             q.host_query_lens, q.host_ctx_lens(host_starts))


@dataclass
class _Queries:
    """Where a step's new tokens are: the part of the metadata every backend needs."""

    tq: int  # the longest query
    max_ctx: int  # the longest context after this step
    ctx_lens: torch.Tensor  # [B]
    pos: torch.Tensor  # [B, Tq] position of each sequence's j-th new token (padded)
    valid: torch.Tensor  # [B, Tq] True where j < query_lens[b]
    index: torch.Tensor  # [B, Tq] packed index of each sequence's j-th new token
    unpad_index: torch.Tensor  # [T] index into the flattened [B * Tq] padded queries
    last_rows: torch.Tensor  # [B] packed index of each sequence's last new token
    host_query_lens: list[int] | None
    decode: bool = False  # one new token a sequence, known on the host

    @staticmethod
    def layout(query_lens: torch.Tensor, starts: torch.Tensor, dev: torch.device,
               max_q: int | None, max_ctx: int | None, host_query_lens: Sequence[int] | None,
               who: str) -> _Queries:
        """The query layout; nothing read back from a device (see AttentionMeta.build)."""
        on_cpu = dev.type == "cpu"
        if not on_cpu and (max_q is None or max_ctx is None):
            raise ValueError(f"{who}.build on {dev.type}: pass max_q and max_ctx (known "
                             "on the host); reading them from the device would stall it")
        b = query_lens.shape[0]
        if max_q == 1 and host_query_lens is not None and all(n == 1 for n in host_query_lens):
            # a decode step: the layout below with every query one token long, in 4 ops, not
            # ~12 (at batch 1 on a CPU each costs a few microseconds on swept caches)
            rows = torch.arange(b, device=dev)  # packed index = padded index = row
            ctx_lens = starts + 1
            return _Queries(1, int(ctx_lens.max()) if max_ctx is None else max_ctx, ctx_lens,
                            starts[:, None].clone(), torch.ones(b, 1, dtype=torch.bool,
                                                                device=dev),
                            rows[:, None], rows, rows, list(host_query_lens), decode=True)
        ctx_lens = starts + query_lens  # [B]
        max_ctx = int(ctx_lens.max()) if max_ctx is None else max_ctx
        tq = int(query_lens.max()) if max_q is None else max_q
        if host_query_lens is None and on_cpu and tq > 1:
            host_query_lens = query_lens.tolist()  # a CPU tensor: no device to wait for
        j = torch.arange(tq, device=dev)
        pos = starts[:, None] + j[None, :]  # [B, Tq]
        valid = j[None, :] < query_lens[:, None]  # [B, Tq]
        first = torch.cumsum(query_lens, 0) - query_lens  # packed index of each first token
        index = torch.where(valid, first[:, None] + j[None, :], 0)
        if tq == 1:  # decode: every query is real, the packed order is the padded one
            unpad_index = torch.arange(b, device=dev)  # [T = B]
        elif host_query_lens is None:
            raise ValueError(f"{who}.build: a prefill step on a GPU needs host_query_lens "
                             "(boolean indexing by a device mask syncs)")
        else:  # the packed order, listed on the host where the lengths are known: [T]
            # indices into the padded [B * Tq] (a device mask would need nonzero(), a sync)
            unpad_index = AttentionMeta._host_to(
                [i * tq + k for i, n in enumerate(host_query_lens) for k in range(n)], dev)
        return _Queries(tq, max_ctx, ctx_lens, pos, valid, index, unpad_index,
                        first + query_lens - 1,
                        None if host_query_lens is None else list(host_query_lens))

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """A padded [B, Tq] tensor in packed order: [T]."""
        return x.reshape(-1) if self.tq == 1 else x.reshape(-1)[self.unpad_index]

    def host_ctx_lens(self, host_starts: Sequence[int] | None) -> list[int] | None:
        """Context lengths as a host list, when the starts are known on the host."""
        if host_starts is None or self.host_query_lens is None:
            return None
        return [s + n for s, n in zip(host_starts, self.host_query_lens)]


_NO_TENSOR = torch.empty(0)  # an argument the C++ decoder stack does not use


class AttentionBackend:
    """Common part: the store, the step's metadata, and the write of new k and v."""

    meta_type: type[AttentionMeta] = AttentionMeta  # what the runner builds for each step

    def __init__(self, store: KVStore, cpu_kernel: bool = False):
        self.store = store
        self.meta: AttentionMeta | None = None
        self.cpu_kernel = cpu_kernel  # a backend with a labkit C++ kernel may use it

    def _in_place(self, q: torch.Tensor):
        """labkit's CPU kernel module when it serves this call (fp32 pool, fp32 CPU q, no
        torch mode on: `cpu_kernels.usable`), else None."""
        if not (self.cpu_kernel and self.store.k.dtype == torch.float32):
            return None
        return cpu_kernels.usable(q)

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

    def stack_args(self, x: torch.Tensor) -> tuple | None:
        """What labkit's C++ decoder stack (`labkit.kernels.stack`) needs to run this
        backend's kernel in every layer of a step, or None where it has none for `x`."""
        return None


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


@dataclass(frozen=True)
class _GatherPlan:
    """One step's gather on the CPU, the same for every layer (PagedAttention._gather_plan)."""

    index: torch.Tensor  # [n] page ids (or slot ids) to read, n = B * pages per sequence
    k_pools: list[torch.Tensor]  # per layer, the K pool as [pages, block * Hkv * D] rows
    v_pools: list[torch.Tensor]
    k_out: torch.Tensor  # [n, block * Hkv * D]: where index_select writes
    v_out: torch.Tensor
    k: torch.Tensor  # [B, L, Hkv, D]: k_out seen as each sequence's context
    v: torch.Tensor


class PagedAttention(AttentionBackend):
    """All sequences at once, through the block tables.

    On the CPU (fp32), labkit's kernel (`labkit.kernels.cpu`) reads each token's keys and
    values in place, a slot at a time, with no copy of the context; elsewhere, or without a
    compiler, or with `cpu_kernel=False`: gather the context into one [B, L, Hkv, D] tensor,
    then fused SDPA. Measured at batch 32, context 256 on SmolLM2: the gather alone cost ~2 ms
    a layer, and SDPA on the gathered copy more than on a contiguous cache.
    """

    def __init__(self, store: KVStore, cpu_kernel: bool = True):
        super().__init__(store, cpu_kernel)  # False: always the gather and SDPA (to compare)
        # CPU: the gathered K and V land in buffers reused by every layer and step. A fresh
        # [B, L, Hkv, D] tensor per layer is a new mmap on each call (megabytes at batch 32),
        # and its page faults cost more than the copy itself (measured: 2x the gather's time)
        self._gather_buf: torch.Tensor | None = None
        self._folded: tuple[AttentionMeta, int, torch.Tensor] | None = None
        self._plan: tuple[AttentionMeta, _GatherPlan] | None = None  # the step's gather
        self._pools: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None

    def _gather_plan(self, slots: torch.Tensor) -> _GatherPlan:
        """This step's gather, made by the first layer and reused by every other.

        A paged pool is read a page at a time: one index per block_size tokens, each a
        contiguous run of block_size * Hkv * D values (measured at batch 32, context 256 on
        SmolLM2: 1.7x faster than one index per token). Padding positions read page 0."""
        m = self.meta
        if self._plan is not None and self._plan[0] is m:
            return self._plan[1]
        store = self.store
        block = getattr(store, "block_size", 1)
        b, seq_len = slots.shape
        index = (slots[:, ::block] // block if block > 1 else slots).reshape(-1)  # [B * nb]
        row = store.k_layers[0][0].numel()  # Hkv * D
        width, n = block * row, index.numel()
        if self._pools is None or self._pools[0] != width:
            self._pools = (width, [k.view(-1, width) for k in store.k_layers],
                           [v.view(-1, width) for v in store.v_layers])
        if self._gather_buf is None or self._gather_buf.shape[1] < n * width:
            self._gather_buf = torch.empty(2, n * width, dtype=store.k.dtype)
        k_out, v_out = (self._gather_buf[i, :n * width].view(n, width) for i in (0, 1))
        plan = _GatherPlan(index, self._pools[1], self._pools[2], k_out, v_out,
                           k_out.view(b, -1, *store.k.shape[2:])[:, :seq_len],
                           v_out.view(b, -1, *store.k.shape[2:])[:, :seq_len])
        self._plan = (m, plan)
        return plan

    def _gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every context slot: two [B, L, Hkv, D] tensors."""
        if slots.device.type != "cpu":  # a GPU's allocator caches; a CUDA graph owns its pool
            return self.store.k_layers[layer][slots], self.store.v_layers[layer][slots]
        p = self._gather_plan(slots)
        torch.index_select(p.k_pools[layer], 0, p.index, out=p.k_out)  # read n rows; write them
        torch.index_select(p.v_pools[layer], 0, p.index, out=p.v_out)
        return p.k, p.v

    def _folded_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's mask with each query row repeated for the G heads of its KV head:
        [B, 1, G*Tq, L], built once per step (every layer uses the same). Additive (0 where
        visible, -inf where not): SDPA turns a boolean mask into exactly this on every call."""
        m = self.meta
        if self._folded is None or self._folded[0] is not m or self._folded[1] != group:
            b, tq, seq_len = m.mask.shape
            mask = m.mask[:, None, None].expand(b, 1, group, tq, seq_len).reshape(
                b, 1, group * tq, seq_len)
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
            self._folded = (m, group, mask)
        return self._folded[2]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        kernel = self._in_place(q)
        if kernel is None:
            return super().attend(layer, q, k, v)
        # labkit's kernel: writes k and v at their slots, then each token reads its keys in
        # place; no gather, no mask, one call a layer
        m = self.meta
        assert m is not None, "begin_step(meta) must come before the forward"
        return kernel.paged_attention(q, k, v, m.write_slots, self.store.k_layers[layer],
                                      self.store.v_layers[layer], m.ctx_slots, m.q_index,
                                      m.query_lens, m.positions, 1.0 / math.sqrt(q.shape[-1]))

    def stack_args(self, x: torch.Tensor) -> tuple | None:
        if self._in_place(x) is None:
            return None
        m, none = self.meta, _NO_TENSOR
        return (0, m.write_slots, self.store.k_layers, self.store.v_layers, m.ctx_slots, none,
                0, 0, m.q_index, m.query_lens, m.positions)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        m = self.meta
        t, h, d = q.shape
        b, tq = m.q_index.shape
        kv_heads = self.store.k.shape[2]
        group = h // kv_heads
        k, v = self._gather(layer, m.ctx_slots)  # [B, L, Hkv, D] each
        # decode (Tq = 1): the packed order is the padded one, no index needed
        qp = q.view(b, 1, h, d) if tq == 1 else q[m.q_index]  # [B, Tq, H, D]
        # fold the G query heads of each KV head into the query rows: [B, Hkv, G*Tq, D]
        qg = qp.view(b, tq, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(
            b, kv_heads, group * tq, d)
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=self._folded_mask(group, qg.dtype))
        # o: [B, Hkv, G*Tq, D]
        o = o.view(b, kv_heads, group, tq, d).permute(0, 3, 1, 2, 4).reshape(b * tq, h, d)
        return o if tq == 1 else o[m.unpad_index]  # [T, H, D]


BACKENDS = {"naive": NaiveAttention, "paged": PagedAttention}


# ---------------------------------------------------------------------------------------------
# FlashAttention: K and V in tiles, a running max and sum (online softmax), never an S x S matrix
# ---------------------------------------------------------------------------------------------

def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(D)) v with the whole [B, H, Tq, L] score matrix in memory; (out,
    lse) as flash_attention, same shapes and causal rule. The reference, and what tiles save."""
    b, h, tq, d = q.shape
    seq_len = k.shape[2]
    g = h // k.shape[1]
    k = k.float().repeat_interleave(g, 1)  # [B, H, L, D]: each query head gets its own copy
    v = v.float().repeat_interleave(g, 1)
    scores = (q.float() / math.sqrt(d)) @ k.transpose(-1, -2)  # [B, H, Tq, L]
    if causal:
        i = torch.arange(tq, device=q.device)[:, None] + seq_len - tq  # query positions
        hidden = torch.arange(seq_len, device=q.device)[None, :] > i  # [Tq, L]
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)  # [B, H, Tq]
    probs = scores.softmax(-1)  # [B, H, Tq, L]: a second S x S matrix
    return (probs @ v).to(q.dtype), lse


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,  # noqa: E741
                          scores: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of `scores` [..., Tq, Tk] and values `v` [..., Tk, D] into the running
    max `m` [..., Tq], sum `l` [..., Tq] and unnormalised output `acc` [..., Tq, D]."""
    m_new = torch.maximum(m, scores.amax(-1))  # the max over every key seen so far
    # a row that has seen only masked keys keeps m = -inf: subtract 0 so exp() gives 0, not NaN
    m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.exp(m - m_ref)  # what was summed under the old max, rescaled to the new one
    p = (scores - m_ref[..., None]).exp_()  # [..., Tq, Tk]: one new tile, exp in place
    l_new = l * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + p @ v  # [..., Tq, D]
    return m_new, l_new, acc


def _finish(m: torch.Tensor, total: torch.Tensor, acc: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from the running state; a row that saw no key gets out 0 and lse -inf."""
    seen = total > 0
    out = acc / torch.where(seen, total, 1.0)[..., None]
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
    return out, lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    block_k: int = 256, block_q: int = 256
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention with online softmax: (out [B, H, Tq, D], lse [B, H, Tq]).

    q: [B, H, Tq, D]; k, v: [B, Hkv, L, D] with H a multiple of Hkv (grouped-query heads share
    a KV head, which is never repeated). Causal: query i sits at position L - Tq + i and sees
    keys 0 .. L - Tq + i. Computed in fp32; memory is O(block_q * block_k) per head, not O(L^2).
    """
    b, h, tq, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    if h % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}, "
                         f"{tuple(v.shape)} do not fit [B, H, Tq, D] / [B, Hkv, L, D]")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    g = h // hkv
    scale = 1.0 / math.sqrt(d)
    qg = q.float().view(b, hkv, g, tq, d)  # query head i uses KV head i // G
    out = torch.empty(b, hkv, g, tq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hkv, g, tq, dtype=torch.float32, device=q.device)
    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        qb = (qg[:, :, :, i0:i1] * scale).reshape(b, hkv, g * (i1 - i0), d)  # read Q block once
        q_pos = seq_len - tq + torch.arange(i0, i1, device=q.device).repeat(g)  # [G * bq]
        # causal: keys past the block's last query are never visible, so never read
        end = min(seq_len, seq_len - tq + i1) if causal else seq_len
        m = torch.full((b, hkv, g * (i1 - i0)), float("-inf"), device=q.device)
        total = torch.zeros(b, hkv, g * (i1 - i0), device=q.device)
        acc = torch.zeros(b, hkv, g * (i1 - i0), d, device=q.device)
        for j0 in range(0, end, block_k):
            j1 = min(j0 + block_k, end)
            kt = k[:, :, j0:j1].float()  # [B, Hkv, bk, D]: read K tile
            scores = qb @ kt.transpose(-1, -2)  # [B, Hkv, G*bq, bk]: stays in the tile
            if causal and j1 - 1 > seq_len - tq + i0:  # the tile crosses the diagonal
                k_pos = torch.arange(j0, j1, device=q.device)
                scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            m, total, acc = online_softmax_update(m, total, acc, scores,
                                                  v[:, :, j0:j1].float())
        o, s = _finish(m, total, acc)
        out[:, :, :, i0:i1] = o.view(b, hkv, g, i1 - i0, d)  # write O block once
        lse[:, :, :, i0:i1] = s.view(b, hkv, g, i1 - i0)
    return out.view(b, h, tq, d).to(q.dtype), lse.view(b, h, tq)


def merge_partials(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attentions of the same queries over disjoint key sets: (out, lse) each,
    out [..., D] and lse [...]; returns the attention over the union, as (out, lse)."""
    (o1, lse1), (o2, lse2) = a, b
    lse = torch.logaddexp(lse1, lse2)  # log(sum over both key sets of exp(score))
    ref = torch.where(lse == float("-inf"), 0.0, lse)  # both sets empty: weights 0, not NaN
    w1 = torch.exp(lse1 - ref)[..., None]  # the share of the softmax mass in the first set
    w2 = torch.exp(lse2 - ref)[..., None]
    return w1 * o1.float() + w2 * o2.float(), lse


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_splits: int = 4,
                 block_k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding (split-K): the context in `num_splits` chunks attended independently
    (on a GPU, in parallel), then merged by their log-sum-exps: (out, lse) as flash_attention.

    q: [B, H, Tq, D] queries that see the whole context (decode); k, v: [B, Hkv, L, D].
    """
    seq_len = k.shape[2]
    chunk = -(-seq_len // max(1, num_splits))
    parts = [flash_attention(q, k[:, :, s:s + chunk], v[:, :, s:s + chunk], causal=False,
                             block_k=block_k, block_q=q.shape[2])
             for s in range(0, seq_len, chunk)]  # each chunk: its own (out, lse)
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_partials((out, lse), part)
    return out.to(q.dtype), lse


@dataclass
class FlashMeta(AttentionMeta):
    """AttentionMeta without the [B, L] context slots or the [B, Tq, L] mask: FlashAttention
    walks the block tables itself, a tile at a time."""

    _: KW_ONLY  # after the base's defaulted fields: these are passed by name
    block_tables: torch.Tensor  # [B, nb] page ids of each sequence, in order
    block_size: int
    starts: torch.Tensor  # [B] tokens cached before this step
    max_ctx: int  # the longest context: how far the tile loop walks

    @staticmethod
    def build(query_lens: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor,
              block_size: int, max_q: int | None = None, max_ctx: int | None = None, *,
              host_query_lens: Sequence[int] | None = None,
              host_starts: Sequence[int] | None = None) -> FlashMeta:
        """Same arguments as AttentionMeta.build; only O(T) index tensors."""
        q = _Queries.layout(query_lens, starts, block_tables.device, max_q, max_ctx,
                            host_query_lens, "FlashMeta")
        kernels = cpu_kernels.usable_for_indices(block_tables) if q.decode else None
        if kernels is not None:  # the same slots in one call of labkit's
            write_slots = kernels.paged_decode_slots(starts, block_tables, block_size, 0)[0]
        else:
            page = block_tables.gather(1, (q.pos // block_size).clamp(
                max=block_tables.shape[1] - 1))
            write_slots = q.packed(page * block_size + q.pos % block_size)  # [B, Tq] -> [T]
        return FlashMeta(write_slots, q.packed(q.pos), None, q.ctx_lens, query_lens,
                         q.index, q.unpad_index, None, q.last_rows, q.host_query_lens,
                         q.host_ctx_lens(host_starts), block_tables=block_tables,
                         block_size=block_size, starts=starts, max_ctx=q.max_ctx)


class FlashAttention(AttentionBackend):
    """Reads the KV pool a tile (`tile_tokens`, whole pages when they fit) at a time through
    the block tables, with online softmax; decode merges per-tile partials (split-K).

    On the CPU (fp32), labkit's C++ kernel (`labkit/kernels/flash_attention.cpp`) runs this
    loop, writing k and v in the same call; `reference` is the same loop in PyTorch, the one to
    read, and what runs with `cpu_kernel=False`, without a compiler or under a torch mode. On
    CUDA with triton importable, the fused kernel in labkit.kernels.attention_triton runs.
    """

    meta_type = FlashMeta

    def __init__(self, store: KVStore, tile_tokens: int = 256, cpu_kernel: bool = True):
        super().__init__(store, cpu_kernel)  # False: always the Python tiles (to compare)
        self.tile_tokens = tile_tokens

    def _tile(self, block_size: int) -> int:
        """Keys per tile: whole pages; a slice of one when a page is larger (the contiguous
        cache's one page per row)."""
        if block_size <= self.tile_tokens:
            return self.tile_tokens // block_size * block_size
        return self.tile_tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        kernel = self._in_place(q)
        if kernel is None:
            return super().attend(layer, q, k, v)
        m = self.meta
        assert m is not None, "begin_step(meta) must come before the forward"
        # one call a layer: write k and v at their slots, then the tiles of every token
        return kernel.flash_attention(q, k, v, m.write_slots, self.store.k_layers[layer],
                                      self.store.v_layers[layer], m.block_tables,
                                      m.block_size, self._tile(m.block_size), m.q_index,
                                      m.query_lens, m.positions, 1.0 / math.sqrt(q.shape[-1]))

    def stack_args(self, x: torch.Tensor) -> tuple | None:
        if self._in_place(x) is None:
            return None
        m = self.meta
        return (1, m.write_slots, self.store.k_layers, self.store.v_layers, _NO_TENSOR,
                m.block_tables, m.block_size, self._tile(m.block_size), m.q_index,
                m.query_lens, m.positions)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        m = self.meta
        if attention_triton.supported(q):
            return attention_triton.paged_flash_forward(
                q, self.store.k[layer], self.store.v[layer], m.q_index, m.starts, m.query_lens,
                m.block_tables, m.block_size)
        return self.reference(layer, q)

    def reference(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The tile loop in PyTorch: q [T, H, D] over the cached context of `layer` (k and v of
        this step already written): [T, H, D]. The C++ kernel computes the same, per token."""
        m = self.meta
        b, tq = m.q_index.shape
        t, h, d = q.shape
        hkv = self.store.k.shape[2]
        g = h // hkv
        bs = m.block_size
        tile = self._tile(bs)
        qp = q[m.q_index].float() / math.sqrt(d)  # [B, Tq, H, D]
        qg = qp.view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
        q_pos = (m.starts[:, None] + torch.arange(tq, device=q.device).repeat(g)[None, :])
        last_col = m.block_tables.shape[1] - 1
        rows = g * tq
        state = None  # (m, l, acc) for prefill; (out, lse) for decode
        for p0 in range(0, m.max_ctx, tile):
            pos = torch.arange(p0, min(p0 + tile, m.max_ctx), device=q.device)  # [Tk]
            pages = m.block_tables[:, (pos // bs).clamp(max=last_col)]  # [B, Tk]
            slots = pages * bs + pos % bs
            kt = self.store.k[layer][slots].float().transpose(1, 2)  # [B, Hkv, Tk, D]
            vt = self.store.v[layer][slots].float().transpose(1, 2)
            scores = qg @ kt.transpose(-1, -2)  # [B, Hkv, G*Tq, Tk]
            hidden = pos[None, None, :] > q_pos[:, :, None]  # [B, G*Tq, Tk]: causal, ragged
            scores = scores.masked_fill(hidden[:, None], float("-inf"))
            if tq == 1:  # decode: this tile's own partial, merged by log-sum-exp (split-K)
                z = (torch.full((b, hkv, rows), float("-inf"), device=q.device),
                     torch.zeros(b, hkv, rows, device=q.device),
                     torch.zeros(b, hkv, rows, d, device=q.device))
                part = _finish(*online_softmax_update(*z, scores, vt))
                state = part if state is None else merge_partials(state, part)
            else:
                if state is None:
                    state = (torch.full((b, hkv, rows), float("-inf"), device=q.device),
                             torch.zeros(b, hkv, rows, device=q.device),
                             torch.zeros(b, hkv, rows, d, device=q.device))
                state = online_softmax_update(*state, scores, vt)
        out = state[0] if tq == 1 else _finish(*state)[0]  # [B, Hkv, G*Tq, D]
        out = out.view(b, hkv, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b * tq, h, d)
        return out[m.unpad_index].to(q.dtype)  # [T, H, D]


BACKENDS["flash"] = FlashAttention

"""FlashAttention's forward as one Triton kernel over the paged KV pool (prefill and decode).

One program per (sequence, block of BLOCK_M of its new queries, query head). It loads its query
block once, then walks the sequence's context BLOCK_N keys at a time, finding each key's page
through the block table, and keeps the running max, sum and output in registers: the scores
never leave the chip. Traffic per program: its Q block, the K and V tiles up to the causal
limit, its O block; nothing of size L^2.

Used by `labkit.attention.FlashAttention` when CUDA and triton are importable; without them
`HAVE_TRITON` is False and this module defines nothing else to call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = torch.cuda.is_available()
except ImportError:  # CPU machines: the PyTorch tile loop in labkit.attention runs instead
    triton = tl = None
    HAVE_TRITON = False


def supported(q: torch.Tensor) -> bool:
    """Whether the kernel takes this query: CUDA, triton, a power-of-two head dim >= 16."""
    d = q.shape[-1]
    return HAVE_TRITON and q.is_cuda and d >= 16 and d & (d - 1) == 0


if HAVE_TRITON:
    @triton.jit
    def _paged_flash_fwd(Q, K, V, O, QIDX, STARTS, QLENS, TABLES,  # noqa: E741 (O: output)
                         stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                         stride_tb, max_q, n_qblocks, scale,
                         G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        b = pid // n_qblocks
        i0 = (pid % n_qblocks) * BLOCK_M
        qlen = tl.load(QLENS + b)
        if i0 < qlen:
            start = tl.load(STARTS + b)
            offs_m = i0 + tl.arange(0, BLOCK_M)
            m_valid = offs_m < qlen
            offs_d = tl.arange(0, D)
            tok = tl.load(QIDX + b * max_q + offs_m, mask=m_valid, other=0)  # packed rows
            kvh = h // G  # grouped-query: this head's KV head, read in place
            q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_valid[:, None], other=0.0)  # read Q block: BLOCK_M * D
            q_pos = start + offs_m  # position of each query in its sequence
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            end = tl.minimum(start + qlen, start + i0 + BLOCK_M)  # causal limit of the block
            for n0 in range(0, end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_valid = offs_n < end
                page = tl.load(TABLES + b * stride_tb + offs_n // PAGE, mask=n_valid, other=0)
                slot = page * PAGE + offs_n % PAGE
                kv_off = slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
                k = tl.load(K + kv_off, mask=n_valid[:, None], other=0.0)  # read BLOCK_N * D
                v = tl.load(V + kv_off, mask=n_valid[:, None], other=0.0)  # read BLOCK_N * D
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # on chip only
                s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :], s,
                             float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_ref)
                p = tl.exp(s - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=m_valid[:, None])  # write O block


def paged_flash_forward(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                        q_index: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
                        block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Causal attention of packed queries q [T, H, D] over the paged pool: [T, H, D].

    k_slots, v_slots: one layer's pool as flat slots [num_slots, Hkv, D]; q_index [B, Tq]:
    packed row of each sequence's j-th new query; starts, query_lens [B]; block_tables [B, nb].
    """
    if not supported(q):
        raise RuntimeError("paged_flash_forward needs CUDA, triton and a power-of-two head dim")
    t, h, d = q.shape
    b, max_q = q_index.shape
    q, k_slots, v_slots = q.contiguous(), k_slots.contiguous(), v_slots.contiguous()
    q_index, tables = q_index.contiguous(), block_tables.contiguous()
    out = torch.empty_like(q)
    block_m = 16 if max_q <= 16 else 64  # decode: one real row; tl.dot needs 16
    n_qblocks = triton.cdiv(max_q, block_m)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact (no tf32)
    _paged_flash_fwd[(b * n_qblocks, h)](
        q, k_slots, v_slots, out, q_index, starts.contiguous(), query_lens.contiguous(), tables,
        q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), out.stride(0),
        out.stride(1), tables.stride(0), max_q, n_qblocks, d ** -0.5,
        G=h // k_slots.shape[1], PAGE=block_size, D=d, BLOCK_M=block_m, BLOCK_N=64, PREC=prec)
    return out

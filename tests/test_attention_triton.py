"""The Triton paged FlashAttention kernel against torch's scaled_dot_product_attention (CUDA)."""

import pytest
import torch
from torch.nn import functional as F

from labkit.kernels import attention_triton

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("starts,qlens", [([0, 0], [70, 5]), ([100, 33, 0], [1, 1, 1]),
                                          ([9, 200], [40, 1])])
def test_paged_kernel_matches_sdpa(dtype, tol, starts, qlens):
    if not attention_triton.HAVE_TRITON:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(sum(starts) + sum(qlens))
    dev = "cuda"
    h, hkv, d, bs = 6, 2, 64, 16
    ctx = [s + q for s, q in zip(starts, qlens)]
    need = [-(-c // bs) for c in ctx]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered pages
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
    k_pool = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(dev, dtype)
    v_pool = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(dev, dtype)
    q = torch.randn(sum(qlens), h, d, generator=gen).to(dev, dtype)
    max_q = max(qlens)
    first = [sum(qlens[:b]) for b in range(len(qlens))]
    q_index = torch.tensor([[f + min(j, n - 1) for j in range(max_q)]
                            for f, n in zip(first, qlens)], device=dev)
    out = attention_triton.paged_flash_forward(
        q, k_pool, v_pool, q_index, torch.tensor(starts, device=dev),
        torch.tensor(qlens, device=dev), block_tables, bs)
    for b, (s, n) in enumerate(zip(starts, qlens)):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(ctx[b])],
                             device=dev)
        k = k_pool[slots].transpose(0, 1)[None].float()  # [1, Hkv, L, D]
        v = v_pool[slots].transpose(0, 1)[None].float()
        qb = q[first[b]:first[b] + n].transpose(0, 1)[None].float()  # [1, H, n, D]
        # query j sits at position s + j: a bottom-right causal mask
        mask = torch.arange(ctx[b], device=dev)[None, :] <= s + torch.arange(n, device=dev)[:, None]
        want = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
        got = out[first[b]:first[b] + n].transpose(0, 1)[None].float()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_engine_flash_backend_on_cuda_matches_paged():
    from labkit.decoders import run
    from labkit.engine import Engine
    from labkit.model import LlamaModel, ModelConfig, init_random
    from labkit.sampling import SamplingParams

    model = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=3)
    outs = {}
    for attention in ("paged", "flash"):
        engine = Engine(model, None, kv_tokens=1024, block_size=16, max_seqs=4, device="cuda",
                        attention=attention)
        ids = [engine.submit(list(range(3, 3 + n)), SamplingParams(max_new_tokens=8,
                                                                   ignore_eos=True))
               for n in (5, 40, 17)]
        run(engine, "pipelined")
        outs[attention] = [engine.seqs[r].output_ids for r in ids]
        engine.close()
    assert outs["flash"] == outs["paged"]

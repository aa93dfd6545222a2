"""Chapter 01's graders: a matmul's arithmetic intensity, a decode step's FLOPs and bytes."""

from __future__ import annotations

from collections.abc import Callable

from labkit.graders.common import diagnose
from labkit.model import ModelConfig


def grade_matmul_intensity(fn: Callable) -> str:
    """Grade an answer to exercise `matmul_intensity` (exercises/ch01_roofline.py)."""
    shapes = [(1, 4096, 4096, 2), (256, 4096, 4096, 2), (64, 128, 256, 4), (512, 512, 512, 1)]
    cases = []
    for m, n, k, b in shapes:
        got = float(fn(m, n, k, b))
        # the reference: 2 FLOPs per multiply-add, over A, B and C each moved once, in bytes
        flops, elems = 2 * m * n * k, m * k + k * n + m * n
        want = flops / (elems * b)
        cases.append((f"({m}, {n}, {k}, {b})", got, want, {
            "Forgot the 2 in 2MNK: a multiply-add is two FLOPs.": want / 2,
            "Forgot bytes per element: divide by bytes moved, not elements.": flops / elems,
            "Counted the reads of A and B but not the write of C (M*N elements).":
                flops / ((m * k + k * n) * b),
            "Counted only the weights B (K*N); A and C are moved too.": flops / (k * n * b),
            "That is bytes per FLOP: intensity is FLOPs / bytes.": elems * b / flops,
            "Integer division (// or int()) rounds the intensity down: keep the fraction, "
            "use /.": float(flops // (elems * b)),
        }))
    diagnose("matmul_intensity", cases)
    return f"exact on {len(shapes)} shapes, from a matvec (I ~ 1) to square matmuls"


def _ref_decode_counts(cfg: ModelConfig, batch: int, context_len: int) -> dict[str, float]:
    """Hand counts of one decode step's FLOPs, term by term."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = d * q + d * kv + d * kv + q * d + 3 * d * f  # q, k, v, o; gate, up, down
    return {"layers": 2 * batch * n * layer_weights, "head": 2 * batch * d * v,
            "attention": 4 * batch * n * q * context_len,  # q.k + p.v, every query head
            # what two known mistakes count instead of the layers' weights
            "layers_no_gqa": 2 * batch * n * (4 * d * q + 3 * d * f),
            "layers_two_mlp": 2 * batch * n * (2 * d * q + 2 * d * kv + 2 * d * f)}


def grade_decode_step_flops(fn: Callable) -> str:
    """Grade an answer to exercise `decode_step_flops` (exercises/ch01_roofline.py)."""
    cases = []
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx in ((1, 1), (4, 100), (16, 2048)):
            got = float(fn(cfg, batch, ctx))
            t = _ref_decode_counts(cfg, batch, ctx)
            want = t["layers"] + t["head"] + t["attention"]
            matmuls = t["layers"] + t["head"]
            cases.append((f"({cfg.name}, batch={batch}, context_len={ctx})", got, want, {
                "Forgot the 2 per weight: a multiply-add is two FLOPs.": want / 2,
                "Forgot the 2 per weight in the matmuls (attention is right).":
                    matmuls / 2 + t["attention"],
                "Counted the matmuls but not attention over the context.": matmuls,
                "Forgot the output head (hidden_size x vocab_size per token).":
                    t["layers"] + t["attention"],
                "Counted the head twice: the embedding is a lookup, not a matmul (tied or not).":
                    want + t["head"],
                "GQA: the k and v projections are hidden_size x num_kv_heads*head_dim, not "
                "num_heads*head_dim.": t["layers_no_gqa"] + t["head"] + t["attention"],
                "The MLP is SwiGLU: three matrices (gate, up, down), not two.":
                    t["layers_two_mlp"] + t["head"] + t["attention"],
                "Attention: every query head (num_heads), not only the KV heads, does the "
                "work.": matmuls + t["attention"] * cfg.num_kv_heads / cfg.num_heads,
                "Attention has two halves: q.k over the keys and p.v over the values.":
                    matmuls + t["attention"] / 2,
                "2 x num_params() counts the norm weights, which do no matmul; count the "
                "projection, MLP and head weights.": 2 * batch * cfg.num_params() + t["attention"],
                "Counted one sequence: every term scales with the batch.": want / batch,
            }))
    diagnose("decode_step_flops", cases)
    return "exact for tiny and SmolLM2-135M at 3 batch sizes and contexts"


def grade_decode_step_bytes(fn: Callable) -> str:
    """Grade an answer to exercise `decode_step_bytes` (exercises/ch01_roofline.py)."""
    cases = []
    for cfg in (ModelConfig.tiny(), ModelConfig.smollm2_135m()):
        for batch, ctx, wb, kvb in ((1, 1, 2, 2), (8, 1000, 2, 2), (32, 512, 0.5, 1),
                                    (5, 300, 4, 2), (3, 77, 4, 4)):
            got = float(fn(cfg, batch, ctx, wb, kvb))
            # the reference: weights once; each sequence reads ctx tokens of K and V and
            # writes one; a token's K and V hold 2 * layers * kv_heads * head_dim values
            weights = cfg.num_params() * wb
            per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kvb
            kv_read, kv_write = batch * ctx * per_token, batch * per_token
            want = weights + kv_read + kv_write
            kv = kv_read + kv_write
            cases.append((f"({cfg.name}, batch={batch}, context_len={ctx}, weight_bytes={wb}, "
                          f"kv_bytes={kvb})", got, want, {
                "Counted the weights but not the KV cache: each sequence reads the K and V of "
                "its whole context.": weights,
                "Forgot to write the new token's K and V.": weights + kv_read,
                "Weights are read once per step, not once per sequence: that sharing is what "
                "batching buys.": batch * weights + kv,
                "Forgot bytes per element: multiply element counts by weight_bytes / kv_bytes.":
                    weights / wb + kv / kvb,
                "Counted K but not V (or V but not K): the cache holds both.": weights + kv / 2,
                "Sized the KV cache in weight_bytes: K and V are stored in kv_bytes per value.":
                    weights + kv * wb / kvb,
                "The cache holds a K and a V in every layer: multiply by num_layers.":
                    weights + kv / cfg.num_layers,
                "GQA: the cache holds num_kv_heads heads per layer, not num_heads.":
                    weights + kv * cfg.num_heads / cfg.num_kv_heads,
                "Counted the embedding and the head apart: these configs tie them, and "
                "num_params() already counts the shared matrix once.":
                    weights + cfg.hidden_size * cfg.vocab_size * wb + kv,
            }))
    diagnose("decode_step_bytes", cases)
    return "exact for tiny and SmolLM2-135M, bf16 to int4 weights, fp32 to fp8 KV"

"""A Llama-family decoder, written to be read.

One `ModelConfig` describes the architecture (RMSNorm, rotary position embeddings, grouped-query
attention, a SwiGLU MLP, a tied or untied output head, optional q/k/v bias as in Qwen2). The
model runs a *packed ragged batch*: the new tokens of every sequence are laid end to end in one
flat tensor, each with its own explicit position, exactly as serving engines do. Attention is
delegated to a backend object (`labkit.attention`) which owns the KV cache; the model itself
knows nothing about scheduling, pages or sampling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from labkit.kernels import cpu as cpu_kernels
from labkit.kernels import stack as decoder_stack


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder; validates itself."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 2048  # the context length the model was trained for
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count, term by term (what a decode step must read from memory)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = d * self.num_heads * self.head_dim
        kv = 2 * d * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * d
        bias = ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim
                if self.attention_bias else 0)
        mlp = 3 * d * f  # gate, up, down
        norms = 2 * d
        per_layer = q + kv + o + bias + mlp + norms
        emb = v * d if include_embedding else 0
        head = 0 if self.tie_embeddings else v * d
        return self.num_layers * per_layer + d + emb + head

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        """KV cache bytes one token occupies: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (the presets are frozen)."""
        return replace(self, **changes)

    @staticmethod
    def smollm2_135m() -> ModelConfig:
        """SmolLM2-135M(-Instruct): the course's default model, 30 layers, GQA 9 heads / 3 KV."""
        return ModelConfig(
            name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position=8192,
            rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True)

    @staticmethod
    def tiny(vocab_size: int = 512) -> ModelConfig:
        """A random tiny model for unit tests: 2 layers, GQA 4 heads / 2 KV."""
        return ModelConfig(
            name="tiny", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=1024,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=True)


PRESETS = {"smollm2-135m": ModelConfig.smollm2_135m, "tiny": ModelConfig.tiny}


class Attention(Protocol):
    """What the model needs from an attention backend (see labkit.attention)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Store k, v for the new tokens, attend q over each sequence's context; [T, H, D]."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in fp32.

    On the CPU in fp32, labkit's C++ kernel (labkit.kernels.cpu) does it in one call: the
    torch ops below are nine dispatches (two of them casting the Python scalars), ~44 us a
    call at batch 1, 61 calls a step."""
    # x: [..., d]; weight: [d]
    kernels = cpu_kernels.usable(x)
    if kernels is not None and weight.dtype == torch.float32 and x.is_contiguous():
        return kernels.rms_norm(x, weight, eps)
    # (every op here is dispatched from Python, a few microseconds each whatever its size, 61
    # times a step: the casts are skipped when x is already fp32, the add is in place)
    x32 = x if x.dtype == torch.float32 else x.float()
    # (sum, then divide: what mean() does inside, without its own dispatch)
    inv_rms = torch.rsqrt((x32 * x32).sum(dim=-1, keepdim=True).div_(x.shape[-1]).add_(eps))
    y = x32 * inv_rms  # a new tensor: scaling it in place is safe
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y.mul_(weight) if y.dtype == weight.dtype else y * weight


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of the rotary angles for each position: two [T, 1, head_dim] tensors
    (the 1 broadcasts over heads). The sin's first half is negated: see `apply_rope`.

    On a CPU the rows come from a table of every position so far (`_rope_rows`), computed by
    the same formula: a decode step then indexes two rows instead of running ~10 small ops
    (~0.15 ms of a 7 ms SmolLM2 int4 step at batch 1, run on caches the weights just swept),
    and a position's angles never depend on how many tokens share its step. (Where the whole
    forward is one C++ call, that call copies the rows from the table itself: `rope_table`.)"""
    if positions.device.type == "cpu" and positions.dim() == 1:
        return _rope_rows(head_dim, theta, positions)
    return _rope_formula(head_dim, theta, positions)


def _rope_formula(head_dim: int, theta: float, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables computed from the positions: the formula itself."""
    # frequency i rotates the pair (i, i + head_dim/2) by position * theta^(-2i/head_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                              device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    sin = angles.sin()
    cos = torch.cat([angles.cos()] * 2, dim=-1)  # [T, D]: the "rotate half" layout
    return cos[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]


_ROPE_ROWS: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}
_ROPE_CHUNK = 512  # positions per formula call while a table is built


def _rope_rows(head_dim: int, theta: float, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables' rows for CPU positions, from `rope_table`, grown where a position is past
    its end."""
    table = rope_table(head_dim, theta)
    try:  # (no max() of the positions first: that would cost a decode step as much again)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)
    except IndexError:  # a position past the table's end, or a negative one
        table = rope_table(head_dim, theta, positions)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


def rope_table(head_dim: int, theta: float, positions: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU table `rope_tables` takes its rows from: cos and signed sin [N, 1, head_dim] of
    positions 0 .. N-1, N at least 2 * _ROPE_CHUNK, doubled until it holds every one of
    `positions` (a negative one: ValueError). labkit's C++ decoder stack copies a step's rows
    from it. It is built `_ROPE_CHUNK` positions per formula call: each call is small enough to
    run on one thread in whole vectors, so every value is the formula's value for that
    position, whatever the thread count."""
    key = (head_dim, float(theta))
    table = _ROPE_ROWS.get(key)
    need = 1
    if positions is not None and positions.numel():
        if int(positions.min()) < 0:
            raise ValueError(f"rope_tables: negative position {int(positions.min())}")
        need = int(positions.max()) + 1
    if table is None or table[0].shape[0] < need:
        n = max(2 * _ROPE_CHUNK, 1 << (need - 1).bit_length())
        parts = [_rope_formula(head_dim, theta, torch.arange(p, min(p + _ROPE_CHUNK, n)))
                 for p in range(0, n, _ROPE_CHUNK)]
        table = _ROPE_ROWS[key] = (torch.cat([c for c, _ in parts]),
                                   torch.cat([s for _, s in parts]))
    return table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's pairs (i, i + D/2) by the position's angle.

    For i < D/2: x_i cos - x_{i+D/2} sin; for i >= D/2: x_i cos + x_{i-D/2} sin. Rolling x by
    D/2 puts each pair's partner in place, and the signed sin table (first half negated, from
    `rope_tables`) carries the minus: three ops per call, built once per step.
    """
    # x: [T, H, D]; cos, sin: [T, 1, D]
    kernels = cpu_kernels.usable(x)
    if kernels is not None and x.dim() == 3 and x.stride(-1) == 1 and cos.is_contiguous():
        return kernels.rope(x, cos, sin)  # the same formula, one call (labkit.kernels.cpu)
    x32 = x if x.dtype == torch.float32 else x.float()
    out = torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, [T, F] each (one call of labkit's kernel on the CPU)."""
    kernels = cpu_kernels.usable(gate)
    if kernels is not None and gate.dim() == 2 and gate.stride(-1) == up.stride(-1) == 1:
        return kernels.silu_mul(gate, up)
    return F.silu(gate).mul_(up)


def linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x) [T, N] for x [T, K]. An fp32 `nn.Linear` on a step of a few rows (decode, a
    speculative verify, a step of a small token budget) runs labkit's kernel on the CPU: it
    reads each weight once for all the rows, where a BLAS made for large products reads them
    more than once, and its result for a row does not depend on how many rows share the step.
    Any other linear (a quantized one, a large step, a GPU), or one with hooks on it
    (labkit.awq's calibration), is called as it is."""
    if type(lin) is nn.Linear and not (lin._forward_hooks or lin._forward_pre_hooks):
        y = few_rows_fp32(x, lin.weight)
        if y is not None:
            return y if lin.bias is None else y + lin.bias
    return lin(x)


def few_rows_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T by labkit's fp32 kernel where it serves (a CPU step of at most
    `_FP32_KERNEL_ROWS` rows, fp32 weights), else None. decoder_stack.cpp decides the same way."""
    if x.shape[0] > _FP32_KERNEL_ROWS or weight.dtype != torch.float32 or \
            not weight.is_contiguous():
        return None
    kernels = cpu_kernels.usable(x)
    return None if kernels is None else kernels.fp32_linear(x.contiguous(), weight)


_FP32_KERNEL_ROWS = 32  # = kFp32KernelRows in labkit/kernels/kernels.h (tests check they agree)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU block, both residual."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.layer = cfg, layer
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.post_attn_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        # set by fuse_projections: q|k|v as one linear, gate|up as another (fewer, larger calls)
        self.qkv_proj: nn.Module | None = None
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        """Replace q, k, v by one `qkv_proj` and gate, up by one `gate_up_proj`, in place.

        Same outputs (the rows of one matmul are the rows of the three), 7 -> 4 linear calls a
        layer: at batch 1 each call is mostly fixed dispatch cost, not arithmetic. A linear that
        is not an nn.Linear (a labkit.quant.QuantLinear) fuses through its class's `concat`.
        """
        if self.qkv_proj is not None:
            return
        self.set_fused(concat_linears([self.q_proj, self.k_proj, self.v_proj]),
                       concat_linears([self.gate_proj, self.up_proj]))

    def set_fused(self, qkv_proj: nn.Module, gate_up_proj: nn.Module) -> None:
        """Install fused q|k|v and gate|up linears (built elsewhere: fuse_projections, or a
        quantized load from codes) in place of the five separate ones."""
        self.qkv_proj, self.gate_up_proj = qkv_proj, gate_up_proj
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            delattr(self, name)  # the fused linears replace them: no weight is held twice

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: Attention) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        # x: [T, d]
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        if self.qkv_proj is not None:  # fused: one call, and one RoPE for q and k together
            qkv = linear(self.qkv_proj, h).view(t, cfg.num_heads + 2 * cfg.num_kv_heads,
                                                cfg.head_dim)
            qk = apply_rope(qkv[:, :cfg.num_heads + cfg.num_kv_heads], cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]  # [T, H, D], [T, Hkv, D]
            v = qkv[:, cfg.num_heads + cfg.num_kv_heads:]  # v: [T, Hkv, D]
        else:
            q = linear(self.q_proj, h).view(t, cfg.num_heads, cfg.head_dim)  # q: [T, H, D]
            k = linear(self.k_proj, h).view(t, cfg.num_kv_heads, cfg.head_dim)  # k: [T, Hkv, D]
            v = linear(self.v_proj, h).view(t, cfg.num_kv_heads, cfg.head_dim)  # v: [T, Hkv, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn.attend(self.layer, q, k, v)  # o: [T, H, D]
        x = x + linear(self.o_proj, o.reshape(t, cfg.num_heads * cfg.head_dim))  # a new x
        h = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        if self.gate_up_proj is not None:
            gate_up = linear(self.gate_up_proj, h)  # [T, 2F]: two slices, cheaper than chunk()
            gate, up = gate_up[:, :cfg.intermediate_size], gate_up[:, cfg.intermediate_size:]
        else:
            gate, up = linear(self.gate_proj, h), linear(self.up_proj, h)
        return x.add_(linear(self.down_proj, silu_mul(gate, up)))


def concat_linears(linears: list[nn.Module]) -> nn.Module:
    """One linear whose output rows are those of `linears` in order (all read the same input)."""
    if any(type(lin) is not nn.Linear for lin in linears):
        return type(linears[0]).concat(linears)  # e.g. QuantLinear.concat: codes stay packed
    has_bias = linears[0].bias is not None
    fused = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears),
                      bias=has_bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]),
                                requires_grad=False)  # [sum N, K]
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]),
                                  requires_grad=False)
    return fused


class LlamaModel(nn.Module):
    """The decoder stack: embed, N layers, final norm, output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)

    def fuse_projections(self) -> LlamaModel:
        """Fuse every layer's q/k/v and gate/up projections (DecoderLayer.fuse_projections)."""
        for layer in self.layers:
            layer.fuse_projections()
        return self

    @property
    def head_weight(self) -> torch.Tensor:
        """The [V, d] output projection (the embedding itself when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the packed tokens (only `logit_rows` of them, if given): [R, V]."""
        # input_ids, positions: [T]; logit_rows: [R] indices into T (usually each sequence's
        # last token: the others' logits are never sampled, and the head is the largest matmul)
        whole = decoder_stack.for_logits(self, attn)  # all of it in one C++ call, where
        if whole is not None:  # labkit's kernels serve: the same ops as below, bit for bit
            return self._whole(whole, input_ids, positions, logit_rows)
        x = self.hidden(input_ids, positions, attn, normed=False)
        if logit_rows is not None:
            x = x[logit_rows]
        return self.head(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps))

    def _whole(self, whole: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
               logit_rows: torch.Tensor | None) -> torch.Tensor:
        """The forward as one C++ call (`whole`, from decoder_stack.for_logits), given RoPE's
        table: the call copies the step's rows from it. A position past the table's end is an
        IndexError raised before anything ran: the table grows and the call runs again."""
        head_dim, theta = self.cfg.head_dim, self.cfg.rope_theta
        table = rope_table(head_dim, theta)
        try:
            return whole(input_ids, *table, positions, logit_rows)
        except IndexError:
            grown = rope_table(head_dim, theta, positions)  # (a negative position: ValueError)
            if grown[0].shape[0] == table[0].shape[0]:
                raise  # not the table's (a logit row out of range)
            return whole(input_ids, *grown, positions, logit_rows)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
               normed: bool = True) -> torch.Tensor:
        """The last layer's hidden states [T, d] (final-normed unless `normed=False`): what
        `head` turns into logits, for a caller that wants them a few rows at a time (a whole
        window's logits are T x vocab floats: 50 MB for 256 of SmolLM2's tokens)."""
        x = self.embed(input_ids)  # x: [T, d]
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, positions)
        layers = decoder_stack.for_step(self, x, attn)  # every layer in one C++ call, where
        if layers is not None:  # labkit's kernels serve: the same ops as below, bit for bit
            x = layers(x, cos, sin)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, attn)
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps) if normed else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of final-normed hidden states x [R, d]."""
        if self.lm_head is not None:  # untied, or a quantized head (labkit.quant)
            return linear(self.lm_head, x)
        logits = few_rows_fp32(x, self.embed.weight)  # tied: the embedding is the head
        return logits if logits is not None else x @ self.embed.weight.t()


def init_random(model: LlamaModel, seed: int = 0) -> LlamaModel:
    """Fill a model with small seeded random weights (for tests and the tiny preset)."""
    gen = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(model.cfg.hidden_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model

"""The roofline: the fastest a step can possibly run, from two numbers every chip has.

A chip does at most P FLOP/s and moves at most W bytes/s between its memory and its cores. An
operation that does F FLOPs and moves B bytes needs at least max(F / P, B / W) seconds. Its
arithmetic intensity I = F / B (FLOP per byte) says which of the two walls it hits: below the
ridge point P / W it is memory-bound, above it compute-bound. A decode step of an LLM reads every
weight to do 2 FLOPs per weight per sequence, so at batch 1 (bf16) it does about 1 FLOP per byte,
hundreds of times below a GPU's ridge: decode is memory-bound, and batching, quantization and the
KV cache layout of the later chapters are all ways of doing more work per byte moved.

This module holds the ceilings (datasheet presets), the FLOP and byte counts of single ops and
of a whole model step. Two neighbours above it finish the lesson: `labkit/ceilings.py`
measures this machine's ceilings (and times a real decode step), and
`labkit/instruments/roofline_plot.py` draws the roofline and the interactive explorer;
`python -m labkit roofline` is in `labkit/cli.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

import torch

from labkit.model import ModelConfig

# bytes per element of each number format; int4/fp4 pack two values in a byte. Group-wise int4
# also stores one 16-bit scale per group of g weights (2/g bytes each: 1.6% more at g = 128),
# which the counts below leave out.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5, "fp4": 0.5}
TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}
TERA, GIGA = 1e12, 1e9


def _dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name, with a message that lists the known names."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# ---------------------------------------------------------------------------------------------
# the ceilings of a chip


@dataclass(frozen=True)
class Hardware:
    """A chip's ceilings: dense peak FLOP/s per dtype, memory bandwidth and size, and sources."""

    name: str
    peak_flops: Mapping[str, float]  # FLOP/s by dtype name, dense (no 2:4 structured sparsity)
    bandwidth: float  # bytes/s between device memory and the cores
    memory: float | None  # bytes of device memory (None: unknown)
    flops_source: str
    bandwidth_source: str
    memory_source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        if not self.peak_flops:
            raise ValueError(f"Hardware {self.name!r}: peak_flops is empty")
        for dtype, peak in self.peak_flops.items():
            _dtype_bytes(dtype)
            if not peak > 0:
                raise ValueError(f"Hardware {self.name!r}: peak_flops[{dtype!r}] = {peak}")
        if not self.bandwidth > 0:
            raise ValueError(f"Hardware {self.name!r}: bandwidth must be > 0, got {self.bandwidth}")
        if self.memory is not None and not self.memory > 0:
            raise ValueError(f"Hardware {self.name!r}: memory must be > 0 or None")

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for a dtype."""
        if dtype not in self.peak_flops:
            raise KeyError(f"{self.name} has no {dtype} peak; it has {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def ridge(self, dtype: str = "bf16") -> float:
        """Ridge point in FLOP/byte: the intensity where memory time equals compute time."""
        return self.peak(dtype) / self.bandwidth  # (FLOP/s) / (byte/s)

    def attainable(self, intensity: float, dtype: str = "bf16") -> float:
        """The roof: FLOP/s attainable at an arithmetic intensity (FLOP/byte)."""
        return min(self.peak(dtype), intensity * self.bandwidth)

    def as_dict(self) -> dict:
        """Plain-JSON form (for the on-disk cache of measured ceilings)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "peak_flops": dict(self.peak_flops)}


_HOPPER_NOTE = ("tensor-core figures are printed with 2:4 sparsity; dense = half of them")

# Each number below is the vendor's datasheet figure, per GPU, dense. GB = 1e9 bytes.
_PRESETS = {
    "RTX3090": Hardware(
        name="RTX 3090",
        # 35.6 TFLOPS FP32 (shader); tensor cores: 71 TFLOPS BF16/FP16 with FP32 accumulate
        # (what PyTorch/cuBLAS use; FP16 accumulate would be 142), TF32 35.6, INT8 284 TOPS
        peak_flops={"fp32": 35.6 * TERA, "tf32": 35.6 * TERA, "bf16": 71 * TERA,
                    "fp16": 71 * TERA, "int8": 284 * TERA},
        bandwidth=936 * GIGA,  # 936 GB/s GDDR6X (19.5 Gbps x 384-bit bus / 8)
        memory=24 * GIGA,  # 24 GB GDDR6X
        flops_source="NVIDIA Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090 "
                     "specifications (dense, FP32 accumulate)",
        bandwidth_source="NVIDIA Ampere GA102 GPU Architecture whitepaper: 936 GB/s",
        memory_source="NVIDIA GeForce RTX 3090 specifications: 24 GB GDDR6X"),
    "A100": Hardware(
        name="A100 80GB SXM",
        # FP32 19.5 TFLOPS; TF32 156, BF16 312, FP16 312 TFLOPS, INT8 624 TOPS (dense)
        peak_flops={"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA,
                    "fp16": 312 * TERA, "int8": 624 * TERA},
        bandwidth=2039 * GIGA,  # 2,039 GB/s HBM2e
        memory=80 * GIGA,  # 80 GB HBM2e
        flops_source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense)",
        bandwidth_source="NVIDIA A100 datasheet, A100 80GB SXM: 2,039 GB/s",
        memory_source="NVIDIA A100 datasheet, A100 80GB SXM: 80 GB HBM2e"),
    "H100": Hardware(
        name="H100 SXM",
        # FP32 67 TFLOPS; datasheet TF32 989, BF16/FP16 1,979, FP8 3,958, INT8 3,958 (sparse)
        peak_flops={"fp32": 67 * TERA, "tf32": 989 / 2 * TERA, "bf16": 1979 / 2 * TERA,
                    "fp16": 1979 / 2 * TERA, "fp8": 3958 / 2 * TERA, "int8": 3958 / 2 * TERA},
        bandwidth=3.35 * TERA,  # 3.35 TB/s HBM3
        memory=80 * GIGA,  # 80 GB HBM3
        flops_source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column; " + _HOPPER_NOTE,
        bandwidth_source="NVIDIA H100 datasheet, H100 SXM: 3.35 TB/s",
        memory_source="NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3"),
    "H200": Hardware(
        name="H200 SXM",
        # the same GH100 compute as H100 SXM; only the memory changed
        peak_flops={"fp32": 67 * TERA, "tf32": 989 / 2 * TERA, "bf16": 1979 / 2 * TERA,
                    "fp16": 1979 / 2 * TERA, "fp8": 3958 / 2 * TERA, "int8": 3958 / 2 * TERA},
        bandwidth=4.8 * TERA,  # 4.8 TB/s HBM3e
        memory=141 * GIGA,  # 141 GB HBM3e
        flops_source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column; " + _HOPPER_NOTE,
        bandwidth_source="NVIDIA H200 datasheet, H200 SXM: 4.8 TB/s",
        memory_source="NVIDIA H200 datasheet, H200 SXM: 141 GB HBM3e"),
    "B200": Hardware(
        name="B200 (HGX)",
        # HGX B200 (8 GPUs, 1,000 W each), divided by 8: FP32 600 TFLOPS -> 75; sparse tensor
        # TF32 18 PFLOPS -> 2.25 -> 1.125 dense; BF16/FP16 36 -> 4.5 -> 2.25; FP8 and INT8
        # 72 -> 9 -> 4.5; FP4 144 -> 18 -> 9 PFLOPS dense per GPU
        peak_flops={"fp32": 75 * TERA, "tf32": 1125 * TERA, "bf16": 2250 * TERA,
                    "fp16": 2250 * TERA, "fp8": 4500 * TERA, "int8": 4500 * TERA,
                    "fp4": 9000 * TERA},
        bandwidth=8 * TERA,  # 64 TB/s HBM3e for 8 GPUs: 8 TB/s each
        memory=180 * GIGA,  # 1,440 GB for 8 GPUs: 180 GB each
        flops_source="NVIDIA HGX B200 datasheet, 8-GPU figures / 8; " + _HOPPER_NOTE,
        bandwidth_source="NVIDIA HGX/DGX B200 datasheet: 64 TB/s for 8 GPUs",
        memory_source="NVIDIA DGX B200 datasheet: 1,440 GB for 8 GPUs"),
}

_ALIASES = {
    "3090": "RTX3090", "GEFORCERTX3090": "RTX3090", "A10080GB": "A100", "A100SXM": "A100",
    "A10080GBSXM": "A100", "A100SXM80GB": "A100", "A100SXM4": "A100", "H100SXM": "H100",
    "H100SXM5": "H100", "H200SXM": "H200", "H200SXM5": "H200", "HGXB200": "B200",
    "DGXB200": "B200", "B200SXM": "B200"}


def _hw_key(name: str) -> str:
    """Normalise a hardware name: case, spaces, dashes and underscores do not matter."""
    key = re.sub(r"[\s_\-]", "", name).upper()
    return _ALIASES.get(key, key)


class _HardwareTable(dict):
    """The presets, looked up case-insensitively and through a few aliases ("h200 sxm")."""

    def __getitem__(self, name: str) -> Hardware:
        key = _hw_key(name)
        if not dict.__contains__(self, key):
            raise KeyError(f"unknown hardware {name!r}; presets: {', '.join(self)} "
                           "(this machine's ceilings: labkit.ceilings.resolve_hardware('this'))")
        return dict.__getitem__(self, key)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, _hw_key(name))

    def get(self, name: str, default: Hardware | None = None) -> Hardware | None:
        return self[name] if name in self else default


HARDWARE: dict[str, Hardware] = _HardwareTable(_PRESETS)


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name (a `Hardware` passes through); measured ones: `labkit.ceilings`."""
    if isinstance(name, Hardware):
        return name
    return HARDWARE[name]


# ---------------------------------------------------------------------------------------------
# single operations


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one operation; where it sits on a chip's roofline."""

    name: str
    flops: float
    nbytes: float
    dtype: str  # whose peak bounds its FLOPs

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.nbytes

    def floor_s(self, hw: Hardware) -> float:
        """The least time it can take: max(compute time, memory time)."""
        return max(self.flops / hw.peak(self.dtype), self.nbytes / hw.bandwidth)

    def bound(self, hw: Hardware) -> str:
        """'compute' or 'memory': the wall it hits on this chip."""
        return "compute" if self.flops / hw.peak(self.dtype) >= self.nbytes / hw.bandwidth \
            else "memory"

    def attainable(self, hw: Hardware) -> float:
        """FLOP/s the roof allows at this op's intensity."""
        return hw.attainable(self.intensity, self.dtype)


def _matmul_counts(m: int, n: int, k: int, bytes_per_element: float) -> tuple[float, float]:
    """(FLOPs, bytes) of C[M, N] = A[M, K] @ B[K, N]."""
    flops = 2 * m * n * k  # one multiply and one add for every (m, n, k)
    nbytes = (m * k + k * n + m * n) * bytes_per_element  # read A, read B, write C: each once
    return flops, nbytes  # (once is the ideal; a real kernel re-reads tiles from cache, not DRAM)


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: float) -> float:
    """Arithmetic intensity (FLOP/byte) of an [M, K] @ [K, N] matmul."""
    flops, nbytes = _matmul_counts(m, n, k, bytes_per_element)
    return flops / nbytes


def matmul_cost(m: int, n: int, k: int, dtype: str = "bf16") -> OpCost:
    """FLOPs and bytes of an [M, K] @ [K, N] matmul."""
    flops, nbytes = _matmul_counts(m, n, k, _dtype_bytes(dtype))
    return OpCost(f"matmul {m}x{k}x{n}", flops, nbytes, dtype)


def matvec_cost(n: int, k: int, dtype: str = "bf16") -> OpCost:
    """FLOPs and bytes of a [N, K] @ [K] matrix-vector product (a matmul with M = 1)."""
    flops, nbytes = _matmul_counts(1, n, k, _dtype_bytes(dtype))
    return OpCost(f"matvec {n}x{k}", flops, nbytes, dtype)  # ~2 FLOPs per weight read: I ~ 2/b


def decode_attention_cost(config: ModelConfig, batch: int, context_len: int,
                          kv_dtype: str = "bf16", dtype: str = "bf16") -> OpCost:
    """One layer's attention at decode: each sequence's one query over its context_len keys."""
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    flops = 4 * batch * h * context_len * d  # q.k (2 per element) and p.v (2 per element)
    kv = 2 * batch * hkv * context_len * d * _dtype_bytes(kv_dtype)  # read K and V once: the
    # h / hkv query heads of a GQA group share one KV head, so intensity ~ 2 (h / hkv) / b_kv
    qo = 2 * batch * h * d * _dtype_bytes(dtype)  # read q, write o
    return OpCost(f"attention decode L={context_len}", flops, kv + qo, dtype)


# ---------------------------------------------------------------------------------------------
# a whole model step


def _linear_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one layer's matmuls: q, k, v, o projections and the SwiGLU MLP."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * cfg.num_heads * hd + 2 * d * cfg.num_kv_heads * hd + cfg.num_heads * hd * d
    return attn + 3 * d * cfg.intermediate_size  # gate, up: [d, f]; down: [f, d]


def _weight_elems(cfg: ModelConfig) -> int:
    """Weights a step reads in full: every layer, the norms and the [V, d] output head."""
    # tied: the head *is* the embedding table; untied: the input table is only gathered (T rows,
    # counted with the activations), so it is left out here
    return cfg.num_params(include_embedding=cfg.tie_embeddings)


def _step_flops(cfg: ModelConfig, batch: int, context_len: int, phase: str
                ) -> tuple[float, float, float]:
    """(linear, attention, head) FLOPs of one step; norms, RoPE and softmax are left out."""
    hd_total = cfg.num_heads * cfg.head_dim
    if phase == "decode":
        tokens = batch  # one new token per sequence, attending over context_len keys
        pairs = batch * context_len  # (query, key) pairs per layer
    else:
        tokens = batch * context_len  # the whole prompt; causal: token i sees i + 1 keys
        pairs = batch * context_len * (context_len + 1) // 2
    linear = 2 * tokens * cfg.num_layers * _linear_params_per_layer(cfg)  # 2 FLOPs per weight
    attention = 4 * pairs * hd_total * cfg.num_layers  # q.k and p.v: 2 + 2 FLOPs per element
    head = 2 * batch * cfg.hidden_size * cfg.vocab_size  # only each sequence's last row
    return float(linear), float(attention), float(head)


def decode_step_flops(cfg: ModelConfig, batch: int, context_len: int) -> float:
    """FLOPs of one decode step: linears, attention over context_len and the output head."""
    return sum(_step_flops(cfg, batch, context_len, "decode"))


def decode_step_bytes(cfg: ModelConfig, batch: int, context_len: int, weight_bytes: float,
                      kv_bytes: float) -> float:
    """Bytes one decode step must move: weights once, each sequence's KV, the new KV."""
    weights = _weight_elems(cfg) * weight_bytes  # once per step, whatever the batch
    kv_read = batch * context_len * cfg.kv_bytes_per_token(1) * kv_bytes  # K, V; all layers
    kv_write = batch * cfg.kv_bytes_per_token(1) * kv_bytes  # the new token's K and V
    return weights + kv_read + kv_write


def _activation_elems(cfg: ModelConfig, tokens: int, rows: int) -> int:
    """Activation elements the step's kernels read and write (each matmul: input + output)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = ((d + q) + 2 * (d + kv)  # q, k, v projections: read x, write q / k / v
                 + 2 * q  # attention reads q, writes o (its K/V traffic is counted as KV)
                 + (q + d)  # o projection
                 + 2 * (d + f) + (f + d))  # gate, up: read h, write f each; down
    # + the embedding rows gathered; the head reads `rows` hidden states and writes their logits.
    # Norms, RoPE and residual adds fuse into their neighbours in a good engine: left out.
    return tokens * (cfg.num_layers * per_layer + d) + rows * (d + cfg.vocab_size)


def _compute_dtype(hw: Hardware, weight_dtype: str) -> str:
    """The format the step's matmuls run in, given the weights' format and the chip."""
    # float weights multiply as they are (fp8 and fp4 where the chip has such tensor cores);
    # int8/int4 weights are weight-only: dequantized in the kernel to the chip's fastest
    # 16/32-bit float format (bf16 on a GPU; fp32 on a CPU without bf16 units)
    if weight_dtype in ("fp32", "bf16", "fp16", "fp8", "fp4") and weight_dtype in hw.peak_flops:
        return weight_dtype
    floats = [dt for dt in ("bf16", "fp16", "fp32") if dt in hw.peak_flops]
    if not floats:
        raise KeyError(f"{hw.name} has no bf16, fp16 or fp32 peak to run {weight_dtype} in")
    return max(floats, key=hw.peak)


@dataclass(frozen=True)
class StepCost:
    """FLOPs, bytes and the predicted floor time of one model step on one chip."""

    model: str
    hardware: str
    phase: str  # "decode" or "prefill"
    batch: int  # sequences
    context_len: int  # decode: tokens each sequence attends over; prefill: prompt length
    weight_dtype: str
    kv_dtype: str
    compute_dtype: str
    tokens: int  # tokens processed: batch (decode) or batch * context_len (prefill)
    linear_flops: float
    attention_flops: float
    head_flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    activation_bytes: float
    peak_flops: float  # FLOP/s of the chip in compute_dtype
    bandwidth: float  # bytes/s
    critical_batch: int | None  # smallest decode batch that is compute-bound; None: never

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.head_flops

    @property
    def nbytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + \
            self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte of the whole step."""
        return self.flops / self.nbytes

    @property
    def ridge(self) -> float:
        """The chip's ridge point in the compute dtype (FLOP/byte)."""
        return self.peak_flops / self.bandwidth

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_s(self) -> float:
        return self.nbytes / self.bandwidth

    @property
    def floor_s(self) -> float:
        """The least time the step can take: the slower of its compute and its memory traffic."""
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second at the floor (decode: new tokens; prefill: prompt tokens)."""
        return self.tokens / self.floor_s

    def as_dict(self) -> dict:
        """The JSON record of `python -m labkit roofline --json`."""
        return {"batch": self.batch, "phase": self.phase, "context": self.context_len,
                "flops": self.flops, "bytes": self.nbytes, "intensity": self.intensity,
                "floor_ms": self.floor_s * 1e3, "bound": self.bound, "ridge": self.ridge,
                "tokens_per_s": self.tokens_per_s, "critical_batch": self.critical_batch,
                "hardware": self.hardware, "model": self.model,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
                "compute_dtype": self.compute_dtype}

    def summary(self) -> str:
        """A few lines a learner can read: counts, the bound, the floor, the critical batch."""
        crit = (f"decode at this context turns compute-bound at batch >= {self.critical_batch}"
                if self.critical_batch else "decode at this context never turns compute-bound "
                "(each sequence's own bytes, its KV above all, cost more than its FLOPs allow)")
        return (
            f"{self.model} {self.phase}, batch {self.batch}, context {self.context_len} on "
            f"{self.hardware} (weights {self.weight_dtype}, KV {self.kv_dtype}, compute "
            f"{self.compute_dtype})\n"
            f"  {self.flops / 1e9:.3g} GFLOP, {self.nbytes / 1e6:.4g} MB (weights "
            f"{self.weight_bytes / 1e6:.4g}, KV read {self.kv_read_bytes / 1e6:.4g}, KV write "
            f"{self.kv_write_bytes / 1e6:.3g}, activations {self.activation_bytes / 1e6:.3g})\n"
            f"  intensity {self.intensity:.3g} FLOP/B vs ridge {self.ridge:.3g}: {self.bound}-"
            f"bound; floor {self.floor_s * 1e3:.4g} ms/step = {self.tokens_per_s:,.0f} tok/s\n"
            f"  {crit}")


def step_cost(config: ModelConfig, batch: int, context_len: int, phase: str = "decode",
              weight_dtype: str = "bf16", kv_dtype: str = "bf16",
              hardware: Hardware | str = "H200", compute_dtype: str | None = None) -> StepCost:
    """FLOPs, bytes, floor time and bound of one decode or prefill step of a whole model."""
    if batch < 1 or context_len < 1:
        raise ValueError(f"batch and context_len must be >= 1, got {batch}, {context_len}")
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    hw = get_hardware(hardware)
    wb, kvb = _dtype_bytes(weight_dtype), _dtype_bytes(kv_dtype)
    compute = compute_dtype or _compute_dtype(hw, weight_dtype)
    act_b = _dtype_bytes(compute) if compute in ("fp32", "bf16", "fp16") else 2  # fp8/fp4
    # matmuls still take and give 16-bit activations around them
    kv_token = config.kv_bytes_per_token(1) * kvb  # K and V, every layer, one token
    tokens = batch if phase == "decode" else batch * context_len
    linear, attention, head = _step_flops(config, batch, context_len, phase)
    weight_bytes = _weight_elems(config) * wb  # read once per step, shared by every sequence
    if phase == "decode":
        kv_read = batch * context_len * kv_token  # every sequence reads its whole context
        kv_write = batch * kv_token  # and appends one token
    else:
        kv_write = batch * context_len * kv_token  # the prompt's K and V, written once
        kv_read = kv_write  # and read back at least once by attention (flash: once per tile
        # of queries, which tiling keeps on chip; this is the floor)
    activation_bytes = _activation_elems(config, tokens, rows=batch) * act_b
    peak = hw.peak(compute)

    # decode FLOPs and bytes are affine in the batch, F(B) = B f1 and M(B) = W + B m1, so the
    # step is compute-bound once B (f1 / peak - m1 / bw) >= W / bw
    f1 = sum(_step_flops(config, 1, context_len, "decode"))
    m1 = context_len * kv_token + kv_token + _activation_elems(config, 1, 1) * act_b
    slope = f1 / peak - m1 / hw.bandwidth
    critical = math.ceil(weight_bytes / hw.bandwidth / slope) if slope > 0 else None
    return StepCost(
        model=config.name, hardware=hw.name, phase=phase, batch=batch, context_len=context_len,
        weight_dtype=weight_dtype, kv_dtype=kv_dtype, compute_dtype=compute, tokens=tokens,
        linear_flops=linear, attention_flops=attention, head_flops=head,
        weight_bytes=weight_bytes, kv_read_bytes=kv_read, kv_write_bytes=kv_write,
        activation_bytes=activation_bytes, peak_flops=peak, bandwidth=hw.bandwidth,
        critical_batch=critical)

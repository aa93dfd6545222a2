"""Weight-only quantization: fewer bytes per weight, so a decode step reads fewer bytes.

Decode reads every weight once per step, whatever the batch (chapter 01), so at batch 1 the
step's time is its weight bytes over the memory bandwidth. Storing a weight in 8 or 4 bits
instead of 32 cuts those bytes 4x or ~7x, *if the kernel reads the packed bytes*: quantizing,
dequantizing back to fp32 and multiplying as before ("fake quantization") costs the error and
buys nothing. So `QuantLinear` runs torch's packed CPU kernels:

- **int8**, symmetric, one scale per output channel: `w ~ q * s`, q in [-127, 127] (never
  -128: with a symmetric scale s = max|w| / 127 the code -128 is never a rounded value, and
  clamping to it would make the grid lopsided). Kernel: `torch._weight_int8pack_mm`.
- **int4**, asymmetric, one scale and one zero per group of `g` input weights (g = 32/64/128,
  and g must divide the linear's K: a group that does not is refused, never swapped for a
  smaller one): `w ~ (q - 8) * s + z`, q in [0, 15], which is exactly the tinygemm kernel's
  formula.
  Kernel: labkit's `int4_linear` (below), else `torch._weight_int4pack_mm_for_cpu` on
  `torch._convert_weight_to_int4pack_for_cpu` (on CUDA, tinygemm).
- Both round to nearest (RTN). **AWQ-style** scaling goes further: before rounding, multiply the
  input channels that large activations hit by a factor s (so they get finer steps) and divide
  the layer's input by s, folded into the RMSNorm weight or the previous projection so that it
  costs nothing at run time; s = mean|x|^alpha, alpha searched per layer on a calibration text.

torch's CPU kernels take **bf16 activations** (fp32 activations send int8 to a slow path), so
on them a QuantLinear casts its input to bf16 and its output back. On the CPU with fp32
activations, labkit's own kernels serve instead (`labkit.kernels.cpu.int8_linear` and
`int4_linear`, where they build): they read the codes, turn them into fp32 in registers (or,
for many rows, a few code rows at a time into L1), and give a row the same result whatever
rows share its call (batch-invariant). int8 applies each row's scale once, to the finished
sum; int4 dequantizes each weight as `q * s + (z - 8 s)`, the very value `dequantize_int4`
gives, from its own layout (`cpu_kernels.int4_layout`: 16 codes in 8 bytes, a group's bf16
scale and zero in one int32). Measured in a SmolLM2 int4 decode step at batch 1, 3 and 32:
1.1x, 1.3x and 2x faster than torch's int4 kernel with its casts (results/). On a CPU with
AVX512-VNNI, int4 runs on `cpu_kernels.int4_linear_dot` instead (where N % 16 == 0, unless
`LABKIT_INT4_DOT=0`): x held as int16 codes (a scale per group), the codes multiplied by an
integer dot product into exact sums, each group's scale and zero applied once to its sum;
at batch 1 on this course's VM 2.2-2.5x faster than int4_linear (results/). There int8
holds x as int16 too (a scale per 64 values, `int8_x_as_int16`) and
multiplies the codes by an integer dot product: turning codes into fp32 had bound it by its
arithmetic (1.3x faster at batch 1, results/cpu-kernels-2026-12-05.md), and holds the codes
in its own layout, 16 rows side by side as unsigned bytes, for `vpdpbusd`
(`cpu_kernels.int8_linear_dot`; a step's linears 1.4-1.9x faster at 4 to 32 rows,
results/cpu-kernels-2026-12-06.md). Scales and zeros
are rounded to bf16 when quantizing, so the kernel and the dequantize reference
(`QuantLinear.reference`) compute with the very same numbers. The tied embedding/LM head: the
head is quantized like any linear; the embedding lookup keeps the exact fp32 rows (it reads one
row per token, not the matrix).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from labkit.kernels import cpu as cpu_kernels
from labkit.kernels.cpu import usable

QUANT_VERSION = 2  # bump when the quantized format changes or old entries may be wrong
# (2: version 1 wrote a cached AWQ entry's norms into the fp32 tensors every model of the file
# shares in a process, so entries built after that in the same process were built on AWQ's norms)
INT4_GROUPS = (32, 64, 128)
_CANONICAL = ("qweight", "scale", "zero")
# labkit's layouts, each with its exact inverse: a QuantLinear on one of them holds only it
# (kweight, kscale) -> codes, scale, zero (int8's: K a multiple of 64, int8_dot_fits)
_LOSSLESS = {"int4_linear_dot": lambda packed, _: cpu_kernels.int4_dot_codes(packed),
             "int4_linear": cpu_kernels.int4_codes,
             "int8_linear_dot": lambda packed, scale: (
                 cpu_kernels.int8_dot_codes(packed, scale.numel()), scale, None)}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantScheme:
    """A weight-only quantization scheme: int8 per channel, or int4 in groups; RTN or AWQ."""

    bits: int  # 8 or 4
    group_size: int | None = None  # int4 only: input weights sharing a scale and a zero
    awq: bool = False  # activation-aware input-channel scaling, searched on calibration text

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"QuantScheme.bits must be 8 or 4, got {self.bits}")
        if self.bits == 8 and self.group_size is not None:
            raise ValueError("int8 is per output channel: it takes no group size")
        if self.bits == 4 and self.group_size not in INT4_GROUPS:
            raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, "
                             f"got {self.group_size}")

    @property
    def name(self) -> str:
        """The CLI spelling: int8, int4-g32, int4-g128-awq, ..."""
        base = "int8" if self.bits == 8 else f"int4-g{self.group_size}"
        return base + ("-awq" if self.awq else "")

    @staticmethod
    def parse(spec: str | QuantScheme | None) -> QuantScheme | None:
        """`none`/None -> None; `int8`, `int4` (g32), `int4-g64`, `int4-g128-awq` -> a scheme."""
        if spec is None or isinstance(spec, QuantScheme):
            return spec
        m = re.fullmatch(r"(int8|int4)(?:-g(\d+))?(-awq)?", spec.strip().lower())
        if spec.strip().lower() == "none":
            return None
        if m is None:
            raise ValueError(f"unknown quantization {spec!r}: use none, int8, int4, int4-gN "
                             f"(N in {INT4_GROUPS}), with an optional -awq suffix")
        bits = int(m.group(1)[3:])
        group = int(m.group(2)) if m.group(2) else (32 if bits == 4 else None)
        return QuantScheme(bits, group, bool(m.group(3)))


def _to_bf16_up(x: torch.Tensor) -> torch.Tensor:
    """x rounded up in magnitude to a bf16 value, returned as fp32 (a scale that never shrinks)."""
    b = x.to(torch.bfloat16).float()
    bumped = torch.nextafter(b.to(torch.bfloat16), torch.full_like(b, math.inf).bfloat16()).float()
    return torch.where(b < x, bumped, b)


# ---------------------------------------------------------------------------------------------
# int8: symmetric, per output channel


def quantize_int8(w: torch.Tensor, bf16_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Round w [N, K] to int8 codes q [N, K] in [-127, 127] and per-row scales s [N]: w ~ q * s."""
    # one scale per output channel (row): a row's outliers cost only that row's resolution.
    # An all-zero row has max 0: a scale of 0 would make its codes 0 / 0 = NaN, so the max is
    # clamped to a tiny positive number (the row's codes are then 0, and so is its dequant)
    amax = w.abs().amax(dim=1).float().clamp(min=1e-8)  # [N]
    scale = amax / 127.0
    if bf16_scales:  # the kernel multiplies by a bf16 scale: make it exactly that one
        scale = _to_bf16_up(scale)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weights [N, K] from int8 codes [N, K] and per-row scales [N]."""
    return q.to(torch.float32, copy=True).mul_(scale[:, None])  # a copy, scaled in place


# ---------------------------------------------------------------------------------------------
# int4: asymmetric, per group of input weights, two codes per byte


def quantize_int4(w: torch.Tensor, group_size: int, bf16_scales: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q [N, K] in [0, 15] (uint8), scales and zeros [N, K/g]: w ~ (q - 8) * s + z."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: K={k} is not a multiple of the group size {group_size}")
    wg = w.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)  # 16 levels span [lo, hi]
    if bf16_scales:
        scale = _to_bf16_up(scale)
    zero = lo + 8 * scale  # the value of code 8: the kernel centres codes on 8
    if bf16_scales:
        zero = zero.to(torch.bfloat16).float()
    q = torch.round((wg - zero[..., None]) / scale[..., None]) + 8
    return q.clamp(0, 15).to(torch.uint8).reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 weights [N, K] from codes [N, K] in [0, 15] and group scales, zeros [N, K/g]."""
    n, k = q.shape
    g = k // scale.shape[1]
    qg = q.to(torch.float32, copy=True).reshape(n, -1, g)  # [N, G, g]: a copy (even of fp32 q)
    # in place, in the order of (q - 8) * s + z: one [N, K] fp32 tensor, where the expression
    # would hold three at once (the int4 head's dequantized copy alone is 113 MB)
    return qg.sub_(8).mul_(scale[..., None]).add_(zero[..., None]).reshape(n, k)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Quantize then dequantize w [N, K] (fp32 in, fp32 out): the error, without the savings."""
    if scheme.bits == 8:
        return dequantize_int8(*quantize_int8(w, bf16_scales=True))
    return dequantize_int4(*quantize_int4(w, check_int4_group(w.shape[1], scheme.group_size),
                                          bf16_scales=True))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: [N, K] -> [N, K/2] uint8; column 2j in the LOW nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [N, K/2] uint8 -> [N, K] codes in [0, 15]."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def int4_groups_dividing(k: int) -> list[int]:
    """The int4 group sizes (INT4_GROUPS) that divide K: those a K-wide linear can take."""
    return [g for g in INT4_GROUPS if k % g == 0]


def check_int4_group(k: int, group_size: int) -> int:
    """The group for a K-wide input: the one asked for, if it divides K; else ValueError.

    Never a smaller one in its place: a learner who asks for int4-g128 must measure g128, or
    be told why not."""
    if k % group_size:
        fit = int4_groups_dividing(k)
        raise ValueError(f"int4-g{group_size}: a linear reads K = {k} inputs, which is not a "
                         f"multiple of {group_size}, so its last group would be short; "
                         + (f"the groups that divide {k}: {', '.join(map(str, fit))}" if fit
                            else f"none of {INT4_GROUPS} divides {k}"))
    return group_size


def check_fits(model: nn.Module, scheme: QuantScheme) -> None:
    """Refuse (ValueError) an int4 scheme whose group does not divide every projection's K,
    naming the K and the schemes that would fit; before anything in the model changes."""
    if scheme.bits != 4:
        return
    ks = sorted({lin.in_features for _, _, lin in _linears(model)})
    bad = [k for k in ks if k % scheme.group_size]
    if bad:
        fit = [QuantScheme(4, g, scheme.awq).name for g in INT4_GROUPS
               if all(k % g == 0 for k in ks)]
        raise ValueError(
            f"{scheme.name} does not fit this model: its linears read K = "
            f"{', '.join(map(str, ks))} inputs, and {bad[0]} is not a multiple of "
            f"{scheme.group_size} (labkit never swaps in a smaller group). "
            + (f"Schemes that fit every linear: {', '.join(fit)}" if fit
               else f"No int4 group of {INT4_GROUPS} fits every linear"))


# ---------------------------------------------------------------------------------------------
# the packed linear


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W stored in int8 or int4, on packed kernels (labkit's or torch's).

    The canonical codes (what the cache stores, in its state_dict): int8 `qweight` [N, K] and
    `scale` [N]; int4 `qweight` [N, K/2] (pack_int4), `scale`, `zero` [N, K/g]. The kernel's
    own layout (`kweight`, `kscale`) is derived from them and not stored: for int8 on the CPU,
    labkit's layout (`cpu_kernels.int8_dot_layout`) where `cpu_kernels.int8_dot_fits`, else
    the codes as they are; for int4 on the CPU, labkit's dot-product layout (`kweight` [N/16,
    K/G, 8G + 64] bytes: codes, scales and zeros in the order a thread reads them; `kscale`
    empty) where `cpu_kernels.int4_dot_fits`, else labkit's (`kscale` [N, K/G]) where
    `cpu_kernels.int4_fits`,
    else torch's (bf16). labkit's layouts keep every code, scale and zero exactly, so a linear
    on one of them holds that layout alone: `canonical()` gives its codes back (and its
    state_dict holds them).
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group_size = (check_int4_group(in_features, scheme.group_size)
                           if scheme.bits == 4 else None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)
        self._labkit_kernel: str | None = None  # set with the codes (_build_kernel_layout)
        self._derived = False  # True: only the kernel's layout is held (`canonical`)

    @classmethod
    def from_weight(cls, w: torch.Tensor, scheme: QuantScheme,
                    bias: torch.Tensor | None = None) -> QuantLinear:
        """Quantize an fp32 weight [N, K] (round to nearest) into a QuantLinear."""
        n, k = w.shape
        ql = cls(k, n, scheme, bias)
        if scheme.bits == 8:
            q, s = quantize_int8(w, bf16_scales=True)
            ql.set_codes(q, s)
        else:
            q, s, z = quantize_int4(w, ql.group_size, bf16_scales=True)
            ql.set_codes(pack_int4(q), s, z)
        return ql

    @classmethod
    def concat(cls, parts: list[QuantLinear]) -> QuantLinear:
        """One QuantLinear whose output rows are those of `parts` in order (same input, same
        scheme): every output row is rounded on its own, so the codes simply stack."""
        first = parts[0]
        if any(p.scheme != first.scheme or p.in_features != first.in_features for p in parts):
            raise ValueError("QuantLinear.concat: the parts must share the scheme and the input")
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("QuantLinear.concat: either every part has a bias or none does")
        bias = None if biases[0] is None else torch.cat(biases)
        fused = cls(first.in_features, sum(p.out_features for p in parts), first.scheme, bias)
        codes = [p.canonical() for p in parts]
        zero = None if first.scheme.bits == 8 else torch.cat([c[2] for c in codes])
        fused.set_codes(torch.cat([c[0] for c in codes]),  # [sum N, K] or [sum N, K/2]
                        torch.cat([c[1] for c in codes]), zero)
        return fused

    def set_codes(self, qweight: torch.Tensor, scale: torch.Tensor,
                  zero: torch.Tensor | None = None) -> None:
        """Install canonical codes (fresh or from the cache) and build the kernel's layout."""
        self._install(qweight.contiguous(), scale.float().contiguous(),
                      None if zero is None else zero.float().contiguous())

    def _install(self, qweight: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None) -> None:
        self._derived = False
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        if zero is not None:
            self.register_buffer("zero", zero)
        self._build_kernel_layout()

    def _build_kernel_layout(self) -> None:
        if self._derived:  # (relayout after a move) the codes first, from the layout moved
            self._install(*self.canonical())
            return
        dev = self.qweight.device
        # which of labkit's CPU kernels serves this linear (where `usable`), else None: torch's
        self._labkit_kernel = None
        if self.scheme.bits == 8 and cpu_kernels.int8_dot_fits(self.in_features, self.scale):
            # an AVX512-VNNI CPU: the codes + 128 on vpdpbusd, 16 rows side by side
            kw, ks = cpu_kernels.int8_dot_layout(self.qweight), self.scale
            self._labkit_kernel = "int8_linear_dot"
        elif self.scheme.bits == 8:  # (kscale: what torch's int8 kernel takes)
            kw, ks = self.qweight, self.scale.to(torch.bfloat16)
            self._labkit_kernel = "int8_linear"
        elif dev.type == "cuda":  # tinygemm: uint8 [N, K/2] in, its own tiled layout out
            codes = unpack_int4(self.qweight)  # [N, K]
            kw = torch.ops.aten._convert_weight_to_int4pack(pack_int4_hi_first(codes), 8)
            ks = _scales_and_zeros(self.scale, self.zero)
        elif cpu_kernels.int4_dot_fits(self.out_features, self.in_features, self.group_size,
                                       self.scale, self.zero):
            # an AVX512-VNNI CPU: x as int16, the codes on an integer dot product, exact sums
            kw = cpu_kernels.int4_dot_layout(unpack_int4(self.qweight), self.scale, self.zero)
            ks = torch.empty(0, dtype=torch.int32)  # (the scales lie among the codes)
            self._labkit_kernel = "int4_linear_dot"
        elif cpu_kernels.int4_fits(self.in_features, self.group_size, self.scale, self.zero):
            # labkit's int4 kernel (labkit.kernels.cpu): fp32 activations, no casts
            kw, ks = cpu_kernels.int4_layout(unpack_int4(self.qweight), self.scale, self.zero)
            self._labkit_kernel = "int4_linear"
        else:
            codes = unpack_int4(self.qweight).to(torch.int32)  # [N, K]
            kw = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # [N, K/2], blocked
            ks = _scales_and_zeros(self.scale, self.zero)
        self.register_buffer("kweight", kw, persistent=False)
        self.register_buffer("kscale", ks, persistent=False)
        if self._labkit_kernel in _LOSSLESS:
            # labkit's layouts hold every code, scale and zero exactly: the canonical buffers
            # are not kept beside them (an int4-g32 SmolLM2 holds 80 MiB, not 176) and
            # `canonical()` gives them back when asked (the cache, dequantized, concat, a move)
            for name in _CANONICAL:
                self._buffers.pop(name, None)
            self._derived = True

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scale, zero): the canonical codes, held or recovered from the layout (a
        linear on labkit's int4 layout has no `qweight`, `scale` or `zero` buffers: ask here)."""
        if not self._derived:
            return self.qweight, self.scale, self._buffers.get("zero")
        codes, scale, zero = _LOSSLESS[self._labkit_kernel](self.kweight, self.kscale)
        return (codes if self.scheme.bits == 8 else pack_int4(codes)), scale, zero

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._derived:  # the cache stores the canonical codes, whatever this model holds
            for name, t in zip(_CANONICAL, self.canonical()):
                if t is not None:  # (int8 has no zero)
                    destination[prefix + name] = t

    @property
    def weight_bytes(self) -> int:
        """Bytes the kernel reads per call: codes plus scales (and zeros)."""
        return (self.kweight.numel() * self.kweight.element_size()
                + self.kscale.numel() * self.kscale.element_size())

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] these codes stand for (the reference; fake quantization)."""
        qweight, scale, zero = self.canonical()
        if self.scheme.bits == 8:
            return dequantize_int8(qweight, scale)
        return dequantize_int4(unpack_int4(qweight), scale, zero)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The naive path: dequantize to fp32, then an ordinary matmul (no bytes saved)."""
        y = x.float() @ self.dequantized().to(x.device).t()
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        # (a decode step makes ~120 of these calls, where a few microseconds of Python each add
        # up: the kernel's name is a plain attribute, the reshapes skipped for 2-D input)
        labkits = self._labkit_kernel
        if labkits is not None:
            mod = usable(x)  # labkit's kernel (labkit.kernels.cpu), where it serves
            if mod is not None:
                x2 = x if x.dim() == 2 and x.is_contiguous() else (
                    x.reshape(-1, self.in_features).contiguous())  # [M, K]
                kernel = getattr(mod, labkits)  # int8_linear(_dot), int4_linear(_dot)
                y = (kernel(x2, self.kweight) if labkits == "int4_linear_dot"
                     else kernel(x2, self.qweight, self.scale) if labkits == "int8_linear"
                     else kernel(x2, self.kweight, self.kscale))  # [M, N]
                y = y if self.bias is None else y + self.bias
                return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
            if labkits != "int8_linear":  # a torch mode is on (it must see aten ops) or x is
                return self.reference(x)  # not fp32 CPU: labkit's layouts have no torch op
        # torch's packed kernels take bf16 rows
        lead = x.shape[:-1]
        xb = (x if x.dim() == 2 else x.reshape(-1, self.in_features)).to(torch.bfloat16)  # [M, K]
        if self.scheme.bits == 8:
            if xb.is_cuda:  # no fused int8 weight-only GEMM in torch core for CUDA
                y = (xb @ self.kweight.t().to(torch.bfloat16)) * self.kscale
            else:
                y = torch._weight_int8pack_mm(xb, self.kweight, self.kscale)  # [M, N] bf16
        elif xb.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(xb, self.kweight, self.group_size,
                                                    self.kscale)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xb, self.kweight, self.group_size,
                                                  self.kscale)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        g = f", group={self.group_size}" if self.group_size else ""
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}{g}"


def pack_int4_hi_first(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] uint8, column 2j in the HIGH nibble (CUDA tinygemm's input)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def _scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The tinygemm layout of group scales and zeros: [K/g, N, 2] bf16."""
    return torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()


# ---------------------------------------------------------------------------------------------
# whole models


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every projection of a LlamaModel, and its output head."""
    if any(layer.qkv_proj is not None for layer in model.layers):
        raise ValueError("quantize a model before fuse_projections, not after: the scales and "
                         "the cache are per projection")
    out = [(layer, attr, getattr(layer, attr)) for layer in model.layers for attr in PROJECTIONS]
    if isinstance(model.lm_head, nn.Linear):
        out.append((model, "lm_head", model.lm_head))
    return out


def untie_head(model: nn.Module) -> None:
    """Give a tied model an output head of its own (a copy), so it can change apart from the
    embedding, whose lookup stays exact."""
    if model.lm_head is None:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False)
        model.lm_head = head


def quantize_model(model: nn.Module, scheme: QuantScheme | str) -> nn.Module:
    """Replace every projection and the output head by a QuantLinear, in place; returns model.

    Round to nearest. The embedding stays exact; a tied head gets its own quantized copy of the
    matrix. An AWQ scheme rounds the weights as they are: labkit.awq.quantize_awq folds its
    scales in first (it imports this module, never the other way round).
    """
    scheme = QuantScheme.parse(scheme)
    if scheme is None:
        return model
    check_fits(model, scheme)  # refuses a fused model, or a group that does not divide a K,
    untie_head(model)  # before anything changes
    for parent, attr, lin in _linears(model):
        setattr(parent, attr, QuantLinear.from_weight(lin.weight.detach(), scheme, lin.bias))
    return model.eval().requires_grad_(False)


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the cache stores: every persistent tensor of a quantized model but the embedding."""
    return {k: v.contiguous() for k, v in model.state_dict().items() if k != "embed.weight"}


def load_quantized(model: nn.Module, scheme: QuantScheme, state: Mapping[str, torch.Tensor],
                   fuse: bool = False) -> nn.Module:
    """Rebuild a quantized model from `quantized_state` output, on an fp32 model; in place.
    `fuse`: q|k|v and gate|up as one QuantLinear each, stacked from their codes (the layout
    fuse_projections gives, without building the separate linears' kernel layouts first)."""
    check_fits(model, scheme)  # an entry written before groups were checked holds other groups

    def linear(*names: str) -> QuantLinear:
        # the named linears' codes, stacked by output rows (each row is quantized on its own)
        def cat(part: str) -> torch.Tensor | None:
            ts = [state.get(f"{n}.{part}") for n in names]
            return None if ts[0] is None else ts[0] if len(ts) == 1 else torch.cat(ts)

        q, s = cat("qweight"), cat("scale")
        k = q.shape[1] * (2 if scheme.bits == 4 else 1)  # int4 holds two codes per byte
        ql = QuantLinear(k, s.shape[0], scheme, cat("bias"))
        ql.set_codes(q, s, cat("zero"))
        return ql

    for i, layer in enumerate(model.layers):
        at = f"layers.{i}"
        if fuse:
            layer.set_fused(linear(f"{at}.q_proj", f"{at}.k_proj", f"{at}.v_proj"),
                            linear(f"{at}.gate_proj", f"{at}.up_proj"))
        for attr in PROJECTIONS:
            if not (fuse and attr in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                setattr(layer, attr, linear(f"{at}.{attr}"))
    model.lm_head = linear("lm_head")
    # AWQ folds its scales into the norms. Replace them, never copy into them: the fp32 model
    # this one was built on shares its tensors with every other model of the same file in
    # this process (load_state_dict would have written AWQ's norms into all of them)
    for key in [k for k in state if k.endswith("norm")]:  # (only these: `state` may read
        value = state[key]  # each tensor from its file when asked, labkit.loading)
        parent, _, attr = key.rpartition(".")
        mod = model.get_submodule(parent)
        old = getattr(mod, attr)
        if old.shape != value.shape:
            raise ValueError(f"cached {key} has shape {tuple(value.shape)}, the model "
                             f"{tuple(old.shape)}: a stale or foreign cache entry")
        setattr(mod, attr, nn.Parameter(value.to(old.dtype, copy=True), requires_grad=False))
    return model.eval().requires_grad_(False)


def relayout(model: nn.Module) -> nn.Module:
    """Rebuild every QuantLinear's kernel layout for the device its codes are on now: after
    `model.to(device)`, which moves the CPU kernel's layout but cannot convert it (on CUDA,
    tinygemm's layout; on the CPU, labkit's or torch's). Returns the model."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod._build_kernel_layout()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear and norm (not the embedding table)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += mod.weight_bytes
        elif isinstance(mod, nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    if model.lm_head is None:  # tied and unquantized: the head reads the embedding matrix
        total += model.embed.weight.numel() * model.embed.weight.element_size()
    total += sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if n.endswith("norm"))
    return total

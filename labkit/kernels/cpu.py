"""labkit's hand-written CPU kernels: which build this CPU gets, how it is built, and when a
kernel may run. The kernels themselves are C++ beside this file (AVX2 + FMA intrinsics where the
CPU has them, a scalar loop of the same structure elsewhere), for the places where torch's ops
cost more in dispatch or conversion than in arithmetic:

    lanes.h              the fixed-order lane reductions every kernel shares (batch invariance)
    quant_linear.cpp     int8_linear, int8_linear_dot, int4_linear, int4_linear_dot
    attention_tiles.h    what both attention kernels share: scores, exp and sum, weighted V
    paged_attention.cpp  paged_attention (and paged_decode_slots: a decode step's slots)
    flash_attention.cpp  flash_attention
    row_ops.cpp          rms_norm, rope, silu_mul
    decoder_stack.cpp    DecoderStack: a model's layers, all of those kernels, in one call
    read_probe.cpp       read_probe: a buffer read and nothing else (`bench step`'s yardstick)
    kernels.h            every kernel's signature (bindings.cpp and decoder_stack.cpp)
    bindings.cpp         the Python module

**int8_linear**: y = x W^T with W as int8 codes and per-row scales. torch's packed CPU kernel
(`torch._weight_int8pack_mm`) takes bf16 activations and, on an AVX2 laptop at batch 1, spends
~190 us on a 1 MB SmolLM2 layer matrix (5 GB/s): it is busy converting, not reading bytes. This
kernel reads the codes once per call: for one to three rows of x it turns them into fp32 in
registers, for more it converts three code rows at a time into a buffer that stays in L1 and
reuses it for every row; tiles of up to 4 x 3 outputs, 8 lanes at a time; each row's scale is
applied once, to the finished sum; each thread prefetches its next block of code rows. That
path is bound by its arithmetic, not by memory: with the codes in cache it multiplies only
18-22 GB/s of them on this course's two cores. Where the CPU has AVX512-VNNI (`has_int8_dot`)
x is held as int16 instead (`int8_x_as_int16`: one scale per 64 values of a row, each value
within amax / 65278 of its own, finer than the bf16 rounding torch's kernels make), so one
`vpmovsxbw` widens 32 codes and one `vpdpwssd` does 32 exact integer multiply-adds; each
block's integer sum is made fp32 and multiply-added into the output's sum, block after block.

**int8_linear_dot** (built on CPUs with AVX512-VNNI): int8_linear's sums on `vpdpbusd`, which
multiplies 64 unsigned bytes by 64 signed ones into 16 int32 lanes: twice the products of
`vpdpwssd` an instruction, with no widening first. QuantLinear holds the codes in labkit's
layout for it (`int8_dot_layout`, `int8_dot_fits`): each code as q + 128, an unsigned byte,
16 output rows side by side (a lane a row), so each thread reads its equal run of blocks of
16 rows front to back as one stream; x's int16 code is split into a high and a low signed
byte (c = 256 h + l, which needs |c| <= 32639: hence those levels), and the 128 sum(c) that
the codes' offset adds to a block's sum is taken off once a block. The same integers as
int8_linear's, so the same bits. Against the tiles of 6 rows on `vpdpwssd` it replaced (on
this course's VM, results/cpu-kernels-2026-12-06.md; both asking ahead for their codes): a
SmolLM2 step's int8 linears as fast at batch 1 where the memory is busy (both read at ~0.85x a
bare read of the same bytes), 1.4x at 4 rows, 1.7-1.9x at 8 and 32, where both are bound by
their dot products; one linear in cache at batch 1, 1.3-1.5x. At one or two rows it asks for
nothing ahead: in one stream a thread the CPU's own prefetcher keeps up, and the requests got in
its way (a step's int8 linears 1.07x where the memory is busy, 1.36x where quiet).

**int4_linear**: the same for int4 codes with a bf16 scale and zero per group of K, in
labkit's layout (`int4_layout`: 16 codes in 8 bytes, so one load, a mask and a shift give two
vectors of codes; a group's scale and zero in one int32). Each weight is dequantized in
registers as q s + (z - 8 s), exactly `labkit.quant.dequantize_int4`'s value, then multiplied
in fp32: no bf16 casts around the call, as torch's int4 kernel needs. One row of x takes 4
code rows at a time, two or three rows take 2, more rows dequantize 3 code rows into an L1
buffer and reuse it (measured in a SmolLM2 step against torch's kernel with its casts: 1.1x at
1 row, 1.3x at 3, 2x at 32). A factored form (the scale applied per group, not per weight)
did less arithmetic per weight and lost to this one inside the model.

**int4_linear_dot** (built on CPUs with AVX512-VNNI): there the factored form wins, because
the codes need not become floats at all. x is held as int16 codes, one scale per group of K
(`int4_x_as_int16`: a power of two, each value its nearest multiple, at most 32639 from 0:
finer than bf16's rounding), each code split into a high and a low byte; a code 0..15 masked
out of its byte pair is an unsigned byte, so `vpdpbusd` (64 byte multiply-adds into int32
lanes an instruction) against each half gives a group's exact sum of code times code; a
group's scale and zero are applied once, to that sum. Lanes are 16 output rows (a block: 8 k
of its 16 rows in 64 bytes, a mask each for the low and the high nibbles): four vector ops
per 64 bytes of codes. `int4_dot_layout` puts everything a thread reads in the order it reads
it: blocks in pairs, and for each pair and group of K the two blocks' codes, then their
scales and zeros, so each thread reads its equal run of pairs (a 576-row matrix is 18 pairs:
9 each) front to back as one stream, as the read probe does, asking 6 KiB ahead. Codes and
scales in tensors of their own had each thread read four streams, each restarting at every
pair: in the one stream a step's int4 linears at batch 1 run 0.99-1.11x as fast (median 1.09x,
seven runs; results/cpu-kernels-2026-12-05j.md). It replaced a kernel on the bf16 dot product
(`vdpbf16ps`, codes to bf16 by a `vpermw` lookup, x rounded to bf16: twelve vector ops per 64
bytes), itself 1.5x int4_linear at batch 1: in a SmolLM2 step's 121 linears, alternating in
one process on this course's VM, this one is 1.03-1.18x faster at batch 1 (median 1.14x),
0.93-1.04x at 2 to 32 rows, with x held more finely (results/cpu-kernels-2026-12-05i.md).
QuantLinear takes it where N is a multiple of 16 (`int4_dot_fits`), unless
`LABKIT_INT4_DOT=0`.

**paged_attention**: each new token attends over its sequence's context by reading the K and V
pool rows at the context's slots where they lie. The gather-then-SDPA path copies every
sequence's context into one padded tensor first, each layer (at batch 32, context 256 on
SmolLM2: ~2 ms a layer for the copy alone), and builds a [B, G*Tq, L] mask. Here one work item
is a token and a KV head: its G query heads share every K and V row read; scores, a softmax
(a vectorised exp) and the weighted sum of V, in fp32, keys in order.

**flash_attention**: the same reads in place, through the block tables, a tile of whole pages
at a time with an online softmax (FlashAttention's loop; `FlashAttention.reference` is it in
Python). Each tile's scores are exponentiated against the tile's own max and folded into the
running max, sum and fp32 accumulator by log-sum-exp, tiles in order; a decode token's tiles
are separate work items (split-K: a long context spreads over the threads even at batch 1),
folded afterwards in the same order. One arithmetic for both, so a token's output is the same
bits as a decode row or inside a prefill chunk.

**rms_norm, rope, silu_mul**: a layer's small per-row ops (labkit.model calls them), one call
each instead of 3 to 9 dispatched torch ops: at batch 1 a dispatch costs more than the work.

**Batch-invariant by construction.** A row's result never depends on how many other rows share
its step. In int8_linear and int4_linear each output y[m, n] gets its own accumulator, is
summed over k in ascending steps of 8 lanes, reduced across lanes in one fixed order, then its
tail added, whatever the tile shape and whether the weights came from registers or the L1
buffer (int8 on its integer dot product: each block's integer sum is exact in any order, and
the blocks are scaled and added in one order). In paged_attention and flash_attention each
(token, KV head) runs the same code alone, and flash_attention folds a token's tiles in one
order whichever thread computed them.
The engine's claims need this (int4_linear_dot: each output's exact group sums, then its
scaled total, in one order for every row count): the pipelined decoder's zombie rows change a step's
row count, chunked prefill changes which tokens share a step, and the tokens must not change.
An int8 kernel that switched paths with the row count broke exactly that (measured: see
results/cpu-quiet-2026-12-01.md).

**The build.** The kernels are compiled once per CPU kind (`torch.utils.cpp_extension.load`: a
C++ compiler and ninja; about a minute, with a line on stderr), into a directory of labkit's
cache named by a hash of every source file, the flags and torch's version: a change to any
source builds anew, and two virtual environments with the same torch share one build. A build
runs in a private directory and is renamed into place when it is complete, under a lock that the
operating system releases when its holder dies (`flock`): a build interrupted at any moment (a
Ctrl-C, a kernel restart in Lab, an out-of-memory kill) leaves nothing that blocks the next one,
and a process that waits for another's build says so on stderr. Where the build fails,
`kernels()` is None: QuantLinear keeps torch's kernel, PagedAttention gathers and runs SDPA,
and the model runs its torch ops. `LABKIT_CPU_KERNELS=0` turns them off. While a torch mode is
active they stand aside too (`usable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from labkit.utils.cache import cache_dir

HERE = Path(__file__).parent
# every file the build reads: the key covers them all
SOURCES = ("lanes.h", "kernels.h", "quant_linear.cpp", "attention_tiles.h",
           "paged_attention.cpp", "flash_attention.cpp", "row_ops.cpp", "decoder_stack.cpp",
           "read_probe.cpp", "bindings.cpp")
# -ffp-contract=off: no FMA the source did not write, so a scalar tail sums the same way in
# every template instance (the batch invariance above depends on it)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LOCK_NOTICE_S = 3.0  # a wait for another process's build longer than this says so on stderr

_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    """Vector flags this CPU runs (the build is cached per flag set, so per CPU kind). A CPU
    with AVX512-VNNI also gets the integer dot products: int8_linear's and `int4_linear_dot`
    (`int4_dot_fits` says when it serves)."""
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if cap not in ("AVX2", "AVX512"):
        return []
    flags = ["-mavx2", "-mfma"]
    if cap == "AVX512":
        if torch.cpu._is_vnni_supported():
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    return flags


def usable(x: torch.Tensor):
    """The compiled module when its kernels may run on `x` now, else None: x is an fp32 CPU
    tensor and no torch mode is active. A pybind kernel is invisible to torch's modes (a
    dispatch trace, tests' fake CUDA and its graph capture, torch.compile), which must see
    aten ops; with a mode on, callers take their torch path."""
    # (called ~270 times a decode step: the cheapest checks, and the module from the dict)
    if (not x.is_cpu or x.dtype is not torch.float32 or _function_mode_on()
            or _dispatch_modes()):
        return None
    return _state["module"] if "module" in _state else kernels()


def usable_for_indices(x: torch.Tensor):
    """`usable` for the kernels that read and make integer tensors (`paged_decode_slots`): x
    is a CPU tensor of any dtype and no torch mode is active."""
    if not x.is_cpu or _function_mode_on() or _dispatch_modes():
        return None
    return _state["module"] if "module" in _state else kernels()


_function_mode_on = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack


def int4_fits(k: int, group_size: int, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether `int4_linear` can serve an int4 linear: the kernels are built, K and the group
    are multiples of 16, and the scales and zeros are bf16 values (its layout stores bf16)."""
    return (scale.device.type == "cpu" and k % 16 == 0 and group_size % 16 == 0
            and bool((scale.bfloat16().float() == scale).all())
            and bool((zero.bfloat16().float() == zero).all()) and kernels() is not None)


def int4_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_linear`'s operands from canonical int4 codes [N, K] (values 0..15) and bf16-valued
    scales and zeros [N, K/G]: packed codes [N, K/2] uint8, each 16 consecutive k of a row in 8
    bytes (byte j: k = 16b + j in the low nibble, k = 16b + 8 + j in the high one), and sz
    [N, K/G] int32 (the bf16 scale's bits in the low half, the zero's in the high half)."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n, k // 16, 2, 8)  # [N, blocks, low/high, 8]
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, _scale_zero_bits(scale, zero)


def _scale_zero_bits(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[N, K/G] int32: each group's bf16 scale in the low half, its bf16 zero in the high."""
    bits = lambda t: t.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    return (bits(scale) | (bits(zero) << 16)).contiguous()


def int4_codes(packed: torch.Tensor, sz: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `int4_layout`: codes [N, K] (uint8, 0..15), scales and zeros [N, K/G]
    (fp32), exactly the values it was given."""
    n, half = packed.shape
    p = packed.reshape(n, half // 8, 1, 8)  # [N, blocks, 1, 8]
    codes = torch.cat([p & 15, p >> 4], dim=2).reshape(n, 2 * half)  # low nibbles, then high
    return codes, _bf16_of(sz & 0xFFFF), _bf16_of((sz >> 16) & 0xFFFF)


def _bf16_of(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of bf16 bit patterns held in a wider integer tensor."""
    return bits.to(torch.int16).view(torch.bfloat16).float()


INT8_X_BLOCK = 64  # int8_linear's integer dot product: one x scale per this many values
INT8_X_LEVELS = 32639  # and x's codes within +-this (int8_linear_dot splits each in two int8)
INT8_X_TINY = 1e-30  # a block whose largest |x| is below this is held as zeros (C++: kTinyX)


def int8_x_as_int16(x: torch.Tensor, block: int = INT8_X_BLOCK) -> torch.Tensor:
    """The x that `int8_linear` and `int8_linear_dot` multiply where the build has the integer
    dot product (`has_int8_dot()`: AVX512-VNNI), as fp32: each block of `block` values of a row
    on the nearest of 65,279 levels between -amax and amax (amax: the block's largest |x|; ties
    to even), so each value moves at most amax / 65278. The kernels keep the int16 codes and
    apply the scale to each block's integer sum; the product is this x times the codes."""
    def held(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        # 32639 / amax as C++ divides (a Python number over a tensor is its reciprocal times
        # the number in torch: another rounding)
        inv = torch.where(amax > INT8_X_TINY, torch.full_like(amax, INT8_X_LEVELS).div(amax),
                          torch.zeros_like(amax))
        return (torch.round(v * inv).clamp(-INT8_X_LEVELS, INT8_X_LEVELS)
                * (amax / INT8_X_LEVELS))

    return _block_by_block(x, block, held)


def _block_by_block(x: torch.Tensor, block: int, held) -> torch.Tensor:
    """x (fp32) with each block of `block` values of a row replaced by held(values, amax), amax
    the block's largest |x| (NaN where the block holds a NaN), as the kernels quantize x."""
    k = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float32)
    for k0 in range(0, k, block):
        v = x[..., k0:k0 + block].float()
        amax = v.abs().amax(dim=-1, keepdim=True)
        amax = torch.where(v.isnan().any(dim=-1, keepdim=True), torch.nan, amax)
        out[..., k0:k0 + block] = held(v, amax)
    return out


INT8_DOT_ROWS, INT8_DOT_K = 16, 64  # int8_dot_layout: blocks of 16 rows, 64 k a run


def int8_dot_fits(k: int, scale: torch.Tensor) -> bool:
    """Whether `int8_linear_dot` can serve an int8 linear with K = `k`: the kernels are built
    with the integer dot product (AVX512-VNNI), the scales are on the CPU, K is a multiple of
    64 (so the layout alone gives the codes back), and `LABKIT_INT8_DOT` is not 0 (0:
    int8_linear on the codes as they are, to compare the two)."""
    return (os.environ.get("LABKIT_INT8_DOT", "1") != "0" and scale.device.type == "cpu"
            and k % INT8_DOT_K == 0 and kernels() is not None and kernels().has_int8_dot())


def int8_dot_layout(codes: torch.Tensor) -> torch.Tensor:
    """`int8_linear_dot`'s codes from int8 codes [N, K]: uint8 [ceil(N/16), ceil(K/64), 1024],
    block [b, c] holding q + 128 for rows 16b .. 16b + 15 and k = 64c .. 64c + 63 as 16 runs of
    64 bytes, run u the codes k = 64c + 4u .. 64c + 4u + 3 of each of the 16 rows in turn (a
    vector lane a row). Past N and K the codes are 0 (held as 128)."""
    n, k = codes.shape
    padded = torch.nn.functional.pad(codes, (0, -k % INT8_DOT_K, 0, -n % INT8_DOT_ROWS))
    held = (padded.to(torch.int16) + 128).to(torch.uint8)  # [Np, Kp]
    nb, kb = held.shape[0] // INT8_DOT_ROWS, held.shape[1] // INT8_DOT_K
    return (held.reshape(nb, INT8_DOT_ROWS, kb, INT8_DOT_K // 4, 4).permute(0, 2, 3, 1, 4)
            .reshape(nb, kb, INT8_DOT_ROWS * INT8_DOT_K).contiguous())


def int8_dot_codes(packed: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """The inverse of `int8_dot_layout`: the codes [n, k] (k: all the layout holds)."""
    nb, kb = packed.shape[:2]
    held = (packed.reshape(nb, kb, INT8_DOT_K // 4, INT8_DOT_ROWS, 4).permute(0, 3, 1, 2, 4)
            .reshape(nb * INT8_DOT_ROWS, kb * INT8_DOT_K))
    return (held[:n, :k].to(torch.int16) - 128).to(torch.int8)


def int4_dot_fits(n: int, k: int, group_size: int, scale: torch.Tensor,
                  zero: torch.Tensor) -> bool:
    """Whether `int4_linear_dot` can serve an int4 linear [n, k]: whatever `int4_linear` needs
    (`int4_fits`), and this build has the integer dot product (an AVX512-VNNI CPU),
    `LABKIT_INT4_DOT` is not 0, N is a multiple of 16 (lanes are output rows), K of 32."""
    return (os.environ.get("LABKIT_INT4_DOT", "1") != "0" and n % 16 == 0 and k % 32 == 0
            and int4_fits(k, group_size, scale, zero) and kernels().has_int4_dot())


INT4_X_LEVELS = INT8_X_LEVELS  # int4_linear_dot's x codes too (a code's high byte is int8)


def int4_x_scale(amax: torch.Tensor) -> torch.Tensor:
    """`int4_linear_dot`'s scale for groups of x whose largest |x| is `amax` (fp32): the least
    power of two s with amax / s <= 32639, so a code times s is an exact fp32 value; 0 where
    amax is below 1e-30 (the group held as zeros), NaN or inf where amax is."""
    _, e = torch.frexp(amax / INT4_X_LEVELS)  # an estimate (the division rounds), as C++'s
    s = torch.exp2(e.float())
    s = torch.where(amax / (0.5 * s) <= INT4_X_LEVELS, 0.5 * s, s)  # exact: powers of two
    s = torch.where(amax / s > INT4_X_LEVELS, 2 * s, s)
    s = torch.where(amax > INT8_X_TINY, s, torch.zeros_like(s))
    return torch.where(amax.isnan() | amax.isinf(), amax, s)


def int4_x_as_int16(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The x that `int4_linear_dot` multiplies, as fp32: each value of a row moved to the
    nearest multiple of its group's scale (`int4_x_scale`, a power of two; ties to even; at
    most 32639 multiples from 0), so it moves at most amax / 32639; a group holding a NaN gets
    a NaN scale. The kernel multiplies the codes (the multiples) exactly and applies the scale
    to each group's integer sums: its product is this x times the dequantized weights."""
    def held(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        s = int4_x_scale(amax)
        inv = torch.where((s > 0) & ~s.isinf(), 1.0 / s, torch.zeros_like(s))  # exact: 2^n
        return torch.round(v * inv) * s

    return _block_by_block(x, group_size, held)


def int4_dot_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                    ) -> torch.Tensor:
    """`int4_linear_dot`'s operand from canonical int4 codes [N, K] (0..15) and bf16-valued
    scales and zeros [N, K/G]: [N/16, K/G, 8G + 64] uint8, the bytes in the order a thread
    reads them. A block is 16 rows; its codes for 8 consecutive k (u) are 64 bytes, byte 4i+e
    holding row i's k = 8u+e in the low nibble and k = 8u+4+e in the high one; its words for a
    group are 16 int32, row i's bf16 scale in the low half and zero in the high (as
    `int4_layout` holds them). Blocks go in pairs (the last alone where N/16 is odd), and for
    each pair and group of G k: the first block's 8G bytes of codes, the second's, the first
    block's 64 bytes of words, the second's."""
    n, k = codes.shape
    ng, nb = scale.shape[1], n // 16
    g = k // ng
    c = codes.to(torch.uint8).reshape(nb, 16, k // 8, 2, 4)  # [blk, i, u, high, e]
    c = c.permute(0, 2, 1, 4, 3)  # [blk, u, i, e, high]
    c = (c[..., 0] | (c[..., 1] << 4)).reshape(nb, ng, 8 * g)  # [blk, group, 8G]
    words = _scale_zero_bits(scale, zero).reshape(nb, 16, ng).transpose(1, 2).contiguous()
    words = words.view(torch.uint8)  # [blk, group, 64]
    out = torch.empty(nb, ng, 8 * g + 64, dtype=torch.uint8)
    flat, pairs = out.view(-1), nb // 2
    if pairs:  # [pair, group, (block 0's codes, block 1's codes, block 0's words, block 1's)]
        two = lambda t: t[:2 * pairs].reshape(pairs, 2, ng, -1).transpose(1, 2).reshape(  # noqa: E731
            pairs, ng, -1)
        flat[:2 * pairs * ng * (8 * g + 64)] = torch.cat([two(c), two(words)], 2).reshape(-1)
    if nb % 2:  # the last block alone: [group, (its codes, its words)]
        flat[2 * pairs * ng * (8 * g + 64):] = torch.cat([c[-1], words[-1]], 1).reshape(-1)
    return out


def int4_dot_codes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `int4_dot_layout`: codes [N, K] (uint8, 0..15), scales and zeros
    [N, K/G] (fp32), exactly the values it was given."""
    nb, ng, run = packed.shape
    g = (run - 64) // 8
    n, k, pairs = 16 * nb, ng * g, nb // 2
    flat = packed.contiguous().view(-1)
    c = torch.empty(nb, ng, 8 * g, dtype=torch.uint8)
    words = torch.empty(nb, ng, 64, dtype=torch.uint8)
    if pairs:
        runs = flat[:2 * pairs * ng * run].reshape(pairs, ng, 2 * run)
        c[:2 * pairs] = runs[..., :16 * g].reshape(pairs, ng, 2, 8 * g).transpose(1, 2).reshape(
            2 * pairs, ng, 8 * g)
        words[:2 * pairs] = runs[..., 16 * g:].reshape(pairs, ng, 2, 64).transpose(1, 2).reshape(
            2 * pairs, ng, 64)
    if nb % 2:
        last = flat[2 * pairs * ng * run:].reshape(ng, run)
        c[-1], words[-1] = last[:, :8 * g], last[:, 8 * g:]
    c = c.reshape(nb, k // 8, 16, 4, 1)  # [blk, u, i, e, 1]
    c = torch.cat([c & 15, c >> 4], dim=4)  # [blk, u, i, e, high]
    codes = c.permute(0, 2, 1, 4, 3).reshape(n, k)  # [blk, i, u, high, e]
    rows = words.view(torch.int32).transpose(1, 2).reshape(n, ng)  # [blk, i, group]
    return codes, _bf16_of(rows & 0xFFFF), _bf16_of((rows >> 16) & 0xFFFF)


def kernels():
    """The compiled module (`int8_linear`, `int4_linear`, `paged_attention`, ...), or None
    where it cannot be built (or LABKIT_CPU_KERNELS=0 when first asked). Built once per
    process; later calls are a lookup."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def status() -> str:
    """Which build of labkit's kernels serves in this process, or why none does (for a
    learner reading a benchmark from another CPU): "avx512vnni", "avx2", "generic", or the
    reason, e.g. "off: LABKIT_CPU_KERNELS=0"."""
    if kernels() is not None:
        return str(_state.get("variant", "built"))
    return str(_state.get("reason", "not built"))


def _build():
    if os.environ.get("LABKIT_CPU_KERNELS", "1") == "0":
        _state["reason"] = "off: LABKIT_CPU_KERNELS=0"
        return None
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        _state["reason"] = "no C++ compiler or no ninja on PATH"
        return None
    flags = _flags()
    module = _build_with(flags)
    if module is None and any(f.startswith("-mavx512") for f in flags):  # an older compiler
        module = _build_with([f for f in flags if not f.startswith("-mavx512")])  # (no VNNI)
    if module is None:  # no working compiler: torch's kernels serve instead
        _state["reason"] = "the build failed (its error is on stderr)"
        warnings.warn("labkit's CPU kernels did not build; using torch's kernels and the "
                      "gather-then-SDPA attention", stacklevel=3)
    return module


def _build_with(flags: list[str]):
    """The kernels built with these vector flags, from the cache or compiled now; None when
    the compiler fails."""
    variant = "avx512vnni" if "-mavx512vnni" in flags else "avx2" if flags else "generic"
    _state["variant"] = variant
    try:
        return build_extension(f"labkit_kernels_{variant}", [HERE / s for s in SOURCES],
                               [*CFLAGS, *flags], ["-fopenmp"])
    except Exception as err:  # a compiler error: the caller falls back
        print(f"labkit: the {variant} build of its CPU kernels failed ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''})", file=sys.stderr, flush=True)
        return None


def build_key(sources: list[Path], cflags: list[str]) -> str:
    """What a build depends on, hashed: every source file's bytes, the flags, torch's version
    and the Python ABI. Never a path: two virtual environments share a build."""
    h = hashlib.sha256()
    for src in sources:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(" ".join(cflags).encode())
    h.update(f"torch {torch.__version__} {sys.implementation.cache_tag}".encode())
    return h.hexdigest()[:16]


def build_extension(name: str, sources: list[Path], cflags: list[str], ldflags: list[str],
                    root: Path | None = None):
    """Load the extension `name` built from `sources`, compiling it first if no complete build
    with the same key exists under `root` (default: the cache's `kernels/`). A build runs in a
    private directory renamed into place when complete, under an flock on `<name>.lock`."""
    root = root or cache_dir() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    full = f"{name}_{build_key(sources, cflags + ldflags)}"
    final = root / full
    if (final / f"{full}.so").exists():
        return _load(full, final)
    with hold_lock(root / f"{full}.lock", f"another process's build of {full}"):
        if (final / f"{full}.so").exists():  # built while this process waited
            return _load(full, final)
        for stale in root.glob(f"{full}.build-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        print("labkit: compiling its CPU kernels (once per machine, about a minute)...",
              file=sys.stderr, flush=True)
        from torch.utils.cpp_extension import load

        private = Path(tempfile.mkdtemp(prefix=f"{full}.build-", dir=root))
        try:
            module = load(full, sources=[str(s) for s in sources if s.suffix != ".h"],
                          extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                          extra_include_paths=sorted({str(s.parent) for s in sources}),
                          build_directory=str(private))
            os.replace(private, final)  # atomic: a reader sees no build or a complete one
        finally:
            shutil.rmtree(private, ignore_errors=True)
    sys.modules[full] = module
    return module


def _load(name: str, directory: Path):
    if name in sys.modules:  # loaded already in this process (torch's `load` imports it)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def hold_lock(path: Path, what: str, notice_s: float = LOCK_NOTICE_S):
    """An exclusive lock on `path` that the operating system releases when its holder dies (a
    killed build never blocks anyone); a wait longer than `notice_s` says on stderr what it
    waits for."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the private build directory alone keeps builds apart
        yield
        return
    with open(path, "a+") as f:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and time.monotonic() - start > notice_s:
                    print(f"labkit: waiting for {what} to finish (lock {path}; a process "
                          "that dies releases it)", file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

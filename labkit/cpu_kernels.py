"""labkit's hand-written CPU kernels (C++, AVX2 + FMA intrinsics where the CPU has them, a
scalar loop of the same structure elsewhere), for the places where torch's ops cost more in
dispatch or conversion than in arithmetic.

**int8_linear**: y = x W^T with W as int8 codes and per-row scales. torch's packed CPU kernel
(`torch._weight_int8pack_mm`) takes bf16 activations and, on an AVX2 laptop at batch 1, spends
~190 us on a 1 MB SmolLM2 layer matrix (5 GB/s): it is busy converting, not reading bytes. This
kernel reads the codes once per call: for one to three rows of x it turns them into fp32 in
registers, for more it converts three code rows at a time into a buffer that stays in L1 and
reuses it for every row; tiles of up to 4 x 3 outputs, 8 lanes at a time; each row's scale is
applied once, to the finished sum; each thread prefetches its next block of code rows.

**int4_linear**: the same for int4 codes with a bf16 scale and zero per group of K, in
labkit's layout (`int4_layout`: 16 codes in 8 bytes, so one load, a mask and a shift give two
vectors of codes; a group's scale and zero in one int32). Each weight is dequantized in
registers as q s + (z - 8 s), exactly `labkit.quant.dequantize_int4`'s value, then multiplied
in fp32: no bf16 casts around the call, as torch's int4 kernel needs. One row of x takes 4
code rows at a time, two or three rows take 2, more rows dequantize 3 code rows into an L1
buffer and reuse it (measured in a SmolLM2 step against torch's kernel with its casts: 1.1x at
1 row, 1.3x at 3, 2x at 32). A factored form (the scale applied per group, not per weight)
did less arithmetic per weight and lost to this one inside the model.

**int4_linear_bf16** (built on CPUs with AVX512-BF16): there the factored form wins, because
the codes need not become fp32. A code 0..15 is exact in bf16, so one 16-entry lookup
(`vpermw`) turns 32 codes into bf16, and one `vdpbf16ps` does 32 multiply-adds into fp32 sums
against x rounded to bf16 (as torch's packed kernels round it); a group's scale and zero are
applied once, to its sum. Lanes are 16 output rows (`int4_bf16_layout`). Measured in a SmolLM2
int4 step on a 2-core AVX-512 machine: 1.5x faster than int4_linear at batch 1, 1.3x at 3,
1.0x at 32. QuantLinear takes it where N is a multiple of 16 (`int4_bf16_fits`), unless
`LABKIT_BF16_DOT=0`.

**paged_attention**: each new token attends over its sequence's context by reading the K and V
pool rows at the context's slots where they lie. The gather-then-SDPA path copies every
sequence's context into one padded tensor first, each layer (at batch 32, context 256 on
SmolLM2: ~2 ms a layer for the copy alone), and builds a [B, G*Tq, L] mask. Here one work item
is a token and a KV head: its G query heads share every K and V row read; scores, a softmax
(a vectorised exp) and the weighted sum of V, in fp32, keys in order.

**rms_norm, rope, silu_mul**: a layer's small per-row ops (labkit.model calls them), one call
each instead of 3 to 9 dispatched torch ops: at batch 1 a dispatch costs more than the work.

**Batch-invariant by construction.** A row's result never depends on how many other rows share
its step. In int8_linear and int4_linear each output y[m, n] gets its own accumulator, is
summed over k in ascending steps of 8 lanes, reduced across lanes in one fixed order, then its
tail added, whatever the tile shape and whether the weights came from registers or the L1
buffer. In paged_attention each (token, KV head) runs the same code alone. The engine's claims
need this (int4_linear_bf16: each output's group sums, then its scaled total, in one order
for every row count): the pipelined decoder's zombie rows change a step's row count,
chunked prefill changes which tokens share a step, and the tokens must not change. An int8
kernel that switched paths with the row count broke exactly that (measured: see
results/cpu-quiet-2026-12-01.md).

The kernels are compiled once (`torch.utils.cpp_extension`: a C++ compiler and ninja; about a
minute, with a line on stderr, then cached under labkit's cache directory). Where that fails,
`kernels()` is None: QuantLinear keeps torch's kernel, PagedAttention gathers and runs SDPA,
and the model runs its torch ops. `LABKIT_CPU_KERNELS=0` turns them off. While a torch mode is
active they stand aside too (`usable`).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import warnings

import torch

from labkit.cache import cache_dir

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// the sum of 8 lanes in one fixed order, the same everywhere (vector and scalar paths)
static inline float sum8(const float* l) {
  return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}
#ifdef __AVX2__
static inline float lanes_sum(__m256 v) {
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  return sum8(l);
}
#endif

// 8 weights as fp32: from an fp32 buffer, or straight from int8 codes (exact either way)
#ifdef __AVX2__
static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
static inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
#endif

// RM rows of x against RN weight rows (fp32 values, or int8 codes W): out[i][j] = sum_k
// x[i][k] * w[j][k]. Every output: one accumulator, k ascending by 8, a fixed lane reduction,
// then the tail; whatever W and the tile shape, the same operations on the same values.
template <int RM, int RN, class W>
static inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y,
                        int64_t ldy) {
  const int64_t K8 = K - K % 8;
#ifdef __AVX2__
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < RM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * (float)w[j * K + k];
      y[i * ldy + j] = s;
    }
#else
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K8; k += 8)
        for (int l = 0; l < 8; ++l) lane[l] += x[i * ldx + k + l] * (float)w[j * K + k + l];
      float s = sum8(lane);
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * (float)w[j * K + k];
      y[i * ldy + j] = s;
    }
#endif
}

template <int RN, class W>
static void rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, RN>(x + m * K, K, w, K, y + m * N, N);
  switch (M - m) {
    case 3: tile<3, RN>(x + m * K, K, w, K, y + m * N, N); break;
    case 2: tile<2, RN>(x + m * K, K, w, K, y + m * N, N); break;
    case 1: tile<1, RN>(x + m * K, K, w, K, y + m * N, N); break;
    default: break;
  }
}

// y [M, N] = x [M, K] (fp32, contiguous) times int8 codes q [N, K] and per-row scales s [N]:
// y[m, n] = (sum_k x[m, k] q[n, k]) * s[n], the scale once per output, not once per weight.
// One to three rows of x read the codes straight into registers, 6 weight rows at a time
// (independent sums in flight); more rows convert 3 code rows at a time into an fp32 buffer
// that stays in L1 and reuse it for every row of x, in tiles of up to 4 x 3 (12 accumulators,
// 3 weights, 1 x: 16 registers). Both give every output the same sums of the same values.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && s.numel() == N && q.is_contiguous() && x.is_contiguous(),
              "int8_linear: x [M, K], q [N, K], s [N]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t RN = M < 4 ? 6 : 3;
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(M < 4 ? 0 : RN * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      if (b + 1 < b1) {  // ask for this thread's next block now: its rows arrive while
        // this one is multiplied (measured, a SmolLM2 int8 step at batch 1: 1.27x faster)
        const char* next = reinterpret_cast<const char*>(qp + (n0 + RN) * K);
        for (int64_t off = 0; off < RN * K; off += 64) __builtin_prefetch(next + off, 0, 3);
      }
      if (M < 4 && rn == 6) {
        rows<6>(xp, M, K, qp + n0 * K, yp + n0, N);
      } else if (M < 4) {
        for (int64_t j = 0; j < rn; ++j) rows<1>(xp, M, K, qp + (n0 + j) * K, yp + n0 + j, N);
      } else {
        for (int64_t j = 0; j < rn; ++j) {  // the codes as fp32 (exact), unscaled
          const int8_t* row = qp + (n0 + j) * K;
          float* wr = w.data() + j * K;
          for (int64_t k = 0; k < K; ++k) wr[k] = (float)row[k];
        }
        if (rn == 3) {
          rows<3>(xp, M, K, w.data(), yp + n0, N);
        } else {
          for (int64_t j = 0; j < rn; ++j) rows<1>(xp, M, K, w.data() + j * K, yp + n0 + j, N);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < rn; ++j) yp[m * N + n0 + j] *= sp[n0 + j];
    }
  });
  return y;
}

// ---- int4: y = x W^T with W as 4-bit codes and a bf16 scale and zero per group of K ----
// codes [N, K/2] uint8 in labkit's kernel layout: each 16 consecutive k of a row are 8 bytes,
// byte j holding k = 16b + j in its low nibble and k = 16b + 8 + j in its high one (so one
// 8-byte load and a widen give two vectors of 8 lanes: the mask is the low k, a shift the high).
// sz [N, K/G] int32: a group's bf16 scale in the low half, its bf16 zero in the high half.
// A weight is w = (q - 8) s + z, computed as q s + (z - 8 s) in one multiply-add: q s is exact
// (4 bits times bf16's 8), and so is z - 8 s for bf16 values within 2^15 of each other, so it
// rounds once, to dequantize_int4's fp32 value (tests/test_quant.py reads the weights back).
static inline void group_sb(uint32_t u, float* s, float* b) {
  const uint32_t sb = u << 16, zb = u & 0xFFFF0000u;
  float sf, zf;
  std::memcpy(&sf, &sb, 4);
  std::memcpy(&zf, &zb, 4);
  *s = sf;
  *b = zf - 8.0f * sf;
}

// RN code rows dequantized into w [RN, K] (fp32, what the register path computes in place)
static void dequant_rows(const uint8_t* c, const uint32_t* sz, int64_t K, int64_t G, int RN,
                         float* w) {
  const int64_t ng = K / G;
  for (int j = 0; j < RN; ++j)
    for (int64_t g = 0; g < ng; ++g) {
      float s, b;
      group_sb(sz[j * ng + g], &s, &b);
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        const uint8_t* p = c + j * (K / 2) + k / 2;
#ifdef __AVX2__
        const __m256i v =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
        _mm256_storeu_ps(w + j * K + k, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), sv, bv));
        _mm256_storeu_ps(w + j * K + k + 8, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), sv, bv));
#else
        for (int l = 0; l < 8; ++l) {
          w[j * K + k + l] = (float)(p[l] & 15) * s + b;
          w[j * K + k + 8 + l] = (float)(p[l] >> 4) * s + b;
        }
#endif
      }
    }
}

// RM rows of x against RN code rows, the weights dequantized in registers: every output the
// same operations on the same values as tile<RM, RN> over dequant_rows' buffer (k ascending by
// 8 into one accumulator, the fixed lane reduction; K % 16 == 0, so no tail).
template <int RM, int RN>
static inline void tile4(const float* x, int64_t ldx, const uint8_t* c, const uint32_t* sz,
                         int64_t K, int64_t G, float* y, int64_t ldy) {
  const int64_t ng = K / G;
#ifdef __AVX2__
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t g = 0; g < ng; ++g) {
    float s[RN], b[RN];
    for (int j = 0; j < RN; ++j) group_sb(sz[j * ng + g], &s[j], &b[j]);
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      __m256i v[RN];
      for (int j = 0; j < RN; ++j)
        v[j] = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j * (K / 2) + k / 2)));
      for (int h = 0; h < 2; ++h)  // the low nibbles (k..k+7), then the high (k+8..k+15)
        for (int j = 0; j < RN; ++j) {
          const __m256 w = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(h ? _mm256_srli_epi32(v[j], 4) : _mm256_and_si256(v[j], mask)),
              _mm256_set1_ps(s[j]), _mm256_set1_ps(b[j]));
          for (int i = 0; i < RM; ++i)
            acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8 * h), w, acc[i][j]);
        }
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) y[i * ldy + j] = lanes_sum(acc[i][j]);
#else
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t g = 0; g < ng; ++g) {
        float s, b;
        group_sb(sz[j * ng + g], &s, &b);
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
          const uint8_t* p = c + j * (K / 2) + k / 2;
          for (int l = 0; l < 8; ++l) lane[l] += x[i * ldx + k + l] * ((float)(p[l] & 15) * s + b);
          for (int l = 0; l < 8; ++l)
            lane[l] += x[i * ldx + k + 8 + l] * ((float)(p[l] >> 4) * s + b);
        }
      }
      y[i * ldy + j] = sum8(lane);
    }
#endif
}

// one to three rows of x against RN code rows, the codes dequantized once for all of them
template <int RN>
static void rows4(const float* x, int64_t M, int64_t K, int64_t G, const uint8_t* c,
                  const uint32_t* sz, float* y, int64_t N) {
  switch (M) {
    case 3: tile4<3, RN>(x, K, c, sz, K, G, y, N); break;
    case 2: tile4<2, RN>(x, K, c, sz, K, G, y, N); break;
    case 1: tile4<1, RN>(x, K, c, sz, K, G, y, N); break;
    default: break;
  }
}

// y [M, N] = x [M, K] (fp32, contiguous) times int4 codes [N, K/2] (the layout above) with
// group scales and zeros sz [N, K/G]. One to three rows of x dequantize the codes in registers
// (one row: 4 code rows at a time; two or three: 2, or their accumulators spill); more rows
// dequantize 3 code rows into an fp32 buffer that stays in L1 and reuse it for every row, in
// tiles of up to 4 x 3. Both give every output the same sums.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor sz) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 16 == 0 && codes.size(1) == K / 2 && sz.size(0) == N && sz.size(1) > 0 &&
                  K % sz.size(1) == 0 && (K / sz.size(1)) % 16 == 0 && codes.is_contiguous() &&
                  sz.is_contiguous() && x.is_contiguous() && codes.scalar_type() == at::kByte &&
                  sz.scalar_type() == at::kInt,
              "int4_linear: x [M, K], codes [N, K/2] uint8, sz [N, K/G] int32, K % 16 == 0, "
              "G % 16 == 0");
  const int64_t G = K / sz.size(1), ng = sz.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(sz.data_ptr<int32_t>());
  float* yp = y.data_ptr<float>();
  const int64_t RN = M == 1 ? 4 : M < 4 ? 2 : 3;
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(M < 4 ? 0 : RN * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      if (b + 1 < b1) {  // this thread's next block, asked for now (as in int8_linear)
        const char* next = reinterpret_cast<const char*>(cp + (n0 + RN) * (K / 2));
        for (int64_t off = 0; off < RN * (K / 2); off += 64) __builtin_prefetch(next + off, 0, 3);
        __builtin_prefetch(sp + (n0 + RN) * ng, 0, 3);
      }
      const uint8_t* c = cp + n0 * (K / 2);
      const uint32_t* s = sp + n0 * ng;
      if (M < 4 && rn == 4) {
        rows4<4>(xp, M, K, G, c, s, yp + n0, N);
      } else if (M < 4 && rn == 2) {
        rows4<2>(xp, M, K, G, c, s, yp + n0, N);
      } else if (M < 4) {
        for (int64_t j = 0; j < rn; ++j)
          rows4<1>(xp, M, K, G, c + j * (K / 2), s + j * ng, yp + n0 + j, N);
      } else {
        dequant_rows(c, s, K, G, (int)rn, w.data());
        if (rn == 3) {
          rows<3>(xp, M, K, w.data(), yp + n0, N);
        } else {
          for (int64_t j = 0; j < rn; ++j) rows<1>(xp, M, K, w.data() + j * K, yp + n0 + j, N);
        }
      }
    }
  });
  return y;
}

// ---- int4 on a bf16 dot product (AVX512-BF16 CPUs: the build for them defines it) ----
// Where the CPU multiplies bf16 pairs into fp32 sums (vdpbf16ps: 32 multiply-adds an
// instruction), int4 need not become fp32 at all: a code 0..15 is exact in bf16, so a 16-entry
// lookup (vpermw) turns 32 codes into bf16 in one instruction, and the group's scale and zero
// are applied once per group: y[m, n] = sum_g s[n,g] sum_{k in g} x'[m,k] q[n,k]
//                                            + (z[n,g] - 8 s[n,g]) sum_{k in g} x'[m,k],
// x' being x rounded to bf16 (the only rounding the fp32 kernel does not make; torch's packed
// kernels round x the same way). Lanes are 16 output rows, not 16 k: codes [N/16, K/4, 32]
// uint8, byte 2i+e of a (row block, k/4) holding row i's k = 4t+e in its low nibble and
// k = 4t+2+e in its high one (`int4_bf16_layout`), so one 32-byte load, a widen, a mask and a
// shift give the (k, k+1) pairs of 16 rows for two dot products; sz [N/16, K/G, 32] int16: a
// group's 16 bf16 scales, then its 16 zeros. Each output: pairs (4t, 4t+1) into one group
// sum, (4t+2, 4t+3) into another, added at the group's end, scaled, its zero term added, in
// that order whatever the number of rows: batch-invariant as the fp32 kernels are.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static constexpr bool kBf16Dot = true;

// RM rows of x against RB blocks of 16 output rows (several blocks: independent sums in flight
// when there are few rows of x; the sums themselves are the same for every RB and RM)
template <int RB, int RM>
static inline void bf16_block(const uint32_t* xb, const float* xs, int64_t K, int64_t ng,
                              int64_t G, const uint8_t* c, const uint16_t* sz, float* y,
                              int64_t ldy) {
  const __m512i table = _mm512_set_epi16(  // bf16 of 0..15 (entries 16..31 unused)
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
      0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i lo = _mm512_set1_epi16(15);
  const int64_t cs = K * 8, ss = ng * 32, kg = G / 4;  // a block's bytes of codes, of sz
  __m512 acc[RM][RB];
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 a0[RM][RB], a1[RM][RB];  // the group's sums: pairs (4t, 4t+1), pairs (4t+2, 4t+3)
    for (int i = 0; i < RM; ++i)
      for (int r = 0; r < RB; ++r) a0[i][r] = a1[i][r] = _mm512_setzero_ps();
    for (int64_t t = g * kg; t < (g + 1) * kg; ++t)
      for (int r = 0; r < RB; ++r) {
        const __m512i b = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * cs + t * 32)));
        const __m512i w0 = _mm512_permutexvar_epi16(_mm512_and_si512(b, lo), table);
        const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        for (int i = 0; i < RM; ++i) {
          const uint32_t* xr = xb + i * (K / 2) + 2 * t;
          a0[i][r] = _mm512_dpbf16_ps(a0[i][r], (__m512bh)w0,
                                      (__m512bh)_mm512_set1_epi32((int)xr[0]));
          a1[i][r] = _mm512_dpbf16_ps(a1[i][r], (__m512bh)w1,
                                      (__m512bh)_mm512_set1_epi32((int)xr[1]));
        }
      }
    for (int r = 0; r < RB; ++r) {
      const uint16_t* p = sz + r * ss + g * 32;
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
      const __m512 bz = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), s, z);  // z - 8 s, exact
      for (int i = 0; i < RM; ++i) {
        acc[i][r] = _mm512_fmadd_ps(_mm512_add_ps(a0[i][r], a1[i][r]), s, acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(bz, _mm512_set1_ps(xs[i * ng + g]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(y + i * ldy + r * 16, acc[i][r]);
}

// up to 8 rows of x (they share each decoded code vector) against RB blocks
template <int RB>
static inline void bf16_rows(const uint32_t* xb, const float* xs, int64_t M, int64_t K,
                             int64_t ng, int64_t G, const uint8_t* c, const uint16_t* sz,
                             float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += 8) {
    const uint32_t* xq = xb + m * K / 2;
    const float* xsq = xs + m * ng;
    float* yq = y + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: bf16_block<RB, 8>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 7: bf16_block<RB, 7>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 6: bf16_block<RB, 6>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 5: bf16_block<RB, 5>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 4: bf16_block<RB, 4>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 3: bf16_block<RB, 3>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      case 2: bf16_block<RB, 2>(xq, xsq, K, ng, G, c, sz, yq, N); break;
      default: bf16_block<RB, 1>(xq, xsq, K, ng, G, c, sz, yq, N); break;
    }
  }
}

// y [M, N] = x [M, K] (fp32) times the int4 codes in int4_bf16_layout. One row of x takes 4
// blocks of 16 output rows at a time, two or three rows take 2, more take 1.
torch::Tensor int4_linear_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor sz) {
  const int64_t M = x.size(0), K = x.size(1), NB = codes.size(0), N = NB * 16;
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && sz.dim() == 2 && K % 32 == 0 &&
                  codes.size(1) == K * 8 && sz.size(0) == NB && sz.size(1) % 32 == 0 &&
                  sz.size(1) > 0 && K % (sz.size(1) / 32) == 0 &&
                  (K / (sz.size(1) / 32)) % 4 == 0 && x.is_contiguous() &&
                  codes.is_contiguous() && sz.is_contiguous() &&
                  x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  sz.scalar_type() == at::kShort,
              "int4_linear_bf16: x [M, K] fp32, codes [N/16, 8K] uint8, sz [N/16, 32 K/G] "
              "int16, K % 32 == 0, G % 4 == 0");
  const int64_t ng = sz.size(1) / 32, G = K / ng;
  auto y = torch::empty({M, N}, x.options());
  // x rounded to bf16 once per call (pairs as uint32), and each group's sum of those values
  std::vector<uint32_t> xb(M * K / 2);
  std::vector<float> xs(M * ng);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 32)
      _mm512_storeu_si512(xb.data() + (m * K + k) / 2,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + m * K + k + 16),
                                                       _mm512_loadu_ps(xp + m * K + k)));
    const uint16_t* h = reinterpret_cast<const uint16_t*>(xb.data() + m * K / 2);
    for (int64_t g = 0; g < ng; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        const uint32_t u = (uint32_t)h[k] << 16;
        float f;
        std::memcpy(&f, &u, 4);
        sum += f;
      }
      xs[m * ng + g] = sum;
    }
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const int64_t cs = K * 8, ss = ng * 32, RB = M == 1 ? 4 : M < 4 ? 2 : 1;
  const int64_t nitems = (NB + RB - 1) / RB;
  const uint32_t* xq = xb.data();
  const float* xsq = xs.data();
  at::parallel_for(0, nitems, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * RB, rb = std::min<int64_t>(RB, NB - r0);
      if (rb == 4) {
        bf16_rows<4>(xq, xsq, M, K, ng, G, cp + r0 * cs, sp + r0 * ss, yp + r0 * 16, N);
      } else if (rb == 2) {
        bf16_rows<2>(xq, xsq, M, K, ng, G, cp + r0 * cs, sp + r0 * ss, yp + r0 * 16, N);
      } else {  // one block at a time (and the last, short item of 4)
        for (int64_t r = r0; r < r0 + rb; ++r)
          bf16_rows<1>(xq, xsq, M, K, ng, G, cp + r * cs, sp + r * ss, yp + r * 16, N);
      }
    }
  });
  return y;
}
#else
static constexpr bool kBf16Dot = false;

torch::Tensor int4_linear_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor sz) {
  TORCH_CHECK(false, "int4_linear_bf16: this build has no bf16 dot product (AVX512-BF16)");
  return x;
}
#endif

bool has_bf16_dot() { return kBf16Dot; }

// ---- attention over the KV pool, read in place through each sequence's slots ----

#ifdef __AVX2__
// exp of 8 floats (Cephes' single-precision scheme): x = n ln2 + r, |r| <= ln2 / 2, then
// e^r by a degree-6 polynomial and 2^n by the exponent bits. Relative error ~2e-7.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}


// the lane sums of four vectors, [sum a, sum b, sum c, sum d], in one fixed order
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores of GC query heads (q, rows D apart) against 4 key rows at once (independent sums in
// flight: one dot product alone waits on its own FMA chain). s[g * lds + j] for j < n.
template <int GC>
static inline void scores4(const float* q, const float* const* kr, int64_t D, float scale,
                           float* s, int64_t lds, int n) {
  const int64_t D8 = D - D % 8;
  __m256 acc[4][GC];
  for (int j = 0; j < 4; ++j)
    for (int g = 0; g < GC; ++g) acc[j][g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 qv[GC];
    for (int g = 0; g < GC; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_loadu_ps(kr[j] + d);
      for (int g = 0; g < GC; ++g) acc[j][g] = _mm256_fmadd_ps(qv[g], kv, acc[j][g]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    alignas(16) float r[4];
    _mm_store_ps(r, sum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
    for (int j = 0; j < n; ++j) {
      for (int64_t d = D8; d < D; ++d) r[j] += q[g * D + d] * kr[j][d];
      s[g * lds + j] = r[j] * scale;
    }
  }
}

// o[g][d0 .. d0 + 8C) = inv[g] * sum over keys p of w[g * nk + p] * v_p[d0 ..], keys in order;
// GC x C accumulators stay in registers for the whole context
template <int GC, int C>
static inline void weighted_v(const float* w, const float* vp, const int64_t* off, int64_t nk,
                              int64_t d0, const float* inv, float* o, int64_t D) {
  __m256 acc[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t p = 0; p < nk; ++p) {
    const float* vr = vp + off[p] + d0;
    __m256 wv[GC];
    for (int g = 0; g < GC; ++g) wv[g] = _mm256_set1_ps(w[g * nk + p]);
    for (int c = 0; c < C; ++c) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * c);
      for (int g = 0; g < GC; ++g) acc[g][c] = _mm256_fmadd_ps(wv[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(o + g * D + d0 + 8 * c,
                       _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

template <int GC>
static void scores_all(const float* q, const float* kp, const int64_t* off, int64_t nk,
                       int64_t D, float scale, float* s) {
  for (int64_t p = 0; p < nk; p += 4) {
    const int n = (int)std::min<int64_t>(4, nk - p);
    const float* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = kp + off[p + (j < n ? j : 0)];  // padding: re-read
    scores4<GC>(q, kr, D, scale, s + p, nk, n);
  }
}

template <int GC>
static void weighted_all(const float* w, int64_t nk, const float* vp, const int64_t* off,
                         int64_t D, const float* inv, float* o) {
  const int64_t D8 = D - D % 8;
  int64_t d0 = 0;
  for (; d0 + 32 <= D8; d0 += 32) weighted_v<GC, 4>(w, vp, off, nk, d0, inv, o, D);
  switch ((D8 - d0) / 8) {
    case 3: weighted_v<GC, 3>(w, vp, off, nk, d0, inv, o, D); break;
    case 2: weighted_v<GC, 2>(w, vp, off, nk, d0, inv, o, D); break;
    case 1: weighted_v<GC, 1>(w, vp, off, nk, d0, inv, o, D); break;
    default: break;
  }
  for (int g = 0; g < GC; ++g)
    for (int64_t d = D8; d < D; ++d) {
      float a = 0.0f;
      for (int64_t p = 0; p < nk; ++p) a += w[g * nk + p] * vp[off[p] + d];
      o[g * D + d] = a * inv[g];
    }
}
#endif

static inline float dot(const float* a, const float* b, int64_t D) {
  const int64_t D8 = D - D % 8;
  float s;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  s = lanes_sum(acc);
#else
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D8; d += 8)
    for (int j = 0; j < 8; ++j) l[j] += a[d + j] * b[d + j];
  s = sum8(l);
#endif
  for (int64_t d = D8; d < D; ++d) s += a[d] * b[d];
  return s;
}

// p[0..n) = exp(p - max), returns their sum; every element through the same exp
static float exp_and_sum(float* p, int64_t n, float max) {
  const int64_t n8 = n - n % 8;
  float total;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = lanes_sum(acc);
  if (n8 < n) {
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = n8 + j < n ? p[n8 + j] - max : -100.0f;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t j = 0; n8 + j < n; ++j) { p[n8 + j] = tail[j]; total += tail[j]; }
  }
#else
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n8; i += 8)
    for (int j = 0; j < 8; ++j) { p[i + j] = std::exp(p[i + j] - max); l[j] += p[i + j]; }
  total = sum8(l);
  for (int64_t i = n8; i < n; ++i) { p[i] = std::exp(p[i] - max); total += p[i]; }
#endif
  return total;
}

// s[g * nk + p] = scale * (query head g . key p) for the G query heads at qh (D apart) and
// the nk keys whose rows start at kp + off[p]
static void scores(const float* qh, const float* kp, const int64_t* off, int64_t nk,
                   int64_t G, int64_t D, float scale, float* s) {
#ifdef __AVX2__
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // query heads three at a time (registers)
    switch (std::min<int64_t>(3, G - g0)) {
      case 3: scores_all<3>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk); break;
      case 2: scores_all<2>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk); break;
      default: scores_all<1>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk); break;
    }
  }
#else
  for (int64_t p = 0; p < nk; ++p)
    for (int64_t g = 0; g < G; ++g) s[g * nk + p] = dot(qh + g * D, kp + off[p], D) * scale;
#endif
}

// oh[g] = inv[g] * sum over keys p of w[g * nk + p] * (value row at vp + off[p]), keys in order
static void weighted(const float* w, int64_t nk, const float* vp, const int64_t* off,
                     int64_t G, int64_t D, const float* inv, float* oh) {
#ifdef __AVX2__
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    switch (std::min<int64_t>(3, G - g0)) {
      case 3: weighted_all<3>(w + g0 * nk, nk, vp, off, D, inv + g0, oh + g0 * D); break;
      case 2: weighted_all<2>(w + g0 * nk, nk, vp, off, D, inv + g0, oh + g0 * D); break;
      default: weighted_all<1>(w + g0 * nk, nk, vp, off, D, inv + g0, oh + g0 * D); break;
    }
  }
#else
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      float a = 0.0f;
      for (int64_t p = 0; p < nk; ++p) a += w[g * nk + p] * vp[off[p] + d];
      oh[g * D + d] = a * inv[g];
    }
#endif
}

// one work item: the G query heads at qh (of one token and KV head hk) over the nk keys at
// the context slots row[0 .. nk); output at oh. score and off are the thread's scratch.
static void attend_item(const float* qh, const float* kp, const float* vp, const int64_t* row,
                        int64_t nk, int64_t hk, int64_t Hkv, int64_t G, int64_t D, float scale,
                        float* oh, std::vector<float>& score, std::vector<int64_t>& off) {
  score.resize(G * nk);  // [G, nk]
  off.resize(nk);  // where key p's row of KV head hk starts, in k and in v
  for (int64_t p = 0; p < nk; ++p) off[p] = (row[p] * Hkv + hk) * D;
  scores(qh, kp, off.data(), nk, G, D, scale, score.data());
  float inv[64];  // 1 / softmax denominator of each query head (G <= 64, checked)
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place, and their sums
    float* s = score.data() + g * nk;
    float m = s[0];
    for (int64_t p = 1; p < nk; ++p) m = std::max(m, s[p]);
    inv[g] = 1.0f / exp_and_sum(s, nk, m);
  }
  weighted(score.data(), nk, vp, off.data(), G, D, inv, oh);
}

// the new tokens' k and v ([T, Hkv, D], rows of any stride) into the pool k, v [S, Hkv, D] at
// write_slots [T]: one call instead of two index_copy_ a layer
static void write_kv(const torch::Tensor& k_new, const torch::Tensor& v_new,
                     const int64_t* wp, int64_t S, float* kw, float* vw) {
  const int64_t T = k_new.size(0), Hkv = k_new.size(1), D = k_new.size(2);
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(wp[t] >= 0 && wp[t] < S, "a write slot outside the pool");
    for (int64_t h = 0; h < Hkv; ++h) {
      std::copy_n(kn + t * k_new.stride(0) + h * k_new.stride(1), D, kw + (wp[t] * Hkv + h) * D);
      std::copy_n(vn + t * v_new.stride(0) + h * v_new.stride(1), D, vw + (wp[t] * Hkv + h) * D);
    }
  }
}

// Writes k_new, v_new at write_slots, then returns out [T, H, D] = softmax(q k^T * scale) v
// for every new token, where the keys of token t (sequence b, position pos) are the K/V pool
// rows at slots[b, 0..pos]. q: [T, H, D] (rows may be a view into the fused q|k|v projection);
// k, v: [S, Hkv, D] (one layer of the pool); slots: [B, L]; q_index: [B, Tq] packed index of
// each sequence's j-th new token, for j < query_lens[b]; positions: [T]. One work item is a
// token and a KV head: its G query heads share each K and V row read. Every item runs the
// same code whatever else is in the step (batch-invariant), in a fixed order over keys.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                              torch::Tensor write_slots, torch::Tensor k, torch::Tensor v,
                              torch::Tensor slots, torch::Tensor q_index,
                              torch::Tensor query_lens, torch::Tensor positions, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T,H,D], k/v [S,Hkv,D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.is_contiguous() &&
              v.is_contiguous(), "q rows of H * D values, k and v contiguous");
  slots = slots.contiguous(); q_index = q_index.contiguous();
  write_slots = write_slots.contiguous(); query_lens = query_lens.contiguous();
  positions = positions.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  const int64_t B = slots.size(0), L = slots.size(1), Tq = q_index.size(1), G = H / Hkv;
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0 && G <= 64, "head shapes");
  TORCH_CHECK(k_new.size(0) == T && k_new.size(1) == Hkv && k_new.size(2) == D &&
              k_new.sizes() == v_new.sizes() && k_new.stride(2) == 1 && v_new.stride(2) == 1,
              "k_new, v_new: [T, Hkv, D] with unit stride in D");
  write_kv(k_new, v_new, write_slots.data_ptr<int64_t>(), S, k.data_ptr<float>(),
           v.data_ptr<float>());

  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ip = q_index.data_ptr<int64_t>();
  const int64_t* lp = query_lens.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  // the tokens, (token, sequence, keys); checked here, before any thread reads memory
  std::vector<int64_t> tok, seq, keys;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < lp[b]; ++j) {
      const int64_t t = ip[b * Tq + j];
      TORCH_CHECK(t >= 0 && t < T && pp[t] >= 0 && pp[t] < L, "a query outside its context");
      tok.push_back(t); seq.push_back(b); keys.push_back(pp[t] + 1);
    }
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "a slot outside the pool");
  // balance the threads: at::parallel_for gives thread i the i-th equal range of the index
  // space, so deal the items (token x KV head, longest first) round-robin into those ranges;
  // -1 is a hole
  const int64_t n = (int64_t)tok.size() * Hkv;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t chunk = (n + nth - 1) / nth;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys[a / Hkv] > keys[b / Hkv]; });
  std::vector<int64_t> place(nth * chunk, -1);
  for (int64_t r = 0; r < n; ++r) place[(r % nth) * chunk + r / nth] = order[r];

  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nth * chunk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score;
    std::vector<int64_t> off;
    for (int64_t i = i0; i < i1; ++i) {
      if (place[i] < 0) continue;
      const int64_t item = place[i] / Hkv, hk = place[i] % Hkv, t = tok[item];
      attend_item(qp + t * q.stride(0) + hk * G * D, kp, vp, sp + seq[item] * L, keys[item],
                  hk, Hkv, G, D, (float)scale, op + (t * H + hk * G) * D, score, off);
    }
  });
  return out;
}

// ---- the small per-row ops of a layer, one call each instead of 3 to 9 dispatched ops ----

// y = x / sqrt(sum(x^2) / d + eps) * w for each row of x [R, d] (contiguous)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 &&
              x.size(-1) == w.size(0), "rms_norm: x [..., d] contiguous, w [d]");
  const int64_t d = w.size(0), R = x.numel() / std::max<int64_t>(d, 1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * d;
      const float ss = dot(xr, xr, d);  // fixed lane order, as everywhere here
      const float inv = 1.0f / std::sqrt(ss / (float)d + (float)eps);
      float* yr = yp + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * wp[i];
    }
  });
  return y;
}

// rotary embedding: out[t, h, i] = x[t, h, i] cos[t, i] + x[t, h, (i + D/2) % D] sin[t, i],
// the signed sin table of labkit.model.rope_tables. x: [T, Hx, D] with unit stride in D (a
// view into the fused q|k|v projection); cos, sin: [T, 1, D] contiguous; out contiguous
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const int64_t T = x.size(0), Hx = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == T * D && sin.numel() == T * D && D % 2 == 0,
              "rope: x [T, Hx, D] (unit stride in D), cos and sin [T, 1, D]");
  auto out = torch::empty({T, Hx, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hx; ++h) {
      const float* xr = xp + t * s0 + h * s1;
      const float* c = cp + t * D;
      const float* sn = sp + t * D;
      float* o = op + (t * Hx + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] = xr[i] * c[i] + xr[(i + half) % D] * sn[i];
    }
  return out;
}

// SwiGLU's middle: silu(gate) * up, each [T, F] with unit stride in F (views of one [T, 2F]
// projection are fine); silu(g) = g / (1 + exp(-g)), the exp as in attention
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
              up.stride(1) == 1, "silu_mul: gate, up [T, F] with unit stride in F");
  const int64_t T = gate.size(0), F = gate.size(1);
  auto out = torch::empty({T, F}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * gs;
      const float* u = up_ + t * us;
      float* o = op + t * F;
      int64_t i = 0;
#ifdef __AVX2__
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= F; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(u + i)));
      }
      if (i < F) {  // the tail through the same exp
        alignas(32) float tg[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tu[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; i + j < F; ++j) { tg[j] = g[i + j]; tu[j] = u[i + j]; }
        const __m256 gv = _mm256_load_ps(tg);
        const __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_store_ps(tg, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                          _mm256_load_ps(tu)));
        for (int64_t j = 0; i + j < F; ++j) o[i + j] = tg[j];
      }
#else
      for (; i < F; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
#endif
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    """Vector flags this CPU runs (the build is cached per flag set, so per CPU kind). A CPU
    with AVX512-BF16 also gets `int4_linear_bf16` (`int4_bf16_fits` says when it serves)."""
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if cap not in ("AVX2", "AVX512"):
        return []
    flags = ["-mavx2", "-mfma"]
    if cap == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
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
    bits = lambda t: t.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    return packed, (bits(scale) | (bits(zero) << 16)).contiguous()


def int4_bf16_fits(n: int, k: int, group_size: int, scale: torch.Tensor,
                   zero: torch.Tensor) -> bool:
    """Whether `int4_linear_bf16` can serve an int4 linear [n, k]: whatever `int4_linear`
    needs (`int4_fits`), and this build has the bf16 dot product (an AVX512-BF16 CPU),
    `LABKIT_BF16_DOT` is not 0, N is a multiple of 16 (lanes are output rows), K of 32."""
    return (os.environ.get("LABKIT_BF16_DOT", "1") != "0" and n % 16 == 0 and k % 32 == 0
            and int4_fits(k, group_size, scale, zero) and kernels().has_bf16_dot())


def int4_bf16_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_linear_bf16`'s operands from canonical int4 codes [N, K] (0..15) and bf16-valued
    scales and zeros [N, K/G]: codes [N/16, 8K] uint8, for each block of 16 rows and each 4
    consecutive k (t) 32 bytes, byte 2i+e holding row i's k = 4t+e in the low nibble and
    k = 4t+2+e in the high one; sz [N/16, 32 K/G] int16, per block and group the 16 rows' bf16
    scales, then their 16 zeros."""
    n, k = codes.shape
    ng = scale.shape[1]
    c = codes.to(torch.uint8).reshape(n // 16, 16, k // 4, 2, 2)  # [blk, i, t, high, e]
    c = c.permute(0, 2, 1, 4, 3)  # [blk, t, i, e, high]
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(n // 16, 8 * k).contiguous()
    s, z = (t.bfloat16().view(torch.int16).reshape(n // 16, 16, ng).transpose(1, 2)
            for t in (scale, zero))  # [blk, group, 16 rows] each
    return packed, torch.stack([s, z], 2).reshape(n // 16, 32 * ng).contiguous()


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


def _build():
    if os.environ.get("LABKIT_CPU_KERNELS", "1") == "0":
        return None
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        return None
    flags = _flags()
    module = _build_with(flags)
    if module is None and "-mavx512bf16" in flags:  # an older compiler without AVX512-BF16
        module = _build_with([f for f in flags if not f.startswith("-mavx512")])
    if module is None:  # no working compiler: torch's kernels serve instead
        warnings.warn("labkit's CPU kernels did not build; using torch's kernels and the "
                      "gather-then-SDPA attention", stacklevel=3)
    return module


def _build_with(flags: list[str]):
    from torch.utils.cpp_extension import load_inline

    name = "labkit_kernels_" + ("avx512bf16" if "-mavx512bf16" in flags
                                else "avx2" if flags else "generic")
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob(f"{name}*.so")):
        print("labkit: compiling its CPU kernels (once per machine, about a minute)...",
              file=sys.stderr, flush=True)
    try:
        # -ffp-contract=off: no FMA the source did not write, so a scalar tail sums the same
        # way in every template instance (the batch invariance above depends on it)
        return load_inline(name, cpp_sources=_SOURCE,
                           functions=["int8_linear", "int4_linear", "int4_linear_bf16",
                                      "has_bf16_dot", "paged_attention", "rms_norm", "rope",
                                      "silu_mul"],
                           extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *flags],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as err:
        print(f"labkit: the {name} build failed ({type(err).__name__})", file=sys.stderr,
              flush=True)
        return None

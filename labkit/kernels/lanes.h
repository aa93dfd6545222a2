// Shared by every labkit CPU kernel: the includes, and the fixed-order reductions that make each
// kernel batch-invariant. Every output is summed over k in ascending steps of 8 lanes, its lanes
// reduced in one fixed order (sum8), then its tail added; whatever the tile shape or the number
// of rows in a call, the same operations on the same values, so a row's result never depends on
// the other rows in its step (DESIGN.md, "Kernels are batch-invariant"). Built with
// -ffp-contract=off, so no FMA the source did not write changes a sum between template instances.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
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
// sum8 of a vector's 8 lanes, the same adds in the same order, in registers (a store and 8
// scalar loads cost a kernel at one row of x ~10% of its time: measured on fp32_linear)
static inline float lanes_sum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_permute_ps(a, 0x31));  // lanes 0, 2: a0 + a1, a2 + a3
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_permute_ps(b, 0x02)));  // (a0 + a1) + (a2 + a3)
}
#endif
#ifdef __AVX512F__
// sum8(l) + sum8(l + 8) of a vector's 16 lanes l, the same adds in the same order, in
// registers: a = l[i] + l[i + 4] in lanes 0..3 and 8..11, b = (a0 + a1), (a2 + a3) in lanes 0
// and 2 (8 and 10), c = b0 + b2 in lane 0 (8), then lane 0 + lane 8
static inline float sum16(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x31));
  const __m512 b = _mm512_add_ps(a, _mm512_permute_ps(a, 0x31));
  const __m512 c = _mm512_add_ps(b, _mm512_permute_ps(b, 0x02));
  return _mm512_cvtss_f32(c) + _mm_cvtss_f32(_mm512_extractf32x4_ps(c, 2));
}
#endif

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
#endif

// a dot product of D floats: 8 lanes, one fixed lane reduction, then the tail
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

// The pieces both attention kernels share (paged_attention.cpp, flash_attention.cpp): the
// write of a step's new k and v into the pool, the scores of a KV head's G query heads against a
// run of keys read in place, exp and sum, the weighted sum of V rows, and the dealing of work
// items to threads. Each runs the same operations on a row whatever else is in the call, keys in
// order (lanes.h): the kernels built from them are batch-invariant.
#pragma once

#include "lanes.h"

// At decode a query's key and value rows come from memory (a step's weights have passed through
// the caches since the layer was last read), scattered through the pool by its pages: met one
// demand miss after another as the loops reach them, they are latency, not bandwidth. So the
// loops ask for each row kRowsAhead rows before they read it (into L2): the scores' loop for the
// key and the value rows, the weighted sum's loop for the value rows again (found in L2 by then,
// mostly); an item asks for its first kRowsAhead keys' and values' rows as it starts
// (`prefetch_rows`). Measured on this course's 2-core VM (a SmolLM2 decode token's 30 layers,
// each read after 4 MB of other reads, the pool in 2 MiB pages; results/
// cpu-kernels-2026-12-05g.md): 1.49x at 256 keys, 1.78x at 1024, over asking for every row (up
// to 256 KB) as the item starts (8 rows ahead 1.27x, 16 1.46x, 24 1.49x); the value rows asked
// for in the scores' loop as well, 1.03-1.20x more at batch 1, 1.07-1.16x at 32.
static constexpr int64_t kRowsAhead = 32;

static inline void prefetch_row(const float* row, int64_t D) {
  const char* r = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * 4; b += 64) __builtin_prefetch(r + b, 0, 2);
}

// the first kRowsAhead of the rows of D floats at base + off[p], p < nk
static inline void prefetch_rows(const float* base, const int64_t* off, int64_t nk, int64_t D) {
  for (int64_t p = 0; p < std::min<int64_t>(nk, kRowsAhead); ++p) prefetch_row(base + off[p], D);
}

#ifdef __AVX2__
// the lane sums of four vectors, [sum a, sum b, sum c, sum d], in one fixed order
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores of GC query heads (q, rows D apart) against 4 key rows at once (independent sums in
// flight: one dot product alone waits on its own FMA chain). s[g * lds + j] for j < n. The
// sums in one array a key row, the key pointers copied in: written as one [4][GC] array,
// inlined into the kernels, GCC 12 kept the sums in registers and also stored all of them to
// the stack on every step of the loop. Without the stores paged attention at 32 rows of 256
// keys ran 1.21x faster in cache, 1.05x from memory (the three-head case written out by hand;
// this form, for every GC, 1.04x faster again in cache; results/cpu-kernels-2026-12-06b.md).
template <int GC>
static inline void scores4(const float* q, const float* const* kr, int64_t D, float scale,
                           float* s, int64_t lds, int n) {
  const int64_t D8 = D - D % 8;
  const float* k[4] = {kr[0], kr[1], kr[2], kr[3]};
  __m256 a0[GC], a1[GC], a2[GC], a3[GC];  // one array a key row
  for (int g = 0; g < GC; ++g) a0[g] = a1[g] = a2[g] = a3[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 qv[GC];
    for (int g = 0; g < GC; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
    const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d),
                 k2 = _mm256_loadu_ps(k[2] + d), k3 = _mm256_loadu_ps(k[3] + d);
    for (int g = 0; g < GC; ++g) {
      a0[g] = _mm256_fmadd_ps(qv[g], k0, a0[g]);
      a1[g] = _mm256_fmadd_ps(qv[g], k1, a1[g]);
      a2[g] = _mm256_fmadd_ps(qv[g], k2, a2[g]);
      a3[g] = _mm256_fmadd_ps(qv[g], k3, a3[g]);
    }
  }
  __m128 r[GC];
  for (int g = 0; g < GC; ++g) r[g] = sum4(a0[g], a1[g], a2[g], a3[g]);
  for (int g = 0; g < GC; ++g) {
    alignas(16) float t[4];
    _mm_store_ps(t, r[g]);
    for (int j = 0; j < n; ++j) {
      for (int64_t d = D8; d < D; ++d) t[j] += q[g * D + d] * k[j][d];
      s[g * lds + j] = t[j] * scale;
    }
  }
}

// the vector ops weighted_v needs, 8 lanes at a time (AVX2) or 16 (AVX-512)
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kN = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_times(float* p, V a, float s) {
    _mm256_storeu_ps(p, _mm256_mul_ps(a, _mm256_set1_ps(s)));
  }
};
#ifdef __AVX512F__
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kN = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_times(float* p, V a, float s) {
    _mm512_storeu_ps(p, _mm512_mul_ps(a, _mm512_set1_ps(s)));
  }
};
#endif

// o[g][d0 .. d0 + nC) = inv[g] * sum over keys p of w[g * nk + p] * v_p[d0 ..], keys in order,
// n = L's lanes; GC x C accumulators stay in registers for the whole context. Each output is
// the same multiply-adds in the same order whatever n is, so the same bits
template <class L, int GC, int C>
static inline void weighted_v(const float* w, const float* vp, const int64_t* off, int64_t nk,
                              int64_t d0, const float* inv, float* o, int64_t D) {
  typename L::V acc[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = L::zero();
  for (int64_t p = 0; p < nk; ++p) {
    if (d0 == 0 && p + kRowsAhead < nk) prefetch_row(vp + off[p + kRowsAhead], D);
    const float* vr = vp + off[p] + d0;
    typename L::V wv[GC];
    for (int g = 0; g < GC; ++g) wv[g] = L::set1(w[g * nk + p]);
    for (int c = 0; c < C; ++c) {
      const typename L::V vv = L::load(vr + L::kN * c);
      for (int g = 0; g < GC; ++g) acc[g][c] = L::fma(wv[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) L::store_times(o + g * D + d0 + L::kN * c, acc[g][c], inv[g]);
}

// weighted_v over the columns [d0, end) (end - d0 a multiple of L's lanes), up to 4 vectors a
// pass over the keys; returns end
template <class L, int GC>
static inline int64_t weighted_runs(const float* w, const float* vp, const int64_t* off,
                                    int64_t nk, int64_t d0, int64_t end, const float* inv,
                                    float* o, int64_t D) {
  for (; d0 + 4 * L::kN <= end; d0 += 4 * L::kN)
    weighted_v<L, GC, 4>(w, vp, off, nk, d0, inv, o, D);
  switch ((end - d0) / L::kN) {
    case 3: weighted_v<L, GC, 3>(w, vp, off, nk, d0, inv, o, D); break;
    case 2: weighted_v<L, GC, 2>(w, vp, off, nk, d0, inv, o, D); break;
    case 1: weighted_v<L, GC, 1>(w, vp, off, nk, d0, inv, o, D); break;
    default: break;
  }
  return end;
}

template <int GC>
static inline void scores_all(const float* q, const float* kp, const int64_t* off, int64_t nk,
                              int64_t D, float scale, float* s, const float* vp) {
  for (int64_t p = 0; p < nk; p += 4) {
    for (int64_t a = p + kRowsAhead; a < std::min<int64_t>(nk, p + kRowsAhead + 4); ++a) {
      prefetch_row(kp + off[a], D);
      if (vp) prefetch_row(vp + off[a], D);  // the value rows too, long before weighted's loop
    }
    const int n = (int)std::min<int64_t>(4, nk - p);
    const float* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = kp + off[p + (j < n ? j : 0)];  // padding: re-read
    scores4<GC>(q, kr, D, scale, s + p, nk, n);
  }
}

template <int GC>
static inline void weighted_all(const float* w, int64_t nk, const float* vp,
                                const int64_t* off, int64_t D, const float* inv, float* o) {
  const int64_t D8 = D - D % 8;
  int64_t d0 = 0;
#ifdef __AVX512F__
  // 16 lanes while they last, then 8, then one at a time. Measured against 8 lanes throughout
  // (this course's VM, 9 query heads on 3 KV heads, 64 wide, 256 keys; the same bits checked):
  // paged attention at 1 row 1.15x in cache, 1.06x from memory (a 64-wide head's values in one
  // pass over the keys, not two); at 32 rows 1.07x in cache, 1.01x from memory; 1,024 keys at
  // 1 row from memory 1.02x (results/cpu-kernels-2026-12-06c.md)
  d0 = weighted_runs<Lanes16, GC>(w, vp, off, nk, d0, D - D % 16, inv, o, D);
#endif
  weighted_runs<Lanes8, GC>(w, vp, off, nk, d0, D8, inv, o, D);
  for (int g = 0; g < GC; ++g)
    for (int64_t d = D8; d < D; ++d) {
      float a = 0.0f;
      for (int64_t p = 0; p < nk; ++p) a += w[g * nk + p] * vp[off[p] + d];
      o[g * D + d] = a * inv[g];
    }
}
#endif


// the largest of r[0..n) (n >= 1), as `m = r[0]; m = std::max(m, r[p])` finds it (NaN only
// where r[0] is; a later NaN passed over), 8 lanes at a time: max is exact, so the order does
// not change it (but for the sign of a zero, which exp(s - m) does not see). The scalar loop,
// a chain of dependent maxima, was 7% of paged attention's time at 32 rows in cache; this one
// 1.08x faster there, 1.02x from memory (results/cpu-kernels-2026-12-06b.md).
static inline float row_max(const float* r, int64_t n) {
  float m = r[0];
  int64_t p = 1;
#ifdef __AVX2__
  if (n >= 33) {
    __m256 a0 = _mm256_set1_ps(m), a1 = a0, a2 = a0, a3 = a0;
    for (; p + 32 <= n; p += 32) {  // max(x, a): a where x is NaN, as std::max(a, x) keeps a
      a0 = _mm256_max_ps(_mm256_loadu_ps(r + p), a0);
      a1 = _mm256_max_ps(_mm256_loadu_ps(r + p + 8), a1);
      a2 = _mm256_max_ps(_mm256_loadu_ps(r + p + 16), a2);
      a3 = _mm256_max_ps(_mm256_loadu_ps(r + p + 24), a3);
    }
    alignas(32) float l[8];
    _mm256_store_ps(l, _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
    for (int j = 0; j < 8; ++j) m = std::max(m, l[j]);  // (all NaN where r[0] is, or none)
  }
#endif
  for (; p < n; ++p) m = std::max(m, r[p]);
  return m;
}

// p[0..n) = exp(p - max), returns their sum; every element through the same exp
static inline float exp_and_sum(float* p, int64_t n, float max) {
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
// the nk keys whose rows start at kp + off[p]; asks for the value rows at vp + off[p] ahead too
static inline void scores(const float* qh, const float* kp, const int64_t* off, int64_t nk,
                          int64_t G, int64_t D, float scale, float* s, const float* vp) {
#ifdef __AVX2__
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // query heads three at a time (registers)
    const float* v = g0 == 0 ? vp : nullptr;  // (asked for once)
    switch (std::min<int64_t>(3, G - g0)) {
      case 3: scores_all<3>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk, v); break;
      case 2: scores_all<2>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk, v); break;
      default: scores_all<1>(qh + g0 * D, kp, off, nk, D, scale, s + g0 * nk, v); break;
    }
  }
#else
  (void)vp;
  for (int64_t p = 0; p < nk; ++p)
    for (int64_t g = 0; g < G; ++g) s[g * nk + p] = dot(qh + g * D, kp + off[p], D) * scale;
#endif
}

// oh[g] = inv[g] * sum over keys p of w[g * nk + p] * (value row at vp + off[p]), keys in order
static inline void weighted(const float* w, int64_t nk, const float* vp, const int64_t* off,
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

// the new tokens' k and v ([T, Hkv, D], rows of any stride) into the pool k, v [S, Hkv, D] at
// write_slots [T]: one call instead of two index_copy_ a layer
static inline void write_kv(const at::Tensor& k_new, const at::Tensor& v_new,
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

// at::parallel_for gives thread i the i-th equal range of [0, nth * chunk): deal the n work
// items (costliest first, by cost[i]) round-robin into those ranges, so that every thread gets
// a like share of the work; -1 is a hole. Which thread runs an item never changes its result.
static inline std::vector<int64_t> deal(const std::vector<int64_t>& cost, int64_t& nth,
                                        int64_t& chunk) {
  const int64_t n = (int64_t)cost.size();
  nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  chunk = (n + nth - 1) / nth;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<int64_t> place(nth * chunk, -1);
  for (int64_t r = 0; r < n; ++r) place[(r % nth) * chunk + r / nth] = order[r];
  return place;
}

// Work in units of Hkv items (a token's KV heads, or a tile's), unit u costing unit_cost[u]:
// where there are units enough, two a thread or more, whole units are dealt (a unit's heads
// run on one thread, one after the other), else each item on its own. `per` gets the items
// an entry of the result holds (Hkv or 1): entry e holds items e * per .. e * per + per - 1,
// item i being unit i / Hkv's KV head i % Hkv. Measured (a SmolLM2 decode step at 32 rows of
// 256 keys, alternating in one process; results/cpu-kernels-2026-12-06b.md): paged attention's
// forward 1.02x (int8 and int4 medians), flash's 1.04x over dealing items alone; likely why:
// the lines of a slot's other heads fetched beside a head's rows are then read by the thread
// that has them.
static inline std::vector<int64_t> deal_units(const std::vector<int64_t>& unit_cost,
                                              int64_t Hkv, int64_t& nth, int64_t& chunk,
                                              int64_t& per) {
  const int64_t units = (int64_t)unit_cost.size();
  per = units >= 2 * at::get_num_threads() ? Hkv : 1;
  if (per > 1) return deal(unit_cost, nth, chunk);
  std::vector<int64_t> cost(units * Hkv);
  for (int64_t i = 0; i < units * Hkv; ++i) cost[i] = unit_cost[i / Hkv];
  return deal(cost, nth, chunk);
}

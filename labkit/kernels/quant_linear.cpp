// The linears labkit computes itself, y = x W^T: fp32_linear (fp32 weights, a few rows), and
// with W stored in fewer bits int8_linear (int8 codes, one fp32 scale per output row; on an
// integer dot product with x held as int16 where the CPU has AVX512-VNNI), int4_linear (4-bit
// codes, a bf16 scale and zero per group of K) and int4_linear_dot (the same on an integer dot
// product with x held as int16, AVX512-VNNI CPUs). int4_linear's many-row path reuses the fp32
// tiles on codes it dequantized into an L1 buffer.
#include "lanes.h"

// Where a kernel asks for the weights it reads next: into L2 (locality 2, prefetcht1), not L1.
// Measured on this course's 2-core VM (int4 and int8 at batch 1, a whole step's 121 linears,
// beside the read probe of the same bytes in the same run): into L1 the kernels read at
// 0.55-0.63x the probe's rate, into L2 at 0.73-0.82x (likely: a prefetch into L1 holds one of
// the core's few line-fill buffers until its line arrives, and the kernel's loads queue behind).
#define LK_LOC 2

// Up to this many rows of x, each thread of an int8 or int4 kernel on the integer dot product
// makes x's int16 codes itself, into buffers it keeps (XInt16, XCodes), rather than the
// calling thread once into buffers allocated each call while the others wait. Measured (a
// SmolLM2 step's linears, one process, alternating; results/cpu-kernels-2026-12-05j.md): int4
// at batch 1 1.07x and 1.14x where the memory was quiet, 1.02x where busy; 1.06x at 2 rows,
// 1.04x at 4, 1.02x at 8, 1.00x at 16 (where the shared codes stay); int8 at batch 1
// 1.00-1.02x (busy).
static constexpr int64_t kXEachThread = 8;

// When (fp32_linear at 2 rows and more, and int8_linear on its integer dot product; fp32 at one row
// asks for nothing, `row_after_row`): a thread multiplying one block of weight rows asks for the
// block two ahead of it, spread through the block's loop, each step asking for as many bytes of
// that block as it reads of its own, so requests flow at the rate of the reads; the block after its
// first it asks for whole as it starts. Measured (a SmolLM2 step's linears, alternating in one
// process beside the read probe over the same tensors; fp32 at 1 row before it read row after row):
// fp32 at 1 row 1.26-1.29x faster than asking for the next block whole at each block's start
// (0.67-0.73x the probe's rate -> 0.86-0.92x), at 4 rows 1.51x (0.96x); int8 on its dot product
// 1.28-1.33x at 1-2 rows where the whole next block gave 1.08-1.11x. A kernel bound by its
// arithmetic rather than by the memory (int8 turning codes into fp32, int4 on bf16) measured
// 0.86-0.98x spread two ahead: its inner loop pays the requests, and it keeps asking one block
// ahead.
struct Ahead {
  const char* p = nullptr;  // the block two ahead (nothing near a thread's end)
  int64_t per = 0;          // its bytes per unit of this block's loop (a k, or a row)
  inline void at(int64_t u0, int64_t u1) const {
    if (p)
      for (int64_t o = u0 * per; o < u1 * per; o += 64) __builtin_prefetch(p + o, 0, LK_LOC);
  }
};

static inline void prefetch_bytes(const char* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, LK_LOC);
}

// block b of a thread's run [b0, b1) of blocks of `bytes` bytes from `base`: what it asks for
static inline Ahead ahead(const void* base, int64_t bytes, int64_t b, int64_t b0, int64_t b1,
                          int64_t per) {
  const char* c = static_cast<const char*>(base);
  if (b == b0 && b + 1 < b1) prefetch_bytes(c + (b + 1) * bytes, bytes);
  return b + 2 < b1 ? Ahead{c + (b + 2) * bytes, per} : Ahead{};
}

// ---- int8 ----

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
// (pf: the weights it asks for ahead, Ahead's units being k)
template <int RM, int RN, class W>
static inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y,
                        int64_t ldy, const Ahead& pf = Ahead()) {
  const int64_t K8 = K - K % 8;
#ifdef __AVX2__
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    pf.at(k, k + 8);
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
  pf.at(0, K);
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

// every row of x against RN weight rows, in tiles of RMAX rows of x and what is left (int8's
// codes: up to 4 x 3; fp32_linear: up to 3 x 6, 18 accumulators, 6 weights and an x in
// registers, the weight rows found in L1 by every tile after the first, which asks for pf)
template <int RN, int RMAX = 4, class W>
static void rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N,
                 const Ahead& pf = Ahead()) {
  int64_t m = 0;
  for (; m + RMAX <= M; m += RMAX)
    tile<RMAX, RN>(x + m * K, K, w, K, y + m * N, N, m == 0 ? pf : Ahead());
  const Ahead& rest = m == 0 ? pf : Ahead();
  switch (M - m) {
    case 3: if constexpr (RMAX > 3) tile<3, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    case 2: tile<2, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    case 1: tile<1, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    default: break;
  }
}

// ---- int8 on an integer dot product (AVX512-VNNI CPUs: the build for them defines it) ----
// Turning int8 codes into fp32 costs two vector ops per 8 weights before their multiply-add:
// with its weights in cache the fp32 path below multiplies 18-22 GB/s of codes on this
// course's 2 cores, no faster than memory delivers them, so it can never read faster. Here x
// is held as int16 instead: each block of 64 of a row's values gets one fp32 scale (its largest
// |x| / 32639) and each value the nearest of those levels (within amax / 65278 of its own:
// finer than bf16's rounding, which torch's kernels make). y[m, n] = s[n] * (sum_b xs[m, b] *
// sum_{k in b} xq[m, k] q[n, k]): each block's integer sum, exact, made fp32 and multiply-added
// (one rounding) into the output's sum, blocks in order (the last one short where K % 64), then
// the row's scale. Integer sums are exact in any order, so every tile shape gives every output
// the same bits (batch-invariant), and int8_linear_dot gives the bits int8_linear gives.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr bool kInt8Dot = true;
static constexpr int64_t kXBlock = 64;
// x's codes within +-this (int8's and int4's integer dot products alike): a code c is then
// 256 h + l with both bytes int8, h = (c + 128) >> 8 <= 127 (split_codes)
static constexpr float kXLevels = 32639.f;
// a block whose largest |x| is below this is held as zeros (32639 / amax would overflow
// to inf near FLT_MIN, and inf times x would turn into codes -2^31); each value moves
// by less than 1e-30
static constexpr float kTinyX = 1e-30f;

// a row of x as int16 codes q [K] and one scale a block s [ceil(K / 64)] (a NaN in a block
// makes its scale NaN, so the outputs it reaches are NaN, as an fp32 product's would be; its
// codes are held in range)
static void x_to_int16(const float* x, int64_t K, int16_t* q, float* s) {
  const __m512i lim = _mm512_set1_epi32((int)kXLevels);
  for (int64_t k0 = 0; k0 < K; k0 += kXBlock) {
    const int64_t n = std::min<int64_t>(kXBlock, K - k0);
    __m512 v[4];
    __mmask16 in[4];
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int u = 0; u < 4; ++u) {
      const int64_t r = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * u));
      in[u] = (__mmask16)((1u << r) - 1);
      v[u] = _mm512_maskz_loadu_ps(in[u], x + k0 + 16 * u);
      m = _mm512_max_ps(m, _mm512_abs_ps(v[u]));
      nan |= _mm512_cmp_ps_mask(v[u], v[u], _CMP_UNORD_Q);
    }
    const float amax = nan ? NAN : _mm512_reduce_max_ps(m);
    const float inv = amax > kTinyX ? kXLevels / amax : 0.f;
    s[k0 / kXBlock] = amax / kXLevels;
    for (int u = 0; u < 4; ++u) {  // rounded to nearest, ties to even (as std::nearbyint)
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[u], _mm512_set1_ps(inv)));
      c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_sub_epi32(_mm512_setzero_si512(), lim)),
                           lim);
      _mm256_mask_storeu_epi16(q + k0 + 16 * u, in[u], _mm512_cvtepi32_epi16(c));
    }
  }
}

// 16 codes c (|c| <= kXLevels, int32 lanes) as their high and low bytes, c = 256 h + l, both
// int8: what vpdpbusd multiplies (one of its operands must be bytes)
static inline void split_codes(__m512i c, int8_t* h, int8_t* l) {
  const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(128)), 8);
  const __m512i lo = _mm512_sub_epi32(c, _mm512_slli_epi32(hi, 8));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm512_cvtepi32_epi8(hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtepi32_epi8(lo));
}

// rows of x as int16 codes (x_to_int16, the rows spread over the threads where there are many):
// codes [M, K], scales [M, ceil(K / 64)]
struct XInt16 {
  std::vector<int16_t> q;
  std::vector<float> s;
  void fill(const float* x, int64_t M, int64_t K) {
    const int64_t nb = (K + kXBlock - 1) / kXBlock;
    q.resize(M * K);
    s.resize(M * nb);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        x_to_int16(x + m * K, K, q.data() + m * K, s.data() + m * nb);
    });
  }
};

// -- int8_linear: the codes as they are, [N, K] --

// RM rows of x (int16 codes xq, block scales xs, K values a row) against RN code rows w [RN, K]:
// y[i][j] = sum over blocks of (exact integer sum) x its scale, as int8_linear_dot sums
template <int RM, int RN>
static inline void tile_i16(const int16_t* xq, const float* xs, int64_t K, const int8_t* w,
                            float* y, int64_t ldy, const Ahead& pf) {
  const int64_t KB = K - K % kXBlock, nb = (K + kXBlock - 1) / kXBlock;
  float acc[RM][RN] = {};
  for (int64_t k0 = 0; k0 < KB; k0 += kXBlock) {
    pf.at(k0, k0 + kXBlock);
    __m512i d[RM][RN];
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j) d[i][j] = _mm512_setzero_si512();
    for (int64_t h = 0; h < kXBlock; h += 32) {
      __m512i wv[RN];
      for (int j = 0; j < RN; ++j)
        wv[j] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k0 + h)));
      for (int i = 0; i < RM; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq + i * K + k0 + h);
        for (int j = 0; j < RN; ++j) d[i][j] = _mm512_dpwssd_epi32(d[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j)
        acc[i][j] = std::fma((float)_mm512_reduce_add_epi32(d[i][j]),
                             xs[i * nb + k0 / kXBlock], acc[i][j]);
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      if (KB < K) {
        int32_t d = 0;
        for (int64_t k = KB; k < K; ++k) d += (int32_t)xq[i * K + k] * (int32_t)w[j * K + k];
        acc[i][j] = std::fma((float)d, xs[i * nb + KB / kXBlock], acc[i][j]);
      }
      y[i * ldy + j] = acc[i][j];
    }
}

// every row of x against RN code rows, in tiles of RMAX rows (the first asks for pf)
template <int RN, int RMAX>
static void rows_i16(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w,
                     float* y, int64_t N, const Ahead& pf) {
  const int64_t nb = (K + kXBlock - 1) / kXBlock;
  int64_t m = 0;
  for (; m + RMAX <= M; m += RMAX)
    tile_i16<RMAX, RN>(xq + m * K, xs + m * nb, K, w, y + m * N, N, m ? Ahead() : pf);
  const Ahead& rest = m == 0 ? pf : Ahead();
  const int16_t* xr = xq + m * K;
  const float* sr = xs + m * nb;
  switch (M - m) {
    case 3: if constexpr (RMAX > 3) tile_i16<3, RN>(xr, sr, K, w, y + m * N, N, rest); break;
    case 2: if constexpr (RMAX > 2) tile_i16<2, RN>(xr, sr, K, w, y + m * N, N, rest); break;
    case 1: tile_i16<1, RN>(xr, sr, K, w, y + m * N, N, rest); break;
    default: break;
  }
}

// int8_linear's arithmetic here: one or two rows of x take 6 code rows at a time, more take 3
// in tiles of up to 4 x 3 (the code rows found in L1 by every tile after the first); each
// row's scale applied once, to the finished sum
static void int8_into(const float* xp, const int8_t* qp, const float* sp, float* yp,
                      int64_t M, int64_t K, int64_t N) {
  XInt16 xc;
  xc.fill(xp, M, K);
  const int16_t* xqp = xc.q.data();
  const float* xsp = xc.s.data();
  const int64_t RN = M <= 2 ? 6 : 3;
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      const int8_t* blk = qp + n0 * K;
      const Ahead pf = ahead(qp, RN * K, b, b0, b1, RN);  // units of k: RN bytes
      if (rn == 6) {
        rows_i16<6, 2>(xqp, xsp, M, K, blk, yp + n0, N, pf);
      } else if (rn == 3) {
        rows_i16<3, 4>(xqp, xsp, M, K, blk, yp + n0, N, pf);
      } else {
        for (int64_t j = 0; j < rn; ++j)
          rows_i16<1, 4>(xqp, xsp, M, K, blk + j * K, yp + n0 + j, N, Ahead());
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < rn; ++j) yp[m * N + n0 + j] *= sp[n0 + j];
    }
  });
}

// -- int8_linear_dot: the codes in int8_dot_layout --
// int8_linear's sums on vpdpbusd, which multiplies 64 uint8 by 64 int8 and adds them in fours
// into 16 int32 lanes: twice the products of vpdpwssd (int16 by int16) an instruction, and the
// codes need no widening first. Each code is held as q + 128 (uint8), 16 output rows side by
// side (a lane a row: [ceil(N / 16), ceil(K / 64), 16 k-quads, 16 rows, 4] bytes, each block of
// 16 rows one run a thread reads front to back), and x's code c = 256 h + l as two int8, h =
// (c + 128) >> 8: the sum of c (q + 128) is 256 sum(h (q + 128)) + sum(l (q + 128)), and
// the 128 sum(c) it carries beyond sum(c q) is taken off once a block. The same integers as
// int8_linear's, so the same bits. Measured (results/cpu-kernels-2026-12-06.md): a SmolLM2
// step's int8 linears, in one process against int8_linear_tiled (vpdpwssd on tiles of 6 rows)
// on the same codes, both asking ahead at every row count: 1.00-1.04x at batch 1 where the
// memory is busy (both read at ~0.85x the probe), 1.4x at 4 rows, 1.7-1.9x at 8 and 32 (bound
// by their dot products there); a single linear in cache at batch 1 1.3-1.5x. At one or two
// rows it now asks for nothing ahead (kDot8AskFrom).

// x's rows for int8_linear_dot: their codes' high and low bytes (h, l: ldx words a row, zeros
// past K), and for each block its scale (s) and 128 times its codes' sum (corr)
struct X8Codes {
  std::vector<int16_t> q;
  std::vector<int32_t> h, l, corr;
  std::vector<float> s;
  int64_t ldx = 0, nb = 0;  // words of h (l) a row, blocks a row
  void fill(const float* x, int64_t M, int64_t K) {
    nb = (K + kXBlock - 1) / kXBlock;
    ldx = nb * kXBlock / 4;
    q.assign(nb * kXBlock, 0);
    h.resize(M * ldx);
    l.resize(M * ldx);
    corr.resize(M * nb);
    s.resize(M * nb);
    for (int64_t m = 0; m < M; ++m) {
      x_to_int16(x + m * K, K, q.data(), s.data() + m * nb);
      int8_t* hb = reinterpret_cast<int8_t*>(h.data() + m * ldx);
      int8_t* lb = reinterpret_cast<int8_t*>(l.data() + m * ldx);
      for (int64_t c = 0; c < nb; ++c) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = c * kXBlock; k < (c + 1) * kXBlock; k += 16) {
          const __m512i v = _mm512_cvtepi16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.data() + k)));
          split_codes(v, hb + k, lb + k);
          sum = _mm512_add_epi32(sum, v);
        }
        corr[m * nb + c] = 128 * _mm512_reduce_add_epi32(sum);  // |corr| < 2^28
      }
    }
  }
};

// acc + the sums of 4 products of u's uint8 and s's int8 in each int32 lane (vpdpbusd; here
// and in int4_linear_dot). In assembly: GCC 12 copies the accumulator of _mm512_dpbusd_epi32
// to another register and back at each call, two moves a multiply (int4_linear_dot in cache
// at 1 row: 1.00-1.07x without them; a SmolLM2 step's int4 linears 1.00x at 1 row, 1.07x at
// 2, 1.11x at 4)
static inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
// the same, s being the int32 at p in every lane (one instruction, its broadcast embedded):
// 1.03-1.07x at one row of x in cache, 0.85-0.88x at two, so one row only
static inline __m512i dpbusd(__m512i acc, __m512i u, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*p));
  return acc;
}

// How far ahead of its reads a thread asks for the codes it reads next, where x has more than
// kDot8AskFrom rows. At one or two rows it asks for nothing: in one stream a thread the CPU's
// own prefetcher keeps up, and the requests got in its way. Measured
// (results/cpu-kernels-2026-12-06.md): one 226 MB call at one row asking 6 KiB ahead read at
// 0.65-0.77x the read probe where the memory was quiet (DRAM 55-63 GB/s) and 0.81-1.00x where
// busy; asking for nothing 0.95-1.1x and 0.95-1.04x (12 and 24 KiB ahead, or into L1, no better
// than 6). A SmolLM2 step's int8 linears asking for nothing: 1.07x at 1 row (1.01-1.12x over 30
// runs, busy) and 1.36x where quiet (48.2 GB/s against 35.0); at 2 rows 1.03-1.08x (busy), but
// 0.70x at 4 rows and 0.90x at 32, where each load feeds 8 or more dot products.
static constexpr int64_t kDot8Ahead = 6144;
static constexpr int64_t kDot8AskFrom = 2;

// RM rows of x (from m0) against one block of 16 output rows w [ceil(K / 64), 16, 16, 4]: y
// [RM, 16] (ldy apart; rn of them real), each times its row's scale rs. Asks for what lies
// `ahead` of w where given.
template <int RM>
static inline void dot8_block(const X8Codes& xc, int64_t m0, const uint8_t* w, float* y,
                              int64_t ldy, const float* rs, int64_t rn, const char* ahead) {
  const int64_t nb = xc.nb, ldx = xc.ldx;
  constexpr int CH = RM == 1 ? 2 : 1;  // sums a row (one row: four independent ones in flight)
  __m512 acc[RM];
  for (int i = 0; i < RM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nb; ++c) {
    const uint8_t* wc = w + c * 1024;
    __m512i dh[RM][CH], dl[RM][CH];
    for (int i = 0; i < RM; ++i)
      for (int e = 0; e < CH; ++e) dh[i][e] = dl[i][e] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {  // (unrolled: the sums stay in registers)
      if (ahead) __builtin_prefetch(ahead + c * 1024 + u * 64, 0, LK_LOC);
      const __m512i wv = _mm512_loadu_si512(wc + u * 64);
      for (int i = 0; i < RM; ++i) {
        const int32_t* hw = xc.h.data() + (m0 + i) * ldx + c * 16 + u;
        const int32_t* lw = xc.l.data() + (m0 + i) * ldx + c * 16 + u;
        if constexpr (RM == 1) {
          dh[i][u % CH] = dpbusd(dh[i][u % CH], wv, hw);
          dl[i][u % CH] = dpbusd(dl[i][u % CH], wv, lw);
        } else {
          dh[i][0] = dpbusd(dh[i][0], wv, _mm512_set1_epi32(*hw));
          dl[i][0] = dpbusd(dl[i][0], wv, _mm512_set1_epi32(*lw));
        }
      }
    }
    for (int i = 0; i < RM; ++i) {
      __m512i hs = dh[i][0], ls = dl[i][0];
      for (int e = 1; e < CH; ++e) {
        hs = _mm512_add_epi32(hs, dh[i][e]);
        ls = _mm512_add_epi32(ls, dl[i][e]);
      }
      // 256 |hs| < 2^30, |ls| < 2^22, |corr| < 2^28: exact
      const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls),
                                         _mm512_set1_epi32(xc.corr[(m0 + i) * nb + c]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xc.s[(m0 + i) * nb + c]),
                               acc[i]);
    }
  }
  const __mmask16 mk = (__mmask16)((1u << rn) - 1);
  const __m512 sc = _mm512_maskz_loadu_ps(mk, rs);
  for (int i = 0; i < RM; ++i) _mm512_mask_storeu_ps(y + i * ldy, mk, _mm512_mul_ps(acc[i], sc));
}

// y [M, N] = x [M, K] (fp32) times the int8 codes in int8_dot_layout and per-row scales s [N].
// Each thread an equal run of blocks of 16 rows, read front to back; rows of x 4 at a time
// (8 sums and 4 outputs in registers; 6 at a time measured no faster).
at::Tensor int8_linear_dot(at::Tensor x, at::Tensor packed, at::Tensor s) {
  const int64_t M = x.size(0), K = x.size(1), N = s.numel();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  s.scalar_type() == at::kFloat && s.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 63) / 64 &&
                  packed.size(2) == 1024,
              "int8_linear_dot: x [M, K] fp32, packed [ceil(N / 16), ceil(K / 64), 1024] "
              "uint8 (int8_dot_layout), s [N] fp32");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t NB = packed.size(0), bbytes = packed.size(1) * 1024;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NB));
  // x's codes: a decode step's few rows by each thread itself, into buffers it keeps; more
  // rows once, shared
  const bool each = M <= kXEachThread;
  X8Codes shared;
  if (!each) shared.fill(xp, M, K);
  at::parallel_for(0, nth, 1, [&](int64_t t0, int64_t t1) {
    thread_local X8Codes mine;
    if (each) mine.fill(xp, M, K);
    const X8Codes& xc = each ? mine : shared;
    for (int64_t th = t0; th < t1; ++th)
      for (int64_t b = NB * th / nth; b < NB * (th + 1) / nth; ++b) {
        const uint8_t* w = wp + b * bbytes;
        const int64_t rn = std::min<int64_t>(16, N - 16 * b);
        const float* rs = sp + 16 * b;
        for (int64_t m = 0; m < M; m += 4) {
          // the block's first pass asks for what lies ahead (many rows); the rest find it in
          // cache
          const char* a = m == 0 && M > kDot8AskFrom
                              ? reinterpret_cast<const char*>(w) + kDot8Ahead : nullptr;
          float* yb = yp + m * N + 16 * b;
          switch (std::min<int64_t>(4, M - m)) {
            case 4: dot8_block<4>(xc, m, w, yb, N, rs, rn, a); break;
            case 3: dot8_block<3>(xc, m, w, yb, N, rs, rn, a); break;
            case 2: dot8_block<2>(xc, m, w, yb, N, rs, rn, a); break;
            default: dot8_block<1>(xc, m, w, yb, N, rs, rn, a);
          }
        }
      }
  });
  return y;
}
#else
static constexpr bool kInt8Dot = false;

// int8_linear's arithmetic without the dot product: y[m, n] = (sum_k x[m, k] q[n, k]) * s[n],
// the scale once per output, not once per weight.
// One to three rows of x read the codes straight into registers, 6 weight rows at a time
// (independent sums in flight); more rows convert 3 code rows at a time into an fp32 buffer
// that stays in L1 and reuse it for every row of x, in tiles of up to 4 x 3 (12 accumulators,
// 3 weights, 1 x: 16 registers). Both give every output the same sums of the same values.
static void int8_into(const float* xp, const int8_t* qp, const float* sp, float* yp,
                      int64_t M, int64_t K, int64_t N) {
  const int64_t RN = M < 4 ? 6 : 3;
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(M < 4 ? 0 : RN * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      if (b + 1 < b1) {  // ask for this thread's next block now: its rows arrive while this
        // one is multiplied (1.27x faster here; this path is bound by its arithmetic, where
        // Ahead's spread requests measured 0.86-0.95x: instructions in its inner loop)
        prefetch_bytes(reinterpret_cast<const char*>(qp + (n0 + RN) * K), RN * K);
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
}

at::Tensor int8_linear_dot(at::Tensor x, at::Tensor packed, at::Tensor s) {
  TORCH_CHECK(false, "int8_linear_dot: this build has no integer dot product (AVX512-VNNI)");
  return x;
}
#endif

// y [M, N] = x [M, K] (fp32, contiguous) times int8 codes q [N, K] and per-row scales s [N],
// by the build's arithmetic (int8_into above: on the integer dot product, or codes to fp32)
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor s) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && s.numel() == N && q.is_contiguous() && x.is_contiguous(),
              "int8_linear: x [M, K], q [N, K], s [N]");
  auto y = at::empty({M, N}, x.options());
  int8_into(x.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(),
            M, K, N);
  return y;
}

bool has_int8_dot() { return kInt8Dot; }

// ---- fp32, few rows ----

#ifdef __AVX512F__

// RM rows of x against RN fp32 weight rows, 16 lanes: k ascending by 16 into one accumulator,
// then sum16 (K % 16 == 0). Half the instructions of tile's 8 lanes for the same bytes: the
// core keeps twice as many bytes of weights in flight (measured on this course's AVX-512 VM,
// every SmolLM2 linear at 1 and at 4 rows: 1.15x faster, 28 GB/s at 1 row beside a read probe
// of ~30; AMD's Zen 4 runs a 512-bit multiply-add as two 256-bit halves, so it is not the
// arithmetic that got faster).
template <int RM, int RN>
static inline void tile16(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                          int64_t ldy, const Ahead& pf) {
  __m512 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    pf.at(k, k + 16);
    __m512 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < RM; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) y[i * ldy + j] = sum16(acc[i][j]);
}

// every row of x against RN weight rows in tiles of up to 4 rows of x (RN = 6: 24
// accumulators, 6 weights and an x: 31 of the 32 vector registers)
template <int RN>
static void rows16(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
                   const Ahead& pf = Ahead()) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile16<4, RN>(x + m * K, K, w, K, y + m * N, N, m ? Ahead() : pf);
  const Ahead& rest = m == 0 ? pf : Ahead();
  switch (M - m) {
    case 3: tile16<3, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    case 2: tile16<2, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    case 1: tile16<1, RN>(x + m * K, K, w, K, y + m * N, N, rest); break;
    default: break;
  }
}

// One row of x (a decode step at batch 1): weight rows [n0, n1) one after the other, each read
// front to back, so a thread's share is one stream of bytes, as the read probe's. The same sums
// as tile16's (one accumulator an output, k ascending by 16, sum16): the same bits. With
// several rows of weights side by side (16 before: 16 streams 4 KiB apart, each 2-6 KiB long)
// one core read SmolLM2's weights at 0.74x the probe's rate; one after the other, at the
// probe's rate (a step's fp32 linears, alternating in one process: 1.33-1.38x when the memory
// is fast, 1.07-1.11x when it is slow, both at 0.98-1.03x the probe). With 2 to 4 rows of x
// the tiles above stay faster (0.89-0.95x this way). It asks for nothing ahead: in one stream
// the CPU's own prefetcher keeps up, as it does for the probe, which asks for nothing either.
// Asking 4 KiB ahead into L2 held the step's fp32 linears back where the memory was quiet
// (without: 1.20-1.25x in three quiet runs of four, 0.99-1.05x busy; the whole batch-1 forward
// 0.99-1.22x quiet, median 1.04x over 7 runs, 0.92-1.06x busy, median 1.01x over 18; 8 KiB
// ahead 0.74-1.01x of 4 KiB on one long call). The tiles, six weight rows side by side, keep
// their requests: without, 2 rows ran 0.69-0.84x (results/cpu-kernels-2026-12-06d.md).
static void row_after_row(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1,
                          float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(wr + k), acc);
    y[n] = sum16(acc);
  }
}
static constexpr bool kLanes16 = true;
#else
template <int RN>
static void rows16(const float*, int64_t, int64_t, const float*, float*, int64_t,
                   const Ahead& = Ahead()) {}
static void row_after_row(const float*, int64_t, const float*, int64_t, int64_t, float*) {}
static constexpr bool kLanes16 = false;
#endif

// y [M, N] = x [M, K] times fp32 weights w [N, K]^T, for the steps of a few rows (decode at a
// small batch, a speculative verify of k + 1 positions). A BLAS blocks and packs for large
// products: at a handful of rows it reads (and at some shapes copies) the weights more than
// once, and how it sums changes with M. Here every weight row is read from memory once per
// call, 6 rows at a time against tiles of up to 3 rows of x (4 with AVX-512's 16 lanes, where
// K % 16 == 0: tile16) (the 6 weight rows come from L1 for every tile after the first; one row
// of x reads them one after the other, `row_after_row`), and
// every output is the same sum of the same products whatever M is (the lanes depend on K and
// the CPU, never on M): a row's result does not depend on how many rows share its step.
// Measured on SmolLM2's shapes (this course's 2-core VM): with 2 threads torch's linear took
// 1.3-3.8x as long for 1 to 32 rows (at 1 row it used one thread); with 1 thread 1.8-2.5x at 2
// and 3 rows, 1.1-1.4x at 4 to 64. A 4-row call here costs 1.3x a 1-row one (the multiplies do
// not all hide behind the reads). Callers use it up to `kFp32KernelRows` rows (a decode step,
// a verify, a budgeted step of decode rows and prompt chunks), at::linear beyond.
at::Tensor fp32_linear(at::Tensor x, at::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  w.size(1) == K && w.is_contiguous() && x.is_contiguous(),
              "fp32_linear: x [M, K], w [N, K], fp32, contiguous");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool lanes16 = kLanes16 && K % 16 == 0;
  if (lanes16 && M == 1) {  // each thread an equal run of weight rows, read row after row
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      row_after_row(xp, K, wp, n0, n1, yp);
    });
    return y;
  }
  constexpr int64_t RN = 6;
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      const Ahead pf = ahead(wp, RN * K * 4, b, b0, b1, RN * 4);  // units of k: RN fp32s
      if (lanes16 && rn == 6) {
        rows16<6>(xp, M, K, wp + n0 * K, yp + n0, N, pf);
      } else if (lanes16) {
        for (int64_t j = 0; j < rn; ++j) rows16<1>(xp, M, K, wp + (n0 + j) * K, yp + n0 + j, N);
      } else if (rn == 6) {
        rows<6, 3>(xp, M, K, wp + n0 * K, yp + n0, N, pf);
      } else {
        for (int64_t j = 0; j < rn; ++j) rows<1, 3>(xp, M, K, wp + (n0 + j) * K, yp + n0 + j, N);
      }
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
at::Tensor int4_linear(at::Tensor x, at::Tensor codes, at::Tensor sz) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 16 == 0 && codes.size(1) == K / 2 && sz.size(0) == N && sz.size(1) > 0 &&
                  K % sz.size(1) == 0 && (K / sz.size(1)) % 16 == 0 && codes.is_contiguous() &&
                  sz.is_contiguous() && x.is_contiguous() && codes.scalar_type() == at::kByte &&
                  sz.scalar_type() == at::kInt,
              "int4_linear: x [M, K], codes [N, K/2] uint8, sz [N, K/G] int32, K % 16 == 0, "
              "G % 16 == 0");
  const int64_t G = K / sz.size(1), ng = sz.size(1);
  auto y = at::empty({M, N}, x.options());
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
        for (int64_t off = 0; off < RN * (K / 2); off += 64)
          __builtin_prefetch(next + off, 0, LK_LOC);
        __builtin_prefetch(sp + (n0 + RN) * ng, 0, LK_LOC);
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

// ---- int4 on an integer dot product (AVX512-VNNI CPUs: the build for them defines it) ----
// Where the CPU multiplies bytes into int32 sums (vpdpbusd: 64 multiply-adds an instruction,
// unsigned bytes by signed ones), int4 need not become a float at all: a code 0..15 is an
// unsigned byte once masked out of its pair, and x is held as int16 codes (one scale per
// group of K, a power of two: a value's code its nearest level, at most 32639 levels from 0,
// within amax / 32639 of it, finer than bf16's rounding), each code split into a high and a
// low signed byte (q = 256 h + l), so two byte dot products give the exact sum of code times
// code:
//   y[m, n] = sum_g sx[m,g] (s[n,g] sum_{k in g} q[n,k] xq[m,k]
//                            + (z[n,g] - 8 s[n,g]) sum_{k in g} xq[m,k]),
// which is x' W^T for x' = xq sx, the x `int4_x_as_int16` gives (W's weights exactly as
// dequantize_int4 has them: q s + z - 8 s). Lanes are 16 output rows (a block): for each 8
// k (u) of a block 64 bytes of codes, lane i's 4 holding row i's k = 8u+e in byte e's low
// nibble and k = 8u+4+e in its high one, so one 64-byte load and two masks give 8 k of 16
// rows (the high nibbles left in place, times 16, and the sum shifted back: exact); for each
// group of a block 16 int32 words, row i's bf16 scale in the low half, its bf16 zero in the
// high half. Where they lie (`int4_dot_layout`, [N/16, K/G, 8G + 64] bytes): blocks in pairs
// (the last alone when N/16 is odd), and for each pair and group one run, the first block's
// 8G bytes of codes, the second's, then the first block's 16 words and the second's. A thread
// reads its run of pairs front to back as one stream, as the read probe reads, and the bytes
// it asks for ahead are simply the next ones. Per group and output: the integer sums (exact in
// any order), then two multiply-
// adds into the fp32 sum, groups in order, whatever the number of rows: batch-invariant.
// Four vector ops per 64 bytes of codes where the bf16 product took twelve (a widen, a shift,
// two lookups and two products per 32 bytes), and x is held more finely: measured in a SmolLM2
// step's 121 linears at batch 1 (results/cpu-kernels-2026-12-05i.md) 1.03-1.18x faster
// (median 1.14x), 0.93-1.04x at 2 to 32 rows, where both are bound by their dot products.
// Where a block's codes and its scales lay in tensors of their own (four streams a thread, each
// restarting at every pair), the step's linears at batch 1 ran 0.90-1.01x as fast (median
// 0.92x, seven runs beside this layout in one process, results/cpu-kernels-2026-12-05j.md).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr bool kInt4Dot = true;

// a group of x's scale: the least power of two sc with amax / sc <= 32639 (codes times it are
// exact fp32 values, and so are its products with the weights' bf16 scales); 0 below kTinyX
// (the group held as zeros), NaN or inf where amax is
static inline float x4_scale(float amax) {
  if (std::isnan(amax) || std::isinf(amax)) return amax;
  if (!(amax > kTinyX)) return 0.f;
  int ex;
  std::frexp(amax / kXLevels, &ex);  // an estimate: the division rounds
  float sc = std::ldexp(1.f, ex);
  if (amax / (0.5f * sc) <= kXLevels) sc *= 0.5f;  // (exact divisions: powers of two)
  if (amax / sc > kXLevels) sc *= 2.f;
  return sc;
}

// a row of x: for each group of G values its scale sx[g] (x4_scale), its codes' high and low
// bytes h, l [K] and sx[g] times the codes' sum, xs[g]
static void x_to_int4dot(const float* x, int64_t K, int64_t G, int8_t* h, int8_t* l, float* sx,
                         float* xs) {
  for (int64_t k0 = 0; k0 < K; k0 += G) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = k0; k < k0 + G; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      m = _mm512_max_ps(m, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float amax = nan ? NAN : _mm512_reduce_max_ps(m);
    const float sc = x4_scale(amax), inv = sc > 0.f && !std::isinf(sc) ? 1.f / sc : 0.f;
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + G; k += 16) {  // nearest level, ties to even (x * inv exact)
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k),
                                                         _mm512_set1_ps(inv)));
      split_codes(q, h + k, l + k);
      qsum = _mm512_add_epi32(qsum, q);
    }
    sx[k0 / G] = sc;
    xs[k0 / G] = sc * (float)_mm512_reduce_add_epi32(qsum);  // |sum| < 2^24: exact, and x2^n
  }
}

// How far ahead of its reads a thread asks for the bytes it reads next (one stream, so a
// distance in bytes). Measured on this course's VM, a SmolLM2 step's int4 linears at batch 1
// (results/cpu-kernels-2026-12-05j.md), where the memory was busy (30-45 GB/s, most of the
// time there): 6 and 8 KiB ahead the fastest, 2 KiB 0.76x of them, 9-20 KiB 0.89-0.97x;
// asking for nothing 0.98-1.00x (in one stream the CPU's own prefetcher keeps up, where with
// four a thread it had read at 0.58-0.65x). Where it was quiet (56-70 GB/s), 12 KiB read
// 1.03-1.14x as fast as 6 KiB; measured again over 12 runs (two quiet), 12 KiB read 0.86-0.95x
// as fast and 8 KiB 0.92-1.03x (results/cpu-kernels-2026-12-06c.md). Asking for nothing,
// measured again over 30 runs busy and quiet (results/cpu-kernels-2026-12-06.md): 0.89-1.02x,
// median 0.955x (int8_linear_dot, half the arithmetic a byte, asks for nothing at one or two
// rows).
static constexpr int64_t kDotAhead = 6144;

// RM rows of x against RB blocks of 16 output rows (RB 2: the two of a pair, whose codes for a
// group lie one after the other; the sums themselves are the same for every RB and RM). xh,
// xl: the rows' high and low bytes as words of 4 (ldx words a row), sx, xs: their groups' (ng
// a row). c: the first block's codes of group 0, s: its words, `unit` bytes from a group's to
// the next's. Where `ahead` is given, it asks for the group's run `ahead` bytes further on,
// `per` lines for each 64 bytes of codes it loads (each loaded block's line once).
template <int RB, int RM>
static inline void dot_block(const int32_t* xh, const int32_t* xl, int64_t ldx, const float* sx,
                             const float* xs, int64_t ng, int64_t G, const uint8_t* c,
                             const uint8_t* s, int64_t unit, float* y, int64_t ldy,
                             const char* ahead, int64_t per) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
  const __m512i zero_half = _mm512_set1_epi32((int)0xFFFF0000u);
  const int64_t ug = G / 8, cb = 8 * G, lines = unit / 64;  // cb: a block's codes of a group
  __m512 acc[RM][RB];
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* cg = c + g * unit;
    // the group's sums of codes times high bytes (h) and times low bytes (l). One row of x
    // keeps four (the high nibbles left in place, x16, in sums of their own: one mask fewer
    // per load, and two dot products a sum, not four, in flight); more rows share one
    // shifted vector of high nibbles and keep two sums each (fewer to add at the group's end).
    // Integer sums: the same totals either way.
    __m512i h0[RM][RB], l0[RM][RB], h1[RM][RB], l1[RM][RB];
    for (int i = 0; i < RM; ++i)
      for (int r = 0; r < RB; ++r)
        h0[i][r] = l0[i][r] = h1[i][r] = l1[i][r] = _mm512_setzero_si512();
    for (int64_t uu = 0; uu < ug; ++uu) {
      if (ahead)
        for (int64_t j = uu * per; j < std::min(lines, (uu + 1) * per); ++j)
          __builtin_prefetch(ahead + g * unit + j * 64, 0, LK_LOC);
      const int64_t u = g * ug + uu;
      for (int r = 0; r < RB; ++r) {
        const __m512i v = _mm512_loadu_si512(cg + r * cb + uu * 64);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = RM == 1 ? _mm512_and_si512(v, high)
                                   : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int i = 0; i < RM; ++i) {
          const int32_t* h = xh + i * ldx + 2 * u;
          const int32_t* l = xl + i * ldx + 2 * u;
          h0[i][r] = dpbusd(h0[i][r], lo, _mm512_set1_epi32(h[0]));
          l0[i][r] = dpbusd(l0[i][r], lo, _mm512_set1_epi32(l[0]));
          if (RM == 1) {
            h1[i][r] = dpbusd(h1[i][r], hi, _mm512_set1_epi32(h[1]));
            l1[i][r] = dpbusd(l1[i][r], hi, _mm512_set1_epi32(l[1]));
          } else {
            h0[i][r] = dpbusd(h0[i][r], hi, _mm512_set1_epi32(h[1]));
            l0[i][r] = dpbusd(l0[i][r], hi, _mm512_set1_epi32(l[1]));
          }
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const __m512i p = _mm512_loadu_si512(s + g * unit + r * 64);
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p, zero_half));
      const __m512 bz = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), sc, z);  // z - 8 s, exact
      for (int i = 0; i < RM; ++i) {
        // sum of code times code: 256 (high-byte sums) + (low-byte sums), |sum| < 2^31
        const __m512i hs = RM == 1 ? _mm512_add_epi32(h0[i][r], _mm512_srai_epi32(h1[i][r], 4))
                                   : h0[i][r];
        const __m512i ls = RM == 1 ? _mm512_add_epi32(l0[i][r], _mm512_srai_epi32(l1[i][r], 4))
                                   : l0[i][r];
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                    _mm512_mul_ps(sc, _mm512_set1_ps(sx[i * ng + g])), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(bz, _mm512_set1_ps(xs[i * ng + g]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(y + i * ldy + r * 16, acc[i][r]);
}

// x as int16 codes (x_to_int4dot, row after row): high and low bytes, each group's scale and
// scaled sum
struct XCodes {
  std::vector<int32_t> h, l;
  std::vector<float> sx, xs;
  void fill(const float* x, int64_t M, int64_t K, int64_t G) {
    const int64_t ng = K / G;
    h.resize(M * K / 4);
    l.resize(M * K / 4);
    sx.resize(M * ng);
    xs.resize(M * ng);
    for (int64_t m = 0; m < M; ++m)
      x_to_int4dot(x + m * K, K, G, reinterpret_cast<int8_t*>(h.data() + m * K / 4),
                   reinterpret_cast<int8_t*>(l.data() + m * K / 4), sx.data() + m * ng,
                   xs.data() + m * ng);
  }
};

// y [M, N] = x [M, K] (fp32) times the int4 codes in int4_dot_layout. Each thread an equal run
// of pairs of blocks, read front to back. Up to 3 rows of x take a pair's two blocks at once
// (one row: 2 independent sums in flight; 3 rows: 18 of the 32 vector registers in sums);
// more rows take its blocks one at a time, 6 rows at once (4 rows and 2 blocks spilled).
at::Tensor int4_linear_dot(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && x.is_contiguous() &&
                  packed.is_contiguous() && x.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kByte && packed.size(2) > 64 &&
                  (packed.size(2) - 64) % 128 == 0 &&
                  packed.size(1) * ((packed.size(2) - 64) / 8) == x.size(1) &&
                  x.size(1) % 32 == 0,
              "int4_linear_dot: x [M, K] fp32 and its int4_dot_layout [N/16, K/G, 8G + 64] "
              "uint8, K % 32 == 0, G % 16 == 0");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  const int64_t ng = packed.size(1), G = K / ng, ug = G / 8;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // (no rows: a step whose logits nobody asked for)
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t NP = (NB + 1) / 2, pair_bytes = 2 * ng * (8 * G + 64), ldx = K / 4;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NP));
  // x as int16 codes: a decode step's few rows by each thread itself, into buffers it keeps
  // (no thread waits while one makes them, nothing allocated a call); more rows once, shared
  const bool each = M <= kXEachThread;
  XCodes shared;
  if (!each) shared.fill(xp, M, K, G);
  at::parallel_for(0, nth, 1, [&](int64_t t0, int64_t t1) {
    thread_local XCodes mine;
    if (each) mine.fill(xp, M, K, G);
    const XCodes& xc = each ? mine : shared;
    const int32_t *xh = xc.h.data(), *xl = xc.l.data();
    const float *sx = xc.sx.data(), *xs = xc.xs.data();
    for (int64_t th = t0; th < t1; ++th) {
      for (int64_t p = NP * th / nth; p < NP * (th + 1) / nth; ++p) {
        const int64_t nb = std::min<int64_t>(2, NB - 2 * p), unit = nb * (8 * G + 64);
        const uint8_t* c = cp + p * pair_bytes;
        const uint8_t* s = c + nb * 8 * G;
        const char* ahead = reinterpret_cast<const char*>(c) + kDotAhead;
        const int64_t per = (unit / 64 + ug - 1) / ug;
        float* yb = yp + p * 32;
        if (M <= 3) {
#define LK_DOT(RB, RM) dot_block<RB, RM>(xh, xl, ldx, sx, xs, ng, G, c, s, unit, yb, N, ahead, \
                                         per)
          if (nb == 2) {
            switch (M) { case 3: LK_DOT(2, 3); break; case 2: LK_DOT(2, 2); break;
                         default: LK_DOT(2, 1); }
          } else {
            switch (M) { case 3: LK_DOT(1, 3); break; case 2: LK_DOT(1, 2); break;
                         default: LK_DOT(1, 1); }
          }
#undef LK_DOT
          continue;
        }
        for (int64_t r = 0; r < nb; ++r)
          for (int64_t m = 0; m < M; m += 6) {
            // the pair's first pass asks for what lies ahead; the rest reads it from cache
            const char* a = r == 0 && m == 0 ? ahead : nullptr;
#define LK_DOT(RM) dot_block<1, RM>(xh + m * ldx, xl + m * ldx, ldx, sx + m * ng, xs + m * ng, \
                                    ng, G, c + r * 8 * G, s + r * 64, unit, yb + m * N + r * 16, \
                                    N, a, per)
            switch (std::min<int64_t>(6, M - m)) {
              case 6: LK_DOT(6); break; case 5: LK_DOT(5); break; case 4: LK_DOT(4); break;
              case 3: LK_DOT(3); break; case 2: LK_DOT(2); break; default: LK_DOT(1);
            }
#undef LK_DOT
          }
      }
    }
  });
  return y;
}
#else
static constexpr bool kInt4Dot = false;

at::Tensor int4_linear_dot(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(false, "int4_linear_dot: this build has no integer dot product (AVX512-VNNI)");
  return x;
}
#endif

bool has_int4_dot() { return kInt4Dot; }

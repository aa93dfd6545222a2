#include "lanes.h"

// ---- the small per-row ops of a layer, one call each instead of 3 to 9 dispatched ops ----

// one row of RMSNorm: yr = xr / sqrt(sum(xr^2) / d + eps) * w
static inline void norm_row(const float* xr, const float* wp, int64_t d, double eps, float* yr) {
  const float ss = dot(xr, xr, d);  // fixed lane order, as everywhere here
  const float inv = 1.0f / std::sqrt(ss / (float)d + (float)eps);
  for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * wp[i];
}

// y = x / sqrt(sum(x^2) / d + eps) * w for each row of x [R, d] (contiguous)
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 &&
              x.size(-1) == w.size(0), "rms_norm: x [..., d] contiguous, w [d]");
  const int64_t d = w.size(0), R = x.numel() / std::max<int64_t>(d, 1);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * d, wp, d, eps, yp + r * d);
  });
  return y;
}

// A layer's residual add and the RMSNorm after it in one call (DecoderStack): s = x + r, into
// `out` (x itself, or a new tensor), and rms_norm(s, w): the same adds (fp32, one rounding each,
// as at::add's) and the same norm as the two calls, without a dispatch and an allocation
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps, bool in_place) {
  TORCH_CHECK(x.is_contiguous() && r.is_contiguous() && x.sizes() == r.sizes() &&
              w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "add_rms_norm: x, r [..., d] contiguous, w [d]");
  const int64_t d = w.size(0), R = x.numel() / std::max<int64_t>(d, 1);
  at::Tensor s = in_place ? x : at::empty_like(x);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      float* sr = sp + row * d;
      for (int64_t i = 0; i < d; ++i) sr[i] = xp[row * d + i] + rp[row * d + i];
      norm_row(sr, wp, d, eps, yp + row * d);
    }
  });
  return {s, y};
}

// rotary embedding: out[t, h, i] = x[t, h, i] cos[t, i] + x[t, h, (i + D/2) % D] sin[t, i],
// the signed sin table of labkit.model.rope_tables. x: [T, Hx, D] with unit stride in D (a
// view into the fused q|k|v projection); cos, sin: [T, 1, D] contiguous; out contiguous
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  const int64_t T = x.size(0), Hx = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == T * D && sin.numel() == T * D && D % 2 == 0,
              "rope: x [T, Hx, D] (unit stride in D), cos and sin [T, 1, D]");
  auto out = at::empty({T, Hx, D}, x.options());
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
      // the two halves apart, so that the loops vectorize (no index wraps): the same products
      // and sum for every element
      for (int64_t i = 0; i < half; ++i) o[i] = xr[i] * c[i] + xr[i + half] * sn[i];
      for (int64_t i = half; i < D; ++i) o[i] = xr[i] * c[i] + xr[i - half] * sn[i];
    }
  return out;
}

// SwiGLU's middle: silu(gate) * up, each [T, F] with unit stride in F (views of one [T, 2F]
// projection are fine); silu(g) = g / (1 + exp(-g)), the exp as in attention
at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
              up.stride(1) == 1, "silu_mul: gate, up [T, F] with unit stride in F");
  const int64_t T = gate.size(0), F = gate.size(1);
  auto out = at::empty({T, F}, gate.options());
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

// The first index of a row's largest value, a NaN counting as larger than any number (the
// first NaN, then): torch.argmax's answer. torch's CPU argmax reads a 49,152-value row at
// ~5 GB/s (~40 us of a greedy decode step at batch 1); this one compares 16 lanes at a time,
// once for the largest value, once for where it first is.
static int64_t argmax_row(const float* r, int64_t n) {
  int64_t p = 0;
#ifdef __AVX512F__
  if (n >= 64) {
    __m512 a0 = _mm512_set1_ps(r[0]), a1 = a0, a2 = a0, a3 = a0;
    __mmask16 nan = 0;
    for (; p + 64 <= n; p += 64) {
      const __m512 v0 = _mm512_loadu_ps(r + p), v1 = _mm512_loadu_ps(r + p + 16),
                   v2 = _mm512_loadu_ps(r + p + 32), v3 = _mm512_loadu_ps(r + p + 48);
      nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q) |
             _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
      a0 = _mm512_max_ps(a0, v0);
      a1 = _mm512_max_ps(a1, v1);
      a2 = _mm512_max_ps(a2, v2);
      a3 = _mm512_max_ps(a3, v3);
    }
    float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
    for (int64_t i = p; i < n; ++i) {
      if (r[i] != r[i]) nan = 1;
      m = std::max(m, r[i]);
    }
    if (nan) {  // rare: the first NaN, read one by one
      for (int64_t i = 0; i < n; ++i)
        if (r[i] != r[i]) return i;
    }
    const __m512 mv = _mm512_set1_ps(m);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), mv, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; ++i)
      if (r[i] == m) return i;
  }
#endif
  int64_t best = 0;
  float m = r[0];
  if (m != m) return 0;
  for (p = 1; p < n; ++p) {
    if (r[p] != r[p]) return p;
    if (r[p] > m) { m = r[p]; best = p; }
  }
  return best;
}

// argmax over the last dimension of x [R, V] (fp32, contiguous, V >= 1): [R] int64
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) >= 1 &&
              x.scalar_type() == at::kFloat, "argmax_rows: x [R, V >= 1], fp32, contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

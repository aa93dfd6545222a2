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

"""A hand-written CPU kernel for weight-only int8: y = x W^T with W as int8 codes and scales.

torch's packed CPU kernel (`torch._weight_int8pack_mm`) takes bf16 activations and, on an AVX2
laptop at batch 1, spends ~190 us on a 1 MB SmolLM2 layer matrix (5 GB/s): it is busy
converting, not reading bytes. This kernel reads the codes once per call. It converts a few
rows at a time into fp32 in a small buffer that stays in L1 (`q * s` is exact in fp32: an 8-bit
code times a bf16 scale), then multiplies them into tiles of up to 4 x 3 outputs, 8 lanes at a
time (AVX2 + FMA intrinsics; a scalar loop of the same structure elsewhere).

**Batch-invariant by construction.** Each output y[m, n] gets its own accumulator, is summed
over k in ascending steps of 8 lanes, reduced across lanes in one fixed order, then its tail
added. The same sequence of operations runs whatever the tile shape, so a row's result never
depends on how many other rows share its step. The engine's claims need this: the pipelined
decoder's zombie rows change a step's row count, and blocking and pipelined must still give
the same tokens. A kernel that switched paths with the row count broke exactly that (measured:
see results/cpu-quiet-2026-12-01.md).

The kernel is compiled at first use (`torch.utils.cpp_extension`: a C++ compiler and ninja;
about a minute, then cached under labkit's cache directory). Where that fails, `kernels()` is
None and QuantLinear keeps torch's kernel; `LABKIT_CPU_KERNELS=0` turns it off.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings

import torch

from labkit.cache import cache_dir

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// RM rows of x against RN dequantized weight rows: out[i][j] = sum_k x[i][k] * w[j][k].
// Every output: one accumulator, k ascending by 8, a fixed lane reduction, then the tail.
template <int RM, int RN>
static inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                        int64_t ldy) {
  const int64_t K8 = K - K % 8;
#ifdef __AVX2__
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < RM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      alignas(32) float lane[8];
      _mm256_store_ps(lane, acc[i][j]);
      float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
#else
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K8; k += 8)
        for (int l = 0; l < 8; ++l) lane[l] += x[i * ldx + k + l] * w[j * K + k + l];
      float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
#endif
}

template <int RN>
static void rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, RN>(x + m * K, K, w, K, y + m * N, N);
  switch (M - m) {
    case 3: tile<3, RN>(x + m * K, K, w, K, y + m * N, N); break;
    case 2: tile<2, RN>(x + m * K, K, w, K, y + m * N, N); break;
    case 1: tile<1, RN>(x + m * K, K, w, K, y + m * N, N); break;
    default: break;
  }
}

// the whole product, RN weight rows at a time: each block's codes are converted once into an
// fp32 buffer that stays in L1, then multiplied with every row of x
template <int RN>
static void blocks(const float* xp, const int8_t* qp, const float* sp, float* yp, int64_t M,
                   int64_t K, int64_t N) {
  const int64_t nblocks = (N + RN - 1) / RN;
  at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(RN * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RN, rn = std::min<int64_t>(RN, N - n0);
      for (int64_t j = 0; j < rn; ++j) {  // dequantize: exact in fp32
        const int8_t* row = qp + (n0 + j) * K;
        const float scale = sp[n0 + j];
        float* wr = w.data() + j * K;
        for (int64_t k = 0; k < K; ++k) wr[k] = (float)row[k] * scale;
      }
      if (rn == RN) {
        rows<RN>(xp, M, K, w.data(), yp + n0, N);
      } else {
        for (int64_t j = 0; j < rn; ++j) rows<1>(xp, M, K, w.data() + j * K, yp + n0 + j, N);
      }
    }
  });
}

// y [M, N] = x [M, K] (fp32, contiguous) times int8 codes q [N, K] and per-row scales s [N]
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tiles of up to 4 rows x 3 weight rows (12 accumulators, 3 weights, 1 x: 16 registers);
  // a row or two alone would leave too few independent sums in flight, so they take 6 weight
  // rows at once. The tile shape never changes how one output is summed.
  if (M < 4) blocks<6>(xp, qp, sp, yp, M, K, N);
  else blocks<3>(xp, qp, sp, yp, M, K, N);
  return y;
}
"""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    """Vector flags this CPU runs (the build is cached per flag set, so per CPU kind)."""
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    return ["-mavx2", "-mfma"] if cap in ("AVX2", "AVX512") else []


def kernels():
    """The compiled module (`int8_linear`), or None where it cannot be built (or
    LABKIT_CPU_KERNELS=0 when first asked). Built once per process; later calls are a lookup."""
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
    from torch.utils.cpp_extension import load_inline

    flags = _flags()
    name = "labkit_int8_" + ("avx2" if flags else "generic")
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load_inline(name, cpp_sources=_SOURCE, functions=["int8_linear"],
                           extra_cflags=["-O3", "-fopenmp", *flags],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as err:  # no working compiler: torch's kernel serves instead
        warnings.warn(f"labkit's CPU int8 kernel did not build ({type(err).__name__}); using "
                      "torch's packed kernel", stacklevel=3)
        return None

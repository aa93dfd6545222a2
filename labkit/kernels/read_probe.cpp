// read_probe: the rate at which this CPU reads a buffer, to set a kernel's effective rate
// against (`bench step`: a linear's bytes of codes and scales over its time, beside this probe
// over the same byte count). It does nothing but read: the buffer split into one contiguous
// share per thread (the same at::parallel_for a kernel uses, so the same wake-up cost), each
// share read 64 bytes a load into 4 independent xor accumulators, folded into a checksum so the
// compiler must keep every load.
#include "lanes.h"

int64_t read_probe(at::Tensor t) {
  TORCH_CHECK(t.is_contiguous(), "read_probe: a contiguous tensor");
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t bytes = t.numel() * t.element_size();
  const int64_t lines = bytes / 256;  // whole 256-byte steps; the tail is read byte by byte
  const int threads = at::get_num_threads();
  std::vector<uint64_t> part(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t th = t0; th < t1; ++th) {
      const int64_t l0 = lines * th / threads, l1 = lines * (th + 1) / threads;
      uint64_t sum = 0;
#if defined(__AVX512F__)
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t l = l0; l < l1; ++l) {
        const __m512i* q = reinterpret_cast<const __m512i*>(p + l * 256);
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(q));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(q + 1));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(q + 2));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(q + 3));
      }
      alignas(64) uint64_t l8[8];
      _mm512_store_si512(l8, _mm512_xor_si512(_mm512_xor_si512(a0, a1),
                                              _mm512_xor_si512(a2, a3)));
      for (uint64_t v : l8) sum ^= v;
#elif defined(__AVX2__)
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t l = l0; l < l1; ++l)
        for (int h = 0; h < 2; ++h) {
          const __m256i* q = reinterpret_cast<const __m256i*>(p + l * 256 + h * 128);
          a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(q));
          a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(q + 1));
          a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(q + 2));
          a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(q + 3));
        }
      alignas(32) uint64_t l4[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(l4), _mm256_xor_si256(
          _mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
      for (uint64_t v : l4) sum ^= v;
#else
      for (int64_t l = l0; l < l1; ++l) {
        const uint64_t* q = reinterpret_cast<const uint64_t*>(p + l * 256);
        for (int i = 0; i < 32; ++i) sum ^= q[i];
      }
#endif
      part[th] = sum;
    }
  });
  uint64_t sum = 0;
  for (uint64_t v : part) sum ^= v;
  for (int64_t b = lines * 256; b < bytes; ++b) sum ^= p[b];
  return (int64_t)sum;
}

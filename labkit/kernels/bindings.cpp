// The Python module: one binding per kernel (labkit/kernels/cpu.py builds and loads it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp32_linear", &fp32_linear,
        "y = x W^T, fp32 W, for a few rows: W read once, batch-invariant");
  m.attr("FP32_KERNEL_ROWS") = kFp32KernelRows;
  m.def("int8_linear", &int8_linear, "y = x W^T, W int8 codes with one scale per output row");
  m.def("int8_linear_dot", &int8_linear_dot,
        "int8_linear on vpdpbusd, the codes in int8_dot_layout (AVX512-VNNI builds)");
  m.def("int4_linear", &int4_linear, "y = x W^T, W int4 codes with a scale and zero per group");
  m.def("int4_linear_dot", &int4_linear_dot,
        "int4_linear on an integer dot product, x as int16 (AVX512-VNNI builds)");
  m.def("has_int4_dot", &has_int4_dot, "whether this build has int4_linear_dot");
  m.def("has_int8_dot", &has_int8_dot, "whether int8_linear holds x as int16 (AVX512-VNNI)");
  m.def("paged_attention", &paged_attention, "attention over the KV pool, read in place");
  m.def("flash_attention", &flash_attention,
        "attention over the KV pool a tile of pages at a time, online softmax, split-K decode");
  m.def("paged_decode_slots", &paged_decode_slots,
        "a decode step's write slots, context slots and valid keys (AttentionMeta.build's)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "x + r (in place, or new) and its RMSNorm, in one call");
  m.def("rope", &rope, "rotary position embedding of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows,
        "the first index of each row's largest value, a NaN the largest (torch.argmax's)");
  bind_decoder_stack(m);  // DecoderStack: every layer of a decoder in one call
  m.def("read_probe", &read_probe, "read every byte of a tensor (a read-rate probe); a checksum");
}

// Every kernel's signature, in one place: the Python bindings and the decoder stack (which
// calls the kernels directly, with no Python between them) both include this.
#pragma once

#include <torch/extension.h>

// fp32_linear serves steps of up to this many rows (decode, a speculative verify, a step of a
// small token budget); whole prompts go to at::linear
constexpr int64_t kFp32KernelRows = 32;
at::Tensor fp32_linear(at::Tensor x, at::Tensor w);
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor s);
at::Tensor int8_linear_dot(at::Tensor x, at::Tensor packed, at::Tensor s);
at::Tensor int4_linear(at::Tensor x, at::Tensor codes, at::Tensor sz);
at::Tensor int4_linear_dot(at::Tensor x, at::Tensor packed);
bool has_int4_dot();
bool has_int8_dot();
at::Tensor paged_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                           at::Tensor write_slots, at::Tensor k, at::Tensor v, at::Tensor slots,
                           at::Tensor q_index, at::Tensor query_lens, at::Tensor positions,
                           double scale);
at::Tensor flash_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                           at::Tensor write_slots, at::Tensor k, at::Tensor v,
                           at::Tensor block_tables, int64_t block_size, int64_t tile,
                           at::Tensor q_index, at::Tensor query_lens, at::Tensor positions,
                           double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode_slots(at::Tensor starts,
                                                                   at::Tensor tables,
                                                                   int64_t block_size,
                                                                   int64_t L);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps, bool in_place);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);
at::Tensor argmax_rows(at::Tensor x);
void bind_decoder_stack(pybind11::module& m);
int64_t read_probe(at::Tensor t);

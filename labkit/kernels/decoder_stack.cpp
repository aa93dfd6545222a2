// ---- the decoder's layers in one call: no Python between a step's kernels ----
//
// labkit.model's DecoderLayer.forward, op for op, over the same kernels (rms_norm, the
// linears, rope, paged or flash attention, silu_mul) and the same aten calls (F.linear's
// at::linear), in the same order, a residual add and the norm after it in one call
// (add_rms_norm: the same adds and the same norm): the outputs are the Python path's, bit
// for bit. What goes is what sat between the kernels in Python: ~20 calls, slices, views and
// module attribute lookups per layer, which at batch 1 cost a third of an int4 forward.
#include <chrono>
#include <vector>

#include "kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

// one linear of a layer: how its weights are stored decides the call
enum LinearKind : int64_t { kFp32 = 0, kInt8 = 1, kInt4 = 2, kInt4Dot = 3, kInt8Dot = 4 };

struct Linear {
  int64_t kind = -1;  // -1: absent (the fused or the unfused form holds it)
  at::Tensor a, b;  // fp32: weight [N, K]; int8: codes (or tiles), scales; int4: codes, scale|zero
  c10::optional<at::Tensor> bias;  // from an empty tensor: none
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, q, k, v, o, gate_up, gate, up, down;
};

// A view of `base`'s values (fp32, CPU) that the layer reads while `base` lives: what narrow()
// and view() give, made without the dispatcher (at batch 1 those ~7 calls a layer, each about
// a microsecond on caches the weights just swept, were most of what remained between the
// kernels). `first`: the first element's offset from base's; sizes and strides in elements.
at::Tensor window(const at::Tensor& base, int64_t first, at::IntArrayRef sizes,
                  at::IntArrayRef strides) {
  return at::from_blob(base.data_ptr<float>() + first, sizes, strides, base.options());
}

// QuantLinear.forward / nn.Linear.forward for a 2-D x, the same calls (x made contiguous)
at::Tensor apply_linear(const Linear& lin, const at::Tensor& x_in) {
  at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  at::Tensor y;
  switch (lin.kind) {
    case kFp32:  // few rows: labkit's kernel (as labkit.model.few_rows_fp32 chooses)
      if (x.size(0) > kFp32KernelRows || !lin.a.is_contiguous())
        return at::linear(x_in, lin.a, lin.bias);
      y = fp32_linear(x, lin.a);
      break;
    case kInt8: y = int8_linear(x, lin.a, lin.b); break;
    case kInt8Dot: y = int8_linear_dot(x, lin.a, lin.b); break;
    case kInt4: y = int4_linear(x, lin.a, lin.b); break;
    case kInt4Dot: y = int4_linear_dot(x, lin.a); break;
    default: TORCH_CHECK(false, "DecoderStack: a linear of unknown kind ", lin.kind);
  }
  return lin.bias ? y + *lin.bias : y;
}

// rows of the RoPE tables [N, 1, D] (labkit.model's table of every position so far) at
// `positions` [T]: the cos and signed sin [T, 1, D] that rope_tables returns, copied. Checked
// before any work: a position outside the table is an IndexError, and the caller, having run
// nothing, grows the table and calls again (at batch 1 Python's two index_select calls cost
// ~0.08 ms a step on caches the weights had just swept).
std::pair<at::Tensor, at::Tensor> rope_rows(const at::Tensor& cos_t, const at::Tensor& sin_t,
                                            const at::Tensor& positions) {
  TORCH_CHECK(cos_t.dim() == 3 && cos_t.sizes() == sin_t.sizes() && cos_t.is_contiguous() &&
              sin_t.is_contiguous() && positions.dim() == 1,
              "DecoderStack: RoPE tables [N, 1, D] (contiguous) and positions [T]");
  const at::Tensor pos = positions.scalar_type() == at::kLong ? positions.contiguous()
                                                               : positions.to(at::kLong);
  const int64_t T = pos.size(0), N = cos_t.size(0), D = cos_t.size(1) * cos_t.size(2);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(pp[t] >= 0 && pp[t] < N, "DecoderStack: position ", pp[t],
                      " outside the RoPE table's ", N, " rows");
  at::Tensor cos = at::empty({T, cos_t.size(1), cos_t.size(2)}, cos_t.options());
  at::Tensor sin = at::empty_like(cos);
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(cos_t.data_ptr<float>() + pp[t] * D, D, cos.data_ptr<float>() + t * D);
    std::copy_n(sin_t.data_ptr<float>() + pp[t] * D, D, sin.data_ptr<float>() + t * D);
  }
  return {cos, sin};
}

// x[rows] for x [T, d] (contiguous) and rows, an int64 vector of rows in [-T, T) (a negative
// one counted from the end, as Python's): the rows copied by hand (at batch 1 the indexing
// call cost ~0.05 ms a step on swept caches). Anything else (a mask, a row out of range, and
// its error) through x.index, as x[rows] does it.
at::Tensor select_rows(const at::Tensor& x, const at::Tensor& rows) {
  if (rows.scalar_type() != at::kLong || rows.dim() != 1 || x.dim() != 2 ||
      !x.is_contiguous() || x.scalar_type() != at::kFloat)
    return x.index({rows});
  const at::Tensor r = rows.contiguous();
  const int64_t T = x.size(0), d = x.size(1), R = r.size(0);
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    if (rp[i] < -T || rp[i] >= T) return x.index({rows});  // its IndexError
  at::Tensor out = at::empty({R, d}, x.options());
  for (int64_t i = 0; i < R; ++i)
    std::copy_n(x.data_ptr<float>() + (rp[i] < 0 ? rp[i] + T : rp[i]) * d, d,
                out.data_ptr<float>() + i * d);
  return out;
}

}  // namespace

// `passes` passes over the linears (kind, x, a, b) as DecoderStack calls them, one after the
// other with nothing between (`bench step`'s view of a step's linears: as the engine calls
// them, from C++)
void linear_pass(const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor>>& calls,
                 int64_t passes) {
  std::vector<std::pair<Linear, at::Tensor>> lins;
  for (const auto& [kind, x, a, b] : calls) {
    Linear l;
    l.kind = kind;
    l.a = a;
    l.b = b;
    lins.emplace_back(l, x);
  }
  for (int64_t p = 0; p < passes; ++p)
    for (const auto& [l, x] : lins) apply_linear(l, x);
}

// The layers of one LlamaModel, their weights held by reference (the module's own tensors).
class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
               double eps)
      : H_(heads), Hkv_(kv_heads), D_(head_dim), F_(intermediate), eps_(eps) {}

  // linears: a list of (kind, a, b, bias) for qkv, q, k, v, o, gate_up, gate, up, down (kind
  // -1 where the layer has the other form)
  void add_layer(at::Tensor input_norm, at::Tensor post_norm,
                 std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor>> lins) {
    TORCH_CHECK(lins.size() == 9, "add_layer: 9 linears (qkv, q, k, v, o, gate_up, gate, up, "
                "down)");
    Layer l;
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    Linear* slots[9] = {&l.qkv, &l.q, &l.k, &l.v, &l.o, &l.gate_up, &l.gate, &l.up, &l.down};
    for (size_t i = 0; i < 9; ++i) {
      auto& [kind, a, b, bias] = lins[i];
      slots[i]->kind = kind;
      slots[i]->a = a;
      slots[i]->b = b;
      if (bias.numel() > 0) slots[i]->bias = bias;
    }
    TORCH_CHECK((l.qkv.kind >= 0) != (l.q.kind >= 0 && l.k.kind >= 0 && l.v.kind >= 0),
                "add_layer: either a fused qkv or q, k and v");
    TORCH_CHECK((l.gate_up.kind >= 0) != (l.gate.kind >= 0 && l.up.kind >= 0),
                "add_layer: either a fused gate_up or gate and up");
    TORCH_CHECK(l.o.kind >= 0 && l.down.kind >= 0, "add_layer: o and down are required");
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // The model's ends, for `logits`: the embedding [V, d], the final norm [d] and the head
  // (kind, a, b, bias) as add_layer's linears (a tied head: kind 0 over the embedding itself)
  void set_ends(at::Tensor embed, at::Tensor final_norm,
                std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor> head) {
    auto& [kind, a, b, bias] = head;
    TORCH_CHECK(kind >= 0, "set_ends: a head is required");
    embed_ = embed;
    final_norm_ = final_norm;
    head_.kind = kind;
    head_.a = a;
    head_.b = b;
    head_.bias = bias.numel() > 0 ? c10::optional<at::Tensor>(bias) : c10::nullopt;
    has_ends_ = true;
  }

  bool has_ends() const { return has_ends_; }

  // LlamaModel.forward in one call: the tokens' embedding, their RoPE rows (`rope_rows`: the
  // tables of every position so far, and the positions), every layer (`forward`, whose
  // arguments follow the positions), the rows whose logits are wanted (`rows`, indexed as
  // Python's x[rows]; None: every row), the final norm and the head: [R, V], the Python path's
  // bits. At batch 1 the embedding, the row select, the norm and the head's dispatch took
  // ~0.1 ms of Python on caches the weights had just swept.
  at::Tensor logits(at::Tensor ids, at::Tensor cos_table, at::Tensor sin_table,
                    at::Tensor rope_positions, int64_t attention,
                    at::Tensor write_slots, std::vector<at::Tensor> k_layers,
                    std::vector<at::Tensor> v_layers, at::Tensor ctx_slots,
                    at::Tensor block_tables, int64_t block_size, int64_t tile,
                    at::Tensor q_index, at::Tensor query_lens, at::Tensor positions,
                    c10::optional<at::Tensor> rows, bool profile) {
    TORCH_CHECK(has_ends_, "DecoderStack.logits: set_ends first");
    auto [cos, sin] = rope_rows(cos_table, sin_table, rope_positions);  // (first: it checks)
    at::Tensor x = at::embedding(embed_, ids);
    x = forward(x, cos, sin, attention, write_slots, std::move(k_layers), std::move(v_layers),
                ctx_slots, block_tables, block_size, tile, q_index, query_lens, positions,
                profile);  // (forward zeroes the kernel time: what follows adds to it)
    if (rows) x = select_rows(x, *rows);  // what x[logit_rows] does (negative rows, masks)
    at::Tensor h = timed(kRowOp, [&] { return rms_norm(x, final_norm_, eps_); });
    return linear(head_, h);
  }

  // Seconds the last `forward` (or `logits`) spent inside kernels and aten calls (with
  // `profile`), by kind: the linears (the head among them), attention (with its KV write), the
  // small row ops (norms, residual adds, RoPE, SiLU times up). Forward time minus their sum is
  // what remains between the kernels.
  std::vector<double> kernel_split() const { return {split_[0], split_[1], split_[2]}; }

  // x [T, d] (the embedded tokens), cos/sin [T, 1, D]; attention: 0 paged (ctx_slots), 1
  // flash (block_tables, block_size, tile); k_layers, v_layers: each layer's pool views
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t attention,
                     at::Tensor write_slots, std::vector<at::Tensor> k_layers,
                     std::vector<at::Tensor> v_layers, at::Tensor ctx_slots,
                     at::Tensor block_tables, int64_t block_size, int64_t tile,
                     at::Tensor q_index, at::Tensor query_lens, at::Tensor positions,
                     bool profile) {
    TORCH_CHECK(k_layers.size() == layers_.size() && v_layers.size() == layers_.size(),
                "DecoderStack.forward: one K and one V pool per layer");
    TORCH_CHECK(attention == 0 || attention == 1, "DecoderStack.forward: attention 0 or 1");
    split_[kLinear] = split_[kAttention] = split_[kRowOp] = 0.0;
    profile_ = profile;
    const int64_t t = x.size(0);
    const double scale = 1.0 / std::sqrt((double)D_);
    at::Tensor h;  // the next layer's normed input, where the add before it made it
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0) h = timed(kRowOp, [&] { return rms_norm(x, l.input_norm, eps_); });
      // q, k, v, gate and up may be windows into qkv, qk and gu (not owning their memory):
      // those three live until the layer's end
      at::Tensor q, k, v, qkv, qk, gu;
      if (l.qkv.kind >= 0) {  // fused: one call, and one RoPE for q and k together
        qkv = linear(l.qkv, h);  // [t, (H + 2 Hkv) D]: rows of q | k | v heads
        const int64_t row = (H_ + 2 * Hkv_) * D_;
        qk = timed(kRowOp, [&] {
          return rope(window(qkv, 0, {t, H_ + Hkv_, D_}, {row, D_, 1}), cos, sin);
        });  // [t, H + Hkv, D], contiguous
        const int64_t qk_row = (H_ + Hkv_) * D_;
        q = window(qk, 0, {t, H_, D_}, {qk_row, D_, 1});
        k = window(qk, H_ * D_, {t, Hkv_, D_}, {qk_row, D_, 1});
        v = window(qkv, (H_ + Hkv_) * D_, {t, Hkv_, D_}, {row, D_, 1});
      } else {
        q = linear(l.q, h).view({t, H_, D_});
        k = linear(l.k, h).view({t, Hkv_, D_});
        v = linear(l.v, h).view({t, Hkv_, D_});
        q = timed(kRowOp, [&] { return rope(q, cos, sin); });
        k = timed(kRowOp, [&] { return rope(k, cos, sin); });
      }
      at::Tensor o = timed(kAttention, [&] {
        return attention == 0
                   ? paged_attention(q, k, v, write_slots, k_layers[i], v_layers[i], ctx_slots,
                                     q_index, query_lens, positions, scale)
                   : flash_attention(q, k, v, write_slots, k_layers[i], v_layers[i],
                                     block_tables, block_size, tile, q_index, query_lens,
                                     positions, scale);
      });
      at::Tensor proj = linear(l.o, window(o, 0, {t, H_ * D_}, {H_ * D_, 1}));  // o: contiguous
      // x + proj (a new x: the embedding is not ours to change), and its norm, in one call
      std::tie(x, h) = timed(kRowOp, [&] {
        return add_rms_norm(x, proj, l.post_norm, eps_, false);
      });
      at::Tensor gate, up;
      if (l.gate_up.kind >= 0) {
        gu = linear(l.gate_up, h);  // [T, 2F]: two slices
        gate = window(gu, 0, {t, F_}, {2 * F_, 1});
        up = window(gu, F_, {t, F_}, {2 * F_, 1});
      } else {
        gate = linear(l.gate, h);
        up = linear(l.up, h);
      }
      at::Tensor act = timed(kRowOp, [&] { return silu_mul(gate, up); });
      at::Tensor down = linear(l.down, act);
      if (i + 1 < layers_.size()) {  // x += down, and the next layer's input norm
        const at::Tensor& next_norm = layers_[i + 1].input_norm;
        std::tie(x, h) = timed(kRowOp, [&] {
          return add_rms_norm(x, down, next_norm, eps_, true);
        });
      } else {
        timed(kRowOp, [&] { return x.add_(down); });
      }
    }
    return x;
  }

 private:
  enum Kind { kLinear = 0, kAttention = 1, kRowOp = 2 };  // kernel_split's order

  template <typename Fn>
  auto timed(Kind kind, Fn&& fn) -> decltype(fn()) {  // a tensor, or add_rms_norm's two
    if (!profile_) return fn();
    const auto t0 = Clock::now();
    auto out = fn();
    split_[kind] += std::chrono::duration<double>(Clock::now() - t0).count();
    return out;
  }

  at::Tensor linear(const Linear& lin, const at::Tensor& x) {
    return timed(kLinear, [&] { return apply_linear(lin, x); });
  }

  int64_t H_, Hkv_, D_, F_;
  double eps_;
  std::vector<Layer> layers_;
  at::Tensor embed_, final_norm_;
  Linear head_;
  bool has_ends_ = false;
  bool profile_ = false;
  double split_[3] = {0.0, 0.0, 0.0};
};

void bind_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_ends", &DecoderStack::set_ends)
      .def("has_ends", &DecoderStack::has_ends)
      .def("logits", &DecoderStack::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("kernel_split", &DecoderStack::kernel_split)
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_pass", &linear_pass, "passes over linears (kind, x, a, b) called from C++, as "
        "DecoderStack calls them", pybind11::call_guard<pybind11::gil_scoped_release>());
}

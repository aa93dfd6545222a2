// PagedAttention's kernel: each new token attends over its whole context in one pass, reading
// the K and V pool rows at its sequence's slots where they lie (the shared pieces:
// attention_tiles.h).
#include "attention_tiles.h"

// one work item: the G query heads at qh (of one token and KV head hk) over the nk keys at
// the context slots row[0 .. nk); output at oh. score and off are the thread's scratch.
static void attend_item(const float* qh, const float* kp, const float* vp, const int64_t* row,
                        int64_t nk, int64_t hk, int64_t Hkv, int64_t G, int64_t D, float scale,
                        float* oh, std::vector<float>& score, std::vector<int64_t>& off) {
  score.resize(G * nk);  // [G, nk]
  off.resize(nk);  // where key p's row of KV head hk starts, in k and in v
  for (int64_t p = 0; p < nk; ++p) off[p] = (row[p] * Hkv + hk) * D;
  prefetch_rows(kp, off.data(), nk, D);  // the first keys and values; the loops ask ahead
  prefetch_rows(vp, off.data(), nk, D);
  scores(qh, kp, off.data(), nk, G, D, scale, score.data(), vp);
  float inv[64];  // 1 / softmax denominator of each query head (G <= 64, checked)
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place, and their sums
    float* s = score.data() + g * nk;
    inv[g] = 1.0f / exp_and_sum(s, nk, row_max(s, nk));
  }
  weighted(score.data(), nk, vp, off.data(), G, D, inv, oh);
}

// Writes k_new, v_new at write_slots, then returns out [T, H, D] = softmax(q k^T * scale) v
// for every new token, where the keys of token t (sequence b, position pos) are the K/V pool
// rows at slots[b, 0..pos]. q: [T, H, D] (rows may be a view into the fused q|k|v projection);
// k, v: [S, Hkv, D] (one layer of the pool); slots: [B, L]; q_index: [B, Tq] packed index of
// each sequence's j-th new token, for j < query_lens[b]; positions: [T]. One work item is a
// token and a KV head: its G query heads share each K and V row read. Every item runs the
// same code whatever else is in the step (batch-invariant), in a fixed order over keys.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                              at::Tensor write_slots, at::Tensor k, at::Tensor v,
                              at::Tensor slots, at::Tensor q_index,
                              at::Tensor query_lens, at::Tensor positions, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T,H,D], k/v [S,Hkv,D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.is_contiguous() &&
              v.is_contiguous(), "q rows of H * D values, k and v contiguous");
  slots = slots.contiguous(); q_index = q_index.contiguous();
  write_slots = write_slots.contiguous(); query_lens = query_lens.contiguous();
  positions = positions.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  const int64_t B = slots.size(0), L = slots.size(1), Tq = q_index.size(1), G = H / Hkv;
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0 && G <= 64, "head shapes");
  TORCH_CHECK(k_new.size(0) == T && k_new.size(1) == Hkv && k_new.size(2) == D &&
              k_new.sizes() == v_new.sizes() && k_new.stride(2) == 1 && v_new.stride(2) == 1,
              "k_new, v_new: [T, Hkv, D] with unit stride in D");
  write_kv(k_new, v_new, write_slots.data_ptr<int64_t>(), S, k.data_ptr<float>(),
           v.data_ptr<float>());

  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ip = q_index.data_ptr<int64_t>();
  const int64_t* lp = query_lens.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  // the tokens, (token, sequence, keys); checked here, before any thread reads memory
  std::vector<int64_t> tok, seq, keys;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < lp[b]; ++j) {
      const int64_t t = ip[b * Tq + j];
      TORCH_CHECK(t >= 0 && t < T && pp[t] >= 0 && pp[t] < L, "a query outside its context");
      tok.push_back(t); seq.push_back(b); keys.push_back(pp[t] + 1);
    }
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "a slot outside the pool");
  // balance the threads: items (token x KV head) cost their keys; a token's heads together
  // where there are tokens enough (deal_units)
  int64_t nth, chunk, per;
  const std::vector<int64_t> place = deal_units(keys, Hkv, nth, chunk, per);

  auto out = at::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nth * chunk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score;
    std::vector<int64_t> off;
    for (int64_t i = i0; i < i1; ++i) {
      if (place[i] < 0) continue;
      for (int64_t j = place[i] * per; j < (place[i] + 1) * per; ++j) {
        const int64_t item = j / Hkv, hk = j % Hkv, t = tok[item];
        attend_item(qp + t * q.stride(0) + hk * G * D, kp, vp, sp + seq[item] * L, keys[item],
                    hk, Hkv, G, D, (float)scale, op + (t * H + hk * G) * D, score, off);
      }
    }
  });
  return out;
}

// A decode step's slots, as labkit.attention's AttentionMeta.build makes them for one new token
// a sequence (sequence b's token at position starts[b], its pages in tables[b]): write_slots [B]
// (the pool slot of that position), and where L > 0 ctx_slots [B, L] (the slot of each
// context position, 0 past the sequence's own context) and valid [B, L] (position <=
// starts[b]); L = 0: those two empty (FlashMeta reads the tables instead). A page index past a
// table's width takes its last page, and a position past L - 1 the slot of L - 1, as the
// build's clamps do. One call where the build is ~14 small tensor ops (at batch 1 on a CPU,
// each a few microseconds on caches the weights had just swept).
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode_slots(at::Tensor starts,
                                                                   at::Tensor tables,
                                                                   int64_t block_size,
                                                                   int64_t L) {
  TORCH_CHECK(starts.dim() == 1 && tables.dim() == 2 && tables.size(0) == starts.size(0) &&
              tables.size(1) >= 1 && starts.scalar_type() == at::kLong &&
              tables.scalar_type() == at::kLong && block_size >= 1 && L >= 0,
              "paged_decode_slots: starts [B] and tables [B, pages >= 1] int64, block_size >= 1");
  starts = starts.contiguous();
  tables = tables.contiguous();
  const int64_t B = starts.size(0), nb = tables.size(1);
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0, "paged_decode_slots: a negative start");
  auto slot = [&](int64_t b, int64_t p) {  // the pool slot of sequence b's position p
    return tp[b * nb + std::min(p / block_size, nb - 1)] * block_size + p % block_size;
  };
  at::Tensor write = at::empty({B}, starts.options());
  at::Tensor ctx = at::empty({B, L}, starts.options());
  at::Tensor valid = at::empty({B, L}, starts.options().dtype(at::kBool));
  int64_t* wp = write.data_ptr<int64_t>();
  int64_t* cp = ctx.data_ptr<int64_t>();
  bool* vp = valid.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    wp[b] = slot(b, L > 0 ? std::min(sp[b], L - 1) : sp[b]);
    for (int64_t p = 0; p < L; ++p) {
      vp[b * L + p] = p <= sp[b];
      cp[b * L + p] = p <= sp[b] ? slot(b, p) : 0;
    }
  }
  return {write, ctx, valid};
}

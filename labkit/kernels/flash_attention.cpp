// FlashAttention's kernel: each new token attends over its context a tile at a time, reading the
// K and V pool through its sequence's block table (whole pages per tile when a page fits in one),
// with an online softmax: a running max m, a running sum l and an fp32 accumulator acc per query
// head, never a whole row of scores. labkit.attention.FlashAttention.reference is the same loop
// in Python, the version to read first.
//
// One arithmetic for every tile: its scores are exponentiated against the tile's own max, giving
// a partial (m_t, l_t, acc_t), which is then folded into the running state by log-sum-exp,
//     m' = max(m, m_t),  l' = l e^(m - m') + l_t e^(m_t - m'),  acc' = acc e^(m - m') + acc_t ...,
// tiles in ascending order. A prefill token folds its tiles as it goes; a decode token (query
// length 1, the only one of its sequence) computes its tiles as separate work items, in
// parallel, and folds their partials afterwards in the same order (split-K, flash-decoding).
// Both do the same operations on the same values, so a token's output is the same bits in a
// decode row, in a prefill chunk, alone or beside any other rows: batch-invariant.
#include "attention_tiles.h"

namespace {

// a partial or running state of one (token, KV head): its G query heads' m [G], l [G] and
// unnormalised acc [G, D], laid end to end in G * (D + 2) floats
struct State {
  float* m;
  float* l;
  float* acc;
  State(float* base, int64_t G) : m(base), l(base + G), acc(base + 2 * G) {}
};

// what one thread reuses across its items
struct Scratch {
  std::vector<float> score, ones, run, tile;
  std::vector<int64_t> off;
};

}  // namespace

// the partial of keys p0 .. p1 (p1 - p0 <= tile) of one (token, KV head): the G query heads at
// qh against the keys of the sequence whose pages are table[], read in place, pages in order
static void tile_partial(const float* qh, const float* kp, const float* vp, const int64_t* table,
                         int64_t bs, int64_t p0, int64_t p1, int64_t hk, int64_t Hkv, int64_t G,
                         int64_t D, float scale, State part, Scratch& sc) {
  const int64_t nk = p1 - p0;
  for (int64_t p = p0; p < p1;) {  // where key p's row of KV head hk starts, a page at a time
    const int64_t at = p % bs, run = std::min(bs - at, p1 - p);
    const int64_t base = ((table[p / bs] * bs + at) * Hkv + hk) * D;
    for (int64_t i = 0; i < run; ++i) sc.off[p - p0 + i] = base + i * Hkv * D;
    p += run;
  }
  prefetch_rows(kp, sc.off.data(), nk, D);  // the tile's first keys and values (the loops
  prefetch_rows(vp, sc.off.data(), nk, D);  // ask for the rest ahead)
  float* s = sc.score.data();  // [G, nk]
  scores(qh, kp, sc.off.data(), nk, G, D, scale, s, vp);
  for (int64_t g = 0; g < G; ++g) {  // the tile's own max; numerators in place, their sum
    float* sg = s + g * nk;
    const float m = row_max(sg, nk);
    part.m[g] = m;
    part.l[g] = exp_and_sum(sg, nk, m);
  }
  weighted(s, nk, vp, sc.off.data(), G, D, sc.ones.data(), part.acc);  // unnormalised: x 1
}

// fold a later tile's partial (a State's floats) into the running state (log-sum-exp: both
// to the larger max)
static void fold(State run, const float* part, int64_t G, int64_t D) {
  const float *m_t = part, *l_t = part + G;
  for (int64_t g = 0; g < G; ++g) {
    const float m = std::max(run.m[g], m_t[g]);
    const float a = std::exp(run.m[g] - m), b = std::exp(m_t[g] - m);
    run.m[g] = m;
    run.l[g] = run.l[g] * a + l_t[g] * b;
    float* acc = run.acc + g * D;
    const float* acc_t = part + 2 * G + g * D;
    for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * a + acc_t[d] * b;
  }
}

// out of the G query heads at oh: acc / l
static void finish(State run, int64_t G, int64_t D, float* oh) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / run.l[g];
    for (int64_t d = 0; d < D; ++d) oh[g * D + d] = run.acc[g * D + d] * inv;
  }
}

// Writes k_new, v_new at write_slots, then returns out [T, H, D] = softmax(q k^T * scale) v for
// every new token, where token t (sequence b, position pos) sees keys 0 .. pos of sequence b:
// key p at pool slot block_tables[b, p / block_size] * block_size + p % block_size. q: [T, H, D]
// (rows may be a view into the fused q|k|v projection); k, v: [S, Hkv, D] (one layer of the
// pool); block_tables: [B, nb]; q_index: [B, Tq] packed index of each sequence's j-th new token,
// for j < query_lens[b]; positions: [T]; tile: keys per tile (from 0, so a multiple of
// block_size keeps whole pages in a tile). One work item is a token and a KV head (its G query
// heads share every K and V row read), or one tile of it for a decode token.
at::Tensor flash_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                           at::Tensor write_slots, at::Tensor k, at::Tensor v,
                           at::Tensor block_tables, int64_t block_size, int64_t tile,
                           at::Tensor q_index, at::Tensor query_lens, at::Tensor positions,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T,H,D], k/v [S,Hkv,D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.is_contiguous() &&
              v.is_contiguous(), "q rows of H * D values, k and v contiguous");
  TORCH_CHECK(block_size >= 1 && tile >= 1, "block_size and tile must be >= 1");
  block_tables = block_tables.contiguous(); q_index = q_index.contiguous();
  write_slots = write_slots.contiguous(); query_lens = query_lens.contiguous();
  positions = positions.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  const int64_t B = block_tables.size(0), nb = block_tables.size(1), Tq = q_index.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0, "head shapes");
  const int64_t G = H / Hkv;
  TORCH_CHECK(k_new.size(0) == T && k_new.size(1) == Hkv && k_new.size(2) == D &&
              k_new.sizes() == v_new.sizes() && k_new.stride(2) == 1 && v_new.stride(2) == 1,
              "k_new, v_new: [T, Hkv, D] with unit stride in D");
  write_kv(k_new, v_new, write_slots.data_ptr<int64_t>(), S, k.data_ptr<float>(),
           v.data_ptr<float>());

  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* ip = q_index.data_ptr<int64_t>();
  const int64_t* lp = query_lens.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  // the tokens, (token, sequence, keys, first partial or -1); checked here, before any thread
  // reads memory: every page a token reads lies inside the pool
  std::vector<int64_t> tok, seq, keys, first;
  int64_t parts = 0;  // partials of the decode tokens' tiles
  for (int64_t b = 0; b < B; ++b) {
    int64_t seen = 0;  // the sequence's longest context this step
    for (int64_t j = 0; j < lp[b]; ++j) {
      const int64_t t = ip[b * Tq + j];
      TORCH_CHECK(t >= 0 && t < T && pp[t] >= 0 && pp[t] < nb * block_size,
                  "a query outside its context or its block table");
      const int64_t n = pp[t] + 1, tiles = (n + tile - 1) / tile;
      tok.push_back(t); seq.push_back(b); keys.push_back(n);
      first.push_back(lp[b] == 1 && tiles > 1 ? parts : -1);  // decode: split-K
      if (lp[b] == 1 && tiles > 1) parts += tiles;
      seen = std::max(seen, n);
    }
    for (int64_t i = 0; i < (seen + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * nb + i] >= 0 && (tp[b * nb + i] + 1) * block_size <= S,
                  "a page outside the pool");
  }
  // the work: a prefill token's every tile (it folds them as it goes), or one tile of a decode
  // token (folded after all of them are done), costing its keys; each x Hkv
  std::vector<int64_t> item_tok, item_tile, cost;  // item_tile -1: every tile
  for (int64_t i = 0; i < (int64_t)tok.size(); ++i) {
    const int64_t tiles = first[i] < 0 ? 1 : (keys[i] + tile - 1) / tile;
    for (int64_t j = 0; j < tiles; ++j) {
      item_tok.push_back(i);
      item_tile.push_back(first[i] < 0 ? -1 : j);
      cost.push_back(first[i] < 0 ? keys[i] : std::min(tile, keys[i] - j * tile));
    }
  }
  // a unit's KV heads together where there are units enough (deal_units)
  int64_t nth, chunk, per;
  const std::vector<int64_t> place = deal_units(cost, Hkv, nth, chunk, per);

  auto out = at::empty({T, H, D}, q.options());
  const int64_t R = G * (D + 2);  // floats of one State
  std::vector<float> partial(parts * Hkv * R);  // [parts, Hkv, R]
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto scratch = [&]() {
    Scratch sc;
    sc.score.resize(G * std::min(tile, nb * block_size));
    sc.off.resize(std::min(tile, nb * block_size));
    sc.ones.assign(G, 1.0f);
    sc.run.resize(R);
    sc.tile.resize(R);
    return sc;
  };
  at::parallel_for(0, nth * chunk, 1, [&](int64_t i0, int64_t i1) {
    Scratch sc = scratch();
    for (int64_t i = i0; i < i1; ++i) {
      if (place[i] < 0) continue;
      for (int64_t w = place[i] * per; w < (place[i] + 1) * per; ++w) {
        const int64_t it = w / Hkv, hk = w % Hkv, x = item_tok[it], t = tok[x];
        const float* qh = qp + t * q.stride(0) + hk * G * D;
        const int64_t* table = tp + seq[x] * nb;
        const int64_t n = keys[x];
        if (item_tile[it] >= 0) {  // one tile of a decode token: its partial, for the fold below
          const int64_t j = item_tile[it];
          tile_partial(qh, kp, vp, table, block_size, j * tile, std::min(n, (j + 1) * tile), hk,
                       Hkv, G, D, (float)scale,
                       State(partial.data() + ((first[x] + j) * Hkv + hk) * R, G), sc);
          continue;
        }
        State run(sc.run.data(), G), part(sc.tile.data(), G);
        tile_partial(qh, kp, vp, table, block_size, 0, std::min(n, tile), hk, Hkv, G, D,
                     (float)scale, run, sc);
        for (int64_t p0 = tile; p0 < n; p0 += tile) {
          tile_partial(qh, kp, vp, table, block_size, p0, std::min(n, p0 + tile), hk, Hkv, G, D,
                       (float)scale, part, sc);
          fold(run, sc.tile.data(), G, D);
        }
        finish(run, G, D, op + (t * H + hk * G) * D);
      }
    }
  });
  if (parts == 0) return out;
  // split-K: each decode token's partials folded in tile order, exactly as a prefill token's
  std::vector<int64_t> split;  // (token index) * Hkv + hk of every split decode token
  for (int64_t x = 0; x < (int64_t)tok.size(); ++x)
    for (int64_t hk = 0; first[x] >= 0 && hk < Hkv; ++hk) split.push_back(x * Hkv + hk);
  at::parallel_for(0, (int64_t)split.size(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(R);
    State run(buf.data(), G);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t x = split[i] / Hkv, hk = split[i] % Hkv;
      const int64_t tiles = (keys[x] + tile - 1) / tile;
      const float* p = partial.data() + (first[x] * Hkv + hk) * R;
      std::copy_n(p, R, buf.data());  // the first tile's partial is where the fold starts
      for (int64_t j = 1; j < tiles; ++j) fold(run, p + j * Hkv * R, G, D);
      finish(run, G, D, op + (tok[x] * H + hk * G) * D);
    }
  });
  return out;
}

// Paged attention over the device KV pool on the CPU, for DECODE and EXTEND alike.
//
// Each request b owns q rows [q_starts[b], q_starts[b+1]) (its new tokens) and a context of
// seq_lens[b] tokens whose pool slots are req_to_token[req_pool_indices[b], :]; its new
// tokens are the last ones of the context, so query i (of n) sees keys [0, seq_len - n + i].
// DECODE is the case n = 1. K/V rows are read in place from the pool through req_to_token:
// nothing is gathered into a per-request copy.
//
// Work items are (request, block of up to kQueryBlock queries, KV head, split of the key
// range). All query heads of one KV head are handled together (GQA), so each K/V row is
// loaded once per KV head and block. Within an item keys are visited in tiles with an
// online softmax (FlashAttention, Dao et al. 2022); long contexts with few items are cut
// into splits whose partial (max, sum, accumulator) states are merged afterwards
// (flash-decoding, Dao et al. 2023: "Flash-Decoding for long-context inference").
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common.h"
#include "decode_avx2.h"
#include "decode_avx512.h"
#include "extend_avx512bf16.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kQueryBlock = 16;    // queries of one request per work item (EXTEND)
constexpr int64_t kKeyTile = 64;       // keys converted to float and scored together
constexpr int64_t kMinSplitKeys = 256; // a split shorter than this costs more to merge than it saves
constexpr int64_t kMaxSplits = 32;
constexpr int64_t kTransposeMinRows = 8;  // rows of an item from which the K tile is transposed
constexpr int64_t kMaxMergeDim = 1024;    // v head dim bound (merge_splits' stack row)

struct AttnItem {
  int64_t req, q_block, kv_head, split, num_splits;
};

struct AttnShape {
  int64_t num_reqs, num_q_heads, num_kv_heads, head_dim, v_head_dim;
  int64_t q_row_stride;     // elements between consecutive tokens of q (heads are contiguous)
  int64_t k_slot_stride, v_slot_stride;  // elements between consecutive pool slots
  int64_t r2t_row_stride;   // elements between rows of req_to_token
  int64_t r2t_rows, r2t_cols;  // req_to_token's shape (its slot values are trusted: the allocator's)
  float scale;
};

// Split count per (request, query block, KV head): enough items to keep every thread busy
// (4 per thread for balance), never a split shorter than kMinSplitKeys.
inline std::vector<AttnItem> plan_items(const AttnShape& s, const int64_t* req_pool_indices, const int64_t* seq_lens,
                                        const int64_t* q_starts, int num_threads) {
  int64_t groups = 0, max_kv = 0;
  for (int64_t b = 0; b < s.num_reqs; ++b) {
    const int64_t n = q_starts[b + 1] - q_starts[b];
    require(n >= 1 && seq_lens[b] >= n && seq_lens[b] <= s.r2t_cols,
            "each request needs 1 <= new tokens <= seq_len <= req_to_token's width");
    require(req_pool_indices[b] >= 0 && req_pool_indices[b] < s.r2t_rows, "req_pool_indices out of range");
    groups += (n + kQueryBlock - 1) / kQueryBlock * s.num_kv_heads;
    max_kv = std::max(max_kv, seq_lens[b]);
  }
  const int64_t want = 4 * static_cast<int64_t>(num_threads);
  const int64_t splits_cap = groups >= want ? 1 : std::min<int64_t>(kMaxSplits, (want + groups - 1) / std::max<int64_t>(groups, 1));
  std::vector<AttnItem> items;
  items.reserve(groups * splits_cap);
  for (int64_t b = 0; b < s.num_reqs; ++b) {
    const int64_t n = q_starts[b + 1] - q_starts[b];
    const int64_t prefix = seq_lens[b] - n;
    for (int64_t qb = 0; qb * kQueryBlock < n; ++qb) {
      const int64_t kv_end = prefix + std::min(n, (qb + 1) * kQueryBlock);
      const int64_t ns = std::max<int64_t>(1, std::min(splits_cap, kv_end / kMinSplitKeys));
      for (int64_t h = 0; h < s.num_kv_heads; ++h)
        for (int64_t sp = 0; sp < ns; ++sp) items.push_back({b, qb, h, sp, ns});
    }
  }
  return items;
}

// Float scratch of the portable path, per thread. Sized on first use: a DECODE batch on the
// AVX-512 path never needs it, and zero-filling ~45 KB per call showed up as a top entry
// (memset) of a B = 16, ctx = 1 profile (per-call overhead, paid once per layer).
struct Scratch {
  std::vector<float> q, k, v, p;
  void reserve(int64_t rows, int64_t D, int64_t Dv) {
    if (!p.empty()) return;
    q.resize(rows * D), k.resize(kKeyTile * D), v.resize(kKeyTile * Dv), p.resize(kKeyTile);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// attend_item's DECODE case on the AVX-512 path: q_row is the request's query token, slots
// its n keys of the item's split.
template <typename T>
void decode_item(const AttnItem& it, const AttnShape& s, const T* q_row, const T* k_buf, const T* v_buf,
                 const int32_t* slots, int64_t n, float* state) {
  const int64_t G = s.num_q_heads / s.num_kv_heads, D = s.head_dim, Dv = s.v_head_dim;
  // The KV head 0 item prefetches whole slots (all heads' rows, contiguous in the pool): the
  // request's other heads' items (next in the item order) then find them in cache, and DRAM
  // is read in runs of Hkv x D elements instead of D. 30 layers' pools, B = 16, Hkv = 3,
  // per layer, ctx 256 / 1024: contiguous slots 0.70x / 0.72x (1 thread), 0.80x / 0.84x (2);
  // slots a batch apart 1.01x / 1.07x (1 thread), 0.99x / 1.01x (2).
  const int64_t esz = static_cast<int64_t>(sizeof(T));
  const bool whole = it.kv_head == 0;
  const KvRows<T> kv{k_buf + it.kv_head * D, v_buf + it.kv_head * Dv, s.k_slot_stride, s.v_slot_stride,
                     slots, (whole ? s.num_kv_heads * D : D) * esz, (whole ? s.num_kv_heads * Dv : Dv) * esz};
  decode_item_avx512(q_row + it.kv_head * G * D, G, D, s.scale, kv, n, state, state + G, state + 2 * G);
}
#endif

// One row (query, head) of a portable-path tile: scores of its `visible` keys (from the K
// tile, transposed or not), the online-softmax update of m, l and the accumulator ar [Dv].
inline void attend_row(const float* __restrict qr, Scratch& w, bool transposed, int64_t visible, int64_t D,
                       int64_t Dv, float& m, float& l, float* __restrict ar) {
  float* __restrict sc = w.p.data();
  if (transposed) {
    for (int64_t j = 0; j < kKeyTile; ++j) sc[j] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float qd = qr[d];
      const float* __restrict kd = &w.k[d * kKeyTile];
#pragma omp simd
      for (int64_t j = 0; j < kKeyTile; ++j) sc[j] += qd * kd[j];
    }
  } else {
    for (int64_t j = 0; j < visible; ++j) {
      const float* __restrict kj = &w.k[j * D];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
      sc[j] = dot;
    }
  }
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, sc[j]);
  const float m_new = std::max(m, tile_max);
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m - m_new);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < visible; ++j) {
    sc[j] = fast_exp(sc[j] - m_new);
    sum += sc[j];
  }
  l = l * alpha + sum;
  m = m_new;
#pragma omp simd
  for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
  for (int64_t j = 0; j < visible; ++j) {
    const float pj = sc[j];
    const float* __restrict vj = &w.v[j * Dv];
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) ar[d] += pj * vj[d];
  }
}

template <typename T>
void attend_item(const AttnItem& it, const AttnShape& s, const T* q, const T* k_buf, const T* v_buf,
                 const int32_t* req_to_token, const int64_t* req_pool_indices, const int64_t* seq_lens,
                 const int64_t* q_starts, float* state, Scratch& w) {
  const int64_t G = s.num_q_heads / s.num_kv_heads, D = s.head_dim, Dv = s.v_head_dim;
  const int64_t n = q_starts[it.req + 1] - q_starts[it.req];
  const int64_t prefix = seq_lens[it.req] - n;
  const int64_t i0 = it.q_block * kQueryBlock;
  const int64_t nq = std::min(kQueryBlock, n - i0);
  const int64_t rows = nq * G;
  const int64_t kv_end = prefix + i0 + nq;
  const int64_t k_begin = kv_end * it.split / it.num_splits;
  const int64_t k_end = kv_end * (it.split + 1) / it.num_splits;
  const int32_t* slots = req_to_token + req_pool_indices[it.req] * s.r2t_row_stride;

  float* m = state;           // [rows]
  float* l = m + rows;        // [rows]
  float* acc = l + rows;      // [rows, Dv]
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // One query (DECODE, or the last query block of an EXTEND request holding a single query) of
  // a small GQA group: the register-blocked path (decode_avx512.h).
  if (nq == 1 && decode_avx512_fits(G, D, Dv))
    return decode_item(it, s, q + (q_starts[it.req] + i0) * s.q_row_stride, k_buf, v_buf, slots + k_begin,
                       k_end - k_begin, state);
#elif defined(__AVX2__) && defined(__FMA__)
  // The same case on AVX2-only CPUs (decode_avx2.h).
  if (nq == 1 && decode_avx2_fits(G, D, Dv)) {
    const KvRowsAvx2<T> kv{k_buf + it.kv_head * D, v_buf + it.kv_head * Dv, s.k_slot_stride, s.v_slot_stride,
                           slots + k_begin};
    return decode_item_avx2(q + (q_starts[it.req] + i0) * s.q_row_stride + it.kv_head * G * D, G, D, s.scale, kv,
                            k_end - k_begin, m, l, acc);
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // Several queries over a bf16 pool: the dpbf16 tile path (extend_avx512bf16.h).
  if constexpr (sizeof(T) == 2) {
    if (nq > 1 && extend_bf16_fits(D, Dv)) {
      const bf16* q_item = reinterpret_cast<const bf16*>(q) + (q_starts[it.req] + i0) * s.q_row_stride +
                           it.kv_head * G * D;
      return extend_item_bf16(q_item, s.q_row_stride, rows, G, D, s.scale,
                              reinterpret_cast<const bf16*>(k_buf) + it.kv_head * D,
                              reinterpret_cast<const bf16*>(v_buf) + it.kv_head * Dv, s.k_slot_stride,
                              s.v_slot_stride, slots, k_begin, k_end, prefix + i0, m, l, acc);
    }
  }
#endif
  w.reserve(kQueryBlock * G, D, Dv);
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + rows * Dv, 0.f);
  for (int64_t i = 0; i < nq; ++i) {
    const T* qi = q + (q_starts[it.req] + i0 + i) * s.q_row_stride + it.kv_head * G * D;
    for (int64_t g = 0; g < G; ++g) {
      float* dst = &w.q[(i * G + g) * D];
      load_row(qi + g * D, dst, D);
      for (int64_t d = 0; d < D; ++d) dst[d] *= s.scale;
    }
  }
  // Few rows (DECODE: one query per head of the group) cannot repay transposing the K tile;
  // they take one dot product per key instead.
  const bool transposed = rows >= kTransposeMinRows;
  for (int64_t t0 = k_begin; t0 < k_end; t0 += kKeyTile) {
    const int64_t kt = std::min(kKeyTile, k_end - t0);
    // K tile transposed to [D, kKeyTile] (zero past kt), so scores of one row are
    // kKeyTile-wide FMAs over d: no horizontal sums per key.
    for (int64_t j = 0; j < kt; ++j) {
      const int64_t slot = slots[t0 + j];
      const T* kj = k_buf + slot * s.k_slot_stride + it.kv_head * D;
      if (transposed)
        for (int64_t d = 0; d < D; ++d) w.k[d * kKeyTile + j] = to_float(kj[d]);
      else
        load_row(kj, &w.k[j * D], D);
      load_row(v_buf + slot * s.v_slot_stride + it.kv_head * Dv, &w.v[j * Dv], Dv);
    }
    if (transposed && kt < kKeyTile)
      for (int64_t d = 0; d < D; ++d) std::fill(&w.k[d * kKeyTile + kt], &w.k[(d + 1) * kKeyTile], 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(kt, prefix + i0 + r / G + 1 - t0);  // causal limit
      if (visible <= 0) continue;
      attend_row(&w.q[r * D], w, transposed, visible, D, Dv, m[r], l[r], acc + r * Dv);
    }
  }
}

// Combine the splits of one (request, query block, KV head) and write the output rows.
// Partial state of a work item: per row (query, head of the group) the running max, the
// running sum of exp(score - max), and the unnormalised output [Dv].
template <typename T>
void merge_splits(const AttnItem& first, const AttnShape& s, const int64_t* q_starts, const float* states,
                  int64_t state_size, T* out) {
  const int64_t G = s.num_q_heads / s.num_kv_heads, Dv = s.v_head_dim;
  const int64_t n = q_starts[first.req + 1] - q_starts[first.req];
  const int64_t i0 = first.q_block * kQueryBlock;
  const int64_t nq = std::min(kQueryBlock, n - i0);
  const int64_t rows = nq * G;
  float o[kMaxMergeDim];
  for (int64_t r = 0; r < rows; ++r) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t sp = 0; sp < first.num_splits; ++sp) M = std::max(M, states[sp * state_size + r]);
    float L = 0.f;
    std::fill(o, o + Dv, 0.f);
    for (int64_t sp = 0; sp < first.num_splits; ++sp) {
      const float* st = states + sp * state_size;
      if (st[r] == -std::numeric_limits<float>::infinity()) continue;  // split saw no key of this row
      const float wgt = fast_exp(st[r] - M);
      L += st[rows + r] * wgt;
      const float* acc = st + 2 * rows + r * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) o[d] += acc[d] * wgt;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const int64_t token = q_starts[first.req] + i0 + r / G;
    const int64_t head = first.kv_head * G + r % G;
    T* dst = out + (token * s.num_q_heads + head) * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) dst[d] = from_float<T>(o[d] * inv);
  }
}

// The new tokens' K/V rows, stored into the pool before attention reads them (they are the
// last context slots of their requests). Fusing the store into the kernel call saves a decode
// step two index_put_ per layer and the Python around them (60 per SmolLM2 step: 30 layers).
template <typename T>
struct KvStore {
  const T* k_new;  // [num_tokens] rows of k_row elements, k_new_stride apart
  const T* v_new;  // [num_tokens] rows of v_row elements, v_new_stride apart
  const int64_t* loc;  // [num_tokens] pool slots
  int64_t num_tokens, k_new_stride, v_new_stride;
};

// Copy each new token's K/V row to its slot: loc is checked against the pool first (an
// out-of-range slot raises before anything is written, as index_put_ does; the attention's own
// checks run after the store, as they would after set_kv_buffer in the unfused order). A DECODE batch
// (num_tokens x Hkv x (D + Dv) elements, 6K at B = 16 on SmolLM2) stays under kGrainSize, so
// it copies on the calling thread: a parallel region would cost more than the copy.
template <typename T>
void store_kv(const KvStore<T>& kv, const AttnShape& s, int64_t pool_slots, T* k_buf, T* v_buf, int num_threads) {
  for (int64_t t = 0; t < kv.num_tokens; ++t)
    require(kv.loc[t] >= 0 && kv.loc[t] < pool_slots, "out_cache_loc out of the pool's range");
  const int64_t k_row = s.num_kv_heads * s.head_dim, v_row = s.num_kv_heads * s.v_head_dim;
  const bool parallel = num_threads > 1 && kv.num_tokens * (k_row + v_row) >= kGrainSize;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
  for (int64_t t = 0; t < kv.num_tokens; ++t) {
    std::memcpy(k_buf + kv.loc[t] * s.k_slot_stride, kv.k_new + t * kv.k_new_stride, k_row * sizeof(T));
    std::memcpy(v_buf + kv.loc[t] * s.v_slot_stride, kv.v_new + t * kv.v_new_stride, v_row * sizeof(T));
  }
}

template <typename T>
void paged_attention(const AttnShape& s, const T* q, const T* k_buf, const T* v_buf, T* out,
                     const int32_t* req_to_token, const int64_t* req_pool_indices, const int64_t* seq_lens,
                     const int64_t* q_starts, int num_threads) {
  int64_t macs = 0;  // upper bound of the multiply-adds (causal halves it for long chunks)
  for (int64_t b = 0; b < s.num_reqs; ++b)
    macs += (q_starts[b + 1] - q_starts[b]) * seq_lens[b] * s.num_q_heads * (s.head_dim + s.v_head_dim);
  if (macs < 8 * kGrainSize) num_threads = 1;
  require(s.v_head_dim <= kMaxMergeDim, "v head dim above 1024");
  const bool parallel = num_threads > 1;
  const std::vector<AttnItem> items = plan_items(s, req_pool_indices, seq_lens, q_starts, num_threads);
  const int64_t G = s.num_q_heads / s.num_kv_heads;
  int64_t max_new = 1;
  for (int64_t b = 0; b < s.num_reqs; ++b) max_new = std::max(max_new, q_starts[b + 1] - q_starts[b]);
  // Rows of the largest item (DECODE: G), not kQueryBlock * G; left uninitialised (every item
  // writes the rows it owns): zero-filling 16x too much was the top of a ctx = 1 profile.
  const int64_t state_size = std::min(kQueryBlock, max_new) * G * (2 + s.v_head_dim);
  std::unique_ptr<float[]> states(new float[items.size() * state_size]);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i)
      attend_item(items[i], s, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, q_starts,
                  &states[i * state_size], w);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < num_items; ++i)
      if (items[i].split == 0) merge_splits(items[i], s, q_starts, &states[i * state_size], state_size, out);
  }
}

}  // namespace cpu
}  // namespace hiserve

// DECODE attention of one (request, KV head, key split) work item with AVX-512: one query
// token, the G query heads of the KV head (GQA), keys read in place from the pool.
//
// Same online softmax (FlashAttention, Dao et al. 2022) and the same state layout (m, l, acc)
// as attend_item, so merge_splits is unchanged. Keys go in tiles of 64, scored in blocks of 16:
//
// * Scores: each (key, head) dot product leaves a 16-lane vector of partial sums; the 16
//   vectors of a block are summed by one transpose-reduce tree (hsum16) that leaves the 16
//   scores in one vector, about 3 ops per key and head instead of a horizontal
//   _mm512_reduce_add_ps each (~8 ops on a serial shuffle chain). With AVX512-BF16 a bf16
//   K row is multiplied straight from the pool by _mm512_dpbf16_ps (32 dims per instruction,
//   no conversion; q stays bf16 as the model gave it and the scale goes on the fp32 scores):
//   0.87-0.91x the time of widening K and using fp32 FMAs (same-process A/B, B = 16).
// * bf16 rows are widened by the even/odd trick (x << 16 gives the even dims, x & 0xffff0000
//   the odd ones): one op per 16 floats instead of two (zero-extend + shift). q and the V
//   accumulators live in that permuted order and are put back in order once per item.
// * Prefetch: with page size 1 a request's keys are ~batch-size slots apart (one slot per
//   request per decode step), so neither the hardware prefetcher nor the row order helps.
//   While a tile's V rows are accumulated the next tile's K and V rows are prefetched (the
//   KV head 0 item prefetches whole slots: see decode_item in paged_attention.h).
// * V: the G x (a few units of 32 dims) accumulators stay in registers across the tile's keys.
//
// Measured on the 2-core AVX-512 BF16 KVM (EPYC), B = 16, Hq 9, Hkv 3, D 64, bf16, 1 thread,
// against the former per-key version (same process, interleaved): ctx 400 0.69-0.79 -> 0.22-0.25
// ms per call with K/V in cache, 1.8-2.5 -> 0.37-0.46 ms with 30 layers' pools cycled (DRAM);
// benchmark/results/cpu_attention_decode_ab.json has these and bench_cpu_attention's figures.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"
#include "simd_avx512.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kDecodeMaxGroup = 8;   // query heads per KV head on this path
constexpr int64_t kDecodeMaxDim = 256;   // head dim (a multiple of 16)
constexpr int64_t kDecodeMaxUnits = kDecodeMaxDim / 32;
// Keys scored before their softmax update (and the prefetch unit). B = 16, ctx 400, 1 thread,
// vs 64: 32 keys 1.05-1.07x with K/V in cache (more max/sum reductions), 128 keys 1.10-1.18x
// with K/V from DRAM (a longer prefetch run ahead).
constexpr int64_t kDecodeKeyTile = 64;
constexpr int64_t kDecodeBlock = 16;     // keys per transpose-reduce
// Tiles between a row's prefetch and its use. 30 layers' pools (DRAM-resident), B = 16,
// 1 thread, per layer: 1 tile 0.32 / 1.03 ms (ctx 256 / 1024), 2 tiles 0.39 / 1.15, 3 tiles
// 0.45 / 1.23: lines fetched further ahead are evicted or crowd out the current tile's.
constexpr int64_t kDecodePrefetchTiles = 1;

inline bool decode_avx512_fits(int64_t G, int64_t D, int64_t Dv) {
  return G >= 1 && G <= kDecodeMaxGroup && D == Dv && D % 16 == 0 && D <= kDecodeMaxDim;
}

// A "unit" is 32 dims of a row, as two fp32 vectors (a, b). float: dims 0-15 and 16-31;
// bf16: the even and the odd dims. `full` is false for a last unit of 16 dims (D % 32 == 16):
// the missing half loads as zeros (masked loads do not fault), so it adds nothing.
inline void load_unit(const float* p, bool full, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_maskz_loadu_ps(full ? 0xffff : 0, p + 16);
}
inline __m512i load_bf16_unit(const bf16* p, bool full) {
  return _mm512_maskz_loadu_epi16(full ? 0xffffffffu : 0xffffu, p);
}
inline void load_unit(const bf16* p, bool full, __m512& a, __m512& b) {
  const __m512i x = load_bf16_unit(p, full);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Write one unit's (a, b) accumulators back in dim order (`full`: 32 dims, else 16).
inline void store_unit(float* dst, bool full, __m512 a, __m512 b, const float*) {
  _mm512_storeu_ps(dst, a);
  if (full) _mm512_storeu_ps(dst + 16, b);
}
inline void store_unit(float* dst, bool full, __m512 a, __m512 b, const bf16*) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, lo, b));
  if (full) _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(a, hi, b));
}

// v[i]: 16 partial sums of one dot product each. Returns their 16 totals: output lane 4b + e
// holds the sum of v[b + 4e] (a 4x4 transpose of the indices). Callers feed key
// kBlockOrder[i] as v[i], so output lane l holds key l (the order is its own inverse).
inline __m512 hsum16(const __m512* v) {
  __m512 r[8], s[4], t[2];
  for (int i = 0; i < 8; ++i)  // [key 2i: 8 partials | key 2i+1: 8 partials]
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  for (int i = 0; i < 4; ++i)  // 128-bit block b: key 4i + b, 4 partials
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; ++i)  // block b: keys 8i + b, 8i + 4 + b, 2 partials each
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x44), _mm512_shuffle_ps(t[0], t[1], 0xee));
}
// Complete unrolling before scalar replacement: without it gcc kept register accumulator
// arrays (o[G][N][2]) mirrored on the stack, 12 stores per key (seen in perf annotate).
#define HISERVE_UNROLL _Pragma("GCC unroll 16")

constexpr int kBlockOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Into L2 (T1), not L1: rows a batch of slots apart (B x Hkv x D x 2 bytes, 6 KB at B = 16)
// fall in a few L1 sets, so a tile's worth of prefetched lines evicted each other there. At
// B = 16, ctx 2000 (24 MB of K/V), 1 thread, strided slots: T0 for both 2.1-3.0 ms, T1 for
// the K rows only 2.1-3.0 ms, T1 for both 1.55-1.66 ms (contiguous / random slots: within
// noise); no prefetch at all: 7-11 ms.
// always_inline: gcc 12 deems a function whose only effect is __builtin_prefetch "const" and
// deletes calls to it that were not inlined before its IPA pass (a KvRows::prefetch built
// on it compiled to nothing, and the kernel ran 2x slower on DRAM-resident K/V).
#define HISERVE_ALWAYS_INLINE inline __attribute__((always_inline))
HISERVE_ALWAYS_INLINE void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(row) + o, _MM_HINT_T1);
}

// The query rows of the group, loaded once per item in the layout the score path wants.
template <int G, typename T>
struct DecodeQuery {
  __m512 a[G * kDecodeMaxUnits], b[G * kDecodeMaxUnits];  // fp32 units (FMA path)
#if defined(__AVX512BF16__)
  __m512i raw[G * kDecodeMaxUnits];  // bf16 pairs as stored (dpbf16 path)
#endif
  static constexpr bool kDpbf16 =
#if defined(__AVX512BF16__)
      sizeof(T) == 2;
#else
      false;
#endif
  DecodeQuery(const T* q0, int64_t D) {
    const int64_t U = (D + 31) / 32;
    for (int g = 0; g < G; ++g)
      for (int64_t u = 0; u < U; ++u) {
        const bool full = D - 32 * u >= 32;
#if defined(__AVX512BF16__)
        if constexpr (kDpbf16) {
          raw[g * U + u] = load_bf16_unit(reinterpret_cast<const bf16*>(q0 + g * D + 32 * u), full);
          continue;
        }
#endif
        load_unit(q0 + g * D + 32 * u, full, a[g * U + u], b[g * U + u]);
      }
  }
  // v[i] = 16 partial sums of q_g . rows[i] (unscaled). Units outer, the block's keys inner:
  // a fixed 16-key loop keeps v in registers whatever D is (a runtime unit count in the
  // inner loop left it unrolled once and v on the stack: measured 1.4x slower).
  void dots(int g, const T* const* rows, int64_t D, __m512* v) const {
    const int64_t U = (D + 31) / 32;
    for (int i = 0; i < kDecodeBlock; ++i) v[i] = _mm512_setzero_ps();
    for (int64_t u = 0; u < U; ++u) {
      const bool full = D - 32 * u >= 32;
#if defined(__AVX512BF16__)
      if constexpr (kDpbf16) {
        // bf16 products are exact in fp32; the sums round as the FMA path's do.
        const __m512bh qu = (__m512bh)raw[g * U + u];
        for (int i = 0; i < kDecodeBlock; ++i) {
          const __m512i kx = load_bf16_unit(reinterpret_cast<const bf16*>(rows[i]) + 32 * u, full);
          v[i] = _mm512_dpbf16_ps(v[i], qu, (__m512bh)kx);
        }
        continue;
      }
#endif
      const __m512 qa = a[g * U + u], qb = b[g * U + u];
      for (int i = 0; i < kDecodeBlock; ++i) {
        __m512 ka, kb;
        load_unit(rows[i] + 32 * u, full, ka, kb);
        v[i] = _mm512_fmadd_ps(qb, kb, _mm512_fmadd_ps(qa, ka, v[i]));
      }
    }
  }
};

// Scaled scores of the tile's keys (K rows kp) into p [G, kDecodeKeyTile] (-inf past kt).
template <int G, typename T>
void score_tile(const DecodeQuery<G, T>& q, int64_t D, float scale, const T* const* kp, int64_t kt, float* p) {
  for (int64_t j0 = 0; j0 < kt; j0 += kDecodeBlock) {
    const int64_t valid = std::min<int64_t>(kDecodeBlock, kt - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1u);
    const T* rows[kDecodeBlock];
    for (int i = 0; i < kDecodeBlock; ++i) rows[i] = kp[j0 + std::min<int64_t>(kBlockOrder[i], valid - 1)];
    for (int g = 0; g < G; ++g) {
      __m512 v[kDecodeBlock];
      q.dots(g, rows, D, v);
      const __m512 s = _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale));
      _mm512_storeu_ps(p + g * kDecodeKeyTile + j0,
                       _mm512_mask_blend_ps(live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s));
    }
  }
}

// Online softmax update of the tile: p becomes exp(score - m_new) (0 past kt); alpha [G]
// rescales the earlier accumulators.
template <int G>
void softmax_tile(float* p, int64_t kt, float* m, float* l, float* alpha) {
  const int64_t nb = (kt + kDecodeBlock - 1) / kDecodeBlock;
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * kDecodeKeyTile;
    __m512 mx = _mm512_loadu_ps(pg);
    for (int64_t b = 1; b < nb; ++b) mx = _mm512_max_ps(mx, _mm512_loadu_ps(pg + b * kDecodeBlock));
    const float m_new = std::max(m[g], _mm512_reduce_max_ps(mx));
    alpha[g] = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[g] - m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t valid = std::min<int64_t>(kDecodeBlock, kt - b * kDecodeBlock);
      const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(live, fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(pg + b * kDecodeBlock),
                                                                         _mm512_set1_ps(m_new))));
      _mm512_storeu_ps(pg + b * kDecodeBlock, e);
      sum = _mm512_add_ps(sum, e);
    }
    l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
    m[g] = m_new;
  }
}

// The item's keys in the pool: K / V rows of this KV head (k0, v0: the pool at the head,
// rows k_stride / v_stride elements apart, slots: the item's keys), and how many bytes from
// a row's start to prefetch (k_pf_bytes, v_pf_bytes; see decode_item_avx512).
template <typename T>
struct KvRows {
  const T *k0, *v0;
  int64_t k_stride, v_stride;
  const int32_t* slots;
  int64_t k_pf_bytes, v_pf_bytes;
  const T* k(int64_t j) const { return k0 + static_cast<int64_t>(slots[j]) * k_stride; }
  const T* v(int64_t j) const { return v0 + static_cast<int64_t>(slots[j]) * v_stride; }
  HISERVE_ALWAYS_INLINE void prefetch(int64_t j) const {
    prefetch_row(k(j), k_pf_bytes);
    prefetch_row(v(j), v_pf_bytes);
  }
};

// acc_u [G, U, 2, 16] (unit layout) = alpha * acc_u + p @ V, for units [u0, u0 + N) over the
// tile's keys. N is a template argument so that the G x N x 2 accumulators are registers
// (with a runtime unit count gcc kept them on the stack). Prefetches keys [pf0, pf0 + npf),
// one per key of the tile: a burst of a whole tile's prefetches at once stalled on the miss
// buffers (18% of score_tile's samples sat on such a loop).
template <int G, int N, typename T>
void accumulate_v_units(const float* p, const float* alpha, const T* const* vp, int64_t kt, int64_t D, int64_t u0,
                        const KvRows<T>& pf, int64_t pf0, int64_t npf, float* acc_u) {
  const int64_t U = (D + 31) / 32;
  bool full[N];
  __m512 o[G][N][2];
  HISERVE_UNROLL for (int u = 0; u < N; ++u) full[u] = D - 32 * (u0 + u) >= 32;
  HISERVE_UNROLL for (int g = 0; g < G; ++g)
    HISERVE_UNROLL for (int u = 0; u < N; ++u)
      HISERVE_UNROLL for (int h = 0; h < 2; ++h)
        o[g][u][h] = _mm512_mul_ps(_mm512_loadu_ps(acc_u + ((g * U + u0 + u) * 2 + h) * 16), _mm512_set1_ps(alpha[g]));
  for (int64_t j = 0; j < kt; ++j) {
    if (j < npf) pf.prefetch(pf0 + j);
    HISERVE_UNROLL for (int u = 0; u < N; ++u) {
      __m512 va, vb;
      load_unit(vp[j] + 32 * (u0 + u), full[u], va, vb);
      HISERVE_UNROLL for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kDecodeKeyTile + j]);
        o[g][u][0] = _mm512_fmadd_ps(pj, va, o[g][u][0]);
        o[g][u][1] = _mm512_fmadd_ps(pj, vb, o[g][u][1]);
      }
    }
  }
  HISERVE_UNROLL for (int g = 0; g < G; ++g)
    HISERVE_UNROLL for (int u = 0; u < N; ++u)
      HISERVE_UNROLL for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc_u + ((g * U + u0 + u) * 2 + h) * 16, o[g][u][h]);
}

// All units of the tile: passes of UB units (G x UB x 2 accumulators fit in 16 registers),
// the remainder one unit at a time. The first pass issues the prefetches.
template <int G, typename T>
void accumulate_v(const float* p, const float* alpha, const T* const* vp, int64_t kt, int64_t D,
                  const KvRows<T>& pf, int64_t pf0, int64_t npf, float* acc_u) {
  constexpr int UB = G >= 5 ? 1 : (G >= 3 ? 2 : (G == 2 ? 4 : 8));
  const int64_t U = (D + 31) / 32;
  int64_t u0 = 0;
  for (; u0 + UB <= U; u0 += UB)
    accumulate_v_units<G, UB, T>(p, alpha, vp, kt, D, u0, pf, pf0, u0 == 0 ? npf : 0, acc_u);
  for (; u0 < U; ++u0) accumulate_v_units<G, 1, T>(p, alpha, vp, kt, D, u0, pf, pf0, u0 == 0 ? npf : 0, acc_u);
}

template <int G, typename T>
void decode_item_group(const T* q0, int64_t D, float scale, const KvRows<T>& kv, int64_t n, float* m, float* l,
                       float* acc) {
  const int64_t U = (D + 31) / 32;
  const DecodeQuery<G, T> q(q0, D);
  alignas(64) float p[G * kDecodeKeyTile];
  alignas(64) float acc_u[G * kDecodeMaxUnits * 32];
  const T *kp[kDecodeKeyTile], *vp[kDecodeKeyTile];
  std::fill(acc_u, acc_u + G * U * 32, 0.f);
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  constexpr int64_t ahead = kDecodePrefetchTiles * kDecodeKeyTile;  // keys between a prefetch and its use
  for (int64_t j = 0; j < std::min(ahead, n); ++j) kv.prefetch(j);
  for (int64_t t0 = 0; t0 < n; t0 += kDecodeKeyTile) {
    const int64_t kt = std::min(kDecodeKeyTile, n - t0);
    for (int64_t j = 0; j < kt; ++j) kp[j] = kv.k(t0 + j), vp[j] = kv.v(t0 + j);
    score_tile<G, T>(q, D, scale, kp, kt, p);
    alignas(64) float alpha[G];
    softmax_tile<G>(p, kt, m, l, alpha);
    const int64_t npf = std::max<int64_t>(0, std::min(kDecodeKeyTile, n - t0 - ahead));
    accumulate_v<G, T>(p, alpha, vp, kt, D, kv, t0 + ahead, npf, acc_u);
  }
  for (int g = 0; g < G; ++g)
    for (int64_t u = 0; u < U; ++u)
      store_unit(acc + g * D + 32 * u, D - 32 * u >= 32, _mm512_loadu_ps(acc_u + (g * U + u) * 32),
                 _mm512_loadu_ps(acc_u + (g * U + u) * 32 + 16), q0);
}

// q0: the group's G query rows (D each, contiguous heads); kv: the item's n keys (kv.slots
// starts at its first). Writes m, l [G] and acc [G, D] (unnormalised), as attend_item does.
template <typename T>
void decode_item_avx512(const T* q0, int64_t G, int64_t D, float scale, const KvRows<T>& kv, int64_t n, float* m,
                        float* l, float* acc) {
  switch (G) {
#define HISERVE_DECODE_G(g) \
  case g:                   \
    return decode_item_group<g, T>(q0, D, scale, kv, n, m, l, acc);
    HISERVE_DECODE_G(1) HISERVE_DECODE_G(2) HISERVE_DECODE_G(3) HISERVE_DECODE_G(4)
    HISERVE_DECODE_G(5) HISERVE_DECODE_G(6) HISERVE_DECODE_G(7) HISERVE_DECODE_G(8)
#undef HISERVE_DECODE_G
    default:
      require(false, "decode_item_avx512: group size out of range");
  }
}

}  // namespace cpu
}  // namespace hiserve
#endif  // __AVX512F__ && __AVX512BW__

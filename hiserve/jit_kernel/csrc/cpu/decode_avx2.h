// DECODE attention of one (request, KV head, key split) work item with AVX2 + FMA (the tier of
// CPUs without AVX-512): one query token, the G query heads of the KV head (GQA), keys read
// in place from the pool. The AVX-512 tiers take decode_avx512.h instead.
//
// Same online softmax (FlashAttention, Dao et al. 2022) and state layout (m, l, acc) as
// attend_item, so merge_splits is unchanged; the same structure as decode_avx512.h at half
// the width, without its bf16 dot-product and prefetch refinements:
// * Scores in blocks of 8 keys: each (key, head) dot product leaves an 8-lane vector of
//   partial sums, and one hadd/permute tree (hsum8) turns the block's 8 vectors into the 8
//   scores, instead of a horizontal sum per key (the portable loop's serial chain of scalar
//   adds, plus a scalar exp: 75 us a call at ctx 240, G 3, D 64 on an AVX2 EPYC).
// * The softmax exponent runs 8 lanes at a time (fast_exp8: fast_exp's clamp, reduction and
//   polynomial).
// * V: the accumulators of G heads x a chunk of dims stay in registers across the tile's keys.
// * No prefetch: next-tile K/V prefetches (T0 or T1, whole slots from the KV head 0 item as
//   decode_avx512.h does) measured within the noise here (30 layers' pools cycled, ctx 240 /
//   1000, 2 threads: 105-135 / 297-367 us a call with and without), so they were left out.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"
#include "simd_avx2.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kAvx2MaxGroup = 8;   // query heads per KV head on this path
constexpr int64_t kAvx2MaxDim = 256;   // head dim (a multiple of 8)
constexpr int64_t kAvx2KeyTile = 64;   // keys scored before their softmax update

inline bool decode_avx2_fits(int64_t G, int64_t D, int64_t Dv) {
  return G >= 1 && G <= kAvx2MaxGroup && D == Dv && D % 8 == 0 && D <= kAvx2MaxDim;
}

// v[i]: 8 partial sums of one dot product each -> lane i holds the total of v[i].
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: [v0..v3 low-half sums | v0..v3 high-half sums]; cd likewise for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes [0, valid) all ones, the rest zero.
inline __m256 live_lanes(int64_t valid) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), idx));
}

// Where the item's keys lie: row j of K at k0 + slots[j] * k_stride (V likewise).
template <typename T>
struct KvRowsAvx2 {
  const T *k0, *v0;
  int64_t k_stride, v_stride;
  const int32_t* slots;
  const T* k(int64_t j) const { return k0 + static_cast<int64_t>(slots[j]) * k_stride; }
  const T* v(int64_t j) const { return v0 + static_cast<int64_t>(slots[j]) * v_stride; }
};

// Scaled scores of the tile's kt keys (rows kp) into p [G, kAvx2KeyTile]; lanes past kt of the
// last block hold -inf.
template <int G, typename T>
void score_tile_avx2(const float* qf, int64_t D, float scale, const T* const* kp, int64_t kt, float* p) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < kt; j0 += 8) {
    const int64_t valid = std::min<int64_t>(8, kt - j0);
    const T* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = kp[j0 + std::min<int64_t>(i, valid - 1)];
    const __m256 live = live_lanes(valid);
    for (int g = 0; g < G; ++g) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 q = _mm256_loadu_ps(qf + g * D + d);
        for (int i = 0; i < 8; ++i) v[i] = _mm256_fmadd_ps(q, load8(rows[i] + d), v[i]);
      }
      const __m256 s = _mm256_mul_ps(hsum8(v), _mm256_set1_ps(scale));
      _mm256_storeu_ps(p + g * kAvx2KeyTile + j0, _mm256_blendv_ps(ninf, s, live));
    }
  }
}

// Online softmax update: p becomes exp(score - m_new) (0 past kt); alpha [G] rescales the
// earlier accumulators.
template <int G>
void softmax_tile_avx2(float* p, int64_t kt, float* m, float* l, float* alpha) {
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * kAvx2KeyTile;
    __m256 mx = _mm256_loadu_ps(pg);
    for (int64_t j = 8; j < kt; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(pg + j));
    const float m_new = std::max(m[g], hmax(mx));
    alpha[g] = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[g] - m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kt; j += 8) {
      const __m256 e = _mm256_and_ps(fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + j), _mm256_set1_ps(m_new))),
                                     live_lanes(kt - j));
      _mm256_storeu_ps(pg + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[g] = l[g] * alpha[g] + reduce_add8(sum);
    m[g] = m_new;
  }
}

// acc [G, D] = alpha * acc + p @ V over dims [d0, d0 + 8 C): G x C accumulators in registers.
template <int G, int C, typename T>
void accumulate_v_chunk(const float* p, const float* alpha, const T* const* vp, int64_t kt, int64_t D, int64_t d0,
                        float* acc) {
  __m256 o[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d0 + 8 * c), _mm256_set1_ps(alpha[g]));
  for (int64_t j = 0; j < kt; ++j) {
    for (int c = 0; c < C; ++c) {
      const __m256 v = load8(vp[j] + d0 + 8 * c);
      for (int g = 0; g < G; ++g) o[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * kAvx2KeyTile + j]), v, o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, o[g][c]);
}

template <int G, typename T>
void decode_item_avx2_group(const T* q0, int64_t D, float scale, const KvRowsAvx2<T>& kv, int64_t n, float* m,
                            float* l, float* acc) {
  // Dims per register pass of V: G x C accumulators + C rows + a broadcast within 16 registers.
  constexpr int C = G <= 2 ? 4 : (G <= 6 ? 2 : 1);
  alignas(32) float qf[G * kAvx2MaxDim];
  alignas(32) float p[G * kAvx2KeyTile];
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(q0[i]);
  std::fill(acc, acc + G * D, 0.f);
  for (int g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  const T *kp[kAvx2KeyTile], *vp[kAvx2KeyTile];
  for (int64_t t0 = 0; t0 < n; t0 += kAvx2KeyTile) {
    const int64_t kt = std::min(kAvx2KeyTile, n - t0);
    for (int64_t j = 0; j < kt; ++j) kp[j] = kv.k(t0 + j), vp[j] = kv.v(t0 + j);
    score_tile_avx2<G, T>(qf, D, scale, kp, kt, p);
    float alpha[G];
    softmax_tile_avx2<G>(p, kt, m, l, alpha);
    int64_t d0 = 0;
    for (; d0 + 8 * C <= D; d0 += 8 * C) accumulate_v_chunk<G, C, T>(p, alpha, vp, kt, D, d0, acc);
    for (; d0 < D; d0 += 8) accumulate_v_chunk<G, 1, T>(p, alpha, vp, kt, D, d0, acc);
  }
}

// q0: the group's G query rows (D each, contiguous heads); kv: the item's n keys (kv.slots
// starts at its first). Writes m, l [G] and acc [G, D] (unnormalised), as attend_item does.
template <typename T>
void decode_item_avx2(const T* q0, int64_t G, int64_t D, float scale, const KvRowsAvx2<T>& kv, int64_t n, float* m,
                      float* l, float* acc) {
  switch (G) {
#define HISERVE_DECODE_AVX2_G(g) \
  case g:                        \
    return decode_item_avx2_group<g, T>(q0, D, scale, kv, n, m, l, acc);
    HISERVE_DECODE_AVX2_G(1) HISERVE_DECODE_AVX2_G(2) HISERVE_DECODE_AVX2_G(3) HISERVE_DECODE_AVX2_G(4)
    HISERVE_DECODE_AVX2_G(5) HISERVE_DECODE_AVX2_G(6) HISERVE_DECODE_AVX2_G(7) HISERVE_DECODE_AVX2_G(8)
#undef HISERVE_DECODE_AVX2_G
    default:
      require(false, "decode_item_avx2: group size out of range");
  }
}

}  // namespace cpu
}  // namespace hiserve
#endif  // AVX2 && FMA, no AVX-512

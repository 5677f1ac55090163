// DECODE attention of one (request, KV head, key split) work item with AVX-512: one query
// token, the G query heads of the KV head (GQA), keys read in place from the pool.
//
// Why a separate path: the portable loop of paged_attention.h reduces one dot product per key
// and query head horizontally and keeps the output accumulators in memory, about 130 cycles
// per key and KV head at G = 3, D = 64. Here each key's K row is loaded once for all G heads
// (G accumulators, then G reductions), and the V accumulation runs one 16-float chunk of the
// head dimension at a time with the G accumulators of that chunk in registers across the
// tile's keys. Same online softmax (FlashAttention) and the same state layout (m, l, acc) as
// attend_item, so merge_splits is unchanged.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kDecodeMaxGroup = 8;   // query heads per KV head on this path
constexpr int64_t kDecodeMaxDim = 256;   // head dim (a multiple of 16)
constexpr int64_t kDecodeKeyTile = 64;   // keys scored before their softmax update

inline bool decode_avx512_fits(int64_t G, int64_t D, int64_t Dv) {
  return G >= 1 && G <= kDecodeMaxGroup && D == Dv && D % 16 == 0 && D <= kDecodeMaxDim;
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// q0: the group's G query rows (D each, contiguous heads); k0 / v0: the pool at this KV head,
// rows `k_stride` / `v_stride` elements apart; slots: the item's n keys. Writes m, l [G] and
// acc [G, D] (unnormalised), as attend_item does.
template <typename T>
void decode_item_avx512(const T* q0, int64_t G, int64_t D, float scale, const T* k0, const T* v0,
                        int64_t k_stride, int64_t v_stride, const int32_t* slots, int64_t n, float* m,
                        float* l, float* acc) {
  const int64_t C = D / 16;
  alignas(64) float qf[kDecodeMaxGroup * kDecodeMaxDim];
  alignas(64) float p[kDecodeMaxGroup * kDecodeKeyTile];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q0[g * D + d]) * scale;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kDecodeKeyTile) {
    const int64_t kt = std::min(kDecodeKeyTile, n - t0);
    // Scores: each K row loaded once, G dot products at a time.
    for (int64_t j = 0; j < kt; ++j) {
      const T* kj = k0 + static_cast<int64_t>(slots[t0 + j]) * k_stride;
      __m512 dots[kDecodeMaxGroup];
      for (int64_t g = 0; g < G; ++g) dots[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m512 kv = load16(kj + c * 16);
        for (int64_t g = 0; g < G; ++g) dots[g] = _mm512_fmadd_ps(_mm512_load_ps(&qf[g * D + c * 16]), kv, dots[g]);
      }
      for (int64_t g = 0; g < G; ++g) p[g * kDecodeKeyTile + j] = _mm512_reduce_add_ps(dots[g]);
    }
    // Online softmax per query head; p becomes the tile's probabilities (unnormalised).
    alignas(64) float alpha[kDecodeMaxGroup];
    for (int64_t g = 0; g < G; ++g) {
      float* pg = &p[g * kDecodeKeyTile];
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < kt; ++j) tile_max = std::max(tile_max, pg[j]);
      const float m_new = std::max(m[g], tile_max);
      alpha[g] = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[g] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kt; ++j) {
        pg[j] = fast_exp(pg[j] - m_new);
        sum += pg[j];
      }
      l[g] = l[g] * alpha[g] + sum;
      m[g] = m_new;
    }
    // V: one 16-float chunk at a time, its G accumulators in registers across the tile.
    for (int64_t c = 0; c < C; ++c) {
      __m512 out[kDecodeMaxGroup];
      for (int64_t g = 0; g < G; ++g)
        out[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c * 16), _mm512_set1_ps(alpha[g]));
      for (int64_t j = 0; j < kt; ++j) {
        const __m512 vv = load16(v0 + static_cast<int64_t>(slots[t0 + j]) * v_stride + c * 16);
        for (int64_t g = 0; g < G; ++g)
          out[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * kDecodeKeyTile + j]), vv, out[g]);
      }
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * D + c * 16, out[g]);
    }
  }
}

}  // namespace cpu
}  // namespace hiserve
#endif  // __AVX512F__

// EXTEND attention of one (request, query block, KV head, key split) work item with
// AVX512-BF16: several queries of a request (a prefill chunk, a question after a cached system
// prompt) over a context in the bf16 pool, both products on _mm512_dpbf16_ps.
//
// The portable path (attend_row) widens every K/V element to fp32 and runs scalar-broadcast FMAs;
// torch's SDPA (flash attention for the CPU) reached ~64 GFLOP/s on one thread of the EPYC
// (family 26) for 50 queries over 1050 keys, SmolLM2 heads (9 query, 3 KV heads, D 64), where a
// oneDNN bf16 GEMM of the same shapes ran at ~375 GFLOP/s: attention there is not bound by the
// multiply-adds. Here, per tile of kExtendKeyTile keys:
//
// * The K tile is packed once into the VNNI pair layout kp[d/2][key][2] (dims 2p and 2p+1 of a key
//   are one dword), then every row of the item (its queries x the KV head's G query heads, GQA)
//   scores the whole tile with one dpbf16 per dim pair and 16 keys: lanes are keys, so no
//   horizontal sums. q pairs are broadcast from the bf16 row as stored (no conversion).
// * Scores, the causal mask and the online softmax (FlashAttention, Dao et al. 2022) stay fp32;
//   the probabilities are rounded to bf16 for the P @ V product, as FlashAttention-2/3 do on GPUs.
// * V is packed in key pairs vp[key/2][dim][2] (one permutex2var per 16 dims of a pair of keys),
//   so P @ V is again one dpbf16 per key pair and 16 dims, lanes = dims, in dim order.
// * Rows go in blocks of kExtendRowBlock: each packed K/V vector is loaded once per block, and a
//   block's score and output accumulators are registers. P @ V runs over the key pairs the block's
//   most-advanced row sees; the others multiply a zero probability by the V rows of keys past
//   their causal limit (their own request's later tokens: finite unless the model already
//   produced inf/NaN, which would then reach those rows too).
//
// The item writes the same state (m, l, acc [rows, Dv] unnormalised, in dim order) as
// attend_item, so split merging (merge_splits) is unchanged.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"
#include "decode_avx512.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kExtendKeyTile = 64;     // keys per packed tile: four 16-lane score vectors
constexpr int kExtendKeyVecs = kExtendKeyTile / 16;
constexpr int64_t kExtendMaxDim = 256;     // head dim bound (a multiple of 32)
constexpr int kExtendRowBlock = 4;         // rows sharing each packed K/V load
constexpr int kExtendDimChunks = 4;        // 16-dim output vectors per P @ V pass (x rows: registers)

inline bool extend_bf16_fits(int64_t D, int64_t Dv) { return D == Dv && D % 32 == 0 && D <= kExtendMaxDim; }

// Transpose of a 16 x 16 dword block: in[i] holds row i; out[j] gets column j.
HISERVE_ALWAYS_INLINE void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + c] now holds, in 128-bit lane L, column 4L + c of rows 4b .. 4b + 3: finish across lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// kp[p * kExtendKeyTile + j] = dims (2p, 2p + 1) of key j (zero for j >= kt): blocks of 16 keys
// x 16 dim pairs, each one 16 x 16 dword transpose.
inline void pack_k_tile(const bf16* const* rows, int64_t kt, int64_t D, uint32_t* __restrict kp) {
  const int64_t P = D / 2;
  for (int64_t j0 = 0; j0 < kExtendKeyTile; j0 += 16)
    for (int64_t p0 = 0; p0 < P; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < kt ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(rows[j0 + i]) + p0)
                           : _mm512_setzero_si512();
      transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kp + (p0 + i) * kExtendKeyTile + j0, r[i]);
    }
}

// vp[(j2 * D + d)] = (V[2 j2][d], V[2 j2 + 1][d]) as one dword (zero rows past kt).
inline void pack_v_tile(const bf16* const* rows, int64_t kt, int64_t D, uint32_t* __restrict vp) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                      53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t j2 = 0; j2 < kExtendKeyTile / 2; ++j2) {
    const int64_t j = 2 * j2;
    uint32_t* dst = vp + j2 * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = j < kt ? _mm512_loadu_si512(rows[j] + d) : _mm512_setzero_si512();
      const __m512i b = j + 1 < kt ? _mm512_loadu_si512(rows[j + 1] + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// One block of NR rows over one packed tile. q[r]: row r's query (bf16, D dims, as dwords);
// visible[r]: its unmasked keys of the tile (causal); m, l, acc: its state rows.
template <int NR>
void extend_block(const uint32_t* const* q, const int64_t* visible, const uint32_t* kp, const uint32_t* vp,
                  int64_t D, float scale, float** m, float** l, float** acc) {
  const int64_t P = D / 2;
  __m512 s[NR][kExtendKeyVecs];
  HISERVE_UNROLL for (int r = 0; r < NR; ++r)
    HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; ++v) s[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh kv[kExtendKeyVecs];
    HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; ++v)
      kv[v] = (__m512bh)_mm512_load_si512(kp + p * kExtendKeyTile + 16 * v);
    HISERVE_UNROLL for (int r = 0; r < NR; ++r) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
      HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], qp, kv[v]);
    }
  }
  alignas(64) uint32_t pb[NR][kExtendKeyTile / 2];  // bf16 probabilities, key pairs as dwords
  float alpha[NR];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  HISERVE_UNROLL for (int r = 0; r < NR; ++r) {
    const int64_t vis = visible[r];
    if (vis <= 0) {  // no key of this tile: the row's state is unchanged
      alpha[r] = 1.f;
      std::memset(pb[r], 0, sizeof(pb[r]));
      continue;
    }
    __m512 x[kExtendKeyVecs];
    __mmask16 live[kExtendKeyVecs];
    __m512 mx = neg_inf;
    HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; ++v) {
      const int64_t n = std::clamp<int64_t>(vis - 16 * v, 0, 16);
      live[v] = static_cast<__mmask16>((1u << n) - 1u);
      x[v] = _mm512_mask_mul_ps(neg_inf, live[v], s[r][v], _mm512_set1_ps(scale));
      mx = _mm512_max_ps(mx, x[v]);
    }
    const float m_new = std::max(*m[r], _mm512_reduce_max_ps(mx));
    alpha[r] = *m[r] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(*m[r] - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; ++v) {
      x[v] = _mm512_maskz_mov_ps(live[v], fast_exp16(_mm512_sub_ps(x[v], mv)));
      sum = _mm512_add_ps(sum, x[v]);
    }
    *l[r] = *l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    *m[r] = m_new;
    HISERVE_UNROLL for (int v = 0; v < kExtendKeyVecs; v += 2)  // keys 16v.. at bf16 lanes of pb
      _mm512_store_si512(pb[r] + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(x[v + 1], x[v]));
  }
  const int64_t pairs = (std::max<int64_t>(0, *std::max_element(visible, visible + NR)) + 1) / 2;
  for (int64_t c0 = 0; c0 < D; c0 += 16 * kExtendDimChunks) {
    const int nc = static_cast<int>(std::min<int64_t>(kExtendDimChunks, (D - c0) / 16));
    __m512 o[NR][kExtendDimChunks];
    HISERVE_UNROLL for (int r = 0; r < NR; ++r)
      HISERVE_UNROLL for (int c = 0; c < kExtendDimChunks; ++c)
        if (c < nc) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c0 + 16 * c), _mm512_set1_ps(alpha[r]));
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      HISERVE_UNROLL for (int c = 0; c < kExtendDimChunks; ++c) {
        if (c >= nc) continue;
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + j2 * D + c0 + 16 * c);
        HISERVE_UNROLL for (int r = 0; r < NR; ++r)
          o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r][j2])), vv);
      }
    }
    HISERVE_UNROLL for (int r = 0; r < NR; ++r)
      HISERVE_UNROLL for (int c = 0; c < kExtendDimChunks; ++c)
        if (c < nc) _mm512_storeu_ps(acc[r] + c0 + 16 * c, o[r][c]);
  }
}

// The item's rows: queries i of [0, nq) (positions first_pos + i), heads g of the group; row
// r = i * G + g, whose bf16 query is q_item + i * q_stride + g * D (q_item: the item's first
// query at the group's first head). slots are the request's pool slots and [k_begin, k_end) the
// item's keys. Writes m, l [rows] and acc [rows, D] as attend_item does. Any group size.
inline void extend_item_bf16(const bf16* q_item, int64_t q_stride, int64_t rows, int64_t G, int64_t D, float scale,
                             const bf16* k_head, const bf16* v_head, int64_t k_stride, int64_t v_stride,
                             const int32_t* slots, int64_t k_begin, int64_t k_end, int64_t first_pos, float* m,
                             float* l, float* acc) {
  alignas(64) uint32_t kp[kExtendMaxDim / 2 * kExtendKeyTile];
  alignas(64) uint32_t vp[kExtendKeyTile / 2 * kExtendMaxDim];
  const bf16 *kr[kExtendKeyTile], *vr[kExtendKeyTile];
  for (int64_t r = 0; r < rows; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
  std::fill(acc, acc + rows * D, 0.f);
  for (int64_t t0 = k_begin; t0 < k_end; t0 += kExtendKeyTile) {
    const int64_t kt = std::min(kExtendKeyTile, k_end - t0);
    for (int64_t j = 0; j < kt; ++j) {
      kr[j] = k_head + static_cast<int64_t>(slots[t0 + j]) * k_stride;
      vr[j] = v_head + static_cast<int64_t>(slots[t0 + j]) * v_stride;
    }
    pack_k_tile(kr, kt, D, kp);
    pack_v_tile(vr, kt, D, vp);
    for (int64_t r0 = 0; r0 < rows; r0 += kExtendRowBlock) {
      const int nr = static_cast<int>(std::min<int64_t>(kExtendRowBlock, rows - r0));
      const uint32_t* q[kExtendRowBlock];
      int64_t visible[kExtendRowBlock];
      float *mr[kExtendRowBlock], *lr[kExtendRowBlock], *ar[kExtendRowBlock];
      for (int r = 0; r < nr; ++r) {
        const int64_t row = r0 + r;
        q[r] = reinterpret_cast<const uint32_t*>(q_item + (row / G) * q_stride + (row % G) * D);
        visible[r] = std::min(kt, first_pos + row / G + 1 - t0);  // causal limit
        mr[r] = m + row, lr[r] = l + row, ar[r] = acc + row * D;
      }
      switch (nr) {
        case 4: extend_block<4>(q, visible, kp, vp, D, scale, mr, lr, ar); break;
        case 3: extend_block<3>(q, visible, kp, vp, D, scale, mr, lr, ar); break;
        case 2: extend_block<2>(q, visible, kp, vp, D, scale, mr, lr, ar); break;
        default: extend_block<1>(q, visible, kp, vp, D, scale, mr, lr, ar); break;
      }
    }
  }
}

}  // namespace cpu
}  // namespace hiserve
#endif  // __AVX512BF16__ && __AVX512BW__

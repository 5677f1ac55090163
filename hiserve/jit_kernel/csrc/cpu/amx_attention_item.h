// The work items of the AMX prefill attention (amx_attention.h): the K/V tile packing, the
// softmax's exp2, and one item (a query head's 16 or 32 queries over all their key blocks) for
// D = 64 (output in tiles) and for any other D (output in memory). See amx_attention.h.
#pragma once

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "amx_bf16_gemm.h"
#include "extend_avx512bf16.h"

namespace hiserve {
namespace cpu {

constexpr int64_t kFlashMaxDim = 256;  // head dims a multiple of 32, at most this

struct FlashCall {
  const bf16* q;
  int64_t q_rs, q_hs;  // element strides: query row, query head
  const bf16* k;
  const bf16* v;
  int64_t k_rs, v_rs;  // key/value row strides (a head follows at +D)
  const int64_t* slots;  // key j's row: slots[j], or j where null
  bf16* out;
  int64_t o_rs, o_hs;
  float* lse;  // [Hq, lse_ld] natural-log log-sum-exp of the scaled scores (query i at i), or null
  int64_t lse_ld;
  int64_t n, S, Hq, Hkv, D;
  bool causal;
  float scale;
};

#ifdef HISERVE_AMX

// Pack keys [32 kb, 32 kb + 32) of KV head hk: K images (D/32 x 2 tiles), V images (D/16 tiles).
inline void flash_pack_block(const FlashCall& a, int64_t hk, int64_t kb, uint16_t* kp, uint16_t* vp) {
  const bf16* krow[32];
  const bf16* vrow[32];
  const int64_t j0 = kb * 32, kt = std::min<int64_t>(32, a.S - j0);
  for (int64_t j = 0; j < kt; ++j) {
    const int64_t row = a.slots != nullptr ? a.slots[j0 + j] : j0 + j;
    krow[j] = a.k + row * a.k_rs + hk * a.D;
    vrow[j] = a.v + row * a.v_rs + hk * a.D;
  }
  for (int64_t c = 0; c < a.D / 32; ++c)
    for (int64_t h = 0; h < 2; ++h) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = 16 * h + i < kt ? _mm512_loadu_si512(krow[16 * h + i] + 32 * c) : _mm512_setzero_si512();
      transpose16x16(r);
      uint16_t* dst = kp + (c * 2 + h) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + 32 * i, r[i]);
    }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                      53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t d = 0; d < a.D; d += 32) {
      const __m512i x = 2 * r < kt ? _mm512_loadu_si512(vrow[2 * r] + d) : _mm512_setzero_si512();
      const __m512i y = 2 * r + 1 < kt ? _mm512_loadu_si512(vrow[2 * r + 1] + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (d / 16) * 512 + 32 * r, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vp + (d / 16 + 1) * 512 + 32 * r, _mm512_permutex2var_epi16(x, hi, y));
    }
}

// 2^x for the softmax's arguments (x <= kFlashLazy): x = i + f, |f| <= 0.5, 2^f by its degree-5
// Taylor polynomial in f ln 2 (relative error < 4e-6, far below the bf16 rounding of P), 2^i by
// scalef (0 below 2^-149). x = -inf (a masked key) gives NaN: callers zero masked lanes.
HISERVE_ALWAYS_INLINE __m512 flash_exp2(__m512 x) {
  const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, i);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  for (float c : {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, i);
}

// Per-thread state of one item: 32 query rows.
struct FlashState {
  alignas(64) float s[32 * 32];                 // the block's scores
  alignas(64) uint16_t p[32 * 32];              // its probabilities, bf16 (A tiles of P V)
  alignas(64) float pv[32 * kFlashMaxDim];      // P V of the block
  alignas(64) float o[32 * kFlashMaxDim];       // the unnormalised output
  alignas(64) float l[32 * 16];                 // row sums, 16 partial sums a row
  alignas(64) uint16_t qpad[32 * kFlashMaxDim];  // a last partial block's queries, zero-padded
  float m[32], alpha[32];
};

// The online softmax over one block of scores; vis[r]: visible keys of row r in the block (32:
// all). Writes P (bf16) and alpha (the factor of the rows' earlier output).
inline void flash_softmax(FlashState& st, const int* vis, float c) {
  for (int r = 0; r < 32; ++r) {
    const __mmask32 km = vis[r] >= 32 ? ~0u : (vis[r] <= 0 ? 0u : (1u << vis[r]) - 1u);
    const __mmask16 k0 = static_cast<__mmask16>(km), k1 = static_cast<__mmask16>(km >> 16);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mask_mov_ps(ninf, k0, _mm512_load_ps(st.s + 32 * r));
    const __m512 s1 = _mm512_mask_mov_ps(ninf, k1, _mm512_load_ps(st.s + 32 * r + 16));
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float m_old = st.m[r], m_new = std::max(m_old, mx);
    if (m_new == -INFINITY) {  // nothing visible yet (a row of a block it does not see)
      st.alpha[r] = 1.0f;
      _mm512_store_si512(st.p + 32 * r, _mm512_setzero_si512());
      continue;
    }
    const float alpha = m_old == -INFINITY ? 0.0f : std::exp2((m_old - m_new) * c);
    const __m512 neg = _mm512_set1_ps(-m_new * c), cc = _mm512_set1_ps(c);
    const __m512 p0 = _mm512_maskz_mov_ps(k0, flash_exp2(_mm512_fmadd_ps(s0, cc, neg)));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, flash_exp2(_mm512_fmadd_ps(s1, cc, neg)));
    _mm512_store_ps(st.l + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(st.l + 16 * r), _mm512_set1_ps(alpha),
                                                  _mm512_add_ps(p0, p1)));
    _mm512_store_si512(st.p + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    st.m[r] = m_new;
    st.alpha[r] = alpha;
  }
}

// One item: query head hq, queries [i0, i0 + rows). kp/vp: the packed K/V of its KV head.
inline void flash_item(const FlashCall& a, FlashState& st, int64_t hq, int64_t i0, const uint16_t* kp,
                       const uint16_t* vp) {
  const int64_t rows = std::min<int64_t>(32, a.n - i0), D = a.D, off = a.S - a.n;
  const bf16* qa = a.q + i0 * a.q_rs + hq * a.q_hs;
  int64_t lda = a.q_rs * 2;
  if (rows < 32) {  // copy the partial block so that the tile loads stay inside q
    std::memset(st.qpad, 0, sizeof(uint16_t) * 32 * D);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(st.qpad + r * D, qa + r * a.q_rs, 2 * D);
    qa = reinterpret_cast<const bf16*>(st.qpad), lda = 2 * D;
  }
  const int64_t last_key = a.causal ? std::min(a.S - 1, i0 + rows - 1 + off) : a.S - 1;
  const int64_t nkb = last_key / 32 + 1;
  const float c = a.scale * 1.44269504088896341f;
  std::fill(st.m, st.m + 32, -INFINITY);
  std::memset(st.l, 0, sizeof(st.l));
  std::memset(st.o, 0, sizeof(float) * 32 * D);
  int vis[32];
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const uint16_t* kt = kp + kb * D * 32;
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t ch = 0; ch < D / 32; ++ch) {
      _tile_loadd(0, qa + 32 * ch, lda);
      _tile_loadd(1, qa + 16 * (lda / 2) + 32 * ch, lda);
      _tile_loadd(2, kt + ch * 1024, 64);
      _tile_loadd(3, kt + ch * 1024 + 512, 64);
      _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, st.s, 128); _tile_stored(5, st.s + 16, 128);
    _tile_stored(6, st.s + 512, 128); _tile_stored(7, st.s + 528, 128);
    const int64_t j0 = kb * 32;
    for (int r = 0; r < 32; ++r) {
      const int64_t lim = a.causal ? std::min(a.S - 1, i0 + r + off) : a.S - 1;  // last visible key
      vis[r] = static_cast<int>(std::clamp<int64_t>(lim - j0 + 1, 0, 32));
    }
    flash_softmax(st, vis, c);
    const uint16_t* vt = vp + kb * D * 32;
    for (int64_t dc = 0; dc < D / 32; ++dc) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      _tile_loadd(0, st.p, 64); _tile_loadd(1, st.p + 512, 64);
      _tile_loadd(2, vt + dc * 1024, 64); _tile_loadd(3, vt + dc * 1024 + 512, 64);
      _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
      float* pv = st.pv + 32 * dc;
      _tile_stored(4, pv, 4 * D); _tile_stored(5, pv + 16, 4 * D);
      _tile_stored(6, pv + 16 * D, 4 * D); _tile_stored(7, pv + 16 * D + 16, 4 * D);
    }
    for (int r = 0; r < 32; ++r) {
      const __m512 al = _mm512_set1_ps(st.alpha[r]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(st.o + r * D + d, _mm512_fmadd_ps(_mm512_load_ps(st.o + r * D + d), al,
                                                          _mm512_load_ps(st.pv + r * D + d)));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(st.l + 16 * r));
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    bf16* dst = a.out + (i0 + r) * a.o_rs + hq * a.o_hs;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 x0 = _mm512_mul_ps(_mm512_load_ps(st.o + r * D + d), inv);
      const __m512 x1 = _mm512_mul_ps(_mm512_load_ps(st.o + r * D + d + 16), inv);
      _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
    if (a.lse != nullptr) a.lse[hq * a.lse_ld + i0 + r] = st.m[r] * a.scale + std::log(l);
  }
}

// D = 64: the output stays in four C tiles across the key blocks (16-query items), and Q K^T runs
// two blocks ahead of the softmax so that the tiles multiply while the vector units
// exponentiate. A row's running max is raised only when a block's max exceeds it by
// more than kFlashLazy (log2 units; FlashAttention-4's conditional rescaling): the probabilities
// then stay below 2^kFlashLazy, and the output tiles are spilled and rescaled only then.
constexpr float kFlashLazy = 8.0f;

struct FlashState64 {
  alignas(64) float s[3][16 * 32];  // scores of blocks kb, kb + 1, kb + 2 (kb % 3)
  alignas(64) uint16_t p[16 * 32];
  alignas(64) float l[16 * 16];
  alignas(64) float o[16 * 64];
  alignas(64) uint16_t qpad[16 * 64];
  alignas(64) float m[16];
  alignas(64) float alpha[16];
};

HISERVE_ALWAYS_INLINE void flash64_qk(const bf16* qa, int64_t lda, const uint16_t* kt, float* s) {
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(0, qa, lda);
  _tile_loadd(1, kt, 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_loadd(1, kt + 512, 64);
  _tile_dpbf16ps(3, 0, 1);
  _tile_loadd(0, qa + 32, lda);
  _tile_loadd(1, kt + 1024, 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_loadd(1, kt + 1536, 64);
  _tile_dpbf16ps(3, 0, 1);
  _tile_stored(2, s, 128);
  _tile_stored(3, s + 16, 128);
}

// The 16 rows' maxima of v[0..16) (lane r of the result: max of v[r]'s lanes): a shuffle tree
// (46 instructions where 16 separate horizontal reductions take ~130).
HISERVE_ALWAYS_INLINE __m512 flash_row_max16(__m512* v) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-1: row i, 2-3: row i + 8
    w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: rows i, i + 8, i + 4, i + 12
    u[i] = _mm512_max_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // per lane: 2 values of its row for u[i], 2 for u[i + 2]
    z[i] = _mm512_max_ps(_mm512_shuffle_ps(u[i], u[i + 2], 0x44), _mm512_shuffle_ps(u[i], u[i + 2], 0xEE));
  // lane L holds rows (of u[0], u[2], u[1], u[3]) of that lane: 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15
  const __m512 m = _mm512_max_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
  return _mm512_permutexvar_ps(order, m);
}

// The block's softmax with lazy rescaling (vis[r]: row r's visible keys; all 32 unless kMasked):
// the rows' maxima and new running maxima as vectors, then each row's exponentials. Writes P and
// st.alpha; returns whether an output row must be rescaled.
template <bool kMasked>
inline bool flash64_softmax(FlashState64& st, const float* s, const int* vis, float c) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY), cc = _mm512_set1_ps(c);
  __mmask32 km[16];
  __m512 v[16];
  for (int r = 0; r < 16; ++r) {
    km[r] = !kMasked || vis[r] >= 32 ? ~0u : (vis[r] <= 0 ? 0u : (1u << vis[r]) - 1u);
    __m512 s0 = _mm512_load_ps(s + 32 * r), s1 = _mm512_load_ps(s + 32 * r + 16);
    if (kMasked) {
      s0 = _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(km[r]), s0);
      s1 = _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(km[r] >> 16), s1);
    }
    v[r] = _mm512_max_ps(s0, s1);
  }
  const __m512 mx = flash_row_max16(v), m_old = _mm512_load_ps(st.m);
  // raise a row's max where it has none yet or the block's exceeds it by over kFlashLazy
  const __mmask16 first = _mm512_cmp_ps_mask(m_old, ninf, _CMP_EQ_OQ);
  const __mmask16 raise = first | _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mx, m_old), cc),
                                                     _mm512_set1_ps(kFlashLazy), _CMP_GT_OQ);
  const __m512 m_new = _mm512_mask_mov_ps(m_old, raise, mx);
  const __mmask16 rescale = raise & ~first;  // rows with earlier output to scale by alpha
  const __m512 alpha = _mm512_mask_blend_ps(rescale, _mm512_set1_ps(1.0f),
                                            flash_exp2(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), cc)));
  _mm512_store_ps(st.m, m_new);
  _mm512_store_ps(st.alpha, alpha);
  alignas(64) float neg[16];
  // a row with no visible key yet (m_new = -inf) gets -(-inf) = +inf here and zero P by its mask
  _mm512_store_ps(neg, _mm512_mul_ps(m_new, _mm512_set1_ps(-c)));
  for (int r = 0; r < 16; ++r) {
    const __m512 nm = _mm512_set1_ps(neg[r]);
    __m512 p0 = flash_exp2(_mm512_fmadd_ps(_mm512_load_ps(s + 32 * r), cc, nm));
    __m512 p1 = flash_exp2(_mm512_fmadd_ps(_mm512_load_ps(s + 32 * r + 16), cc, nm));
    if (kMasked || st.m[r] == -INFINITY) {
      const __mmask32 k = st.m[r] == -INFINITY ? 0u : km[r];
      p0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(k), p0);
      p1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(k >> 16), p1);
    }
    _mm512_store_ps(st.l + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(st.l + 16 * r), _mm512_set1_ps(st.alpha[r]),
                                                  _mm512_add_ps(p0, p1)));
    _mm512_store_si512(st.p + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  return rescale != 0;
}

HISERVE_ALWAYS_INLINE void flash64_store_o(float* o) {
  _tile_stored(4, o, 256);
  _tile_stored(5, o + 16, 256);
  _tile_stored(6, o + 32, 256);
  _tile_stored(7, o + 48, 256);
}

// One D = 64 item: query head hq, queries [i0, i0 + 16) (fewer at the end).
inline void flash_item64(const FlashCall& a, FlashState64& st, int64_t hq, int64_t i0, const uint16_t* kp,
                         const uint16_t* vp) {
  const int64_t rows = std::min<int64_t>(16, a.n - i0), off = a.S - a.n;
  const bf16* qa = a.q + i0 * a.q_rs + hq * a.q_hs;
  int64_t lda = a.q_rs * 2;
  if (rows < 16) {
    std::memset(st.qpad, 0, sizeof(st.qpad));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(st.qpad + r * 64, qa + r * a.q_rs, 128);
    qa = reinterpret_cast<const bf16*>(st.qpad), lda = 128;
  }
  const int64_t last_key = a.causal ? std::min(a.S - 1, i0 + rows - 1 + off) : a.S - 1;
  const int64_t nkb = last_key / 32 + 1;
  const float c = a.scale * 1.44269504088896341f;
  std::fill(st.m, st.m + 16, -INFINITY);
  std::memset(st.l, 0, sizeof(st.l));
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  flash64_qk(qa, lda, kp, st.s[0]);
  if (nkb > 1) flash64_qk(qa, lda, kp + 2048, st.s[1]);
  int vis[16];
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t j0 = kb * 32;
    bool rescale;
    if (j0 + 32 > a.S || (a.causal && j0 + 31 > i0 + off)) {  // a block some row sees only in part
      for (int r = 0; r < 16; ++r) {
        const int64_t lim = a.causal ? std::min(a.S - 1, i0 + r + off) : a.S - 1;  // its last visible key
        vis[r] = static_cast<int>(std::clamp<int64_t>(lim - j0 + 1, 0, 32));
      }
      rescale = flash64_softmax<true>(st, st.s[kb % 3], vis, c);
    } else {
      rescale = flash64_softmax<false>(st, st.s[kb % 3], vis, c);
    }
    if (rescale) {
      flash64_store_o(st.o);
      for (int r = 0; r < 16; ++r) {
        const __m512 al = _mm512_set1_ps(st.alpha[r]);
        for (int d = 0; d < 64; d += 16)
          _mm512_store_ps(st.o + 64 * r + d, _mm512_mul_ps(_mm512_load_ps(st.o + 64 * r + d), al));
      }
      _tile_loadd(4, st.o, 256); _tile_loadd(5, st.o + 16, 256);
      _tile_loadd(6, st.o + 32, 256); _tile_loadd(7, st.o + 48, 256);
    }
    if (kb + 2 < nkb) flash64_qk(qa, lda, kp + (kb + 2) * 2048, st.s[(kb + 2) % 3]);
    const uint16_t* vt = vp + kb * 2048;
    _tile_loadd(0, st.p, 64);
    _tile_loadd(1, vt, 64); _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(1, vt + 512, 64); _tile_dpbf16ps(5, 0, 1);
    _tile_loadd(1, vt + 1024, 64); _tile_dpbf16ps(6, 0, 1);
    _tile_loadd(1, vt + 1536, 64); _tile_dpbf16ps(7, 0, 1);
  }
  flash64_store_o(st.o);
  for (int64_t r = 0; r < rows; ++r) {
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(st.l + 16 * r));
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    bf16* dst = a.out + (i0 + r) * a.o_rs + hq * a.o_hs;
    for (int d = 0; d < 64; d += 32) {
      const __m512 x0 = _mm512_mul_ps(_mm512_load_ps(st.o + 64 * r + d), inv);
      const __m512 x1 = _mm512_mul_ps(_mm512_load_ps(st.o + 64 * r + d + 16), inv);
      _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
    if (a.lse != nullptr) a.lse[hq * a.lse_ld + i0 + r] = st.m[r] * a.scale + std::log(l);
  }
}

inline void flash_configure16() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx_configure in gguf_amx.h
  _tile_loadconfig(&cfg);
}

#endif  // HISERVE_AMX

}  // namespace cpu
}  // namespace hiserve

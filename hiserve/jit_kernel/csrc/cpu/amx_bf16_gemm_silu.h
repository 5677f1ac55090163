// The MLP's gate/up GEMM with its activation in the epilogue, on AMX: y [M, I] = silu(x Wg^T) *
// (x Wu^T) for W = [Wg; Wu] [2I, K] in amx_bf16_gemm.h's strip layout (the same packed weight
// the plain GEMM takes): gate strip p pairs with up strip p + I/32.
//
// Why: the plain GEMM writes gate | up [M, 2I] in bf16 and silu_and_mul reads it back (and
// rounds the gate twice); here each 32 x 32 block pair goes from its float32 sums straight to
// silu(gate) * up, one rounding, while the next pair's tiles multiply (as the plain GEMM's
// conversion). A row block's gate and up strips alternate, so both stay in L2 for all row blocks.
#pragma once

#include "amx_bf16_gemm.h"
#include "simd_avx512.h"

namespace hiserve {
namespace cpu {

#ifdef HISERVE_AMX

// Float32 sums of a gate block and its up block waiting for the epilogue.
struct AmxGatedPending {
  const float* gate = nullptr;  // 4 C tiles each, as AmxPendingBlock::sums
  const float* up = nullptr;
  bf16* out = nullptr;
  int64_t ldy = 0, rows = 0;
};

// silu(g) = g / (1 + e^-g) as silu_and_mul_row_avx512, on the unrounded sums; one rounding.
inline void amx_convert_block(AmxGatedPending& p) {
  if (p.gate == nullptr) return;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t at = (r >> 4) * 512 + (r & 15) * 16;
    __m512 y[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 g = _mm512_load_ps(p.gate + at + 256 * h);
      const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      y[h] = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_load_ps(p.up + at + 256 * h));
    }
    _mm512_storeu_si512(p.out + r * p.ldy, (__m512i)_mm512_cvtne2ps_pbh(y[1], y[0]));
  }
  p.gate = nullptr;
}

inline void amx_store_sums(bool two, float* buf) {
  _tile_stored(4, buf, 64);
  _tile_stored(5, buf + 256, 64);
  if (two) {
    _tile_stored(6, buf + 512, 64);
    _tile_stored(7, buf + 768, 64);
  }
}

// Rows [r, r + rows) against strip pair (bg, bu): the gate block, then the up block, queued
// for the epilogue (which the next pair's first K steps run).
inline void amx_gated_pair(const AmxDenseCall& g, const uint16_t* bg, const uint16_t* bu, int64_t r, int64_t rows,
                           bf16* out, float (*sums)[2][1024], int* which, AmxGatedPending* pending) {
  const bool two = rows > 16;
  int64_t pl = 0;
  float* buf = sums[*which][0];
  amx_dense_block(g.x + r * g.ldx, g.ldx, bg, g.KB, two, nullptr, 0, 0, &pl, pending);
  amx_convert_block(*pending);  // KB == 1: no K step left to overlap it with
  amx_store_sums(two, buf);
  amx_dense_block(g.x + r * g.ldx, g.ldx, bu, g.KB, two, nullptr, 0, 0, &pl, pending);
  amx_store_sums(two, buf + 1024);
  *pending = AmxGatedPending{buf, buf + 1024, out, g.ldy, rows};
  *which ^= 1;
}

// y [M, I] bf16 (row stride ldy) = silu(x Wg^T) * (x Wu^T); x [M, K] bf16 (row stride ldx);
// wp: [2I/32][K/32][1024] (amx_bf16_pack of [Wg; Wu]); I and K multiples of 32, any M >= 1.
inline void amx_bf16_gemm_silu(const bf16* x, int64_t ldx, const uint16_t* wp, bf16* y, int64_t ldy, int64_t M,
                               int64_t I, int64_t K, int num_threads) {
  if (!amx_permitted()) throw std::runtime_error("the kernel refused AMX tile state (arch_prctl XTILEDATA)");
  const int64_t KB = K / 32, NP = I / 32, full = M / 32 * 32, tail = M - full;
  const int64_t chunk = std::max<int64_t>(32, kAmxDenseRowBytes / (K * 2) / 32 * 32);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, NP * std::max<int64_t>(1, M / 32))));
  const AmxDenseCall g{x, ldx, wp, nullptr, y, ldy, M, KB};
#pragma omp parallel num_threads(nt)
  {
    alignas(64) float sums[2][2][1024];
    int which = 0;
    AmxGatedPending pending;
    const AmxDenseShare sh = amx_dense_share(omp_get_thread_num(), omp_get_num_threads(), NP, full / 32);
    const int64_t r0 = sh.b0 * 32, r1 = sh.b1 * 32, tl = sh.tail ? tail : 0;
    if (sh.s1 > sh.s0 && (r1 > r0 || tl > 0)) {
      amx_dense_configure(r1 > r0 ? 32 : tl);
      for (int64_t c0 = r0; c0 < r1 || (c0 == r0 && tl > 0); c0 += chunk) {  // x's chunk stays in L2
        const int64_t c1 = std::min(r1, c0 + chunk);
        for (int64_t p = sh.s0; p < sh.s1; ++p) {
          const uint16_t* bg = wp + p * KB * 1024;
          const uint16_t* bu = wp + (p + NP) * KB * 1024;
          for (int64_t r = c0; r < c1; r += 32) amx_gated_pair(g, bg, bu, r, 32, y + r * ldy + p * 32, sums, &which, &pending);
          if (c1 != r1 || tl == 0) continue;
          if (c1 > c0) amx_dense_configure(tl);
          amx_gated_pair(g, bg, bu, M - tl, tl, y + (M - tl) * ldy + p * 32, sums, &which, &pending);
          if (c1 > c0) amx_dense_configure(32);
        }
      }
      amx_convert_block(pending);
      _tile_release();
    }
  }
}

#else  // not an AMX build: the Python side never calls this (it checks the tier first)

inline void amx_bf16_gemm_silu(const bf16*, int64_t, const uint16_t*, bf16*, int64_t, int64_t, int64_t, int64_t,
                               int) {
  throw std::runtime_error("this build of the CPU kernels has no AMX (kernel ISA tier below amx)");
}

#endif

}  // namespace cpu
}  // namespace hiserve

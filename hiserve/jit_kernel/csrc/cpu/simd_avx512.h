// 16-lane AVX-512 helpers shared by the vector kernels: typed loads/stores with the scalar
// helpers' rounding (common.h; with AVX512-BF16 a denormal result flushes to zero, see
// round16), and a vector fast_exp.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "common.h"

namespace hiserve {
namespace cpu {

// The lanes set in `m` of p[0..16) as floats (the others zero; masked lanes do not fault).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  // 512-bit masked word load (AVX512BW; the 256-bit form would also need AVX512VL), low half used
  const __m512i h = _mm512_maskz_loadu_epi16(static_cast<__mmask32>(m), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
}

// from_float<bf16> on 16 lanes, as bits in the low half of each 32-bit lane: round to
// nearest even, NaN kept quiet, denormals kept (round16 / store16 use it without AVX512-BF16).
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)),
      16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(is_nan, rounded, nan);
}

// round_to<T> on 16 lanes. With AVX512-BF16 one VCVTNEPS2BF16 rounds (to nearest even, as
// torch does); it also flushes denormals (|x| < 2^-126) to zero, where torch keeps them: the
// only difference, ~1e-38 absolute. Without it, bf16_bits16's integer rounding (6 ops).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
#if defined(__AVX512BF16__)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
#endif
  }
}

// Store the lanes set in `m` to p[0..16), rounded as round16<T>.
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m256i bits = _mm512_cvtepi32_epi16(bf16_bits16(v));
#endif
  _mm512_mask_storeu_epi16(p, static_cast<__mmask32>(m), _mm512_castsi256_si512(bits));  // as load16: no VL
}

// Lanes of the 16-wide step starting at i of a row of n.
inline __mmask16 tail16(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
}

// fast_exp (common.h) on 16 lanes: the same clamp, reduction and polynomial, except that
// max/min turn a NaN argument into -87 (result ~0) where the scalar version keeps the NaN.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace cpu
}  // namespace hiserve
#endif  // __AVX512F__ && __AVX512BW__

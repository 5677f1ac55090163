// Scalar helpers shared by the CPU kernels: bf16 <-> float conversion and typed row loads.
// Loops are written plainly so the compiler vectorises them for the ISA that
// hiserve/jit_kernel/cpu.py picked from the CPU's features (-mavx512f..., -mavx2, or baseline).
#pragma once

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hiserve {
namespace cpu {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline bf16 from_float<bf16>(float x) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet).
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  // A select, not an early return: a branch keeps loops scalar on AVX2 ("control flow in loop").
  const uint32_t nan = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}

// Round a float through T and back (the rounding a torch op in dtype T applies).
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// exp(x) for x <= 0-ish softmax arguments, vectorisable (no libm call): x = n ln2 + r with
// |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n built
// in the exponent bits. x is clamped to [-87, 88], so exp(-inf) gives ~1.6e-38, not 0:
// callers keep masked entries out of the sums themselves.
inline float fast_exp(float x) {
  // A compare-select clamp, not std::fmin/fmax: gcc does not vectorise those (their NaN rules)
  // and a loop calling this then stays scalar. A NaN stays NaN.
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Below this many elements (or multiply-adds) a loop runs on the calling thread, as
// at::parallel_for does below its grain size: a parallel region costs microseconds and
// waits for every thread, which a decode step's many small ops cannot repay.
constexpr int64_t kGrainSize = 32768;

#ifdef __AVX2__
// Sum of the 8 lanes.
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("hiserve cpu kernel: " + what);
}

}  // namespace cpu
}  // namespace hiserve

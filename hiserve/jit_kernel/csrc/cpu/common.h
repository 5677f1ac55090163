// Scalar helpers shared by the CPU kernels: bf16 <-> float conversion and typed row loads.
// Loops are written plainly so the compiler vectorises them for the ISA that
// hiserve/jit_kernel/cpu.py picked from the CPU's features (-mavx512f..., -mavx2, or baseline).
#pragma once

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
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
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

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("hiserve cpu kernel: " + what);
}

}  // namespace cpu
}  // namespace hiserve

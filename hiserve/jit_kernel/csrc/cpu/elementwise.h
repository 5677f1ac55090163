// One-pass CPU forms of the per-token small ops (and greedy sampling's argmax), rounding where the torch references in
// hiserve/layers/{norms,rotary,activations}.py round, so bf16 results match them to within
// one rounding of the final value. Parallel over tokens.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "simd_avx2.h"
#include "simd_avx512.h"

namespace hiserve {
namespace cpu {

// One token of rmsnorm below: xt, rt (or null), ot, nr (written when rt is set) [hidden];
// row: float scratch [hidden].
template <typename T>
void rmsnorm_row(const T* xt, const T* rt, const T* weight, T* ot, T* nr, int64_t hidden, float eps, float* row) {
  float ss = 0.f;
  if (rt != nullptr) {
    for (int64_t i = 0; i < hidden; ++i) {
      nr[i] = from_float<T>(to_float(xt[i]) + to_float(rt[i]));
      row[i] = to_float(nr[i]);
    }
  } else {
    load_row(xt, row, hidden);
  }
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < hidden; ++i) ss += row[i] * row[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) ot[i] = from_float<T>(to_float(weight[i]) * round_to<T>(row[i] * inv));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// rmsnorm_row on 16 lanes, the same roundings (bf16 by VCVTNEPS2BF16, simd_avx512.h); no
// scratch: the second pass re-reads the (rounded) residual sum or x. Only with AVX512-BF16:
// on the avx512 tier, with the 6-op integer rounding, this row took 1.08-1.17x the time of the
// compiler's vectorised scalar loop (bench_small_ops.py, 16 and 230 rows, an observation of
// session 17 not kept as a JSON), so that tier keeps the loop.
template <typename T>
void rmsnorm_row_avx512(const T* xt, const T* rt, const T* weight, T* ot, T* nr, int64_t hidden, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 m = tail16(i, hidden);
    __m512 v = load16(xt + i, m);
    if (rt != nullptr) {
      v = round16<T>(_mm512_add_ps(v, load16(rt + i, m)));
      store16(nr + i, v, m);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(hidden) + eps));
  const T* src = rt != nullptr ? nr : xt;
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 m = tail16(i, hidden);
    const __m512 normed = round16<T>(_mm512_mul_ps(load16(src + i, m), inv));
    store16(ot + i, _mm512_mul_ps(load16(weight + i, m), normed), m);
  }
}
#endif

// x [T, H] (row stride x_stride), residual [T, H] or null, weight [H] -> out [T, H];
// with a residual, new_residual [T, H] = x + residual (rounded to T) and the norm reads it.
template <typename T>
void rmsnorm(const T* x, int64_t x_stride, const T* residual, const T* weight, T* out, T* new_residual,
             int64_t tokens, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (tokens * hidden >= kGrainSize)
  {
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__))
    std::vector<float> row(hidden);
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* rt = residual != nullptr ? residual + t * hidden : nullptr;
      T* nr = residual != nullptr ? new_residual + t * hidden : nullptr;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
      rmsnorm_row_avx512(x + t * x_stride, rt, weight, out + t * hidden, nr, hidden, eps);
#else
      rmsnorm_row(x + t * x_stride, rt, weight, out + t * hidden, nr, hidden, eps, row.data());
#endif
    }
  }
}

// x [T, heads, head_dim] (token stride x_stride, heads contiguous), cos/sin [T, rotary_dim/2]
// float32 (token stride cs_stride) -> out [T, heads, head_dim] contiguous. NeoX pairs
// channel i with i + rotary_dim/2; interleaved (GPT-J) pairs 2i with 2i+1. Channels past
// rotary_dim are copied.
template <typename T>
void rotary(const T* x, int64_t x_stride, const float* cos, const float* sin, int64_t cs_stride, T* out,
            int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool neox, int num_threads) {
  const int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * head_dim >= kGrainSize)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * cs_stride;
    const float* s = sin + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + t * x_stride + h * head_dim;
      T* oh = out + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x1 = to_float(xh[a]), x2 = to_float(xh[b]);
        oh[a] = from_float<T>(x1 * c[i] - x2 * s[i]);
        oh[b] = from_float<T>(x2 * c[i] + x1 * s[i]);
      }
      for (int64_t i = rotary_dim; i < head_dim; ++i) oh[i] = xh[i];
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One token of silu_and_mul on 16 lanes, the scalar loop's roundings (simd_avx512.h's: one
// VCVTNEPS2BF16 where AVX512-BF16 has it). 0.75x the compiler-vectorised scalar loop at 16 and
// 230 rows on the AMX Xeon with it, within noise of it without (benchmark/results/
// cpu_small_ops_before.json against cpu_small_ops.json, each as a ratio to the baseline loops).
template <typename T>
void silu_and_mul_row_avx512(const T* g, const T* u, T* o, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = tail16(i, inter);
    const __m512 gi = load16(g + i, m);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi));
    const __m512 si = round16<T>(_mm512_div_ps(gi, _mm512_add_ps(one, e)));
    store16(o + i, _mm512_mul_ps(si, load16(u + i, m)), m);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
// One token of silu_and_mul on 8 lanes (the tail scalar), the scalar loop's roundings. gcc
// left that loop scalar on this tier: 0.65-0.73x the time of the baseline build's scalar loop
// where the AVX-512 builds took 0.08x; this row takes 0.14x (benchmark/results/
// cpu_small_ops*.json, a 2-core Xeon running each tier's build).
template <typename T>
void silu_and_mul_row_avx2(const T* g, const T* u, T* o, int64_t inter) {
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8) {
    const __m256 gi = load8(g + i);
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi));
    const __m256 si = round8<T>(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store8(o + i, _mm256_mul_ps(si, load8(u + i)));
  }
  for (; i < inter; ++i) {
    const float gi = to_float(g[i]);
    o[i] = from_float<T>(round_to<T>(gi / (1.f + fast_exp(-gi))) * to_float(u[i]));
  }
}
#endif

// x [T, 2I] (gate | up, row stride x_stride) -> out [T, I] = silu(gate) * up, with silu
// rounded to T first as F.silu(gate) * up does.
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t tokens, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * inter >= kGrainSize)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = x + t * x_stride;
    const T* u = g + inter;
    T* o = out + t * inter;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    silu_and_mul_row_avx512(g, u, o, inter);
#elif defined(__AVX2__) && defined(__FMA__)
    silu_and_mul_row_avx2(g, u, o, inter);
#else
    // fast_exp (common.h) vectorises; std::exp is a scalar libm call per element, which made
    // this loop ~17% of a bf16 prefill. Its error (~1e-7 relative) is far below T's rounding.
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float gi = to_float(g[i]);
      const float si = round_to<T>(gi / (1.f + fast_exp(-gi)));
      o[i] = from_float<T>(si * to_float(u[i]));
    }
#endif
  }
}

// Greedy sampling: out[b] = index of the largest x[b, :] (the first on ties; the first NaN if
// any, as torch.argmax). x [B, V] float32, row stride x_stride. A vectorized max with a NaN
// flag, then a scan for its first occurrence: torch's CPU argmax (one scalar pass, one thread)
// took 1.1 ms for 16 x 49152 logits on a 2-core Xeon, ~3% of a batch-16 decode step.
inline void argmax_rows(const float* x, int64_t x_stride, int64_t* out, int64_t rows, int64_t vocab,
                        int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * vocab >= kGrainSize)
  for (int64_t b = 0; b < rows; ++b) {
    const float* r = x + b * x_stride;
    // 32 independent lanes: a single running max is one dependent compare per element
    // (measured as slow as torch's); these compile to vector max/compare ops.
    constexpr int kLanes = 32;
    float lane[kLanes];
    int bad[kLanes];
    for (int j = 0; j < kLanes; ++j) lane[j] = -INFINITY, bad[j] = 0;
    int64_t i = 0;
    for (; i + kLanes <= vocab; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float v = r[i + j];
        lane[j] = v > lane[j] ? v : lane[j];
        bad[j] |= v != v;  // NaN test: valid because the kernels build without -ffast-math
      }
    float mx = -INFINITY;
    int nan = 0;
    for (; i < vocab; ++i) mx = r[i] > mx ? r[i] : mx, nan |= r[i] != r[i];
    for (int j = 0; j < kLanes; ++j) mx = lane[j] > mx ? lane[j] : mx, nan |= bad[j];
    int64_t at = 0;
    if (nan) {
      while (r[at] == r[at]) ++at;
    } else {  // the first block of 32 holding mx (a vector compare a block), then within it
      for (; at + kLanes <= vocab; at += kLanes) {
        int hit = 0;
        for (int j = 0; j < kLanes; ++j) hit |= r[at + j] == mx;
        if (hit) break;
      }
      while (at + 1 < vocab && r[at] != mx) ++at;
    }
    out[b] = at;
  }
}

}  // namespace cpu
}  // namespace hiserve

// One-pass CPU forms of the per-token small ops (and greedy sampling's argmax), rounding where the torch references in
// hiserve/layers/{norms,rotary,activations}.py round, so bf16 results match them to within
// one rounding of the final value. Parallel over tokens.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace hiserve {
namespace cpu {

// x [T, H] (row stride x_stride), residual [T, H] or null, weight [H] -> out [T, H];
// with a residual, new_residual [T, H] = x + residual (rounded to T) and the norm reads it.
template <typename T>
void rmsnorm(const T* x, int64_t x_stride, const T* residual, const T* weight, T* out, T* new_residual,
             int64_t tokens, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (tokens * hidden >= kGrainSize)
  {
    std::vector<float> row(hidden);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xt = x + t * x_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        const T* rt = residual + t * hidden;
        T* nr = new_residual + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          nr[i] = from_float<T>(to_float(xt[i]) + to_float(rt[i]));
          row[i] = to_float(nr[i]);
        }
      } else {
        load_row(xt, row.data(), hidden);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* ot = out + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) ot[i] = from_float<T>(to_float(weight[i]) * round_to<T>(row[i] * inv));
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

// x [T, 2I] (gate | up, row stride x_stride) -> out [T, I] = silu(gate) * up, with silu
// rounded to T first as F.silu(gate) * up does.
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t tokens, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * inter >= kGrainSize)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = x + t * x_stride;
    const T* u = g + inter;
    T* o = out + t * inter;
    // fast_exp (common.h) vectorises; std::exp is a scalar libm call per element, which made
    // this loop ~17% of a bf16 prefill. Its error (~1e-7 relative) is far below T's rounding.
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float gi = to_float(g[i]);
      const float si = round_to<T>(gi / (1.f + fast_exp(-gi)));
      o[i] = from_float<T>(si * to_float(u[i]));
    }
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

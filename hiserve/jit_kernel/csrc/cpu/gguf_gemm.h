// GEMM of a few activation rows by a weight kept in llama.cpp's own GGUF blocks (32 weights a
// block along K), dequantizing each block in registers: y[r, n] = sum_k x[r, k] * w[n, k].
//
// Why: a decode step multiplies one (or a few) rows by every weight once, so it is bound by
// reading the weight. Q4_1 is 5 bits a weight and Q8_0 8.5, against 32 for the float32 copy
// that a CPU without native bf16 serves. PyTorch's int4 kernel computes in bf16 only (its
// float32 instantiation is scalar code), which costs conversions on such a CPU; it also has
// no Q8_0 form. This kernel computes in float32 for either activation dtype.
//
// The weights are the file's bytes, unchanged (ggml-common.h block_q4_0 / block_q4_1 /
// block_q8_0): row n of W is K/32 consecutive blocks of
//   Q4_0, 18 bytes: d (fp16), 16 code bytes;          w = d * (q - 8)
//   Q4_1, 20 bytes: d (fp16), m (fp16), 16 code bytes; w = d * q + m
//   Q8_0, 34 bytes: d (fp16), 32 int8 codes;           w = d * q
// where code byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
// Each weight is formed exactly as gguf's dequantizer forms it (gguf-py `quants.py`, float32):
// d * q is exact in float32 (an fp16 d times an integer of at most 8 bits) and so is
// d * (q - 8) = d * q - 8 d, so a fused multiply-add rounds once where gguf does. Only the
// order of the sum over K differs from a dense GEMM's. (A non-finite d is the one exception:
// Q4_0 with d = +-inf gives NaN here, +-inf * (q - 8) in gguf; no quantizer writes one.)
#pragma once

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

// The vector path needs AVX2 + FMA (+ F16C for the scales); x86 tiers below it and other
// architectures take the portable loops (immintrin.h only where it exists).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HISERVE_GGUF_AVX2 1
#include <immintrin.h>
#endif

namespace hiserve {
namespace cpu {

constexpr int64_t kBlock = 32;
// Activation rows per pass over a weight row: each dequantized block is reused for this many
// rows (AVX2: 4 rows x 2 accumulators + 4 weight vectors of its 16 registers).
constexpr int kRowTile = 4;
// Rows of x per sweep over the weight: the sweep re-reads these rows for every output feature,
// so they should stay in L2 (32 x K floats: 72 KB at K = 576, 192 KB at K = 1536).
constexpr int64_t kRowBlock = 32;

enum class BlockType : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t block_bytes(BlockType t) { return t == BlockType::kQ4_0 ? 18 : t == BlockType::kQ4_1 ? 20 : 34; }

// IEEE binary16 -> float (F16C where the tier has it; else exact bit arithmetic).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#ifdef HISERVE_GGUF_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400u));
    bits = sign | ((112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// The block's scale d and offset m with w = d * q + m (m = -8 d for Q4_0, 0 for Q8_0).
template <BlockType B>
inline void block_scale(const uint8_t* blk, float& d, float& m) {
  d = half_to_float(blk);
  m = B == BlockType::kQ4_1 ? half_to_float(blk + 2) : B == BlockType::kQ4_0 ? -8.f * d : 0.f;
}

template <BlockType B>
inline const uint8_t* block_codes(const uint8_t* blk) {
  return blk + (B == BlockType::kQ4_1 ? 4 : 2);
}

#ifdef HISERVE_GGUF_AVX2
// AVX2 (also taken on the AVX-512 tiers, Q8_0 excepted): 8 lanes, a block is four vectors.

template <BlockType B>
inline void dequant_block(const uint8_t* blk, __m256 w[4]) {
  float d, m;
  block_scale<B>(blk, d, m);
  const uint8_t* codes = block_codes<B>(blk);
  const __m256 vd = _mm256_set1_ps(d);
  if constexpr (B == BlockType::kQ8_0) {
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j));
      w[j] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
    const __m256 vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vm);
    w[1] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vm);
    w[2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vm);
    w[3] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vm);
  }
}

#ifdef __AVX512F__
// Q8_0 on the AVX-512 tiers (the LM head): a block is two 16-lane vectors of codes, multiplied
// by x as integers and scaled once a block, d * (q . x), where the AVX2 path forms d * q per
// weight first (about half the instructions a block; with a one-hot x both give d * q
// exactly). 1.07-1.10x the AVX2 path at one row of SmolLM2's head on a Xeon with AMX.
template <int Rows>
inline void row_dot_q8_avx512(const uint8_t* __restrict row, int64_t nb, const float* __restrict x, int64_t k,
                              float* __restrict y) {
  constexpr int A = Rows == 1 ? 2 : 1;  // two chains for one row: the FMA latency
  __m512 acc[Rows][A];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < A; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes(BlockType::kQ8_0);
    const __m512 d = _mm512_set1_ps(half_to_float(blk));
    const __m128i* codes = reinterpret_cast<const __m128i*>(blk + 2);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 1)));
    for (int r = 0; r < Rows; ++r) {
      const float* xr = x + r * k + b * kBlock;
      const __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xr)));
      acc[r][b % A] = _mm512_fmadd_ps(d, s, acc[r][b % A]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    y[r] = _mm512_reduce_add_ps(A == 2 ? _mm512_add_ps(acc[r][0], acc[r][A - 1]) : acc[r][0]);
}
#endif

// Dot products of one weight row (nb blocks at `row`) with `Rows` float32 rows of x (row
// stride k), into y[r].
template <BlockType B, int Rows>
inline void row_dot(const uint8_t* __restrict row, int64_t nb, const float* __restrict x, int64_t k,
                    float* __restrict y) {
#ifdef __AVX512F__
  if constexpr (B == BlockType::kQ8_0) {
    row_dot_q8_avx512<Rows>(row, nb, x, k, y);
    return;
  }
#endif
  // Four accumulators for one row (FMA latency), two a row for more rows (register budget).
  constexpr int A = Rows == 1 ? 4 : 2;
  __m256 acc[Rows][A];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < A; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    dequant_block<B>(row + b * block_bytes(B), w);
    for (int r = 0; r < Rows; ++r) {
      const float* xr = x + r * k + b * kBlock;
      for (int j = 0; j < 4; ++j) acc[r][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r][j % A]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    __m256 s = acc[r][0];
    for (int j = 1; j < A; ++j) s = _mm256_add_ps(s, acc[r][j]);
    y[r] = reduce_add8(s);
  }
}
#else
// Portable form (baseline tier): the compiler vectorises the 32-wide loops as it can.
template <BlockType B, int Rows>
inline void row_dot(const uint8_t* __restrict row, int64_t nb, const float* __restrict x, int64_t k,
                    float* __restrict y) {
  float acc[Rows][kBlock] = {};
  float w[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes(B);
    float d, m;
    block_scale<B>(blk, d, m);
    const uint8_t* codes = block_codes<B>(blk);
    for (int i = 0; i < 16; ++i) {
      if constexpr (B == BlockType::kQ8_0) {
        w[i] = d * static_cast<float>(static_cast<int8_t>(codes[i]));
        w[i + 16] = d * static_cast<float>(static_cast<int8_t>(codes[i + 16]));
      } else {
        w[i] = d * static_cast<float>(codes[i] & 0x0F) + m;
        w[i + 16] = d * static_cast<float>(codes[i] >> 4) + m;
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int i = 0; i < kBlock; ++i) acc[r][i] += w[i] * x[r * k + b * kBlock + i];
  }
  for (int r = 0; r < Rows; ++r) {
    float s = 0.f;
    for (int i = 0; i < kBlock; ++i) s += acc[r][i];
    y[r] = s;
  }
}
#endif

// Rows [0, M) of x and y here are one row block of the caller's.
template <BlockType B>
void gguf_gemm_rows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(B);
  // Parallel over output features; a thread runs every row of the block for its features, so
  // each weight byte is read once per row block and dequantized once per kRowTile rows.
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= kGrainSize)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wn = w + n * row_bytes;
#ifdef HISERVE_GGUF_AVX2
    // The weight row 4 ahead, into L1: the hardware prefetchers left a one-row call of the
    // 28 MB Q8_0 LM head at 8 GB/s on a Xeon with AMX (2 threads); with this, 1.3-1.45x.
    if (n + 4 < N)
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(wn + 4 * row_bytes + off), _MM_HINT_T0);
#endif
    float out[kRowTile];
    int64_t r = 0;
    for (; r + kRowTile <= M; r += kRowTile) {
      row_dot<B, kRowTile>(wn, nb, x + r * K, K, out);
      for (int i = 0; i < kRowTile; ++i) y[(r + i) * N + n] = out[i];
    }
    const int64_t left = M - r;
    if (left == 3) row_dot<B, 3>(wn, nb, x + r * K, K, out);
    if (left == 2) row_dot<B, 2>(wn, nb, x + r * K, K, out);
    if (left == 1) row_dot<B, 1>(wn, nb, x + r * K, K, out);
    for (int64_t i = 0; i < left; ++i) y[(r + i) * N + n] = out[i];
  }
}

// x [M, K] float32 contiguous, w [N, K/32 blocks] as above, y [M, N] float32 contiguous.
template <BlockType B>
void gguf_gemm_f32(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int num_threads) {
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock)
    gguf_gemm_rows<B>(x + r0 * K, w, y + r0 * N, std::min(kRowBlock, M - r0), N, K, num_threads);
}

// x [M, K] (row stride x_stride) in T -> y [M, N] in T (contiguous): the float32 GEMM above,
// with x converted (bf16) or compacted (strided rows) into a float32 scratch first and y
// rounded to T last.
template <typename T, BlockType B>
void gguf_gemm(const T* x, int64_t x_stride, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t K,
               int num_threads) {
  constexpr bool f32 = std::is_same<T, float>::value;
  std::vector<float> xf;
  const float* xp = reinterpret_cast<const float*>(x);
  if (!f32 || x_stride != K) {
    xf.resize(M * K);
    for (int64_t r = 0; r < M; ++r) load_row(x + r * x_stride, xf.data() + r * K, K);
    xp = xf.data();
  }
  if constexpr (f32) {
    gguf_gemm_f32<B>(xp, w, reinterpret_cast<float*>(y), M, N, K, num_threads);
  } else {
    std::vector<float> yf(M * N);
    gguf_gemm_f32<B>(xp, w, yf.data(), M, N, K, num_threads);
    for (int64_t i = 0; i < M * N; ++i) y[i] = from_float<T>(yf[i]);
  }
}

}  // namespace cpu
}  // namespace hiserve

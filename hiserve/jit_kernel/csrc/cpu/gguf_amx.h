// GEMM of bf16 activation rows by a GGUF Q4_0/Q4_1/Q8_0 weight on Intel AMX: each 16 x 32 weight
// tile is dequantized once into a bf16 tile in L1 and multiplied by up to 64 rows with
// TDPBF16PS (Intel SDM vol. 2, "Intel AMX instructions"; the tile layout of the Intel
// Optimization Reference Manual, ch. 20). y[r, n] = sum_k x[r, k] * w[n, k].
//
// Why: a batched decode step multiplies a few to a few tens of rows by every weight once.
// PyTorch's int4 kernel re-dequantizes each group for every block of rows (its cost grows with
// the rows: 1.2 ms a SmolLM2 layer at 16 rows on a 2-core Xeon with AMX), and the dense bf16
// copy reads 3.2x the bytes (0.6 ms). Here the dequantization is paid once per weight per call
// and AMX does the multiply almost for free: ~0.28 ms at 16 rows.
//
// Layout (gguf_amx_pack, once at load): the weight in records of 16 output features x 32 K
// (one GGUF block of each of 16 rows), 320 bytes, ordered [N / 16][K / 32]:
//   bytes 0-255: 16 "VNNI rows" r (the K pair 2r, 2r + 1) of 16 bytes; byte i holds the code of
//     feature i / 2 at k = 2r + (i & 1) in its low nibble and of feature 8 + i / 2 in its high
//     nibble, so that widening the 16 bytes to 32-bit lanes and converting the low and high
//     nibbles with _mm512_cvtne2ps_pbh yields the B-tile row in AMX's pair-interleaved order
//     without a permute;
//   bytes 256-287: d of the 16 features (fp16, as the file stores it);
//   bytes 288-319: m of the 16 features (fp16; -8 d for Q4_0, exact in fp16).
// 5 bits a weight, as Q4_1 in the file. Q8_0 (the LM head of many GGUFs) has 544-byte
// records: 16 VNNI rows of 32 int8 codes (bytes 0-15 the pairs of features 0-7, 16-31 those of
// features 8-15, same order as above), then d of the 16 features (fp16); w = d * q.
// Each weight is d * q + m in one fp32 FMA (exact where
// gguf's dequantizer is exact, see gguf_gemm.h), then rounded to bf16 for the tile: the
// weights multiplied are gguf's dequantized values to bf16 rounding, as the dense bf16 copy's.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HISERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hiserve {
namespace cpu {

constexpr int64_t kAmxRecord = 320;    // bytes of one 16 x 32 Q4 weight record
constexpr int64_t kAmxRecordQ8 = 544;  // the same for Q8_0
constexpr int64_t kAmxPassRows = 64; // rows of x per pass: four 16-row C tiles

#ifdef HISERVE_AMX

// Linux gives a process AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XTILEDATA*/) == 0;
  return ok;
}

inline int64_t amx_record_bytes(int block_type) { return block_type == 2 ? kAmxRecordQ8 : kAmxRecord; }

// One record's codes from the 16 features' blocks (blk[n]: feature n's block of this K range).
inline void amx_pack_codes(const uint8_t* const* blk, int block_type, uint8_t* rec) {
  if (block_type == 2) {  // Q8_0: 32 int8 codes after d
    for (int r = 0; r < 16; ++r)
      for (int i = 0; i < 16; ++i) {
        rec[32 * r + i] = blk[i / 2][2 + 2 * r + (i & 1)];
        rec[32 * r + 16 + i] = blk[8 + i / 2][2 + 2 * r + (i & 1)];
      }
    return;
  }
  const int64_t bb = block_type == 0 ? 18 : 20;
  auto code = [&](int n, int k) {  // weight k of feature n's block: byte k % 16, low nibble below 16
    const uint8_t byte = blk[n][bb - 16 + (k & 15)];
    return k < 16 ? byte & 0x0F : byte >> 4;
  };
  for (int r = 0; r < 16; ++r)
    for (int i = 0; i < 16; ++i)
      rec[16 * r + i] = static_cast<uint8_t>(code(i / 2, 2 * r + (i & 1)) | code(8 + i / 2, 2 * r + (i & 1)) << 4);
}

// Pack [N, K/32 blocks] Q4_0 (block_type 0, 18 bytes), Q4_1 (1, 20 bytes) or Q8_0 (2, 34 bytes)
// GGUF rows into the record layout above. N % 16 == 0. Runs once at load.
inline void gguf_amx_pack(const uint8_t* blocks, int64_t N, int64_t K, int block_type, uint8_t* out) {
  const int64_t KB = K / 32, bb = block_type == 0 ? 18 : block_type == 1 ? 20 : 34, row_bytes = KB * bb;
  const int64_t rb = amx_record_bytes(block_type), scales = block_type == 2 ? 512 : 256;  // d after the codes
  for (int64_t t = 0; t < N / 16; ++t) {
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* rec = out + (t * KB + b) * rb;
      const uint8_t* blk[16];
      for (int n = 0; n < 16; ++n) blk[n] = blocks + (t * 16 + n) * row_bytes + b * bb;
      amx_pack_codes(blk, block_type, rec);
      for (int n = 0; n < 16; ++n) {
        std::memcpy(rec + scales + 2 * n, blk[n], 2);
        if (block_type == 2) continue;
        uint16_t m;
        if (block_type == 1) {
          std::memcpy(&m, blk[n] + 2, 2);
        } else {  // Q4_0: m = -8 d, a power-of-two multiple: exact in fp16 unless it overflows
          uint16_t d;
          std::memcpy(&d, blk[n], 2);
          m = _cvtss_sh(-8.0f * _cvtsh_ss(d), _MM_FROUND_TO_NEAREST_INT);
          if (std::isfinite(_cvtsh_ss(d)) && !std::isfinite(_cvtsh_ss(m)))
            throw std::runtime_error("a Q4_0 scale too large for the AMX layout's fp16 offset (|d| >= 8192)");
        }
        std::memcpy(rec + 288 + 2 * n, &m, 2);
      }
    }
  }
}

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 = A (16 rows), 3 = A of the pass's last chunk (`last` rows), 1 = B (16 x 32 bf16),
// 4-7 = C of the pass's chunks (16 fp32 features each).
inline void amx_configure(int64_t chunks, int64_t last) {
  AmxTileConfig cfg;
  auto set = [&](int tile, int64_t rows) {
    cfg.rows[tile] = static_cast<uint8_t>(rows);
    cfg.colsb[tile] = 64;
  };
  set(0, 16);
  set(1, 16);
  set(3, last);
  for (int64_t c = 0; c < chunks; ++c) set(4 + static_cast<int>(c), c + 1 == chunks ? last : 16);
  // gcc 12 may drop these stores as dead before the ldtilecfg that reads them (seen with a
  // plain loop: a zero-width config and a fault); the barrier keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Dequantize one Q4 record into a B tile image (16 rows of 32 bf16, pairs interleaved).
inline void amx_dequant_q4(const uint8_t* rec, uint16_t* tile) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
  const __m512i lo8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi8 = _mm512_add_epi32(lo8, _mm512_set1_epi32(8));
  const __m512 d_lo = _mm512_permutexvar_ps(lo8, d), d_hi = _mm512_permutexvar_ps(hi8, d);
  const __m512 m_lo = _mm512_permutexvar_ps(lo8, m), m_hi = _mm512_permutexvar_ps(hi8, m);
  const __m512i nib = _mm512_set1_epi32(0x0F);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * r)));
    const __m512 w_lo = _mm512_fmadd_ps(d_lo, _mm512_cvtepi32_ps(_mm512_and_si512(v, nib)), m_lo);
    const __m512 w_hi = _mm512_fmadd_ps(d_hi, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m_hi);
    _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
  }
}

// The same for a Q8_0 record (w = d * q, exact in fp32).
inline void amx_dequant_q8(const uint8_t* rec, uint16_t* tile) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 512)));
  const __m512i lo8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 d_lo = _mm512_permutexvar_ps(lo8, d);
  const __m512 d_hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo8, _mm512_set1_epi32(8)), d);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m128i* row = reinterpret_cast<const __m128i*>(rec + 32 * r);
    const __m512 w_lo = _mm512_mul_ps(d_lo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))));
    const __m512 w_hi = _mm512_mul_ps(d_hi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))));
    _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
  }
}

// Tiles are addressed by immediates: one switch per chunk index.
#define HISERVE_AMX_DP(c, a)                                           \
  switch (c) {                                                         \
    case 0: _tile_dpbf16ps(4, a, 1); break;                            \
    case 1: _tile_dpbf16ps(5, a, 1); break;                            \
    case 2: _tile_dpbf16ps(6, a, 1); break;                            \
    default: _tile_dpbf16ps(7, a, 1); break;                           \
  }

inline void amx_zero_c(int64_t chunks) {
  _tile_zero(4);  // only configured tiles may be touched (rows 0: #UD)
  if (chunks > 1) _tile_zero(5);
  if (chunks > 2) _tile_zero(6);
  if (chunks > 3) _tile_zero(7);
}

// C[chunk] += A(rows of chunk, K block c) x B (tile 1, loaded by the caller).
inline void amx_dp_chunks(const bf16* x, int64_t ldx, int64_t c, int64_t chunks) {
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const bf16* a = x + ch * 16 * ldx + c * 32;
    if (ch + 1 == chunks) {
      _tile_loadd(3, a, ldx * 2);
      HISERVE_AMX_DP(ch, 3)
    } else {
      _tile_loadd(0, a, ldx * 2);
      HISERVE_AMX_DP(ch, 0)
    }
  }
}

// Write the C tiles (rows of the pass x the 16 features of column t) to out as bf16.
inline void amx_store_c(int64_t chunks, int64_t last, float* cbuf, bf16* out, int64_t N, int64_t t) {
  _tile_stored(4, cbuf, 64);
  if (chunks > 1) _tile_stored(5, cbuf + 256, 64);
  if (chunks > 2) _tile_stored(6, cbuf + 512, 64);
  if (chunks > 3) _tile_stored(7, cbuf + 768, 64);
  const int64_t rows = (chunks - 1) * 16 + last;
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + t * 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(cbuf + 16 * r)));
}

template <bool kQ8>
inline void amx_dequant(const uint8_t* recs, int64_t b, uint16_t* tile) {
  if constexpr (kQ8)
    amx_dequant_q8(recs + b * kAmxRecordQ8, tile);
  else
    amx_dequant_q4(recs + b * kAmxRecord, tile);
}

// One pass (<= 64 rows): column t's records are dequantized into a ring of 4 tile images
// and each image is multiplied two records later (a tile load right after the vector stores
// that wrote it waits for them).
template <bool kQ8>
inline void amx_column_pipelined(const bf16* x, int64_t ldx, const uint8_t* recs, int64_t KB, int64_t chunks,
                                 int64_t last, uint16_t (*ring)[512], float* cbuf, bf16* out, int64_t N, int64_t t) {
  constexpr int64_t kLag = 2;
  amx_zero_c(chunks);
  for (int64_t b = 0; b < KB + kLag; ++b) {
    if (b < KB) amx_dequant<kQ8>(recs, b, ring[b & 3]);
    if (b < kLag) continue;
    _tile_loadd(1, ring[(b - kLag) & 3], 64);
    amx_dp_chunks(x, ldx, b - kLag, chunks);
  }
  amx_store_c(chunks, last, cbuf, out, N, t);
}

#undef HISERVE_AMX_DP

// y [M, N] bf16 = x [M, K] bf16 (row stride ldx) times the packed weight (Q8_0 records when
// q8, else Q4); threads split the 16-feature columns; passes of up to 64 rows re-read and
// re-dequantize the weight. Dequantizing a column once for all passes measured slower (same
// process, 2-core Xeon, a SmolLM2 layer: 256 rows 4.9 against 3.6 ms, 1024 rows 24 against
// 17 ms): the pipelined pass overlaps the AVX-512 dequantization with the AMX multiplies.
inline void gguf_amx_gemm(const bf16* x, int64_t ldx, const uint8_t* packed, bool q8, bf16* out, int64_t M,
                          int64_t N, int64_t K, int num_threads) {
  if (!amx_permitted()) throw std::runtime_error("the kernel refused AMX tile state (arch_prctl XTILEDATA)");
  const int64_t KB = K / 32, NT = N / 16, rb = q8 ? kAmxRecordQ8 : kAmxRecord;
#pragma omp parallel num_threads(num_threads)
  {
    alignas(64) uint16_t ring[4][512];
    alignas(64) float cbuf[kAmxPassRows * 16];
    for (int64_t r0 = 0; r0 < M; r0 += kAmxPassRows) {
      const int64_t rows = std::min(kAmxPassRows, M - r0), chunks = (rows + 15) / 16;
      const int64_t last = rows - (chunks - 1) * 16;
      amx_configure(chunks, last);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < NT; ++t) {
        const uint8_t* recs = packed + t * KB * rb;
        if (q8)
          amx_column_pipelined<true>(x + r0 * ldx, ldx, recs, KB, chunks, last, ring, cbuf, out + r0 * N, N, t);
        else
          amx_column_pipelined<false>(x + r0 * ldx, ldx, recs, KB, chunks, last, ring, cbuf, out + r0 * N, N, t);
      }
    }
    _tile_release();
  }
}

#else  // not an AMX build: the Python side never calls these (it checks the tier first)

inline bool amx_permitted() { return false; }
inline void gguf_amx_pack(const uint8_t*, int64_t, int64_t, int, uint8_t*) {
  throw std::runtime_error("this build of the CPU kernels has no AMX (kernel ISA tier below amx)");
}
inline int64_t amx_record_bytes(int block_type) { return block_type == 2 ? kAmxRecordQ8 : kAmxRecord; }
inline void gguf_amx_gemm(const bf16*, int64_t, const uint8_t*, bool, bf16*, int64_t, int64_t, int64_t, int) {
  throw std::runtime_error("this build of the CPU kernels has no AMX (kernel ISA tier below amx)");
}

#endif

}  // namespace cpu
}  // namespace hiserve

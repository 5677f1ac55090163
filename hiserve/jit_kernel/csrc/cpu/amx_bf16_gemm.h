// Dense bf16 GEMM on Intel AMX: y [M, N] = x [M, K] w^T (+ bias), bf16 in and out; float32
// sums and bias, one rounding to bf16 (TDPBF16PS: Intel SDM vol. 2, "Intel AMX instructions";
// the 2 x 2 tile blocking and B-tile layout of the Intel Optimization Reference Manual, ch. 20).
//
// Why our own and not oneDNN's (PyTorch's prepacked mkldnn linear, which the dense weights
// used before): on SmolLM2's shapes (K = 576 or 1536, N = 576 to 3072) at 200-1000 rows that
// reached 1.2-2.6 TFLOP/s (cpu_amx_dense_gemm.json) on 2 cores of a Xeon whose AMX peak
// measured 3.8 TFLOP/s a core.
// This loop (0.70-0.80x oneDNN's time a layer from 1 to 392 rows, 1.02x at 1000, 1.07x at 2048:
// benchmark/results/cpu_amx_dense_gemm.json) keeps each 16 x 32
// weight tile pair in L1/L2 for all row blocks of a strip, prefetches the next strip's tiles
// into L2 while multiplying, reads x's tiles straight from its rows (no packing pass), and
// converts a block's float32 sums to bf16 while the next block's multiplies run (a vector load
// right after a tile store waits for it: converting in place cost 30-50% at 200 rows).
//
// Weight layout (amx_bf16_pack, once at load): [N/32][K/32][2][16][32] bf16. For strip s (32
// output features), K block kb and half h, the 1 KiB B-tile image holds row r (K pair 2r,
// 2r + 1) as 16 features x 2: element [r][2f + p] = w[32s + 16h + f][32kb + 2r + p] (AMX's
// pair-interleaved "VNNI" order). Needs N % 32 == 0 and K % 32 == 0.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "common.h"
#include "gguf_amx.h"

namespace hiserve {
namespace cpu {

#ifdef HISERVE_AMX

// Rows of x walked against each strip before the next chunk of rows: x's chunk stays within
// 512 KiB of a 2 MiB L2. Larger chunks re-read the weight from L3 less often, smaller ones
// keep x hotter; 256 KiB, 512 KiB and 1 MiB were within ~5% of each other on SmolLM2's shapes
// (2-core Xeon with AMX), 512 KiB the best at 1000 rows.
constexpr int64_t kAmxDenseRowBytes = 512 * 1024;

// Float32 sums of one 32 x 32 block waiting for conversion to bf16.
struct AmxPendingBlock {
  const float* sums = nullptr;  // 4 C tiles: [rows 0-15 | 16-31] x [features 0-15 | 16-31]
  bf16* out = nullptr;
  const float* bias = nullptr;  // the strip's 32 features, or null
  int64_t ldy = 0, rows = 0;
};

inline void amx_convert_block(AmxPendingBlock& p) {
  if (p.sums == nullptr) return;
  const __m512 b_lo = p.bias != nullptr ? _mm512_loadu_ps(p.bias) : _mm512_setzero_ps();
  const __m512 b_hi = p.bias != nullptr ? _mm512_loadu_ps(p.bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* c = p.sums + (r >> 4) * 512 + (r & 15) * 16;
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c), b_lo), hi = _mm512_add_ps(_mm512_load_ps(c + 256), b_hi);
    _mm512_storeu_si512(p.out + r * p.ldy, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  p.sums = nullptr;
}

// Tiles: 0/1 = A (x rows 0-15 / 16-31 of the block), 2/3 = B (features 0-15 / 16-31),
// 4-7 = C. rows: the block's rows (32, or all of M when M < 32).
inline void amx_dense_configure(int64_t rows) {
  AmxTileConfig cfg;
  const int64_t a0 = std::min<int64_t>(16, rows), a1 = rows - a0;
  auto set = [&](int tile, int64_t r) {
    cfg.rows[tile] = static_cast<uint8_t>(r);
    cfg.colsb[tile] = 64;
  };
  set(0, a0), set(2, 16), set(3, 16), set(4, a0), set(5, a0);
  if (a1 > 0) set(1, a1), set(6, a1), set(7, a1);
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx_configure in gguf_amx.h
  _tile_loadconfig(&cfg);
}

// One block: C = x rows [r, r + rows) times strip b (rows: 32, or the tail's; `two`: rows > 16).
// Prefetches `per` lines of the next strip (from *pl up to `lines`) per K step, and converts
// the previous block's sums while this block's tiles multiply.
template <class Pending>  // AmxPendingBlock, or amx_bf16_gemm_silu.h's pair of blocks
inline void amx_dense_block(const bf16* xa, int64_t ldx, const uint16_t* b, int64_t KB, bool two,
                            const char* next, int64_t per, int64_t lines, int64_t* pl, Pending* pending) {
  const bf16* xb = xa + 16 * ldx;
  _tile_zero(4);
  _tile_zero(5);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (next != nullptr)
      for (int64_t q = 0; q < per && *pl < lines; ++q, ++*pl) _mm_prefetch(next + 64 * *pl, _MM_HINT_T1);
    const uint16_t* bk = b + kb * 1024;
    _tile_loadd(0, xa + kb * 32, ldx * 2);
    _tile_loadd(2, bk, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, bk + 512, 64);
    _tile_dpbf16ps(5, 0, 3);
    if (two) {
      _tile_loadd(1, xb + kb * 32, ldx * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    if (kb == 1) amx_convert_block(*pending);  // a vector load right after a tile store would wait
  }
}

// Store the block's sums (4 C tiles, or 2 when `two` is false) for conversion by the next block.
inline void amx_dense_finish(bool two, int64_t rows, bf16* out, const float* bias, int64_t ldy,
                             float (*sums)[1024], int* which, AmxPendingBlock* pending) {
  amx_convert_block(*pending);  // KB == 1: no K step left to overlap it with
  float* buf = sums[*which];
  *which ^= 1;
  _tile_stored(4, buf, 64);
  _tile_stored(5, buf + 256, 64);
  if (two) {
    _tile_stored(6, buf + 512, 64);
    _tile_stored(7, buf + 768, 64);
  }
  *pending = AmxPendingBlock{buf, out, bias, ldy, rows};
}

struct AmxDenseCall {
  const bf16* x;
  int64_t ldx;
  const uint16_t* wp;
  const float* bias;  // [N] or null
  bf16* y;
  int64_t ldy, M, KB;
};

// One thread's strips [s0, s1) over the 32-row blocks of rows [c0, c1), then (`tail` > 0) the
// last M % 32 rows under their own tile shape (ldtilecfg measured ~50 ns: twice a strip is
// cheaper than recomputing rows of an overlapping full block).
inline void amx_dense_strips(const AmxDenseCall& g, int64_t s0, int64_t s1, int64_t c0, int64_t c1, int64_t tail,
                             float (*sums)[1024], int* which, AmxPendingBlock* pending) {
  const int64_t blocks = (c1 - c0) / 32 + (tail > 0), lines = g.KB * 2048 / 64;
  const int64_t per = (lines + blocks * g.KB - 1) / (blocks * g.KB);
  for (int64_t s = s0; s < s1; ++s) {
    const uint16_t* b = g.wp + s * g.KB * 1024;
    const float* bias = g.bias != nullptr ? g.bias + s * 32 : nullptr;
    const char* next = s + 1 < s1 ? reinterpret_cast<const char*>(b + g.KB * 1024) : nullptr;
    int64_t pl = 0;
    for (int64_t r = c0; r < c1; r += 32) {
      amx_dense_block(g.x + r * g.ldx, g.ldx, b, g.KB, true, next, per, lines, &pl, pending);
      amx_dense_finish(true, 32, g.y + r * g.ldy + s * 32, bias, g.ldy, sums, which, pending);
    }
    if (tail == 0) continue;
    const int64_t r = g.M - tail;
    if (c1 > c0) amx_dense_configure(tail);  // else the call is all tail, configured once
    amx_dense_block(g.x + r * g.ldx, g.ldx, b, g.KB, tail > 16, next, per, lines, &pl, pending);
    amx_dense_finish(tail > 16, tail, g.y + r * g.ldy + s * 32, bias, g.ldy, sums, which, pending);
    if (c1 > c0) amx_dense_configure(32);
  }
}

// Thread t's share: strips [s0, s1) of one strip group and 32-row blocks [b0, b1) of one row
// group, the tail (M % 32 rows) with the last row group. Strips are split first: each strip's
// tiles then stay with one thread; rows are split too only where there are fewer strips than
// threads (e.g. 18 strips of a 576-wide layer on a many-core CPU).
struct AmxDenseShare {
  int64_t s0, s1, b0, b1;
  bool tail;
};

inline AmxDenseShare amx_dense_share(int t, int nt, int64_t NS, int64_t blocks) {
  const int64_t ps = std::min<int64_t>(NS, nt), pr = std::max<int64_t>(1, std::min<int64_t>(nt / ps, blocks));
  const int64_t i = t % ps, j = t / ps;
  if (j >= pr) return {0, 0, 0, 0, false};  // a thread left over by the grid
  return {NS * i / ps, NS * (i + 1) / ps, blocks * j / pr, blocks * (j + 1) / pr, j + 1 == pr};
}

// y [M, N] bf16 (row stride ldy) = x [M, K] bf16 (row stride ldx) times the packed weight, plus
// bias [N] float32 (or null) before the rounding. Rows go in chunks that keep x's share in L2;
// any M >= 1.
inline void amx_bf16_gemm(const bf16* x, int64_t ldx, const uint16_t* wp, const float* bias, bf16* y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int num_threads) {
  if (!amx_permitted()) throw std::runtime_error("the kernel refused AMX tile state (arch_prctl XTILEDATA)");
  const int64_t KB = K / 32, NS = N / 32, full = M / 32 * 32, tail = M - full;
  const int64_t chunk = std::max<int64_t>(32, kAmxDenseRowBytes / (K * 2) / 32 * 32);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, NS * std::max<int64_t>(1, M / 32))));
  const AmxDenseCall g{x, ldx, wp, bias, y, ldy, M, KB};
#pragma omp parallel num_threads(nt)
  {
    alignas(64) float sums[2][1024];
    int which = 0;
    AmxPendingBlock pending;
    const AmxDenseShare sh = amx_dense_share(omp_get_thread_num(), omp_get_num_threads(), NS, full / 32);
    const int64_t r0 = sh.b0 * 32, r1 = sh.b1 * 32, tl = sh.tail ? tail : 0;
    if (sh.s1 > sh.s0 && (r1 > r0 || tl > 0)) {
      amx_dense_configure(r1 > r0 ? 32 : tl);
      for (int64_t c0 = r0; c0 < r1 || (c0 == r0 && tl > 0); c0 += chunk) {
        const int64_t c1 = std::min(r1, c0 + chunk);
        amx_dense_strips(g, sh.s0, sh.s1, c0, c1, c1 == r1 ? tl : 0, sums, &which, &pending);
      }
      amx_convert_block(pending);
      _tile_release();
    }
  }
}

#else  // not an AMX build: the Python side never calls this (it checks the tier first)

inline void amx_bf16_gemm(const bf16*, int64_t, const uint16_t*, const float*, bf16*, int64_t, int64_t, int64_t,
                          int64_t, int) {
  throw std::runtime_error("this build of the CPU kernels has no AMX (kernel ISA tier below amx)");
}

#endif

}  // namespace cpu
}  // namespace hiserve

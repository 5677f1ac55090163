// Prefill attention on Intel AMX: out = softmax(q k^T * scale [+ causal mask]) v for one
// sequence of n queries over S keys, GQA (query head h reads KV head h / (Hq / Hkv)), bf16 in
// and out, float32 scores, online softmax (FlashAttention, Dao et al. 2022; the probabilities
// rounded to bf16 for P v, as FlashAttention-2/3 do), optional log-sum-exp out for a cascade
// merge (cpu_prefix_split).
//
// Why: torch's CPU flash attention (SDPA) reached 0.29 TFLOP/s (causal, 1061 tokens) and 0.52
// (56-token questions over a 1008-token prefix) on 2 cores of an AMX Xeon with SmolLM2's heads
// (D = 64), a third to a fifth of the dense GEMM's rate there: with 64-dim heads each score costs
// as many vector instructions (max, exp, sum, rounding) as its 256 multiply-adds take on the
// tiles, so the softmax must stay in L1 next to the tiles and do no horizontal sum per block.
//
// Steps: (1) K and V of each KV head are packed once per call into tile images (32-key blocks,
// zero past S), read through `slots` where given (straight from the pool, no gathered copy);
// (2) a work item is (query head, 32 queries): per 32-key block, Q K^T on 2 x 2 C tiles, the
// block's scores through the online softmax in AVX-512 (row sums kept as 16-lane partial sums,
// reduced once at the end), P V on 2 x 2 C tiles per 32 output dims, then O = O * alpha + P V.
// Causal (bottom-right aligned: query i sees keys j <= i + S - n) skips the blocks past the item's
// last query and masks the diagonal ones.
//
// K tile image [kb][c][h]: 16 x 16 dwords, row r = dims (32c + 2r, 32c + 2r + 1) of keys
// 32kb + 16h + f, f = 0..15 (TDPBF16PS's B operand for q rows as A). V tile image [kb][dn]:
// row r = keys (32kb + 2r, 32kb + 2r + 1) interleaved for dims 16dn + f (B for P as A).
#pragma once

#include <algorithm>
#include <new>
#include <vector>

#include "amx_attention_item.h"

namespace hiserve {
namespace cpu {

// A batch of sequences (FlashAttention's "varlen" form): sequence b has queries [cu_q[b],
// cu_q[b + 1]) of q/out/lse and keys [cu_k[b], cu_k[b + 1]) of slots (or of k/v's rows where
// slots is null). `base` holds the whole tensors; its n, S are unused.
struct FlashBatch {
  FlashCall base;
  const int64_t* cu_q;
  const int64_t* cu_k;
  int64_t B;

  FlashCall seq(int64_t b) const {
    FlashCall a = base;
    const int64_t q0 = cu_q[b], k0 = cu_k[b];
    a.n = cu_q[b + 1] - q0, a.S = cu_k[b + 1] - k0;
    a.q += q0 * a.q_rs, a.out += q0 * a.o_rs;
    if (a.lse != nullptr) a.lse += q0;
    if (a.slots != nullptr)
      a.slots += k0;
    else
      a.k += k0 * a.k_rs, a.v += k0 * a.v_rs;
    return a;
  }
};

#ifdef HISERVE_AMX

// Pack every sequence's K/V (parallel over KV heads x key blocks), then the items (parallel over
// query heads x query blocks of every sequence, those that see the most key blocks first).
// `scratch`: 2 * Hkv * (sum of ceil(S_b / 32)) * 32 * D uint16 for the packed K/V.
inline void amx_flash_attention(const FlashBatch& fb, uint16_t* scratch, int num_threads) {
  if (!amx_permitted()) throw std::runtime_error("the kernel refused AMX tile state (arch_prctl XTILEDATA)");
  const FlashCall& a0 = fb.base;
  const bool d64 = a0.D == 64;
  const int64_t qrows = d64 ? 16 : 32, G = a0.Hq / a0.Hkv, blk = 32 * a0.D;
  std::vector<int64_t> kb_off(fb.B + 1, 0);  // sequence b's key blocks start at kb_off[b]
  struct Item { int64_t b, qb, cost; };
  std::vector<Item> items;
  for (int64_t b = 0; b < fb.B; ++b) {
    const FlashCall a = fb.seq(b);
    kb_off[b + 1] = kb_off[b] + (a.S + 31) / 32;
    if (a.S == 0) continue;
    for (int64_t qb = 0; qb * qrows < a.n; ++qb) {
      const int64_t last = a.causal ? std::min(a.S - 1, std::min(a.n, (qb + 1) * qrows) - 1 + a.S - a.n) : a.S - 1;
      items.push_back({b, qb, last / 32 + 1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t KB = kb_off[fb.B], per_head = KB * blk, NI = static_cast<int64_t>(items.size()) * a0.Hq;
  uint16_t* kp = scratch;
  uint16_t* vp = scratch + a0.Hkv * per_head;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, NI)));
  // Each thread's item state, allocated here: an exception must not leave a parallel region.
  const size_t state_bytes = d64 ? sizeof(FlashState64) : sizeof(FlashState);  // multiples of 64
  char* states = static_cast<char*>(std::aligned_alloc(64, state_bytes * nt));
  if (states == nullptr) throw std::bad_alloc();
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a0.Hkv * KB; ++t) {
      const int64_t hk = t / KB, g = t % KB;
      const int64_t b = std::upper_bound(kb_off.begin(), kb_off.end(), g) - kb_off.begin() - 1;
      flash_pack_block(fb.seq(b), hk, g - kb_off[b], kp + hk * per_head + g * blk, vp + hk * per_head + g * blk);
    }
    void* st = states + state_bytes * omp_get_thread_num();
    if (d64) flash_configure16(); else amx_dense_configure(32);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < NI; ++t) {
      const Item& it = items[t / a0.Hq];
      const int64_t hq = t % a0.Hq, off = (hq / G) * per_head + kb_off[it.b] * blk;
      const FlashCall a = fb.seq(it.b);
      if (d64)
        flash_item64(a, *static_cast<FlashState64*>(st), hq, it.qb * 16, kp + off, vp + off);
      else
        flash_item(a, *static_cast<FlashState*>(st), hq, it.qb * 32, kp + off, vp + off);
    }
    _tile_release();
  }
  std::free(states);
}

#else  // not an AMX build: the Python side never calls this (it checks the tier first)

inline void amx_flash_attention(const FlashBatch&, uint16_t*, int) {
  throw std::runtime_error("this build of the CPU kernels has no AMX (kernel ISA tier below amx)");
}

#endif

}  // namespace cpu
}  // namespace hiserve

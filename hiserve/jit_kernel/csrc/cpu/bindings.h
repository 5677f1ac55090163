// Functions exported to Python through apache-tvm-ffi (built by hiserve/jit_kernel/cpu.py).
// Python checks shapes, dtypes and devices first and raises ValueError; the checks here
// only guard memory safety. Every tensor is a CPU tensor; float tensors are all float32 or
// all bfloat16 (the dtype of the first argument picks the instantiation).
#pragma once

#include <tvm/ffi/container/tensor.h>

#include <initializer_list>
#include <vector>

#include "amx_attention.h"
#include "amx_bf16_gemm.h"
#include "amx_bf16_gemm_silu.h"
#include "elementwise.h"
#include "gguf_amx.h"
#include "gguf_gemm.h"
#include "paged_attention.h"

namespace hiserve {
namespace cpu {

using tvm::ffi::TensorView;

inline bool is_bf16(const TensorView& t) {
  const DLDataType dt = t.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) return true;
  require(dt.code == kDLFloat && dt.bits == 32, "tensors must be float32 or bfloat16");
  return false;
}

inline void same_dtype(const TensorView& a, const TensorView& b, const char* name) {
  require(a.dtype().code == b.dtype().code && a.dtype().bits == b.dtype().bits,
          std::string(name) + " must have the dtype of the first tensor");
}

inline void require_inner_contiguous(const TensorView& t, const char* name) {
  require(t.stride(t.ndim() - 1) == 1, std::string(name) + " must be contiguous in its last dimension");
}

template <typename T>
T* ptr(const TensorView& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace cpu
}  // namespace hiserve

namespace hiserve {
namespace cpu {

// The optional K/V store of paged_attention: k_new [T', Hkv * D], v_new [T', Hkv * Dv] in the
// pool's dtype (rows strided, each contiguous), out_cache_loc [T'] int64 contiguous.
inline int64_t check_kv_store(const TensorView& k_buf, const TensorView& v_buf, const TensorView& k_new,
                              const TensorView& v_new, const TensorView& loc) {
  same_dtype(k_buf, k_new, "k_new");
  same_dtype(k_buf, v_new, "v_new");
  require(k_new.ndim() == 2 && v_new.ndim() == 2 && loc.ndim() == 1, "k_new/v_new must be 2-D, out_cache_loc 1-D");
  require_inner_contiguous(k_new, "k_new");
  require_inner_contiguous(v_new, "v_new");
  require(loc.dtype().code == kDLInt && loc.dtype().bits == 64 && loc.IsContiguous(),
          "out_cache_loc must be contiguous int64");
  const int64_t n = loc.size(0);
  require(k_new.size(0) == n && v_new.size(0) == n, "k_new/v_new must have one row per out_cache_loc entry");
  require(k_new.size(1) == k_buf.size(1) * k_buf.size(2) && v_new.size(1) == v_buf.size(1) * v_buf.size(2),
          "k_new/v_new rows must be Hkv * D / Hkv * Dv wide");
  return n;
}

template <typename T>
void run_paged_attention(const AttnShape& s, const TensorView& q, const TensorView& k_buf, const TensorView& v_buf,
                         const TensorView& out, const TensorView& req_to_token, const TensorView& req_pool_indices,
                         const TensorView& seq_lens, const TensorView& q_starts, const KvStore<T>* store, int nt) {
  if (store != nullptr) store_kv<T>(*store, s, k_buf.size(0), ptr<T>(k_buf), ptr<T>(v_buf), nt);
  paged_attention<T>(s, ptr<T>(q), ptr<T>(k_buf), ptr<T>(v_buf), ptr<T>(out), ptr<int32_t>(req_to_token),
                     ptr<int64_t>(req_pool_indices), ptr<int64_t>(seq_lens), ptr<int64_t>(q_starts), nt);
}

template <typename T>
void dispatch_paged_attention(const AttnShape& s, const TensorView& q, const TensorView& k_buf,
                              const TensorView& v_buf, const TensorView& out, const TensorView& req_to_token,
                              const TensorView& req_pool_indices, const TensorView& seq_lens,
                              const TensorView& q_starts, const TensorView& k_new, const TensorView& v_new,
                              const TensorView& loc, bool store, int nt) {
  if (!store)
    return run_paged_attention<T>(s, q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, q_starts,
                                  nullptr, nt);
  const int64_t n = check_kv_store(k_buf, v_buf, k_new, v_new, loc);
  const KvStore<T> kv{ptr<T>(k_new), ptr<T>(v_new), ptr<int64_t>(loc), n, k_new.stride(0), v_new.stride(0)};
  run_paged_attention<T>(s, q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, q_starts, &kv, nt);
}

}  // namespace cpu
}  // namespace hiserve

// q [T, Hq * D] (row stride free), k_buf [slots, Hkv, D], v_buf [slots, Hkv, Dv], out [T, Hq * Dv]
// contiguous; req_to_token [R, max_context] int32; req_pool_indices, seq_lens [B] int64;
// q_starts [B + 1] int64 (cumulative new-token counts). With store_kv, k_new/v_new rows are
// first copied to the pool at out_cache_loc (check_kv_store); without, those three are unread.
void paged_attention(tvm::ffi::TensorView q, tvm::ffi::TensorView k_buf, tvm::ffi::TensorView v_buf,
                     tvm::ffi::TensorView out, tvm::ffi::TensorView req_to_token,
                     tvm::ffi::TensorView req_pool_indices, tvm::ffi::TensorView seq_lens,
                     tvm::ffi::TensorView q_starts, tvm::ffi::TensorView k_new, tvm::ffi::TensorView v_new,
                     tvm::ffi::TensorView out_cache_loc, bool store_kv, int64_t num_q_heads, int64_t num_kv_heads,
                     double scale, int64_t num_threads) {
  using namespace hiserve::cpu;
  const bool bf = is_bf16(q);
  same_dtype(q, k_buf, "k_buf");
  same_dtype(q, v_buf, "v_buf");
  same_dtype(q, out, "out");
  require_inner_contiguous(q, "q");
  require(k_buf.IsContiguous() && v_buf.IsContiguous() && out.IsContiguous(), "pool buffers and out must be contiguous");
  require(req_to_token.dtype().code == kDLInt && req_to_token.dtype().bits == 32 && req_to_token.stride(1) == 1,
          "req_to_token must be int32, rows contiguous");
  require(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads");
  require(k_buf.size(1) == num_kv_heads && v_buf.size(1) == num_kv_heads, "pool head count mismatch");
  require(q_starts.size(0) == req_pool_indices.size(0) + 1 && seq_lens.size(0) == req_pool_indices.size(0),
          "q_starts must be [B + 1], seq_lens [B]");
  // Shapes the kernel indexes by, checked here as well as in the Python wrapper: the CPU decode
  // loop (hiserve/models/cpu_decode_loop.py) calls this binding directly.
  require(q.ndim() == 2 && out.ndim() == 2 && k_buf.ndim() == 3 && v_buf.ndim() == 3 && req_to_token.ndim() == 2,
          "q/out must be 2-D, the pool buffers 3-D, req_to_token 2-D");
  require(q.size(1) == num_q_heads * k_buf.size(2) && out.size(0) == q.size(0) &&
              out.size(1) == num_q_heads * v_buf.size(2),
          "q must be [T, Hq * D] and out [T, Hq * Dv]");
  for (const tvm::ffi::TensorView* t : {&req_pool_indices, &seq_lens, &q_starts})
    require(t->ndim() == 1 && t->dtype().code == kDLInt && t->dtype().bits == 64 && t->IsContiguous(),
            "req_pool_indices, seq_lens and q_starts must be contiguous int64 vectors");
  AttnShape s{req_pool_indices.size(0), num_q_heads, num_kv_heads, k_buf.size(2), v_buf.size(2), q.stride(0),
              k_buf.stride(0), v_buf.stride(0), req_to_token.stride(0), req_to_token.size(0), req_to_token.size(1),
              static_cast<float>(scale)};
  require(q_starts.data_ptr() != nullptr && (s.num_reqs == 0 || ptr<int64_t>(q_starts)[s.num_reqs] <= q.size(0)),
          "q_starts runs past q's rows");
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  if (bf)
    dispatch_paged_attention<bf16>(s, q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, q_starts,
                                   k_new, v_new, out_cache_loc, store_kv, nt);
  else
    dispatch_paged_attention<float>(s, q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, q_starts,
                                    k_new, v_new, out_cache_loc, store_kv, nt);
}

// x [T, H] (row stride free), weight [H], out [T, H]; with_residual: residual and new_residual
// [T, H] contiguous (residual may alias new_residual).
void rmsnorm(tvm::ffi::TensorView x, tvm::ffi::TensorView residual, tvm::ffi::TensorView weight,
             tvm::ffi::TensorView out, tvm::ffi::TensorView new_residual, bool with_residual, double eps,
             int64_t num_threads) {
  using namespace hiserve::cpu;
  const bool bf = is_bf16(x);
  same_dtype(x, weight, "weight");
  same_dtype(x, out, "out");
  require_inner_contiguous(x, "x");
  require(out.IsContiguous() && weight.IsContiguous(), "out and weight must be contiguous");
  require(x.ndim() == 2, "x must be [T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  auto is_th = [&](const tvm::ffi::TensorView& t) { return t.ndim() == 2 && t.size(0) == T && t.size(1) == H; };
  require(weight.ndim() == 1 && weight.size(0) == H && is_th(out), "weight must be [H] and out [T, H]");
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  if (with_residual) {
    same_dtype(x, residual, "residual");
    same_dtype(x, new_residual, "new_residual");
    require(residual.IsContiguous() && new_residual.IsContiguous(), "residuals must be contiguous");
    require(is_th(residual) && is_th(new_residual), "residual and new_residual must be [T, H]");
  }
  if (bf)
    rmsnorm<bf16>(ptr<bf16>(x), x.stride(0), with_residual ? ptr<bf16>(residual) : nullptr, ptr<bf16>(weight),
                  ptr<bf16>(out), with_residual ? ptr<bf16>(new_residual) : nullptr, T, H, static_cast<float>(eps), nt);
  else
    rmsnorm<float>(ptr<float>(x), x.stride(0), with_residual ? ptr<float>(residual) : nullptr, ptr<float>(weight),
                   ptr<float>(out), with_residual ? ptr<float>(new_residual) : nullptr, T, H,
                   static_cast<float>(eps), nt);
}

// x [T, heads, head_dim] (token stride free, heads contiguous); cos, sin [T, *, rotary_dim/2]
// float32 sharing one token stride; out [T, heads, head_dim] contiguous.
void rotary(tvm::ffi::TensorView x, tvm::ffi::TensorView cos, tvm::ffi::TensorView sin, tvm::ffi::TensorView out,
            int64_t rotary_dim, bool neox, int64_t num_threads) {
  using namespace hiserve::cpu;
  const bool bf = is_bf16(x);
  same_dtype(x, out, "out");
  require(x.ndim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must have contiguous heads");
  require(out.ndim() == 3 && out.IsContiguous() && out.size(0) == x.size(0) && out.size(1) == x.size(1) &&
              out.size(2) == x.size(2),
          "out must be contiguous with x's shape");
  require(cos.dtype().code == kDLFloat && cos.dtype().bits == 32 && sin.dtype().code == kDLFloat &&
              sin.dtype().bits == 32,
          "cos/sin must be float32");
  require(cos.stride(0) == sin.stride(0) && cos.stride(cos.ndim() - 1) == 1 && sin.stride(sin.ndim() - 1) == 1,
          "cos and sin must share a token stride and be contiguous per token");
  const int64_t T = x.size(0), heads = x.size(1), hd = x.size(2);
  require(rotary_dim % 2 == 0 && rotary_dim <= hd, "rotary_dim must be even and <= head_dim");
  require(cos.size(0) >= T && sin.size(0) >= T && cos.size(cos.ndim() - 1) == rotary_dim / 2 &&
              sin.size(sin.ndim() - 1) == rotary_dim / 2,
          "cos/sin must be [T, *, rotary_dim / 2]");
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  if (bf)
    rotary<bf16>(ptr<bf16>(x), x.stride(0), ptr<float>(cos), ptr<float>(sin), cos.stride(0), ptr<bf16>(out), T,
                 heads, hd, rotary_dim, neox, nt);
  else
    rotary<float>(ptr<float>(x), x.stride(0), ptr<float>(cos), ptr<float>(sin), cos.stride(0), ptr<float>(out), T,
                  heads, hd, rotary_dim, neox, nt);
}

// x [T, 2I] (row stride free) -> out [T, I] contiguous.
void silu_and_mul(tvm::ffi::TensorView x, tvm::ffi::TensorView out, int64_t num_threads) {
  using namespace hiserve::cpu;
  const bool bf = is_bf16(x);
  same_dtype(x, out, "out");
  require_inner_contiguous(x, "x");
  require(x.ndim() == 2 && out.ndim() == 2 && out.IsContiguous() && out.size(0) == x.size(0),
          "x must be [T, 2I] and out contiguous [T, I]");
  const int64_t T = x.size(0), I = out.size(1);
  require(x.size(1) == 2 * I, "x must be [T, 2 * I] for out [T, I]");
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  if (bf)
    silu_and_mul<bf16>(ptr<bf16>(x), x.stride(0), ptr<bf16>(out), T, I, nt);
  else
    silu_and_mul<float>(ptr<float>(x), x.stride(0), ptr<float>(out), T, I, nt);
}

// x [B, V] float32 (row stride free, rows contiguous) -> out [B] int64: each row's argmax.
void argmax_rows(tvm::ffi::TensorView x, tvm::ffi::TensorView out, int64_t num_threads) {
  using namespace hiserve::cpu;
  require(!is_bf16(x) && x.ndim() == 2 && out.ndim() == 1, "x must be float32 [B, V], out [B]");
  require_inner_contiguous(x, "x");
  require(out.IsContiguous() && out.dtype().code == kDLInt && out.dtype().bits == 64 && out.size(0) == x.size(0),
          "out must be contiguous int64 [B]");
  require(x.size(1) >= 1, "x must have at least one column");
  argmax_rows(ptr<float>(x), x.stride(0), ptr<int64_t>(out), x.size(0), x.size(1),
              static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// x [M, K] (row stride free) float32 or bf16; w uint8 [N, K/32 * block bytes]: each row the
// GGUF blocks of one output feature (block_type 0: Q4_0, 1: Q4_1, 2: Q8_0; gguf_gemm.h);
// out [M, N] in x's dtype, contiguous.
void gguf_gemm(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView out, int64_t block_type,
               int64_t num_threads) {
  using namespace hiserve::cpu;
  const bool bf = is_bf16(x);
  same_dtype(x, out, "out");
  require_inner_contiguous(x, "x");
  require(block_type >= 0 && block_type <= 2, "block_type must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  const BlockType B = static_cast<BlockType>(block_type);
  require(x.ndim() == 2 && out.ndim() == 2, "x and out must be 2-D");
  require(w.IsContiguous() && out.IsContiguous() && w.dtype().bits == 8 && w.ndim() == 2,
          "w must be a contiguous 8-bit [N, bytes] tensor and out contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  require(K % kBlock == 0 && w.size(1) == K / kBlock * block_bytes(B), "w rows must hold K/32 blocks of x's K");
  require(out.size(0) == M && out.size(1) == N, "out must be [M, N]");
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  const uint8_t* wp = ptr<uint8_t>(w);
  if (bf) {
    if (B == BlockType::kQ4_0) gguf_gemm<bf16, BlockType::kQ4_0>(ptr<bf16>(x), x.stride(0), wp, ptr<bf16>(out), M, N, K, nt);
    if (B == BlockType::kQ4_1) gguf_gemm<bf16, BlockType::kQ4_1>(ptr<bf16>(x), x.stride(0), wp, ptr<bf16>(out), M, N, K, nt);
    if (B == BlockType::kQ8_0) gguf_gemm<bf16, BlockType::kQ8_0>(ptr<bf16>(x), x.stride(0), wp, ptr<bf16>(out), M, N, K, nt);
  } else {
    if (B == BlockType::kQ4_0) gguf_gemm<float, BlockType::kQ4_0>(ptr<float>(x), x.stride(0), wp, ptr<float>(out), M, N, K, nt);
    if (B == BlockType::kQ4_1) gguf_gemm<float, BlockType::kQ4_1>(ptr<float>(x), x.stride(0), wp, ptr<float>(out), M, N, K, nt);
    if (B == BlockType::kQ8_0) gguf_gemm<float, BlockType::kQ8_0>(ptr<float>(x), x.stride(0), wp, ptr<float>(out), M, N, K, nt);
  }
}

// 1 where this build has the AMX GEMM and the process may use AMX tiles (gguf_amx.h), else 0.
int64_t gguf_amx_ready() { return hiserve::cpu::amx_permitted() ? 1 : 0; }

// blocks uint8 [N, K/32 * block bytes] (Q4_0: block_type 0, Q4_1: 1, Q8_0: 2), N % 16 == 0 ->
// out uint8 [N/16, K/32, record bytes (320, Q8_0 544)] in gguf_amx.h's record layout.
void gguf_amx_pack(tvm::ffi::TensorView blocks, tvm::ffi::TensorView out, int64_t block_type) {
  using namespace hiserve::cpu;
  require(block_type >= 0 && block_type <= 2, "block_type must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  require(blocks.IsContiguous() && out.IsContiguous() && blocks.ndim() == 2 && out.ndim() == 3 &&
              blocks.dtype().bits == 8 && out.dtype().bits == 8, "blocks/out must be contiguous uint8, 2-D / 3-D");
  const int64_t N = blocks.size(0), KB = out.size(1);
  require(N % 16 == 0 && out.size(0) == N / 16 && out.size(2) == amx_record_bytes(static_cast<int>(block_type)) &&
              blocks.size(1) == KB * block_bytes(static_cast<BlockType>(block_type)),
          "out must be [N/16, K/32, record bytes] for blocks [N, K/32 blocks]");
  gguf_amx_pack(ptr<uint8_t>(blocks), N, KB * 32, static_cast<int>(block_type), ptr<uint8_t>(out));
}

// x [M, K] bf16 (row stride free); packed [N/16, K/32, 320 or 544] from gguf_amx_pack; out [M, N] bf16.
void gguf_amx_gemm(tvm::ffi::TensorView x, tvm::ffi::TensorView packed, tvm::ffi::TensorView out,
                   int64_t num_threads) {
  using namespace hiserve::cpu;
  require(is_bf16(x), "x must be bfloat16");
  same_dtype(x, out, "out");
  require_inner_contiguous(x, "x");
  require(x.ndim() == 2 && out.ndim() == 2 && out.IsContiguous(), "x and out must be 2-D, out contiguous");
  require(packed.IsContiguous() && packed.ndim() == 3 && packed.dtype().bits == 8 &&
              (packed.size(2) == kAmxRecord || packed.size(2) == kAmxRecordQ8),
          "packed must be a contiguous uint8 [N/16, K/32, 320 or 544] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  require(packed.size(1) * 32 == K && out.size(0) == M && out.size(1) == N, "shapes disagree");
  if (M == 0) return;
  const bool q8 = packed.size(2) == kAmxRecordQ8;
  gguf_amx_gemm(ptr<bf16>(x), x.stride(0), ptr<uint8_t>(packed), q8, ptr<bf16>(out), M, N, K,
                static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// x [M, K] bf16 (row stride free); packed bf16 [N/32, K/32, 1024] in amx_bf16_gemm.h's tile
// layout; bias float32 [N], or [0] for none; out [M, N] bf16 contiguous.
void amx_bf16_gemm(tvm::ffi::TensorView x, tvm::ffi::TensorView packed, tvm::ffi::TensorView bias,
                   tvm::ffi::TensorView out, int64_t num_threads) {
  using namespace hiserve::cpu;
  require(x.ndim() == 2 && out.ndim() == 2 && out.IsContiguous(), "x and out must be 2-D, out contiguous");
  require(is_bf16(x), "x must be bfloat16");
  same_dtype(x, out, "out");
  same_dtype(x, packed, "packed");
  require_inner_contiguous(x, "x");
  require(packed.IsContiguous() && packed.ndim() == 3 && packed.size(2) == 1024,
          "packed must be a contiguous bf16 [N/32, K/32, 1024] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 32;
  require(packed.size(1) * 32 == K && out.size(0) == M && out.size(1) == N, "shapes disagree");
  require(bias.ndim() == 1 && bias.IsContiguous() && bias.dtype().code == kDLFloat && bias.dtype().bits == 32 &&
              (bias.size(0) == N || bias.size(0) == 0),
          "bias must be a contiguous float32 [N] tensor, or [0] for none");
  require(K > 0, "K must be positive");
  if (M == 0 || N == 0) return;
  amx_bf16_gemm(ptr<bf16>(x), x.stride(0), ptr<uint16_t>(packed), bias.size(0) ? ptr<float>(bias) : nullptr,
                ptr<bf16>(out), N, M, N, K, static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// x [M, K] bf16 (row stride free); packed bf16 [2I/32, K/32, 1024] (amx_bf16_pack of [W_gate;
// W_up]); out [M, I] bf16 contiguous = silu(x W_gate^T) * (x W_up^T).
void amx_bf16_gemm_silu(tvm::ffi::TensorView x, tvm::ffi::TensorView packed, tvm::ffi::TensorView out,
                        int64_t num_threads) {
  using namespace hiserve::cpu;
  require(x.ndim() == 2 && out.ndim() == 2 && out.IsContiguous(), "x and out must be 2-D, out contiguous");
  require(is_bf16(x), "x must be bfloat16");
  same_dtype(x, out, "out");
  same_dtype(x, packed, "packed");
  require_inner_contiguous(x, "x");
  require(packed.IsContiguous() && packed.ndim() == 3 && packed.size(2) == 1024 && packed.size(0) % 2 == 0,
          "packed must be a contiguous bf16 [2I/32, K/32, 1024] tensor");
  const int64_t M = x.size(0), K = x.size(1), I = packed.size(0) * 16;
  require(packed.size(1) * 32 == K && out.size(0) == M && out.size(1) == I && K > 0, "shapes disagree");
  if (M == 0 || I == 0) return;
  amx_bf16_gemm_silu(ptr<bf16>(x), x.stride(0), ptr<uint16_t>(packed), ptr<bf16>(out), I, M, I, K,
                     static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// Prefill attention on AMX (amx_attention.h), B sequences. q [Tq, Hq, D], k/v [R, Hkv, D] bf16
// (last dim contiguous, heads adjacent, rows strided); slots int64 [Tk] rows of k/v (or [0]: the
// keys are k/v's rows, Tk = R); cu_q / cu_k int64 [B + 1] offsets into q's rows and the keys;
// out [Tq, Hq, D] bf16 (last dim contiguous); lse float32 [Hq, Tq] contiguous, or [0] for none.
void amx_flash_attention(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v,
                         tvm::ffi::TensorView slots, tvm::ffi::TensorView cu_q, tvm::ffi::TensorView cu_k,
                         tvm::ffi::TensorView out, tvm::ffi::TensorView lse, bool causal, double scale,
                         int64_t num_threads) {
  using namespace hiserve::cpu;
  require(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3, "q, k, v and out must be 3-D");
  require(is_bf16(q), "q must be bfloat16");
  same_dtype(q, k, "k"), same_dtype(q, v, "v"), same_dtype(q, out, "out");
  require_inner_contiguous(q, "q"), require_inner_contiguous(k, "k"), require_inner_contiguous(v, "v");
  require_inner_contiguous(out, "out");
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), rows = k.size(0);
  require(D % 32 == 0 && D > 0 && D <= kFlashMaxDim && k.size(2) == D && v.size(2) == D && v.size(1) == Hkv &&
              v.size(0) == rows && Hkv > 0 && Hq % Hkv == 0 && out.size(0) == Tq && out.size(1) == Hq &&
              out.size(2) == D && k.stride(1) == D && v.stride(1) == D,
          "shapes disagree (D a multiple of 32 up to 256, Hq a multiple of Hkv, heads adjacent)");
  const bool with_slots = slots.size(0) > 0;
  const int64_t Tk = with_slots ? slots.size(0) : rows;
  const int64_t* sl = with_slots ? ptr<int64_t>(slots) : nullptr;
  if (with_slots) {
    require(slots.ndim() == 1 && slots.IsContiguous() && slots.dtype().code == kDLInt && slots.dtype().bits == 64,
            "slots must be contiguous int64 [Tk]");
    for (int64_t j = 0; j < Tk; ++j) require(sl[j] >= 0 && sl[j] < rows, "a slot is out of range of k/v");
  }
  for (const TensorView* cu : {&cu_q, &cu_k})
    require(cu->ndim() == 1 && cu->IsContiguous() && cu->dtype().code == kDLInt && cu->dtype().bits == 64 &&
                cu->size(0) == cu_q.size(0) && cu->size(0) >= 2,
            "cu_q and cu_k must be contiguous int64 [B + 1], B >= 1");
  const int64_t B = cu_q.size(0) - 1;
  const int64_t* cq = ptr<int64_t>(cu_q);
  const int64_t* ck = ptr<int64_t>(cu_k);
  require(cq[0] == 0 && ck[0] == 0 && cq[B] == Tq && ck[B] <= Tk, "cu_q must run from 0 to Tq, cu_k from 0 within the keys");
  for (int64_t b = 0; b < B; ++b) {
    require(cq[b + 1] >= cq[b] && ck[b + 1] >= ck[b], "cu_q and cu_k must not decrease");
    require(!causal || ck[b + 1] - ck[b] >= cq[b + 1] - cq[b], "causal attention needs S >= n in every sequence");
    require(cq[b + 1] == cq[b] || ck[b + 1] > ck[b], "a sequence with queries has no keys");
  }
  float* lp = nullptr;
  if (lse.size(0) > 0) {
    require(lse.ndim() == 2 && lse.IsContiguous() && lse.dtype().code == kDLFloat && lse.dtype().bits == 32 &&
                lse.size(0) == Hq && lse.size(1) == Tq,
            "lse must be contiguous float32 [Hq, Tq], or [0]");
    lp = ptr<float>(lse);
  }
  if (Tq == 0) return;
  const FlashBatch fb{{ptr<bf16>(q), q.stride(0), q.stride(1), ptr<bf16>(k), ptr<bf16>(v), k.stride(0), v.stride(0),
                       sl, ptr<bf16>(out), out.stride(0), out.stride(1), lp, Tq, 0, 0, Hq, Hkv, D, causal,
                       static_cast<float>(scale)},
                      cq, ck, B};
  int64_t blocks = 0;
  for (int64_t b = 0; b < B; ++b) blocks += (ck[b + 1] - ck[b] + 31) / 32;
  require(scale > 0, "scale must be positive (the running max is kept on unscaled scores)");
  // Kept across calls (one allocation per prompt size, not per layer), but not a long prompt's
  // size for good: a much larger buffer than this call needs is given back first.
  static thread_local std::vector<uint16_t> scratch;
  const size_t need = static_cast<size_t>(2 * Hkv * blocks * 32 * D);
  if (scratch.capacity() > 4 * need && scratch.capacity() > (size_t{32} << 20)) std::vector<uint16_t>().swap(scratch);
  scratch.resize(need);
  amx_flash_attention(fb, scratch.data(), static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// Token-granular transfers between the `layer_first` device pool and a host buffer in any of
// the three host layouts, run by SM threads on mapped (pinned / registered) host memory:
//   * per-layer load-back (host -> device), one layer of K and V (or the MLA row);
//   * all-layer write-back (device -> host), every layer, through a per-layer pointer table
//     (the `layer_first` and `page_first_direct` write-back paths, and the per-token baseline
//     the staged path is measured against).
//
// The grid is capped at `block_quota` blocks (grid-stride loop), so a transfer running beside
// the forward pass takes only a few SMs. Each thread keeps kUnroll 16-byte loads in flight to
// cover the latency of the host link.
//
// Host address of (host slot h, layer l): base + (h / P) * page_stride + (h % P) * token_stride
// + l * layer_stride, with the strides of each layout (S host slots, L layers, P page size,
// e = item bytes):
//   layer_first        [L, S, item]        page P*e,   token e,   layer S*e
//   page_first         [S, L, item]        page P*L*e, token L*e, layer e
//   page_first_direct  [S/P, L, P, item]   page L*P*e, token e,   layer P*e
#pragma once

#include "common.cuh"

namespace hiserve {
namespace kvcacheio {

#ifndef HISERVE_TRANSFER_THREADS
#define HISERVE_TRANSFER_THREADS 1024
#endif
#ifndef HISERVE_TRANSFER_UNROLL
#define HISERVE_TRANSFER_UNROLL 4
#endif

enum HostLayout : int64_t { kLayerFirst = 0, kPageFirst = 1, kPageFirstDirect = 2 };

struct HostAddressing {
  char* base[2];  // per kind, device-accessible
  uint64_t page_stride;
  uint64_t token_stride;
  uint64_t layer_stride;
  FastDivmod page;  // page_size
};

inline HostAddressing make_host_addressing(int64_t layout, int64_t host_slots, int64_t num_layers, int64_t page_size,
                                           int64_t item_bytes) {
  require(host_slots >= 0 && host_slots < (int64_t{1} << 31), "transfer: host slots must be < 2^31");
  HostAddressing h;
  h.base[0] = h.base[1] = nullptr;
  const uint64_t e = static_cast<uint64_t>(item_bytes), P = static_cast<uint64_t>(page_size);
  const uint64_t L = static_cast<uint64_t>(num_layers), S = static_cast<uint64_t>(host_slots);
  switch (layout) {
    case kLayerFirst:
      h.page_stride = P * e, h.token_stride = e, h.layer_stride = S * e;
      break;
    case kPageFirst:
      h.page_stride = P * L * e, h.token_stride = L * e, h.layer_stride = e;
      break;
    case kPageFirstDirect:
      h.page_stride = L * P * e, h.token_stride = e, h.layer_stride = P * e;
      break;
    default:
      require(false, "transfer: unknown host layout code");
  }
  h.page = FastDivmod(static_cast<uint32_t>(page_size));
  return h;
}

struct DeviceAddressing {
  const uint64_t* table;  // [num_kinds * table_layers] kind-major layer bases, or nullptr
  uint64_t ptrs[2];       // per kind, when table == nullptr (a single layer)
  uint32_t table_layers;
  __device__ __forceinline__ char* layer_base(uint32_t kind, uint32_t layer) const {
    return reinterpret_cast<char*>(table != nullptr ? table[kind * table_layers + layer]
                                                    : (kind == 0 ? ptrs[0] : ptrs[1]));
  }
};

template <typename DevIdxT, typename HostIdxT>
struct TransferParams {
  DeviceAddressing dev;
  HostAddressing host;
  const DevIdxT* device_indices;  // [tokens], on the device
  const HostIdxT* host_indices;   // [tokens], on the device
  uint32_t total_vectors;         // tokens * kinds * layers * vectors per item
  uint32_t item_bytes;
  uint32_t host_layer_offset;     // host layer of op layer 0 (the layer id of a per-layer load-back)
  FastDivmod vectors_per_item;
  FastDivmod layers;              // layers moved by this op
  FastDivmod kinds;
};

// Vector id -> (token, kind, layer, vector): consecutive threads walk one item's vectors, so
// both sides are accessed in 16-byte pieces of contiguous item rows.
template <typename DevIdxT, typename HostIdxT, bool kToHost, int kThreads, int kUnroll>
__global__ void __launch_bounds__(kThreads) kv_transfer_kernel(const TransferParams<DevIdxT, HostIdxT> p) {
  const uint32_t stride = gridDim.x * kThreads * kUnroll;
  for (uint32_t base = blockIdx.x * kThreads * kUnroll + threadIdx.x; base < p.total_vectors; base += stride) {
    uint4 v[kUnroll];
    char* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * kThreads;
      dst[u] = nullptr;
      if (idx < p.total_vectors) {
        uint32_t vec, layer, kind, in_page;
        const uint32_t row = p.vectors_per_item.divmod(idx, vec);
        const uint32_t r2 = p.layers.divmod(row, layer);
        const uint32_t token = p.kinds.divmod(r2, kind);
        const uint64_t slot = static_cast<uint64_t>(p.device_indices[token]);
        const uint32_t host_slot = static_cast<uint32_t>(p.host_indices[token]);
        const uint32_t page = p.host.page.divmod(host_slot, in_page);
        char* dev_addr = p.dev.layer_base(kind, layer) + slot * p.item_bytes + vec * kVecBytes;
        char* host_base = kind == 0 ? p.host.base[0] : p.host.base[1];
        char* host_addr = host_base + page * p.host.page_stride + in_page * p.host.token_stride +
                          (p.host_layer_offset + layer) * p.host.layer_stride + vec * kVecBytes;
        if (kToHost) {
          v[u] = load_vec_stream(dev_addr);
          dst[u] = host_addr;
        } else {
          v[u] = load_vec(host_addr);
          dst[u] = dev_addr;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) store_vec(dst[u], v[u]);
    }
  }
}

template <typename DevIdxT, typename HostIdxT>
inline void launch_kv_transfer(TransferParams<DevIdxT, HostIdxT>& p, int64_t tokens, int64_t num_layers,
                               int64_t item_bytes, int num_kinds, bool to_host, int64_t block_quota,
                               cudaStream_t stream) {
  constexpr int kThreads = HISERVE_TRANSFER_THREADS;
  constexpr int kUnroll = HISERVE_TRANSFER_UNROLL;
  require(item_bytes > 0 && item_bytes % kVecBytes == 0, "transfer: item_bytes must be a positive multiple of 16");
  require(num_kinds == 1 || num_kinds == 2, "transfer: num_kinds must be 1 or 2");
  require(block_quota >= 1, "transfer: block_quota must be >= 1");
  if (tokens <= 0) return;
  const int64_t total = tokens * num_kinds * num_layers * (item_bytes / kVecBytes);
  require(total < (int64_t{1} << 31) - int64_t{kThreads} * kUnroll,
          "transfer: too many 16-byte vectors for one launch (split the transfer)");
  p.total_vectors = static_cast<uint32_t>(total);
  p.item_bytes = static_cast<uint32_t>(item_bytes);
  p.vectors_per_item = FastDivmod(static_cast<uint32_t>(item_bytes / kVecBytes));
  p.layers = FastDivmod(static_cast<uint32_t>(num_layers));
  p.kinds = FastDivmod(static_cast<uint32_t>(num_kinds));
  const int64_t per_block = int64_t{kThreads} * kUnroll;
  const int64_t wanted = (total + per_block - 1) / per_block;
  const unsigned grid = static_cast<unsigned>(wanted < block_quota ? wanted : block_quota);
  if (to_host) {
    kv_transfer_kernel<DevIdxT, HostIdxT, true, kThreads, kUnroll><<<grid, kThreads, 0, stream>>>(p);
  } else {
    kv_transfer_kernel<DevIdxT, HostIdxT, false, kThreads, kUnroll><<<grid, kThreads, 0, stream>>>(p);
  }
  check_cuda(cudaGetLastError(), "kv_transfer_kernel launch");
}

// Dispatch on the two index dtypes (int32 / int64 each).
template <typename F>
inline void with_index_types(bool device_int64, bool host_int64, F&& f) {
  if (device_int64) {
    if (host_int64) f(int64_t{}, int64_t{});
    else f(int64_t{}, int32_t{});
  } else {
    if (host_int64) f(int32_t{}, int64_t{});
    else f(int32_t{}, int32_t{});
  }
}

// Host base of a kind, as the device may address it.
inline char* device_accessible(char* host_ptr, int device) {
  return can_use_host_pointer(device) ? host_ptr : device_alias(host_ptr);
}

}  // namespace kvcacheio
}  // namespace hiserve

// Relayout for the staged write-back: gather whole pages from the per-layer device buffers
// (`layer_first`, one tensor per layer and kind, rows of `item_bytes`) into a device staging
// buffer ordered [page][token][layer][element], i.e. exactly the bytes of those pages in the
// host `page_first` layout, so that each staged page can leave as one contiguous DMA.
//
// Staged page j holds page `page_map[j]` of the operation (the host side orders the chunk by
// host page, so that consecutive host pages land in consecutive staged pages and leave as
// one copy). Token t of that page comes from device slot device_indices[page_map[j] * P + t]:
// one index per token, so any device slots work; only the host side needs page-aligned runs.
//
// One thread moves 16-byte vectors; consecutive threads take consecutive vectors of the
// staging buffer, so stores are fully coalesced and loads are coalesced within each row.
// Each thread issues kUnroll independent loads before its stores.
#pragma once

#include "common.cuh"

namespace hiserve {
namespace kvcacheio {

#ifndef HISERVE_RELAYOUT_THREADS
#define HISERVE_RELAYOUT_THREADS 256
#endif
#ifndef HISERVE_RELAYOUT_UNROLL
#define HISERVE_RELAYOUT_UNROLL 4
#endif

// Staged pages per relayout launch (the page map travels in the kernel parameters).
constexpr int kMaxRelayoutPages = 256;
#ifndef HISERVE_RELAYOUT_MAX_BLOCKS
#define HISERVE_RELAYOUT_MAX_BLOCKS 0
#endif

template <typename IndexT>
struct RelayoutParams {
  const uint64_t* layer_ptrs;    // [num_kinds * num_layers]: kind-major table of layer base addresses
  char* staging[2];              // per kind; staging[k] row r = staged token r, all layers
  const IndexT* device_indices;  // [operation tokens] device slot of every token of the operation
  uint32_t total_vectors;        // per kind: staged tokens * num_layers * vectors per item
  uint32_t num_layers;
  uint32_t item_bytes;
  FastDivmod vectors_per_item;   // item_bytes / 16
  FastDivmod layers;             // num_layers
  FastDivmod page_size;          // P
  int32_t page_map[kMaxRelayoutPages];  // operation page of each staged page
};

template <typename IndexT, int kThreads, int kUnroll>
__global__ void __launch_bounds__(kThreads) relayout_lf_pf_kernel(const __grid_constant__ RelayoutParams<IndexT> p) {
  const uint32_t kind = blockIdx.y;
  const uint64_t* __restrict__ table = p.layer_ptrs + static_cast<size_t>(kind) * p.num_layers;
  char* __restrict__ staging = kind == 0 ? p.staging[0] : p.staging[1];  // no run-time index into params
  const uint32_t stride = gridDim.x * kThreads * kUnroll;
  for (uint32_t base = blockIdx.x * kThreads * kUnroll + threadIdx.x; base < p.total_vectors; base += stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * kThreads;
      if (idx < p.total_vectors) {
        uint32_t vec, layer, token_in_page;
        const uint32_t row = p.vectors_per_item.divmod(idx, vec);
        const uint32_t token = p.layers.divmod(row, layer);
        const uint32_t page = p.page_size.divmod(token, token_in_page);
        const uint64_t op_token = static_cast<uint64_t>(p.page_map[page]) * p.page_size.divisor + token_in_page;
        const uint64_t slot = static_cast<uint64_t>(p.device_indices[op_token]);
        const char* src = reinterpret_cast<const char*>(table[layer]) + slot * p.item_bytes + vec * kVecBytes;
        v[u] = load_vec_stream(src);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * kThreads;
      if (idx < p.total_vectors) store_vec(staging + static_cast<size_t>(idx) * kVecBytes, v[u]);
    }
  }
}

// Enqueue the relayout of the staged pages `page_map[0 .. num_pages)` (all layers,
// `num_kinds` kinds) on `stream`.
template <typename IndexT>
inline void launch_relayout_lf_pf(const uint64_t* layer_ptrs, char* staging0, char* staging1,
                                  const IndexT* device_indices, const int32_t* page_map, int64_t num_pages,
                                  int64_t page_size, int64_t num_layers, int64_t item_bytes, int num_kinds, int device,
                                  cudaStream_t stream) {
  constexpr int kThreads = HISERVE_RELAYOUT_THREADS;
  constexpr int kUnroll = HISERVE_RELAYOUT_UNROLL;
  require(item_bytes > 0 && item_bytes % kVecBytes == 0, "relayout: item_bytes must be a positive multiple of 16");
  require(num_kinds == 1 || num_kinds == 2, "relayout: num_kinds must be 1 or 2");
  require(num_pages <= kMaxRelayoutPages, "relayout: more staged pages than one launch takes");
  if (num_pages <= 0) return;
  const int64_t total = num_pages * page_size * num_layers * (item_bytes / kVecBytes);
  require(total < (int64_t{1} << 31) - int64_t{kThreads} * kUnroll,
          "relayout: a chunk has too many 16-byte vectors for 32-bit indexing (use fewer pages per chunk)");
  RelayoutParams<IndexT> p;
  p.layer_ptrs = layer_ptrs;
  p.staging[0] = staging0;
  p.staging[1] = staging1;
  p.device_indices = device_indices;
  p.total_vectors = static_cast<uint32_t>(total);
  p.num_layers = static_cast<uint32_t>(num_layers);
  p.item_bytes = static_cast<uint32_t>(item_bytes);
  p.vectors_per_item = FastDivmod(static_cast<uint32_t>(item_bytes / kVecBytes));
  p.layers = FastDivmod(static_cast<uint32_t>(num_layers));
  p.page_size = FastDivmod(static_cast<uint32_t>(page_size));
  for (int64_t j = 0; j < num_pages; ++j) p.page_map[j] = page_map[j];
  const int64_t per_block = int64_t{kThreads} * kUnroll;
  const int64_t wanted = (total + per_block - 1) / per_block;
  // HISERVE_RELAYOUT_MAX_BLOCKS (KvcacheioConfig.relayout_max_blocks) > 0 caps the grid so the
  // relayout, which only has to outpace the copy engine, leaves most SMs to a concurrent forward.
  const int64_t cap = HISERVE_RELAYOUT_MAX_BLOCKS > 0 ? int64_t{HISERVE_RELAYOUT_MAX_BLOCKS}
                                                      : int64_t{device_sm_count(device)} * 16;
  const dim3 grid(static_cast<unsigned>(wanted < cap ? wanted : cap), static_cast<unsigned>(num_kinds));
  relayout_lf_pf_kernel<IndexT, kThreads, kUnroll><<<grid, kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "relayout_lf_pf_kernel launch");
}

}  // namespace kvcacheio
}  // namespace hiserve

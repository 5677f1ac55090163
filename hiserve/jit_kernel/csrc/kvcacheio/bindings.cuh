// Functions the Python side calls (exported through apache-tvm-ffi by
// hiserve/jit_kernel/utils.py). Python checks shapes, dtypes, devices and index placement
// first and raises ValueError; the checks here only guard against memory errors.
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>

#include <algorithm>
#include <vector>

#include "relayout.cuh"
#include "staged_write_back.cuh"
#include "transfer.cuh"

namespace hiserve {
namespace kvcacheio {

using tvm::ffi::TensorView;

inline bool is_int64_index(const TensorView& t, const char* name) {
  const DLDataType dt = t.dtype();
  const bool ok = dt.code == kDLInt && dt.lanes == 1 && (dt.bits == 32 || dt.bits == 64);
  require(ok, std::string(name) + " must be int32 or int64");
  return dt.bits == 64;
}

inline void require_device(const TensorView& t, int device, const char* name) {
  require(t.device().device_type == kDLCUDA && t.device().device_id == device,
          std::string(name) + " must be on the CUDA device of the KV pool");
}

inline void require_host(const TensorView& t, const char* name) {
  const DLDeviceType type = t.device().device_type;
  require(type == kDLCPU || type == kDLCUDAHost, std::string(name) + " must be a host (CPU) tensor");
}

inline char* bytes_of(const TensorView& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace kvcacheio
}  // namespace hiserve

// One chunk of the staged write-back; see staged_write_back.cuh. `order` is a CPU int64
// tensor whose first entries are the operation's pages in staging order (empty: identity). Returns
// path | (copies << 2), path 1 = one cudaMemcpyBatchAsync, 2 = one cudaMemcpyAsync per copy.
int64_t staged_write_back_chunk(tvm::ffi::TensorView layer_ptrs, tvm::ffi::TensorView staging0,
                                tvm::ffi::TensorView staging1, int64_t staging_offset, tvm::ffi::TensorView host0,
                                tvm::ffi::TensorView host1, tvm::ffi::TensorView device_indices,
                                tvm::ffi::TensorView host_indices, tvm::ffi::TensorView order, int64_t position,
                                int64_t num_pages, int64_t page_size, int64_t num_layers, int64_t item_bytes,
                                int64_t num_kinds, int64_t host_slots, int64_t stream, int64_t relayout_stream,
                                int64_t chunk_index, int64_t copy_mode, bool merge_runs) {
  using namespace hiserve::kvcacheio;
  const int device = device_indices.device().device_id;
  require_device(device_indices, device, "device_indices");
  require_device(layer_ptrs, device, "layer pointer table");
  require_device(staging0, device, "staging buffer");
  require_device(staging1, device, "staging buffer");
  require_host(host_indices, "host_indices");
  require_host(order, "page order");
  require_host(host0, "host buffer");
  require_host(host1, "host buffer");
  require(layer_ptrs.numel() == num_kinds * num_layers, "layer pointer table must have num_kinds * num_layers entries");
  require(device_indices.numel() == host_indices.numel(), "device_indices and host_indices differ in length");
  require(page_size > 0 && device_indices.numel() % page_size == 0, "indices are not a whole number of pages");
  const int64_t op_pages = device_indices.numel() / page_size;
  const bool has_order = order.numel() > 0;
  require(!has_order || (order.numel() >= op_pages && order.dtype().code == kDLInt && order.dtype().bits == 64),
          "page order must be int64 with (at least) one entry per page of the operation");
  require(position >= 0 && num_pages >= 0 && position + num_pages <= op_pages, "chunk runs past the operation");
  if (has_order) {
    const int64_t* pages = static_cast<const int64_t*>(order.data_ptr());
    for (int64_t j = position; j < position + num_pages; ++j) {
      require(pages[j] >= 0 && pages[j] < op_pages, "page order names a page outside the operation");
    }
  }
  const int64_t chunk_bytes = num_pages * page_size * num_layers * item_bytes;
  require(staging_offset >= 0 && staging0.numel() * (staging0.dtype().bits / 8) >= staging_offset + chunk_bytes &&
              staging1.numel() * (staging1.dtype().bits / 8) >= staging_offset + chunk_bytes,
          "staging buffer smaller than the chunk");
  require(copy_mode >= kCopyBatchOrFallback && copy_mode <= kCopyBatchStrict, "unknown copy_mode");
  DeviceGuard guard(device);
  return staged_write_back_chunk_impl(
      layer_ptrs.data_ptr(), bytes_of(staging0), bytes_of(staging1), staging_offset, bytes_of(host0), bytes_of(host1),
      device_indices.data_ptr(), is_int64_index(device_indices, "device_indices"), host_indices.data_ptr(),
      is_int64_index(host_indices, "host_indices"), has_order ? static_cast<const int64_t*>(order.data_ptr()) : nullptr,
      position, num_pages, page_size, num_layers, item_bytes, static_cast<int>(num_kinds), host_slots, device,
      reinterpret_cast<cudaStream_t>(stream), reinterpret_cast<cudaStream_t>(relayout_stream), chunk_index, copy_mode,
      merge_runs);
}

// Load-back of layer `layer_id`: host buffer(s) in `layout` -> device layer tensors
// dev0/dev1 [device slots, item], for every token of host_indices / device_indices (both on
// the device).
void transfer_one_layer_h2d(tvm::ffi::TensorView host0, tvm::ffi::TensorView host1, tvm::ffi::TensorView dev0,
                            tvm::ffi::TensorView dev1, tvm::ffi::TensorView host_indices,
                            tvm::ffi::TensorView device_indices, int64_t layout, int64_t layer_id,
                            int64_t num_layers, int64_t host_slots, int64_t page_size, int64_t item_bytes,
                            int64_t num_kinds, int64_t block_quota, int64_t stream) {
  using namespace hiserve::kvcacheio;
  const int device = device_indices.device().device_id;
  require_device(device_indices, device, "device_indices");
  require_device(host_indices, device, "host_indices (for an SM kernel)");
  require_device(dev0, device, "device layer");
  require_device(dev1, device, "device layer");
  require_host(host0, "host buffer");
  require_host(host1, "host buffer");
  require(device_indices.numel() == host_indices.numel(), "device_indices and host_indices differ in length");
  require(layer_id >= 0 && layer_id < num_layers, "layer_id out of range");
  DeviceGuard guard(device);
  const bool dev64 = is_int64_index(device_indices, "device_indices");
  const bool host64 = is_int64_index(host_indices, "host_indices");
  HostAddressing host = make_host_addressing(layout, host_slots, num_layers, page_size, item_bytes);
  host.base[0] = device_accessible(bytes_of(host0), device);
  host.base[1] = device_accessible(bytes_of(host1), device);
  DeviceAddressing dev;
  dev.table = nullptr;
  dev.table_layers = 1;
  dev.ptrs[0] = reinterpret_cast<uint64_t>(dev0.data_ptr());
  dev.ptrs[1] = reinterpret_cast<uint64_t>(dev1.data_ptr());
  with_index_types(dev64, host64, [&](auto dev_tag, auto host_tag) {
    using D = decltype(dev_tag);
    using H = decltype(host_tag);
    TransferParams<D, H> p;
    p.dev = dev;
    p.host = host;
    p.device_indices = static_cast<const D*>(device_indices.data_ptr());
    p.host_indices = static_cast<const H*>(host_indices.data_ptr());
    p.host_layer_offset = static_cast<uint32_t>(layer_id);
    launch_kv_transfer(p, device_indices.numel(), 1, item_bytes, static_cast<int>(num_kinds), false, block_quota,
                       reinterpret_cast<cudaStream_t>(stream));
  });
}

// All-layer write-back by SM threads: device layers (pointer table, kind-major) -> host
// buffer(s) in `layout`, for every token of device_indices / host_indices (both on the device).
void transfer_all_layer_d2h(tvm::ffi::TensorView layer_ptrs, tvm::ffi::TensorView host0, tvm::ffi::TensorView host1,
                            tvm::ffi::TensorView device_indices, tvm::ffi::TensorView host_indices, int64_t layout,
                            int64_t num_layers, int64_t host_slots, int64_t page_size, int64_t item_bytes,
                            int64_t num_kinds, int64_t block_quota, int64_t stream) {
  using namespace hiserve::kvcacheio;
  const int device = device_indices.device().device_id;
  require_device(device_indices, device, "device_indices");
  require_device(host_indices, device, "host_indices (for an SM kernel)");
  require_device(layer_ptrs, device, "layer pointer table");
  require_host(host0, "host buffer");
  require_host(host1, "host buffer");
  require(layer_ptrs.numel() == num_kinds * num_layers, "layer pointer table must have num_kinds * num_layers entries");
  require(device_indices.numel() == host_indices.numel(), "device_indices and host_indices differ in length");
  DeviceGuard guard(device);
  const bool dev64 = is_int64_index(device_indices, "device_indices");
  const bool host64 = is_int64_index(host_indices, "host_indices");
  HostAddressing host = make_host_addressing(layout, host_slots, num_layers, page_size, item_bytes);
  host.base[0] = device_accessible(bytes_of(host0), device);
  host.base[1] = device_accessible(bytes_of(host1), device);
  DeviceAddressing dev;
  dev.table = static_cast<const uint64_t*>(layer_ptrs.data_ptr());
  dev.table_layers = static_cast<uint32_t>(num_layers);
  dev.ptrs[0] = dev.ptrs[1] = 0;
  with_index_types(dev64, host64, [&](auto dev_tag, auto host_tag) {
    using D = decltype(dev_tag);
    using H = decltype(host_tag);
    TransferParams<D, H> p;
    p.dev = dev;
    p.host = host;
    p.device_indices = static_cast<const D*>(device_indices.data_ptr());
    p.host_indices = static_cast<const H*>(host_indices.data_ptr());
    p.host_layer_offset = 0;
    launch_kv_transfer(p, device_indices.numel(), num_layers, item_bytes, static_cast<int>(num_kinds), true,
                       block_quota, reinterpret_cast<cudaStream_t>(stream));
  });
}

// [compiled CUDART_VERSION, runtime version, driver version, cudaMemcpyBatchAsync found (0/1),
//  batched copies usable (0/1), CanUseHostPointerForRegisteredMem of `device` (0/1)]
tvm::ffi::Array<int64_t> batch_copy_info(int64_t device) {
  using namespace hiserve::kvcacheio;
  const BatchCopySupport& s = batch_copy_support();
  return tvm::ffi::Array<int64_t>({static_cast<int64_t>(s.compiled_runtime), static_cast<int64_t>(s.runtime),
                                   static_cast<int64_t>(s.driver), static_cast<int64_t>(s.symbol),
                                   static_cast<int64_t>(s.usable()),
                                   static_cast<int64_t>(can_use_host_pointer(static_cast<int>(device)))});
}

// Checks that every page of `host_indices` (CPU int32/int64, a whole number of pages) is P
// consecutive slots starting at a multiple of P inside [0, host_slots), and orders the pages by
// host slot. Returns -1 - p for the first bad page p; 0 when the pages are already in
// ascending host order (identity: `order` untouched); 1 when `order` (CPU int64, one entry per
// page) now holds the operation's pages in ascending host order.
int64_t plan_host_pages(tvm::ffi::TensorView host_indices, int64_t page_size, int64_t host_slots,
                        tvm::ffi::TensorView order) {
  using namespace hiserve::kvcacheio;
  require_host(host_indices, "host_indices");
  require_host(order, "page order");
  require(page_size > 0 && host_indices.numel() % page_size == 0, "host_indices are not a whole number of pages");
  const bool is64 = is_int64_index(host_indices, "host_indices");
  const void* data = host_indices.data_ptr();
  const int64_t pages = host_indices.numel() / page_size;
  require(order.numel() >= pages && order.dtype().code == kDLInt && order.dtype().bits == 64,
          "page order must be int64 with an entry per page");
  require(host_slots / page_size < (int64_t{1} << 31) && pages < (int64_t{1} << 32), "too many host pages");
  // Key = host page << 32 | operation page: one integer sort, no pairs.
  thread_local std::vector<uint64_t> keys;
  keys.clear();
  bool ascending = true;
  int64_t previous = -1;
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t slot = read_index(data, is64, p * page_size);
    bool run = slot >= 0 && slot % page_size == 0 && slot + page_size <= host_slots;
    for (int64_t t = 1; run && t < page_size; ++t) run = read_index(data, is64, p * page_size + t) == slot + t;
    if (!run) return -1 - p;
    ascending = ascending && slot > previous;
    previous = slot;
    keys.push_back((static_cast<uint64_t>(slot / page_size) << 32) | static_cast<uint64_t>(p));
  }
  if (ascending) return 0;
  std::sort(keys.begin(), keys.end());
  int64_t* out = static_cast<int64_t*>(order.data_ptr());
  for (int64_t p = 0; p < pages; ++p) out[p] = static_cast<int64_t>(keys[p] & 0xffffffffu);
  return 1;
}

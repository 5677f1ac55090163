// Staged write-back, device `layer_first` -> host `page_first`, one chunk per call:
//   1. relayout (relayout.cuh) gathers the chunk's pages into the device staging buffer;
//   2. the copy engine moves each staged page to its host page, on the same stream.
//
// Hop 2 builds one descriptor (dst, src, bytes) per staged page and kind; a run of pages
// whose host pages are consecutive is merged into one descriptor (the staged pages are
// consecutive by construction), so a contiguous host run leaves as one large copy. The
// descriptors are submitted either all at once through cudaMemcpyBatchAsync (CUDA >= 12.8
// runtime and driver, non-legacy stream) or as one cudaMemcpyAsync each.
//
// Host destination indices are read here on the CPU (they must be a CPU tensor): nothing in
// this file waits for the device. The staging buffer of chunk i+1 is overwritten only after
// chunk i's copies have read it, because every step is in stream order (the batched copies
// use cudaMemcpySrcAccessOrderStream).
#pragma once

#include <dlfcn.h>

#include <vector>

#include "common.cuh"
#include "relayout.cuh"

namespace hiserve {
namespace kvcacheio {

// How the copies of hop 2 are submitted.
enum CopyMode : int64_t {
  kCopyBatchOrFallback = 0,  // cudaMemcpyBatchAsync when usable, else one cudaMemcpyAsync per descriptor
  kCopyPerPage = 1,          // always one cudaMemcpyAsync per descriptor
  kCopyBatchStrict = 2,      // cudaMemcpyBatchAsync or an error (tests force the batched path with it)
};

// What a call did, returned to Python: path | (descriptors << 2).
enum CopyPath : int64_t { kPathNone = 0, kPathBatch = 1, kPathPerCopy = 2 };

// ---------------------------------------------------------------- batched copies

#if CUDART_VERSION >= 13000
// CUDA 13: no failIdx, const pointer arrays.
using MemcpyBatchFn = cudaError_t (*)(void* const*, const void* const*, const size_t*, size_t,
                                      cudaMemcpyAttributes*, size_t*, size_t, cudaStream_t);
#elif CUDART_VERSION >= 12080
// CUDA 12.8 - 12.9: failIdx out-parameter before the stream.
using MemcpyBatchFn = cudaError_t (*)(void**, void**, size_t*, size_t, cudaMemcpyAttributes*, size_t*, size_t,
                                      size_t*, cudaStream_t);
#endif

struct BatchCopySupport {
  int compiled_runtime = CUDART_VERSION;
  int runtime = 0;
  int driver = 0;
  bool symbol = false;
#if CUDART_VERSION >= 12080
  MemcpyBatchFn fn = nullptr;
#endif
  bool usable() const { return symbol && runtime >= 12080 && driver >= 12080; }
};

// Resolved once per process. The symbol is looked up in the CUDA runtime this module is
// linked to (found through a function we call directly), so a module built on >= 12.8 still
// loads, and falls back, on an older runtime.
inline const BatchCopySupport& batch_copy_support() {
  static BatchCopySupport support = [] {
    BatchCopySupport s;
    cudaRuntimeGetVersion(&s.runtime);
    cudaDriverGetVersion(&s.driver);
    cudaGetLastError();
#if CUDART_VERSION >= 12080
    Dl_info info;
    void* sym = nullptr;
    if (dladdr(reinterpret_cast<void*>(&cudaRuntimeGetVersion), &info) != 0 && info.dli_fname != nullptr) {
      void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
      if (handle != nullptr) {
        sym = dlsym(handle, "cudaMemcpyBatchAsync");
        dlclose(handle);
      }
    }
    if (sym == nullptr) sym = dlsym(RTLD_DEFAULT, "cudaMemcpyBatchAsync");
    s.fn = reinterpret_cast<MemcpyBatchFn>(sym);
    s.symbol = sym != nullptr;
#endif
    return s;
  }();
  return support;
}

struct CopyList {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  void clear() {
    dst.clear();
    src.clear();
    bytes.clear();
  }
  // Append a copy, extending the last one when both sides continue it.
  void add(void* d, const void* s, size_t n, bool merge) {
    if (merge && !bytes.empty()) {
      char* last_d = static_cast<char*>(dst.back()) + bytes.back();
      const char* last_s = static_cast<const char*>(src.back()) + bytes.back();
      if (last_d == d && last_s == s) {
        bytes.back() += n;
        return;
      }
    }
    dst.push_back(d);
    src.push_back(s);
    bytes.push_back(n);
  }
};

// Returns true when the batch was enqueued; false when the runtime/driver/stream cannot take
// it (the caller falls back). Other errors throw.
inline bool try_copy_batch(CopyList& copies, int device, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  const BatchCopySupport& support = batch_copy_support();
  if (!support.usable() || stream == nullptr /* legacy default stream is refused by the API */) return false;
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeDevice;
  attr.srcLocHint.id = device;
  attr.dstLocHint.type = cudaMemLocationTypeHost;
  attr.dstLocHint.id = 0;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  cudaError_t err = support.fn(copies.dst.data(), copies.src.data(), copies.bytes.data(), copies.bytes.size(), &attr,
                               &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  cudaError_t err = support.fn(copies.dst.data(), const_cast<void**>(copies.src.data()), copies.bytes.data(),
                               copies.bytes.size(), &attr, &attr_index, 1, &fail_index, stream);
#endif
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver || err == cudaErrorInvalidValue) {
    cudaGetLastError();  // clear the sticky-free error so later checks do not see it
    return false;
  }
  check_cuda(err, "cudaMemcpyBatchAsync");
  return false;
#else
  (void)copies;
  (void)device;
  (void)stream;
  return false;
#endif
}

inline void copy_one_by_one(const CopyList& copies, cudaStream_t stream) {
  for (size_t i = 0; i < copies.bytes.size(); ++i) {
    check_cuda(cudaMemcpyAsync(copies.dst[i], copies.src[i], copies.bytes[i], cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (staged page -> host)");
  }
}

// Reads the first host slot of page `page` from a CPU int32/int64 index tensor.
inline int64_t host_page_start(const void* data, bool is_int64, int64_t page, int64_t page_size) {
  const int64_t at = page * page_size;
  return is_int64 ? static_cast<const int64_t*>(data)[at] : static_cast<const int32_t*>(data)[at];
}

// One chunk of the staged write-back (see the file comment).
//   layer_ptrs: uint64 [num_kinds * L] on the device (K layers then V layers, or the MLA layers)
//   staging0/1: device buffers of at least num_pages * P * L * item_bytes bytes (MLA: staging1 unused)
//   host0/1:    page_first host buffers [S, L, ...] of the kinds (pinned / registered)
//   device_indices: device int32/int64, all slots of the operation; host_indices: CPU int32/int64, same length
//   page_begin, num_pages: the chunk, in pages of the operation; host_slots: S of the host buffers
// Returns path | (descriptors << 2).
inline int64_t staged_write_back_chunk_impl(const void* layer_ptrs, char* staging0, char* staging1, char* host0,
                                            char* host1, const void* device_indices, bool device_int64,
                                            const void* host_indices, bool host_int64, int64_t page_begin,
                                            int64_t num_pages, int64_t page_size, int64_t num_layers,
                                            int64_t item_bytes, int num_kinds, int64_t host_slots, int device,
                                            cudaStream_t stream,
                                            int64_t copy_mode, bool merge_runs) {
  if (num_pages <= 0) return kPathNone;
  const int64_t tokens = num_pages * page_size;
  const int64_t first_token = page_begin * page_size;
  const uint64_t* table = static_cast<const uint64_t*>(layer_ptrs);
  if (device_int64) {
    launch_relayout_lf_pf<int64_t>(table, staging0, staging1, static_cast<const int64_t*>(device_indices) + first_token,
                                   tokens, num_layers, item_bytes, num_kinds, device, stream);
  } else {
    launch_relayout_lf_pf<int32_t>(table, staging0, staging1, static_cast<const int32_t*>(device_indices) + first_token,
                                   tokens, num_layers, item_bytes, num_kinds, device, stream);
  }

  const size_t page_bytes = static_cast<size_t>(page_size * num_layers * item_bytes);
  const size_t slot_bytes = static_cast<size_t>(num_layers * item_bytes);
  const bool batch = copy_mode != kCopyPerPage;
  // Where the device cannot use host virtual addresses of registered memory, the batched
  // copies get each page's device alias; pages are then not merged (the aliases of two
  // registrations need not be adjacent).
  const bool translate = batch && !can_use_host_pointer(device);
  thread_local CopyList copies;
  copies.clear();
  char* staging[2] = {staging0, staging1};
  char* host[2] = {host0, host1};
  for (int kind = 0; kind < num_kinds; ++kind) {
    for (int64_t p = 0; p < num_pages; ++p) {
      const int64_t slot = host_page_start(host_indices, host_int64, page_begin + p, page_size);
      require(slot >= 0 && slot % page_size == 0 && slot + page_size <= host_slots,
              "staged write-back: a host page start is not page-aligned or lies outside the host buffer");
      char* dst = host[kind] + static_cast<size_t>(slot) * slot_bytes;
      if (translate) dst = device_alias(dst);
      copies.add(dst, staging[kind] + static_cast<size_t>(p) * page_bytes, page_bytes, merge_runs && !translate);
    }
  }
  const int64_t count = static_cast<int64_t>(copies.bytes.size());
  if (batch && try_copy_batch(copies, device, stream)) return kPathBatch | (count << 2);
  require(copy_mode != kCopyBatchStrict,
          "staged write-back: cudaMemcpyBatchAsync is not usable here (needs CUDA runtime and driver >= 12.8 "
          "and a non-legacy stream)");
  if (translate) {
    // cudaMemcpyAsync takes host virtual addresses and translates them itself.
    copies.clear();
    for (int kind = 0; kind < num_kinds; ++kind) {
      for (int64_t p = 0; p < num_pages; ++p) {
        const int64_t slot = host_page_start(host_indices, host_int64, page_begin + p, page_size);
        copies.add(host[kind] + static_cast<size_t>(slot) * slot_bytes, staging[kind] + static_cast<size_t>(p) * page_bytes,
                   page_bytes, merge_runs);
      }
    }
  }
  copy_one_by_one(copies, stream);
  return kPathPerCopy | (static_cast<int64_t>(copies.bytes.size()) << 2);
}

}  // namespace kvcacheio
}  // namespace hiserve

// Staged write-back, device `layer_first` -> host `page_first`, one chunk per call:
//   1. relayout (relayout.cuh) gathers the chunk's pages into the device staging buffer;
//   2. the copy engine moves each staged page to its host page.
//
// The caller orders the operation's pages by host page, so pages whose host pages are
// consecutive sit in consecutive staged pages; hop 2 builds one descriptor (dst, src, bytes)
// per staged page and kind and merges such runs into one descriptor, so a contiguous host run
// (in any order) leaves as one large copy. The descriptors are submitted either all at once
// through cudaMemcpyBatchAsync (CUDA >= 12.8 runtime and driver, non-legacy stream) or as one
// cudaMemcpyAsync each.
//
// Plain chunks run both hops on one stream: the staging buffer of chunk i+1 is overwritten
// only after chunk i's copies have read it (stream order; the batched copies use
// cudaMemcpySrcAccessOrderStream). Pipelined chunks alternate between two halves of the
// staging buffer and run the relayout on a second stream, chained by events, so the relayout
// of chunk i+1 overlaps the copies of chunk i and the copy engine never waits for it.
//
// Host destination indices are read here on the CPU (they must be a CPU tensor): nothing in
// this file waits for the device.
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

// Events that chain a pipelined write-back: relayout of chunk i (relayout stream) into staging
// half i % 2 waits for the copies of chunk i - 2 (copy stream) that read that half; the copies of
// chunk i wait for its relayout. One set per device and calling thread.
struct PipelineEvents {
  cudaEvent_t start = nullptr;
  cudaEvent_t relayout_done[2] = {nullptr, nullptr};
  cudaEvent_t copy_done[2] = {nullptr, nullptr};
};

inline PipelineEvents& pipeline_events(int device) {
  thread_local std::vector<PipelineEvents> per_device;
  if (static_cast<int>(per_device.size()) <= device) per_device.resize(device + 1);
  PipelineEvents& e = per_device[device];
  if (e.start == nullptr) {
    cudaEvent_t* all[] = {&e.start, &e.relayout_done[0], &e.relayout_done[1], &e.copy_done[0], &e.copy_done[1]};
    for (cudaEvent_t* ev : all) check_cuda(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "cudaEventCreate");
  }
  return e;
}

inline int64_t read_index(const void* data, bool is_int64, int64_t at) {
  return is_int64 ? static_cast<const int64_t*>(data)[at] : static_cast<const int32_t*>(data)[at];
}

// One chunk of the staged write-back (see the file comment).
//   layer_ptrs: uint64 [num_kinds * L] on the device (K layers then V layers, or the MLA layers)
//   staging0/1 + staging_offset: where this chunk's staged pages go (MLA: staging1 unused)
//   host0/1:    page_first host buffers [host_slots, L, ...] of the kinds (pinned / registered)
//   device_indices: device int32/int64, all slots of the operation; host_indices: CPU int32/int64, same length
//   order:      CPU int64 [operation pages], the operation's pages in staging order, or nullptr (identity)
//   position, num_pages: this chunk is order[position .. position + num_pages)
//   relayout_stream: == stream for a plain chunk; another stream to pipeline (chunk_index counts the chunks of
//                    the operation, staging halves alternate by the caller's staging_offset)
// Host page runs are checked here (every page P consecutive slots from a multiple of P, inside the
// buffer) before anything is enqueued. Returns path | (copies << 2).
inline int64_t staged_write_back_chunk_impl(const void* layer_ptrs, char* staging0, char* staging1,
                                            int64_t staging_offset, char* host0, char* host1,
                                            const void* device_indices, bool device_int64, const void* host_indices,
                                            bool host_int64, const int64_t* order, int64_t position,
                                            int64_t num_pages, int64_t page_size, int64_t num_layers,
                                            int64_t item_bytes, int num_kinds, int64_t host_slots, int device,
                                            cudaStream_t stream, cudaStream_t relayout_stream, int64_t chunk_index,
                                            int64_t copy_mode, bool merge_runs) {
  if (num_pages <= 0) return kPathNone;
  require(num_pages <= kMaxRelayoutPages, "staged write-back: at most 256 pages per chunk");
  int32_t page_map[kMaxRelayoutPages];
  int64_t host_start[kMaxRelayoutPages];
  for (int64_t j = 0; j < num_pages; ++j) {
    const int64_t op_page = order != nullptr ? order[position + j] : position + j;
    require(op_page >= 0 && op_page < (int64_t{1} << 31), "staged write-back: page order out of range");
    const int64_t first = op_page * page_size;
    const int64_t slot = read_index(host_indices, host_int64, first);
    bool run = slot >= 0 && slot % page_size == 0 && slot + page_size <= host_slots;
    for (int64_t t = 1; run && t < page_size; ++t) run = read_index(host_indices, host_int64, first + t) == slot + t;
    require(run, "staged write-back: host_indices of operation page " + std::to_string(op_page) +
                     " are not P consecutive slots from a multiple of P inside the host buffer");
    page_map[j] = static_cast<int32_t>(op_page);
    host_start[j] = slot;
  }

  char* staged0 = staging0 + staging_offset;
  char* staged1 = staging1 + staging_offset;
  const bool pipelined = relayout_stream != stream;
  const int half = static_cast<int>(chunk_index & 1);
  PipelineEvents* events = pipelined ? &pipeline_events(device) : nullptr;
  if (pipelined) {
    if (chunk_index == 0) {
      // Everything already queued on the copy stream (the producing forward, earlier write-backs
      // reading either staging half) comes before this operation's relayouts.
      check_cuda(cudaEventRecord(events->start, stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(relayout_stream, events->start, 0), "cudaStreamWaitEvent");
    } else if (chunk_index >= 2) {
      check_cuda(cudaStreamWaitEvent(relayout_stream, events->copy_done[half], 0), "cudaStreamWaitEvent");
    }
  }
  const uint64_t* table = static_cast<const uint64_t*>(layer_ptrs);
  if (device_int64) {
    launch_relayout_lf_pf<int64_t>(table, staged0, staged1, static_cast<const int64_t*>(device_indices), page_map,
                                   num_pages, page_size, num_layers, item_bytes, num_kinds, device, relayout_stream);
  } else {
    launch_relayout_lf_pf<int32_t>(table, staged0, staged1, static_cast<const int32_t*>(device_indices), page_map,
                                   num_pages, page_size, num_layers, item_bytes, num_kinds, device, relayout_stream);
  }
  if (pipelined) {
    check_cuda(cudaEventRecord(events->relayout_done[half], relayout_stream), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream, events->relayout_done[half], 0), "cudaStreamWaitEvent");
  }

  const size_t page_bytes = static_cast<size_t>(page_size * num_layers * item_bytes);
  const size_t slot_bytes = static_cast<size_t>(num_layers * item_bytes);
  const bool batch = copy_mode != kCopyPerPage;
  // Where the device cannot use host virtual addresses of registered memory, the batched
  // copies get each page's device alias; pages are then not merged (the aliases of two
  // registrations need not be adjacent).
  const bool translate = batch && !can_use_host_pointer(device);
  thread_local CopyList copies;
  char* staged[2] = {staged0, staged1};
  char* host[2] = {host0, host1};
  auto build = [&](bool use_alias) {
    copies.clear();
    for (int kind = 0; kind < num_kinds; ++kind) {
      for (int64_t j = 0; j < num_pages; ++j) {
        char* dst = host[kind] + static_cast<size_t>(host_start[j]) * slot_bytes;
        if (use_alias) dst = device_alias(dst);
        copies.add(dst, staged[kind] + static_cast<size_t>(j) * page_bytes, page_bytes, merge_runs && !use_alias);
      }
    }
  };
  build(translate);
  int64_t path = kPathPerCopy;
  if (batch && try_copy_batch(copies, device, stream)) {
    path = kPathBatch;
  } else {
    require(copy_mode != kCopyBatchStrict,
            "staged write-back: cudaMemcpyBatchAsync is not usable here (needs CUDA runtime and driver >= 12.8 "
            "and a non-legacy stream)");
    if (translate) build(false);  // cudaMemcpyAsync takes host virtual addresses and translates them itself
    copy_one_by_one(copies, stream);
  }
  if (pipelined) check_cuda(cudaEventRecord(events->copy_done[half], stream), "cudaEventRecord");
  return path | (static_cast<int64_t>(copies.bytes.size()) << 2);
}

}  // namespace kvcacheio
}  // namespace hiserve

// Shared helpers of the KV-transfer kernels: error checks, fast unsigned division by a
// run-time constant, 16-byte vector loads and stores.
//
// Every kernel here moves whole rows ("items": one token of one layer of one kind, K, V or
// the MLA row) of `item_bytes` bytes, a multiple of 16, as 16-byte vectors. Linear vector
// ids stay below 2^31 (checked on the host before each launch), so index math is 32-bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace hiserve {
namespace kvcacheio {

constexpr int kVecBytes = 16;

// Throws std::runtime_error naming the call and the CUDA error (tvm-ffi turns it into a
// Python RuntimeError).
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::ostringstream os;
    os << what << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")";
    throw std::runtime_error(os.str());
  }
}

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// n / d and n % d for 0 <= n < 2^31 with a divisor fixed at launch: q = (umulhi(n, m) + n) >> s,
// with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1 (m < 2^32; the sum cannot
// overflow because n < 2^31). Three instructions instead of a ~20-instruction division.
struct FastDivmod {
  uint32_t divisor;
  uint32_t multiplier;
  uint32_t shift;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d), multiplier(0), shift(0) {
    require(d >= 1, "FastDivmod: divisor must be >= 1");
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }

  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (__umulhi(n, multiplier) + n) >> shift;
  }
  // quotient returned, remainder in `rem`
  __device__ __forceinline__ uint32_t divmod(uint32_t n, uint32_t& rem) const {
    uint32_t q = div(n);
    rem = n - q * divisor;
    return q;
  }
};

// 16-byte load that does not allocate in L1 (each byte is read once).
__device__ __forceinline__ uint4 load_vec_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// 16-byte load of memory another engine may have written earlier in stream order (host
// memory read over the bus): plain coherent load, no L1 allocation.
__device__ __forceinline__ uint4 load_vec(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void store_vec(void* ptr, uint4 v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Makes `device` current for the scope and restores the caller's device afterwards (the
// caller's framework keeps its own notion of the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

inline int device_sm_count(int device) {
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute(SMs)");
  return count;
}

// Whether device `device` may use the host virtual address of registered (cudaHostRegister)
// memory directly; where it may not, the copy engine needs the device alias of each page.
inline bool can_use_host_pointer(int device) {
  static std::mutex mu;
  static std::vector<int> cache;  // -1 unknown, 0 no, 1 yes
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1, -1);
  if (cache[device] < 0) {
    int value = 0;
    check_cuda(cudaDeviceGetAttribute(&value, cudaDevAttrCanUseHostPointerForRegisteredMem, device),
               "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)");
    cache[device] = value != 0 ? 1 : 0;
  }
  return cache[device] == 1;
}

// Device alias of `host_ptr` (inside pinned or registered host memory).
inline char* device_alias(char* host_ptr) {
  void* alias = nullptr;
  check_cuda(cudaHostGetDevicePointer(&alias, host_ptr, 0),
             "cudaHostGetDevicePointer (host KV buffer must be pinned or cudaHostRegister-ed)");
  return static_cast<char*>(alias);
}

}  // namespace kvcacheio
}  // namespace hiserve

// Host-side plumbing of the CUDA session (session_cuda.cu) and of the bandwidth probe
// (session_bandwidth.cu): a failed CUDA call turned into residentk's 608 naming the call, the
// owners of what a session holds on the device and in pinned host memory (freed on scope exit,
// also when opening throws halfway), and the eager loading of a kernel's module. No kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "algenta/residentk.hpp"
#include "algenta/status_error.hpp"
#include "common.cuh"

namespace algenta {
namespace residentk {
namespace {

// residentk's refusals; any CUDA error is its 608 naming the call (gpu::call_failed clears the
// pending error).
[[noreturn]] inline void refuse(int code, const std::string& msg) {
  gpu::refuse(Family::Resident, code, msg);
}
inline void ck(cudaError_t e, const char* what) {
  gpu::check(Family::Resident, RESIDENT_ERR_LAUNCH_FAILED, e, what);
}
#define CK(call) ck((call), #call)

// A device allocation freed on scope exit (gpu::DeviceBuffer); a failed cudaMalloc is 608.
struct DevMem : gpu::DeviceBuffer {
  void alloc(int64_t bytes, const char* what) { ck(allocate(bytes), what); }
};

// Pinned host memory: copies from and to it are truly asynchronous (a pageable source makes the
// runtime stage it and a pageable destination drains the stream), and they read or write it
// when they run, not when they are enqueued: a slot is rewritten only after the stream that
// reads it was synchronized.
template <class T>
struct Pinned {
  T* p = nullptr;
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (p) cudaFreeHost(p);
  }
  void alloc(int64_t n, const char* what) {
    ck(cudaMallocHost(reinterpret_cast<void**>(&p), size_t(n) * sizeof(T)), what);
  }
};

// The session's non-blocking stream, destroyed with the session (also when opening throws).
struct Stream {
  cudaStream_t s = nullptr;
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
  void create() { ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  operator cudaStream_t() const { return s; }
};

// Loads a kernel's module now (cudaFuncGetAttributes): with lazy loading, CUDA 12's default, a
// kernel's first launch loads it, which must not happen inside a graph capture. A kernel with
// dynamic shared memory also gets the opt-in above 48 KiB, set to the same value (all the
// device allows beside its static arrays) by every session: the attribute is per function and
// process-wide, and a smaller model opened later must not lower it under a larger open session.
template <class F>
void load_kernel(F* fn, const char* what, int optin_smem) {
  const void* f = reinterpret_cast<const void*>(fn);
  cudaFuncAttributes a{};
  ck(cudaFuncGetAttributes(&a, f), what);
  if (optin_smem > 0)
    ck(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            optin_smem - int(a.sharedSizeBytes)),
       what);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

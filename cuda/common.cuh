// What both CUDA families (lossk_*.cu, session_*.cu) share: a failed CUDA call turned into the
// family's status, device memory freed on scope exit, and the block reductions whose order is
// fixed (so their bits do not depend on which thread runs first).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "algenta/status_error.hpp"

namespace algenta {
namespace gpu {

// A failed CUDA call -> StatusError(family, code) naming the call. The pending error is cleared
// first so a later, unrelated call does not report it again (a sticky error such as a device
// fault keeps failing, and keeps saying so).
[[noreturn]] inline void call_failed(Family family, int code, cudaError_t e, const char* what) {
  cudaGetLastError();
  throw StatusError(family, code,
                    std::string("CUDA call failed: ") + what + ": " + cudaGetErrorName(e) + " (" +
                        cudaGetErrorString(e) + ")");
}
// e checked: anything but success is call_failed(family, code, e, what).
inline void check(Family family, int code, cudaError_t e, const char* what) {
  if (e != cudaSuccess) call_failed(family, code, e, what);
}
// A refusal of the caller's request: StatusError(family, code) with the message.
[[noreturn]] inline void refuse(Family family, int code, const std::string& msg) {
  throw StatusError(family, code, msg);
}

// A device allocation freed on scope exit, so a refusal halfway through frees what was taken.
// Never zeroed here: what must start at zero is cleared on the stream that uses it (a cudaMemset
// on the legacy default stream is not ordered before work on a non-blocking stream).
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p) { o.p = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  // At least 16 bytes (a zero-byte request still gets a distinct pointer); the caller turns the
  // result into its family's status.
  cudaError_t allocate(int64_t bytes) {
    if (p) cudaFree(p), p = nullptr;
    return cudaMalloc(&p, size_t(bytes > 0 ? bytes : 16));
  }
  template <class X>
  X* as() const {
    return static_cast<X*>(p);
  }
  float* f() const { return as<float>(); }
};

// ---- global accesses the emulator sees ------------------------------------------------------
// A global load and store as a plain access compiles them (ld.global.ca, st.global.wb), spelled
// with CUDA's cache-hint intrinsics so the emulator's traffic report (cuda/emu/cuda_runtime.h)
// counts the sectors each warp instruction touches; read-only inputs use __ldg. Never for shared
// memory: these are global-space instructions.
template <class T>
__device__ __forceinline__ T ld(const T* p) {
  return __ldca(p);
}
template <class T>
__device__ __forceinline__ void st(T* p, T v) {
  __stwb(p, v);
}

// A read-only load valid only under a condition its caller tests (a bound, a non-null pointer):
// an ordinary load on a device, never __ldg. nvcc takes __ldg (ld.global.nc) for free to run
// speculatively: on sm_90 with nvcc 13.0 it hoisted the logits epilogue's bias loads out of their
// row loop and past their column bound, reading past the end of the bias on an H200
// (compute-sanitizer memcheck; a pointer that was null would have faulted). An ordinary load may
// fault, so the compiler keeps it under its condition. A speculated load moves to where its
// address is already known: out of a loop it does not vary in, or into a select. So an __ldg
// stays only where that cannot reach a bad address: its address varies with the innermost loop
// around it, whose own bound keeps it in range (the matvecs' weight streams, whose loops run
// under row and alignment tests: a loop is never hoisted above its guard), or it is valid
// wherever the kernel runs; a load tested on its own line or invariant in a loop under a
// test is ld_guarded (tests/test_cuda_sources.py catches the plainest breach). The emulator
// counts it as the read-only load it is.
template <class T>
__device__ __forceinline__ T ld_guarded(const T* p) {
#ifdef ALGENTA_CUDA_EMU
  return __ldg(p);
#else
  return *p;
#endif
}

// Names what the host thread's following launches are for in the emulator's traffic report
// (one kernel template serving several jobs); null clears it. Nothing on a device.
inline void launch_label(const char* label) {
#ifdef ALGENTA_CUDA_EMU
  ::algenta_emu::t_launch_label = label;
#else
  (void)label;
#endif
}

// ---- programmatic dependent launch (Hopper) -------------------------------------------------
// A kernel launched with launch(pdl = true, ...) may start while the previous kernel of its
// stream still runs (on sm_90; before it, and in a graph node without a predecessor, the
// attribute orders nothing), so that its launch and its weights' first bytes overlap that
// kernel. Until pdl_wait() returns (the previous grid has completed and its writes are visible)
// such a kernel may only prefetch what no kernel of the step writes (prefetch_l2: weights).
// Every thread calls pdl_wait() before any other global access and before it exits: the next
// kernel's wait orders it after this grid's completion only, so a grid finishing early would
// let it overtake the one before. The emulator enforces both (a PDL launch's thread touching
// global memory or exiting before pdl_wait() fails with the kernel's name); on a device they are
// invisible. pdl_launch_dependents() after the wait lets the next kernel launch: at most two
// kernels of a step in flight, the running one and the next one prefetching.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#elif defined(ALGENTA_CUDA_EMU)
  ::algenta_emu::pdl_waited();
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first PDL_PREFETCH_BYTES of [p, p + bytes) towards L2, one 128-byte line a thread: a
// hint with no architectural effect (nothing on the emulator), sized so the blocks resident on
// an H200 (a few per SM) ask for a few MB of its 50 MB L2 ahead of their first loads.
constexpr int64_t PDL_PREFETCH_BYTES = 16 * 1024;
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
#ifdef __CUDA_ARCH__
  const int64_t off = int64_t(threadIdx.x) * 128;
  if (off < bytes && off < PDL_PREFETCH_BYTES)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + off));
#else
  (void)p, (void)bytes;
#endif
}

// fn<<<grid, block, smem, s>>>(args...), as a programmatic dependent launch when pdl is set
// (cudaLaunchKernelEx with programmatic stream serialization; in a stream capture it becomes a
// programmatic edge of the graph). Errors are left for the caller's cudaGetLastError check.
template <class... P, class... A>
void launch(bool pdl, const char* name, void (*fn)(P...), dim3 grid, dim3 block, size_t smem,
            cudaStream_t s, A&&... args) {
#ifdef ALGENTA_CUDA_EMU
  ::algenta_emu::launch(name, fn, grid, block, smem, s, pdl)(std::forward<A>(args)...);
#else
  (void)name;
  cudaLaunchAttribute at[1] = {};
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&cfg, fn, std::forward<A>(args)...);
#endif
}

// ---- warp and block reductions ------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024) by warp shuffles, then across warps;
// every thread gets the total. red: 32 doubles of shared memory. Two barriers; the caller may
// reuse red afterwards.
__device__ inline double block_sum_d(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_d(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double t = lane < nw ? red[lane] : 0.0;
  t = warp_sum_d(t);
  __syncthreads();  // red is free again once every warp has read it
  return t;
}

// A block of exactly NT threads (a power of two) reduced in a fixed tree through shared memory:
// thread i folds in thread i + s for s = NT/2, ..., 1; every thread gets the result. red: NT
// doubles of shared memory, free again on return.
struct TreeSum {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct TreeMin {
  __device__ double operator()(double a, double b) const { return fmin(a, b); }
};
struct TreeMax {
  __device__ double operator()(double a, double b) const { return fmax(a, b); }
};

template <int NT, class Op>
__device__ double block_tree(double v, double* red, Op op) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = NT / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) red[threadIdx.x] = op(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();
  return r;
}

}  // namespace gpu
}  // namespace algenta

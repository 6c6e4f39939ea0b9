// What the lossk CUDA sources share (lossk_cuda.cu, the fused loss; lossk_seed.cu, the seed's
// materialized kernels): refusals and CUDA errors as lossk statuses, the element types, the data
// checks and the host's device copies.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "algenta/half.hpp"
#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"
#include "algenta/session.hpp"
#include "algenta/status_error.hpp"
#include "common.cuh"

namespace algenta {
namespace lossk {
namespace {

[[noreturn]] inline void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Loss, code, msg);
}

// Any CUDA error -> 591 naming the call (gpu::call_failed clears the pending error).
inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) gpu::call_failed(Family::Loss, LOSS_ERR_DEVICE_FAILED, e, what);
}
#define CK(call) ck((call), #call)

inline void require_device(const char* fn) {
  const residentk::CudaBackend& b = residentk::cuda_backend();
  if (!b.usable)
    refuse(LOSS_ERR_NO_DEVICE, std::string(fn) + ": device='cuda' needs a usable CUDA device: " +
                                   b.why);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

inline unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), 8192)));
}

inline size_t elem_bytes(Dtype e) { return e == Dtype::F64 ? 8 : e == Dtype::F32 ? 4 : 2; }

// ---- element types ------------------------------------------------------------------------------

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

__device__ __forceinline__ float dexp(float x) { return expf(x); }
__device__ __forceinline__ double dexp(double x) { return exp(x); }
__device__ __forceinline__ float dtanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dtanh(double x) { return tanh(x); }
__device__ __forceinline__ float dfma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double dfma(double a, double b, double c) { return fma(a, b, c); }

// float -> bfloat16 with the rounding the CPU backend uses too (algenta/half.hpp): a bf16
// gradient, and the bf16 d_logits the backward products take, are the same bits on both.
__device__ __forceinline__ __nv_bfloat16 to_bf16(float v) {
  const uint16_t b = half::f32_to_bf16(v);
  __nv_bfloat16 h;
  memcpy(&h, &b, 2);
  return h;
}

// A result cell in its output type, stored in global memory: float/double as they are, halves
// rounded to nearest even (as the CPU backend narrows). Spelled gpu::st, as every global access
// of the tile and gradient kernels is gpu::ld/st or __ldg: the emulator's traffic report sees it.
using gpu::ld;
using gpu::st;
__device__ __forceinline__ void put(float* p, float v) { st(p, v); }
__device__ __forceinline__ void put(double* p, double v) { st(p, v); }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { st(p, to_bf16(v)); }
__device__ __forceinline__ void put(__half* p, float v) { st(p, __float2half_rn(v)); }

template <class X>
__device__ __forceinline__ bool finite_el(X x) {
  return isfinite(widen(x));
}

// ---- data checks ------------------------------------------------------------------------------

// Data checks: each sets its flag when any element is bad (the flag's value does not depend on
// which thread saw it first).
template <class X>
__global__ void k_check_finite(const X* p, int64_t n, int* flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    if (!finite_el(p[i])) {
      atomicExch(flag, 1);
      return;
    }
}

// The first scored token (the lowest index: atomicMin) whose target is outside [0, V).
__global__ void k_check_targets(const int64_t* targets, int64_t n, int64_t shift, int64_t seq,
                                bool has_ignore, int64_t ignore, int64_t V,
                                unsigned long long* first_bad) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    if (!math::counted(targets, t, shift, seq, has_ignore, ignore)) continue;
    const int64_t y = targets[t + shift];
    if (y < 0 || y >= V) atomicMin(first_bad, (unsigned long long)t);
  }
}

// Device memory for the host entry points' copies: allocated (591 when it cannot be), filled
// from the host when given one, freed on scope exit.
struct DevBuf : gpu::DeviceBuffer {
  DevBuf() = default;
  explicit DevBuf(size_t bytes) { CK(allocate(int64_t(bytes))); }
  DevBuf(const void* host, size_t bytes) : DevBuf(bytes) {
    if (host) CK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  }
};

inline void to_host(void* dst, const void* src, size_t bytes) {
  if (dst && src) CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace
}  // namespace lossk
}  // namespace algenta

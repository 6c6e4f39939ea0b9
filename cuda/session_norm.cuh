// RMSNorm on the device: y = w * (x * 1/sqrt(mean(x^2) + eps)) over one D-row by a whole block,
// as the block-level helpers the fused stages call (k_norm_qkv and k_norm_gateup norm their
// input as they stage it, k_out_norm_residual norms a sublayer's output onto the residual) and
// as its own launch (k_rmsnorm_rows: the final norm; prefill's input and post norms).
//
// Numerics: the squares are summed in double (a block reduction in a fixed order: gpu::
// block_sum_d, so the bits do not depend on which thread runs first) and the inverse rounded to
// float once (session_math::rms_inv); each element is then session_math::rms_apply, the CPU
// engine's arithmetic. x and w are only read.
// Limits: blockDim.x a multiple of 32, at most 1024 (block_sum_d).
#pragma once

#include "session_device.cuh"

namespace algenta {
namespace residentk {
namespace {

// RMSNorm's inverse of x (n) by the whole block (every thread gets it): squares summed in
// double, the inverse rounded to float once.
__device__ float block_rms_inv(const float* __restrict__ x, int64_t n, double eps) {
  __shared__ double red[32];
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = __ldg(x + i);
    ss += v * v;
  }
  ss = block_sum_d(ss, red);
  return session_math::rms_inv(ss, n, eps);
}

// dst (n) = w (n) * (x (n) * 1/sqrt(mean(x^2) + eps)), by the whole block; dst in global memory
// (kGlobalDst) or shared. Squares summed in double (as the CPU engine), the inverse rounded to
// float once. x and w are read-only here. Ends with a barrier (dst complete for the block).
template <bool kGlobalDst>
__device__ void block_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, int64_t n,
                              double eps, float* dst) {
  const float inv = block_rms_inv(x, n, eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float y = session_math::rms_apply(__ldg(x + i), __ldg(w + i), inv);
    if (kGlobalDst)
      st(dst + i, y);
    else
      dst[i] = y;
  }
  __syncthreads();
}

// Y (M, D) row r = rmsnorm(X row r) * w. grid M, ROW_THREADS.
__global__ void k_rmsnorm_rows(const float* __restrict__ X /* (M, D) */,
                               const float* __restrict__ w /* (D) */, int64_t D, double eps,
                               float* __restrict__ Y /* (M, D) */) {
  step_begin();
  const int64_t r = blockIdx.x;
  block_rmsnorm<true>(X + r * D, w, D, eps, Y + r * D);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

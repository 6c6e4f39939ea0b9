// The input vector of a decode matvec, staged in shared memory as the weight format's products
// consume it: the rule the CPU engine applies to its activations (session_cpu.hpp,
// ActScratch::prepare) and prefill applies to its rows (k_round_bf16, k_quantize_rows):
//   f32, f16  the float32 values as they are;
//   bf16      each value rounded to bf16 in place (half.hpp; a product of two bf16 values is
//             exact in float32);
//   int8      each block of 32 quantized (quant::q8_block: codes and one scale a block) beside
//             the float32 values, for Q8_0 x Q8_0 products (session_matvec.cuh).
// A row kernel stages up to R such vectors, stage_stride(K, F) bytes apart, normed on the way
// in where its stage has a norm (stage_rows): the normed vector is never written to global
// memory, each block rebuilds it (K floats) instead of a launch of its own.
//
// Layout of a block's dynamic shared memory (stage_bytes(K, F), session_cuda_plan.hpp): x (K
// floats, padded to whole float4), then for int8 the codes q (K, padded to 16 bytes) and the
// block scales s (ceil(K / 32)).
// Limits: K * R within the plan's staged-bytes tier (checked when the session opens).
#pragma once

#include "session_device.cuh"
#include "session_norm.cuh"

namespace algenta {
namespace residentk {
namespace {

// ---- the staged input vector ------------------------------------------------------------------
// A matvec kernel's dynamic shared memory (stage_bytes(K, F)): the K-vector in float32, padded to
// whole float4; for int8 then its codes (padded to 16 bytes) and block scales.
struct Staged {
  float* x;
  int8_t* q;
  float* s;
};
__device__ __forceinline__ Staged staged(float4* smem, int64_t K) {
  float* x = reinterpret_cast<float*>(smem);
  int8_t* q = reinterpret_cast<int8_t*>(x + 4 * ceil_div(K, 4));
  return Staged{x, q, reinterpret_cast<float*>(q + 16 * ceil_div(K, 16))};
}
// The row kernels stage one vector a row, stride bytes apart (stage_stride(K, F)).
__device__ __forceinline__ Staged staged_row(const Staged& v0, int64_t stride, int b) {
  const int64_t f = b * (stride / 4);
  return Staged{v0.x + f, v0.q + b * stride, v0.s + f};
}

// Once v.x holds the K-vector (after a barrier): the vector as F's products consume it, the CPU
// engine's rule: bf16 rounds each value to bf16 in place (half.hpp); int8 quantizes each block
// of 32 (quant::q8_block, one thread a block) into v.q and v.s; then a barrier. f32, f16:
// nothing (the branch is the same for every thread of the block).
template <Dtype F>
__device__ void consume(const Staged& v, int64_t K) {
  if (F == Dtype::BF16) {
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x)
      v.x[i] = half::bf16_to_f32(half::f32_to_bf16(v.x[i]));
    __syncthreads();
  } else if (F == Dtype::Int8) {
    const int64_t nb = ceil_div(K, RESIDENT_INT8_BLOCK);
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
      const int64_t k0 = b * RESIDENT_INT8_BLOCK;
      v.s[b] = quant::q8_block(v.x + k0, min(RESIDENT_INT8_BLOCK, K - k0), v.q + k0);
    }
    __syncthreads();
  }
}

// Copy v (n, read-only here) global -> shared by the whole block, then a barrier.
__device__ __forceinline__ void stage(const float* __restrict__ v, int64_t n, float* s) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s[i] = __ldg(v + i);
  __syncthreads();
}

// A row kernel's pass of rows of X (M, K) staged from v on, stride bytes apart, as F's
// products consume them: each row RMSNormed by nw (sum of squares in double, as block_rmsnorm)
// where nw is given, else copied as it is.
template <Dtype F>
__device__ void stage_rows(const float* __restrict__ X, const float* __restrict__ nw, int64_t K,
                           double eps, const Staged& v, int64_t stride, const PassRows& pr) {
  for (int b = 0; b < pr.nrows; ++b) {
    const Staged vb = staged_row(v, stride, b);
    if (nw)
      block_rmsnorm<false>(X + (pr.m0 + b) * K, nw, K, eps, vb.x);
    else
      stage(X + (pr.m0 + b) * K, K, vb.x);
    consume<F>(vb, K);
  }
}

// A row kernel's opening once its weights' first bytes are asked of L2 (prefetch_rows): the wait
// for the kernel before (step_begin), then blockIdx.y's pass of rows of X (M, K) staged from smem
// on (normed by nw where given) as F's products consume them.
struct RowPass {
  PassRows pr;     // the launch's rows this block stages
  int64_t stride;  // bytes from one staged row to the next (stage_stride(K, F))
  Staged v;        // the first staged row
};
template <Dtype F>
__device__ __forceinline__ RowPass begin_pass(float4* smem, const float* __restrict__ X,
                                              const float* __restrict__ nw, int64_t K,
                                              double eps, int64_t M, int nr) {
  step_begin();
  const RowPass p{pass_rows(M, nr), stage_stride(K, F), staged(smem, K)};
  stage_rows<F>(X, nw, K, eps, p.v, p.stride, p.pr);
  return p;
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

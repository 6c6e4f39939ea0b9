// Attention's inputs, decode stages 1 and 2 of a layer:
//   k_norm_qkv      qkv (M, Q) = Wqkv (Q, D) . rmsnorm(x), a row kernel (session_matvec.cuh)
//                   whose blocks each norm and stage x themselves (the normed x never exists in
//                   global memory, no launch of its own);
//   k_qk_norm_rope  in place on qkv: the family's q/k/v bias, per-head q/k RMSNorm, rotate-half
//                   RoPE at the row's position, and the k and v heads written into the row's KV
//                   slot in the cache's format: four element-wise passes in one launch, a head a
//                   block, each thread owning its rotation pair.
// Numerics: the norm's squares summed in double and its inverse rounded once (session_norm.cuh),
// RoPE from the host-built table (session_weights.hpp: double angles rounded once), a 16-bit KV
// cache rounding each value once as it is written (session_math::kv_narrow): the CPU engine's
// arithmetic, element for element.
// Limits: Dh even or 1 (a head of one element has no rotation pair); positions below T.
#pragma once

#include "session_matvec.cuh"

namespace algenta {
namespace residentk {
namespace {

// Y (M, N) = rmsnorm(X (M, K)) * nw . W (N, K)^T.
template <Dtype F, int R>
__global__ void k_norm_qkv(DevMat W /* (N, K) */, const float* __restrict__ X /* (M, K) */,
                           const float* __restrict__ nw /* (K) */, int64_t K, int64_t N,
                           double eps, int64_t rows_per_block, int split, int64_t M, int nr,
                           float* __restrict__ Y /* (M, N) */) {
  row_matvec<F, R>(W, X, nw, eps, K, N, rows_per_block, split, M, nr,
                   [&](const PassRows& pr, int64_t r, int b, float2 d) {
                     st(Y + (pr.m0 + b) * N + r, d.x);
                   });
}

// In place on qkv (M, Q): every head first gets its bias where the family has one (bias (Q),
// else null); q heads and k heads then get per-head RMSNorm (q_norm / k_norm; skipped when
// qn is null, a family without them) and rotate-half RoPE at the row's position P from this
// layer's table; k and v heads are then written to position P of the row's slot (its region
// slot_stride elements after the previous slot's). grid (Hq + 2*Hkv, M),
// plan.norm_rope_threads threads; thread i owns the pair (i, i + Dh/2), so it reads and writes
// only its own two elements after the norm's reduction.
template <Dtype KV>
__global__ void k_qk_norm_rope(float* __restrict__ qkv /* (M, Q) */, int64_t Q,
                               const float* __restrict__ bias /* (Q) or null */,
                               const float* __restrict__ qn /* (Dh) or null */,
                               const float* __restrict__ kn /* (Dh) or null */,
                               const float* __restrict__ rope /* cos (T, Dh/2), sin (T, Dh/2) */,
                               const StepRow* __restrict__ rows, int64_t Hq, int64_t Hkv,
                               int64_t Dh, int64_t T, double eps, int64_t slot_stride,
                               void* __restrict__ Kc /* (Hkv, T, Dh) of KV, slot 0 */,
                               void* __restrict__ Vc /* (Hkv, T, Dh) of KV, slot 0 */) {
  __shared__ double red[32];
  step_begin();
  const int64_t h = blockIdx.x, row = blockIdx.y;
  const int64_t p = ld(&rows[row].pos);
  float* v = qkv + row * Q + h * Dh;
  const int64_t half = Dh / 2;
  if (bias) {  // the same for every thread of the block: the barrier is reached by all
    for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x)
      st(v + i, ld(v + i) + gpu::ld_guarded(bias + h * Dh + i));
    __syncthreads();
  }
  if (h < Hq + Hkv) {
    const float* w = h < Hq ? qn : kn;
    float inv = 1.f;
    if (w) {
      double ss = 0.0;
      for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x) {
        const double e = ld(v + i);
        ss += e * e;
      }
      ss = block_sum_d(ss, red);  // its barriers also order every read of v before the writes
      inv = session_math::rms_inv(ss, Dh, eps);
    }
    const auto normed = [&](int64_t i) {
      return w ? session_math::rms_apply(ld(v + i), gpu::ld_guarded(w + i), inv) : ld(v + i);
    };
    if (half == 0) {  // Dh == 1: no rotation pair exists
      if (threadIdx.x == 0) st(v, normed(0));
    }
    const float* cs = rope + p * (half > 0 ? half : 1);
    const float* sn = cs + T * (half > 0 ? half : 1);
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const float a = normed(i);
      const float b = normed(i + half);
      float ra, rb;
      session_math::rope_pair(a, b, __ldg(cs + i), __ldg(sn + i), &ra, &rb);
      st(v + i, ra);
      st(v + i + half, rb);
    }
    __syncthreads();
  }
  if (h >= Hq) {
    const int64_t g = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
    void* dst = h < Hq + Hkv ? Kc : Vc;
    const int64_t at = ld(&rows[row].slot) * slot_stride + (g * T + p) * Dh;
    for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x) kv_store<KV>(dst, at + i, ld(v + i));
  }
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

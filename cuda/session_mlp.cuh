// The MLP's gate, act(g + bg) * (u + bu) with act silu or gelu-tanh as the family computes it
// (session_math::silu_mul / gelu_tanh_mul, the CPU engine's CpuSession::gate), biases where the
// family has them:
//   k_norm_gateup  decode stage 5, a row kernel (session_matvec.cuh): rmsnorm(x) staged by each
//                  block, and the warp that owns weight row j forms gate j and up j in one pass
//                  over the staged rows and writes only act j: gate and up never exist apart,
//                  nor the normed x;
//   k_gate_act     prefill's element-wise gate over the GEMMs' gate and up rows.
// Numerics: both call gate_act, so an element's activation is the same arithmetic on either path.
#pragma once

#include "session_matvec.cuh"

namespace algenta {
namespace residentk {
namespace {

// The MLP gate of one element: act(g + bg) * (u + bu) (biases where the family has them),
// silu or gelu-tanh as the family computes it; the CPU engine's CpuSession::gate.
__device__ __forceinline__ float gate_act(float g, float u, const float* __restrict__ gb,
                                          const float* __restrict__ ub, int64_t j, bool gelu) {
  if (gb) g += gpu::ld_guarded(gb + j), u += gpu::ld_guarded(ub + j);
  return gelu ? session_math::gelu_tanh_mul(g, u) : session_math::silu_mul(g, u);
}

// Act (M, Fd) = act(Xn Wg^T + bg) * (Xn Wu^T + bu), Xn = rmsnorm(X (M, D)) * nw staged in
// shared memory. The warp owning weight row j forms gate j and up j together and writes only
// act j.
template <Dtype F, int R>
__global__ void k_norm_gateup(DevMat Wg /* (Fd, D) */, DevMat Wu /* (Fd, D) */,
                              const float* __restrict__ X /* (M, D) */,
                              const float* __restrict__ nw /* (D) */, int64_t D, int64_t Fd,
                              double eps, int64_t rows_per_block, int split,
                              const float* __restrict__ gb /* (Fd) or null */,
                              const float* __restrict__ ub /* (Fd) or null */, bool gelu,
                              int64_t M, int nr, float* __restrict__ Act /* (M, Fd) */) {
  extern __shared__ float4 smem4[];
  const RowRange rows = block_rows(rows_per_block, Fd);
  prefetch_rows<F>(Wg, rows, D);
  prefetch_rows<F>(Wu, rows, D);
  const RowPass p = begin_pass<F>(smem4, X, nw, D, eps, M, nr);
  for_rows<R>(
      rows_per_block, Fd, D, split, p.pr.nrows,
      [&](int64_t r, int64_t k0, int64_t k1, float2 (&d)[R]) {
        const int lane = threadIdx.x & 31;
        float g[R], u[R];
        warp_dot_rows<F, R>(Wg, r, p.v, p.stride, p.pr.nrows, D, lane, k0, k1, g);
        warp_dot_rows<F, R>(Wu, r, p.v, p.stride, p.pr.nrows, D, lane, k0, k1, u);
        for (int b = 0; b < R; ++b) d[b] = make_float2(g[b], u[b]);
      },
      [&](int64_t r, int b, float2 gu) {
        st(Act + (p.pr.m0 + b) * Fd + r, gate_act(gu.x, gu.y, gb, ub, r, gelu));
      });
}

// g (M, Fd) = act(g + bg) * (u + bu), elementwise (prefill's MLP activation, gate_act).
__global__ void k_gate_act(float* __restrict__ g /* (M, Fd) */,
                           const float* __restrict__ u /* (M, Fd) */, int64_t n /* M * Fd */,
                           int64_t Fd, const float* __restrict__ gb /* (Fd) or null */,
                           const float* __restrict__ ub /* (Fd) or null */, bool gelu) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) g[i] = gate_act(g[i], u[i], gb, ub, i % Fd, gelu);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

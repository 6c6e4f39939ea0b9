// What lands on the residual stream x (M, D) after each sublayer:
//   k_matvec_residual    decode stages 4 and 6: x += W (D, K) . a (o_proj over attention's
//                        output, down over the MLP's act), a row kernel (session_matvec.cuh)
//                        whose epilogue adds the family's bias and writes the cell in place:
//                        each cell of x read and written by the one warp owning its weight row,
//                        no atomics; for a sandwich family (Gemma 2/3) the sum goes to y instead;
//   k_out_norm_residual  a sandwich family's x += rmsnorm(y) * w (session_norm.cuh's inverse);
//   k_bias_residual      prefill's epilogue after a GEMM into y: x += y + b, or y += b for a
//                        sandwich family (k_out_norm_residual follows).
// Never materialized: a decode projection's output apart from x where the family adds nothing
// (it accumulates in place).
#pragma once

#include "session_matvec.cuh"
#include "session_norm.cuh"

namespace algenta {
namespace residentk {
namespace {

// X (M, N) += A (M, K) W (N, K)^T (+ bias b where given). With Y given (a sandwich family) the
// sum goes to Y instead, for k_out_norm_residual. Cell (m, n) of X is read and written only by
// the warp that owns weight row n: no atomics.
template <Dtype F, int R>
__global__ void k_matvec_residual(DevMat W /* (N, K) */, const float* __restrict__ A /* (M, K) */,
                                  int64_t K, int64_t N, int64_t rows_per_block, int split,
                                  const float* __restrict__ b /* (N) or null */, int64_t M, int nr,
                                  float* __restrict__ Y /* (M, N) or null */,
                                  float* __restrict__ X /* (M, N) */) {
  row_matvec<F, R>(W, A, nullptr, 0.0, K, N, rows_per_block, split, M, nr,
                   [&](const PassRows& pr, int64_t r, int i, float2 d) {
                     const float o = b ? d.x + gpu::ld_guarded(b + r) : d.x;
                     const int64_t at = (pr.m0 + i) * N + r;
                     if (Y)
                       st(Y + at, o);
                     else
                       st(X + at, ld(X + at) + o);
                   });
}

// X (M, D) row r += rmsnorm(Y row r) * w: a sandwich family's norm of a sublayer's output,
// then the residual add (the CPU engine's out_norm_add). grid M, ROW_THREADS.
__global__ void k_out_norm_residual(float* __restrict__ X /* (M, D) */,
                                    const float* __restrict__ Y /* (M, D) */,
                                    const float* __restrict__ w /* (D) */, int64_t D, double eps) {
  step_begin();
  const int64_t r = blockIdx.x;
  const float* y = Y + r * D;
  const float inv = block_rms_inv(y, D, eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    st(X + r * D + i, ld(X + r * D + i) + session_math::rms_apply(ld(y + i), __ldg(w + i), inv));
}

// Prefill's X (M, D) += Y + b elementwise (a bias, no sandwich), or Y += b (a sandwich family:
// k_out_norm_residual follows); decode's k_matvec_residual epilogue, row by row.
// grid ceil(M * D / ROW_THREADS).
__global__ void k_bias_residual(float* __restrict__ X /* (M, D) */,
                                float* __restrict__ Y /* (M, D) */,
                                const float* __restrict__ b /* (D) or null */, int64_t M,
                                int64_t D, bool sandwich) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * D) return;
  const float o = b ? ld(Y + i) + gpu::ld_guarded(b + i % D) : ld(Y + i);
  if (sandwich)
    st(Y + i, o);
  else
    st(X + i, ld(X + i) + o);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

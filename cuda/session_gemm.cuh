// Prefill's products Y (M, N) (+)= X (M, K) . W (N, K)^T on CUDA cores, for a session of one
// slot (a block of M <= PREFILL_BLOCK tokens a layer), and the rounding of its activation rows:
//   k_gemm_narrow  M < 32: one weight row a warp, read once for NARROW_ROWS activation rows;
//   k_gemm_wide    64 x 64 tiles through shared memory, 4 x 4 outputs a thread, K in BK slices;
//   k_round_bf16   X rounded to bf16 in place, as decode's staged vector is (consume<BF16>), so
//                  a prompt multiplies the same values whether prefilled or stepped.
// Which tile runs is residentk_prefill_gemm_use_narrow_tile's choice (prefill_gemm_grid); bf16
// weights on the wide tile take lossk's tensor-core tile GEMM instead (session_cuda_prefill.cuh)
// and int8 weights k_gemm_q8 (session_gemm_q8.cuh) at every M.
// Numerics: W's elements widened exactly to float32 (w_at) as they are loaded, X as consumed,
// float32 multiply-adds in k order per cell. A cell's sum is not formed in decode's order (a
// session of several slots prefills through decode's row kernels instead, for batch invariance).
// Never materialized: a widened copy of W (each tile widens what it stages).
#pragma once

#include "session_device.cuh"

namespace algenta {
namespace residentk {
namespace {

// Y (M, N) (+)= X (M, K) . W (N, K)^T for M < 32: one weight row per warp, read once per
// NARROW_ROWS activation rows (<= 4 passes), the accumulators a compile-time-indexed array; W's
// elements widened to float32 (w_at), X already as consumed (k_round_bf16 for bf16).
// grid plan matvec launch over N rows.
template <Dtype F>
__global__ void k_gemm_narrow(const float* __restrict__ X /* (M, K) */, DevMat W /* (N, K) */,
                              float* __restrict__ Y /* (M, N) */, int64_t M, int64_t N, int64_t K,
                              int64_t rows_per_block, bool accumulate) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  for (int64_t n = r0 + warp; n < r1; n += MATVEC_WARPS) {
    for (int64_t m0 = 0; m0 < M; m0 += NARROW_ROWS) {
      float acc[NARROW_ROWS];
#pragma unroll
      for (int i = 0; i < NARROW_ROWS; ++i) acc[i] = 0.f;
      for (int64_t k = lane; k < K; k += 32) {
        const float wk = w_at<F>(W, n, K, k);
#pragma unroll
        for (int i = 0; i < NARROW_ROWS; ++i)
          if (m0 + i < M) acc[i] = fmaf(wk, X[(m0 + i) * K + k], acc[i]);
      }
#pragma unroll
      for (int i = 0; i < NARROW_ROWS; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && m0 + i < M) {
          float* y = Y + (m0 + i) * N + n;
          *y = accumulate ? *y + v : v;
        }
      }
    }
  }
}

// A thread's 4 x 4 outputs of a prefill GEMM tile, rows m.., columns n.., into Y (M, N) (added
// to what Y holds with accumulate); cells outside Y are not stored.
__device__ __forceinline__ void store_tile(const float (&acc)[4][4], float* __restrict__ Y,
                                           int64_t M, int64_t N, int64_t m, int64_t n,
                                           bool accumulate) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (m + i < M && n + j < N) {
        float* y = Y + (m + i) * N + n + j;
        st(y, accumulate ? ld(y) + acc[i][j] : acc[i][j]);
      }
}

// Y (M, N) (+)= X (M, K) . W (N, K)^T, 64 x 64 tiles through shared memory, 4 x 4 outputs per
// thread, K in BK = 16 slices; out-of-range cells load zeros and are not stored. W's elements
// widened to float32 as they are staged (w_at), X already as consumed (k_round_bf16 for bf16).
// grid (ceil(N / 64), ceil(M / 64)), GEMM_THREADS.
template <Dtype F>
__global__ void __launch_bounds__(GEMM_THREADS)
k_gemm_wide(const float* __restrict__ X /* (M, K) */, DevMat W /* (N, K) */,
            float* __restrict__ Y /* (M, N) */, int64_t M, int64_t N, int64_t K, bool accumulate) {
  // +4 floats per row: the transposed stores (k-major) then spread over banks.
  __shared__ float As[GEMM_BK][GEMM_BM + 4];
  __shared__ float Bs[GEMM_BK][GEMM_BN + 4];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t m0 = int64_t(blockIdx.y) * GEMM_BM, n0 = int64_t(blockIdx.x) * GEMM_BN;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += GEMM_BK) {
#pragma unroll
    for (int t = 0; t < (GEMM_BM * GEMM_BK) / GEMM_THREADS; ++t) {
      const int idx = tid + t * GEMM_THREADS, r = idx / GEMM_BK, kk = idx % GEMM_BK;
      const int64_t k = k0 + kk;
      As[kk][r] = (m0 + r < M && k < K) ? X[(m0 + r) * K + k] : 0.f;
      Bs[kk][r] = (n0 + r < N && k < K) ? w_at<F>(W, n0 + r, K, k) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i], b[i] = Bs[kk][tx * 4 + i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  store_tile(acc, Y, M, N, m0 + ty * 4, n0 + tx * 4, accumulate);
}

// X (M, K), in place, rounded to bf16 as a decode step's products consume a vector
// (consume<BF16>), so a prompt multiplies the same values whether prefilled or stepped.
// grid (ceil(K / ROW_THREADS), M).
__global__ void k_round_bf16(float* __restrict__ X /* (M, K) */, int64_t K) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  float* x = X + int64_t(blockIdx.y) * K + i;
  st(x, half::bf16_to_f32(half::f32_to_bf16(ld(x))));
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

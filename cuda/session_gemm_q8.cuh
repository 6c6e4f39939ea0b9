// Prefill's int8 path, decode's Q8_0 x Q8_0 products as a GEMM:
//   k_quantize_rows  X (M, K) quantized by quant::q8_block a block of 32 at a time, the rule
//                    decode's staged vector follows (consume<Int8>);
//   k_gemm_q8        Y (M, N) (+)= Xq . W^T, each block's 32 code products summed exactly in
//                    int32 (dp4a), entering float32 once as float(sum) * (sw * sx), blocks in
//                    order; 64 x 64 tiles, 4 x 4 outputs a thread.
// Never materialized: the weights or the activations widened to float32.
// Limits: the codes' rows ldq (a multiple of 32) bytes apart, zero past K; W's rows are K bytes
// apart, so a 4-byte word load only where K % 4 == 0 (else byte by byte).
#pragma once

#include "session_device.cuh"
#include "session_gemm.cuh"

namespace algenta {
namespace residentk {
namespace {

// X (M, K) quantized as decode's consume<Int8> quantizes a vector: each block of 32 of a row by
// quant::q8_block into its codes Xq (M, ldq; bytes past K zero) and scale Xs (M, ldq / 32).
// grid (ceil(ldq / 32 / ROW_THREADS), M), one thread a block.
__global__ void k_quantize_rows(const float* __restrict__ X /* (M, K) */, int64_t K, int64_t ldq,
                                int8_t* __restrict__ Xq /* (M, ldq) */,
                                float* __restrict__ Xs /* (M, ldq / 32) */) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nb = ldq / RESIDENT_INT8_BLOCK, r = blockIdx.y, k0 = b * RESIDENT_INT8_BLOCK;
  if (b >= nb) return;
  const int64_t n = k0 < K ? min(RESIDENT_INT8_BLOCK, K - k0) : 0;
  float x[RESIDENT_INT8_BLOCK];
  int8_t q[RESIDENT_INT8_BLOCK];
  for (int64_t i = 0; i < n; ++i) x[i] = ld(X + r * K + k0 + i);
  for (int64_t i = n; i < RESIDENT_INT8_BLOCK; ++i) q[i] = 0;
  const float s = n > 0 ? quant::q8_block(x, n, q) : 0.f;
  int* dst = reinterpret_cast<int*>(Xq + r * ldq + k0);  // ldq % 32 == 0: word-aligned
  for (int w = 0; w < RESIDENT_INT8_BLOCK / 4; ++w) {
    int v;
    memcpy(&v, q + 4 * w, 4);
    st(dst + w, v);
  }
  st(Xs + r * nb + b, s);
}

// Y (M, N) (+)= Q8_0 x Q8_0 of X (codes Xq (M, ldq), scales Xs (M, ldq / 32): k_quantize_rows)
// and W (int8 rows (N, K), scales (N, ceil(K / 32))): per output, each block's 32 products summed
// exactly in int32 (dp4a), entering float32 once as float(sum) * (sw * sx), blocks in order; the
// products decode's warp_dot_rows<Int8, R> forms. 64 x 64 tiles, 4 x 4 outputs a thread, a block
// of 32 along K a step. grid (ceil(N / 64), ceil(M / 64)), GEMM_THREADS.
__global__ void __launch_bounds__(GEMM_THREADS)
k_gemm_q8(const int8_t* __restrict__ Xq /* (M, ldq) */, int64_t ldq,
          const float* __restrict__ Xs /* (M, ldq / 32) */, DevMat W /* (N, K) int8 */,
          float* __restrict__ Y /* (M, N) */, int64_t M, int64_t N, int64_t K, bool accumulate) {
  constexpr int WORDS = RESIDENT_INT8_BLOCK / 4;  // 8 words of 4 codes a row's block
  __shared__ int As[GEMM_BM][WORDS + 1];  // +1: a row's words spread over the banks
  __shared__ int Bs[GEMM_BN][WORDS + 1];
  __shared__ float sa[GEMM_BM];
  __shared__ float sb[GEMM_BN];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t m0 = int64_t(blockIdx.y) * GEMM_BM, n0 = int64_t(blockIdx.x) * GEMM_BN;
  const int8_t* Wq = static_cast<const int8_t*>(W.w);
  const int64_t nb = ceil_div(K, RESIDENT_INT8_BLOCK), nbx = ldq / RESIDENT_INT8_BLOCK;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * RESIDENT_INT8_BLOCK;
    for (int t = tid; t < GEMM_BM * WORDS; t += GEMM_THREADS) {
      const int r = t / WORDS, w = t % WORDS;
      const int64_t m = m0 + r, n = n0 + r, k = k0 + 4 * w;
      As[r][w] = m < M ? ld(reinterpret_cast<const int*>(Xq + m * ldq + k0) + w) : 0;
      int v = 0;  // W's rows are K bytes apart: a word load only where it is aligned and whole
      if (n < N && k < K) {
        const int8_t* p = Wq + n * K + k;
        if ((K & 3) == 0) {
          v = gpu::ld_guarded(reinterpret_cast<const int*>(p));
        } else {
          for (int e = 0; e < 4 && k + e < K; ++e)
            v |= int(uint8_t(gpu::ld_guarded(p + e))) << (8 * e);
        }
      }
      Bs[r][w] = v;
    }
    if (tid < GEMM_BM)
      sa[tid] = m0 + tid < M ? ld(Xs + (m0 + tid) * nbx + b) : 0.f;
    else if (tid < GEMM_BM + GEMM_BN)
      sb[tid - GEMM_BM] =
          n0 + tid - GEMM_BM < N ? gpu::ld_guarded(W.s + (n0 + tid - GEMM_BM) * nb + b) : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int isum = 0;
#pragma unroll
        for (int w = 0; w < WORDS; ++w) isum = __dp4a(As[ty * 4 + i][w], Bs[tx * 4 + j][w], isum);
        acc[i][j] = fmaf(float(isum), sb[tx * 4 + j] * sa[ty * 4 + i], acc[i][j]);
      }
    __syncthreads();
  }
  store_tile(acc, Y, M, N, m0 + ty * 4, n0 + tx * 4, accumulate);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

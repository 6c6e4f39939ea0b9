// The CUDA resident session's device code: the decode and prefill kernels session_cuda.cu
// launches (see its header for the stage list, the numerics and the limits), and the control
// block a step reads. The per-element math (RMSNorm's scale, the SiLU gate, RoPE, the argmax
// order) is session_math.hpp's, shared with the CPU engine.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "algenta/session_math.hpp"
#include "common.cuh"
#include "algenta/session_cuda_plan.hpp"

namespace algenta {
namespace residentk {
namespace {

using namespace cudaplan;

// ---- device helpers ---------------------------------------------------------------------------

using gpu::block_sum_d;
using gpu::warp_max;
using gpu::warp_sum;
using gpu::warp_sum_d;

// dst (n) = w (n) * (x (n) * 1/sqrt(mean(x^2) + eps)), by the whole block; dst may be shared or
// global. Squares summed in double (as the CPU engine), the inverse rounded to float once.
__device__ void block_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, int64_t n,
                              double eps, float* dst) {
  __shared__ double red[32];
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = x[i];
    ss += v * v;
  }
  ss = block_sum_d(ss, red);
  const float inv = session_math::rms_inv(ss, n, eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = session_math::rms_apply(x[i], w[i], inv);
  __syncthreads();
}

// One warp: w (K) . xs (K), w a weight row in global memory, xs staged in shared memory; every
// lane returns the sum. K % 4 == 0 takes 16-byte loads: the arena aligns every tensor to 256
// bytes and row r starts r*K floats in, so every row is 16-byte aligned exactly then.
__device__ __forceinline__ float warp_dot(const float* __restrict__ w, const float* xs, int64_t K,
                                          int lane) {
  float acc = 0.f;
  if ((K & 3) == 0) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    const int64_t K4 = K >> 2;
#pragma unroll 4
    for (int64_t i = lane; i < K4; i += 32) {
      const float4 a = __ldg(w4 + i);
      const float4 b = x4[i];
      acc = fmaf(a.x, b.x, acc);
      acc = fmaf(a.y, b.y, acc);
      acc = fmaf(a.z, b.z, acc);
      acc = fmaf(a.w, b.w, acc);
    }
  } else {
    for (int64_t i = lane; i < K; i += 32) acc = fmaf(__ldg(w + i), xs[i], acc);
  }
  return warp_sum(acc);
}

// Copy v (n) global -> shared by the whole block, then a barrier.
__device__ __forceinline__ void stage(const float* __restrict__ v, int64_t n, float* s) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s[i] = v[i];
  __syncthreads();
}

// ---- control block in device memory ----------------------------------------------------------
// What one decode step depends on from the host, written by one 24-byte copy from pinned memory
// before it runs, so a step's launch sequence (and so its CUDA graph) is the same at every
// position; plus what the head kernel leaves for the host.
struct Control {
  int64_t tok;        // the token this step embeds
  int64_t pos;        // P: tokens in the KV cache before this step (the slot it writes)
  int64_t n_splits;   // S of this step's split-K attention (1 on the standard path)
  int64_t argmax;     // written by k_head_argmax: the first maximum of the logits
  unsigned int done;  // head blocks finished in the current launch (last-block reduction)
};
constexpr int64_t CONTROL_IN_BYTES = 3 * sizeof(int64_t);  // tok, pos, n_splits
static_assert(offsetof(Control, pos) == 8 && offsetof(Control, n_splits) == 16,
              "the host writes tok, pos, n_splits as one contiguous copy");

// ---- kernels ------------------------------------------------------------------------------

// X (M, D) row r = E[ids[r]]. grid (ceil(D / ROW_THREADS), M). ids validated on the host.
__global__ void k_embed(const float* __restrict__ E /* (V, D) */, const int64_t* __restrict__ ids,
                        float* __restrict__ X /* (M, D) */, int64_t D) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.y;
  if (i < D) X[r * D + i] = E[ids[r] * D + i];
}

// Y (M, D) row r = rmsnorm(X row r) * w. grid M, ROW_THREADS.
__global__ void k_rmsnorm_rows(const float* __restrict__ X /* (M, D) */,
                               const float* __restrict__ w /* (D) */, int64_t D, double eps,
                               float* __restrict__ Y /* (M, D) */) {
  const int64_t r = blockIdx.x;
  block_rmsnorm(X + r * D, w, D, eps, Y + r * D);
}

// y (N) = W (N, K) . rmsnorm(x (K)) * nw. Dynamic shared memory: K floats. grid plan.qkv_mv.
__global__ void k_norm_qkv(const float* __restrict__ W, const float* __restrict__ x,
                           const float* __restrict__ nw, int64_t K, int64_t N, double eps,
                           int64_t rows_per_block, float* __restrict__ y) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  block_rmsnorm(x, nw, K, eps, xs);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
    const float v = warp_dot(W + r * K, xs, K, lane);
    if (lane == 0) y[r] = v;
  }
}

// act (F) = silu(Wg . xn) * (Wu . xn), xn = rmsnorm(x (D)) * nw staged in shared memory (D
// floats). The warp owning row r forms gate r and up r together and writes only act r.
__global__ void k_norm_gateup(const float* __restrict__ Wg /* (F, D) */,
                              const float* __restrict__ Wu /* (F, D) */,
                              const float* __restrict__ x, const float* __restrict__ nw, int64_t D,
                              int64_t F, double eps, int64_t rows_per_block,
                              float* __restrict__ act) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  block_rmsnorm(x, nw, D, eps, xs);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(F, r0 + rows_per_block);
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
    const float g = warp_dot(Wg + r * D, xs, D, lane);
    const float u = warp_dot(Wu + r * D, xs, D, lane);
    if (lane == 0) act[r] = session_math::silu_mul(g, u);
  }
}

// x (N) += W (N, K) . a (K); a staged in shared memory (K floats). Row r of x is read and written
// only by the warp that owns it, so the residual add needs no atomics.
__global__ void k_matvec_residual(const float* __restrict__ W, const float* __restrict__ a,
                                  int64_t K, int64_t N, int64_t rows_per_block,
                                  float* __restrict__ x) {
  extern __shared__ float4 smem4[];
  float* as = reinterpret_cast<float*>(smem4);
  stage(a, K, as);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
    const float v = warp_dot(W + r * K, as, K, lane);
    if (lane == 0) x[r] += v;
  }
}

// In place on qkv (M, Q): q heads and k heads get per-head RMSNorm (q_norm / k_norm) and
// rotate-half RoPE at position P + row; k and v heads are then written to the cache slot
// P + row. grid (Hq + 2*Hkv, M), plan.norm_rope_threads threads; thread i owns the pair
// (i, i + Dh/2), so it reads and writes only its own two elements after the norm's reduction.
__global__ void k_qk_norm_rope(float* __restrict__ qkv /* (M, Q) */, int64_t Q,
                               const float* __restrict__ qn /* (Dh) */,
                               const float* __restrict__ kn /* (Dh) */,
                               const float* __restrict__ rope /* cos (T, Dh/2), sin (T, Dh/2) */,
                               const Control* __restrict__ ctl, int64_t Hq, int64_t Hkv,
                               int64_t Dh, int64_t T, double eps,
                               float* __restrict__ Kc /* (Hkv, T, Dh) */,
                               float* __restrict__ Vc /* (Hkv, T, Dh) */) {
  __shared__ double red[32];
  const int64_t h = blockIdx.x, row = blockIdx.y;
  const int64_t p = ctl->pos + row;
  float* v = qkv + row * Q + h * Dh;
  const int64_t half = Dh / 2;
  if (h < Hq + Hkv) {
    const float* w = h < Hq ? qn : kn;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x) ss += double(v[i]) * double(v[i]);
    ss = block_sum_d(ss, red);  // its barriers also order every read of v before the writes
    const float inv = session_math::rms_inv(ss, Dh, eps);
    if (half == 0) {  // Dh == 1: no rotation pair exists
      if (threadIdx.x == 0) v[0] = session_math::rms_apply(v[0], w[0], inv);
    }
    const float* cs = rope + p * (half > 0 ? half : 1);
    const float* sn = cs + T * (half > 0 ? half : 1);
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const float a = session_math::rms_apply(v[i], w[i], inv);
      const float b = session_math::rms_apply(v[i + half], w[i + half], inv);
      session_math::rope_pair(a, b, cs[i], sn[i], &v[i], &v[i + half]);
    }
    __syncthreads();
  }
  if (h >= Hq) {
    const int64_t g = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
    float* dst = (h < Hq + Hkv ? Kc : Vc) + (g * T + p) * Dh;
    for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x) dst[i] = v[i];
  }
}

// Attention of query head h, key split s, query row `row`: grid (Hq, S_grid, M), ATTN_THREADS.
// n_keys = P + row + 1 (causal). S, the split count, is gridDim.y in prefill and ctl->n_splits
// in decode (splits_on_device), where the grid is sized once to the plan's maximum so one graph
// serves every split count: blocks past S exit at once. The split covers
// splitk_range(n_keys, S, s). Each warp walks every ATTN_WARPS-th key of the split with an
// online softmax (running max m, sum l, output accumulator rescaled by exp(m_old - m_new)),
// then the block merges its warps.
// finalize (S must be 1): writes out (M, A) normalized. Otherwise writes the unnormalized
// partial (acc, m, l) for k_attn_merge (S may be 1 there too: the deep path's launch count does
// not depend on S); an empty split writes m = -inf, l = 0, acc = 0.
// Shared memory: q (Dh), per-warp accumulators (ATTN_WARPS, Dh), per-warp (m, l).
__global__ void k_attn_partial(const float* __restrict__ qkv /* (M, Q) */, int64_t Q,
                               const float* __restrict__ Kc /* (Hkv, T, Dh) */,
                               const float* __restrict__ Vc /* (Hkv, T, Dh) */,
                               const Control* __restrict__ ctl, int64_t T, int64_t G, int64_t Dh,
                               float scale, bool splits_on_device, bool finalize,
                               float* __restrict__ out /* (M, A) */,
                               float* __restrict__ part_acc /* (Hq, S, Dh) */,
                               float* __restrict__ part_ml /* (Hq, S, 2) */) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* acc = qs + Dh;
  float* ml = acc + ATTN_WARPS * Dh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.x, s = blockIdx.y, row = blockIdx.z;
  const int64_t S = splits_on_device ? ctl->n_splits : int64_t(gridDim.y);
  if (s >= S) return;  // the whole block: no barrier has been reached yet
  const int64_t A = int64_t(gridDim.x) * Dh;
  const int64_t n = ctl->pos + row + 1;
  int64_t k0, k1;
  splitk_range(n, S, s, &k0, &k1);

  const float* q = qkv + row * Q + h * Dh;
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) qs[d] = q[d];
  float* my = acc + warp * Dh;
  for (int64_t d = lane; d < Dh; d += 32) my[d] = 0.f;
  __syncthreads();

  const int64_t kv = (h / G) * T * Dh;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = k0 + warp; j < k1; j += ATTN_WARPS) {
    const float* kr = Kc + kv + j * Dh;
    float dot = 0.f;
    for (int64_t d = lane; d < Dh; d += 32) dot = fmaf(qs[d], kr[d], dot);
    const float sc = warp_sum(dot) * scale;
    const float mn = fmaxf(m, sc);
    const float corr = expf(m - mn);  // m = -inf on the first key: corr = 0, nothing to rescale
    const float pj = expf(sc - mn);
    l = l * corr + pj;
    const float* vr = Vc + kv + j * Dh;
    for (int64_t d = lane; d < Dh; d += 32) my[d] = fmaf(my[d], corr, pj * vr[d]);
    m = mn;
  }
  if (lane == 0) {
    ml[2 * warp] = m;
    ml[2 * warp + 1] = l;
  }
  __syncthreads();

  // Merge the warps: a warp that saw no key (l == 0, m = -inf) contributes nothing, and is
  // skipped rather than weighted by exp(-inf - -inf) = NaN.
  float M = -INFINITY;
  for (int w = 0; w < ATTN_WARPS; ++w)
    if (ml[2 * w + 1] > 0.f) M = fmaxf(M, ml[2 * w]);
  float wt[ATTN_WARPS];
  float lt = 0.f;
#pragma unroll
  for (int w = 0; w < ATTN_WARPS; ++w) {
    wt[w] = ml[2 * w + 1] > 0.f ? expf(ml[2 * w] - M) : 0.f;
    lt += ml[2 * w + 1] * wt[w];
  }
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) a = fmaf(acc[w * Dh + d], wt[w], a);
    if (finalize)
      out[row * A + h * Dh + d] = a / lt;  // one split covers keys 0..P: lt >= 1, never empty
    else
      part_acc[(h * S + s) * Dh + d] = a;
  }
  if (!finalize && threadIdx.x == 0) {
    part_ml[(h * S + s) * 2] = M;
    part_ml[(h * S + s) * 2 + 1] = lt;
  }
}

// out (A) head h = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M = max m_s over the
// non-empty splits. grid Hq, ROW_THREADS; S = ctl->n_splits <= RESIDENT_SPLITK_MAX_SPLITS.
__global__ void k_attn_merge(const float* __restrict__ part_acc /* (Hq, S, Dh) */,
                             const float* __restrict__ part_ml /* (Hq, S, 2) */,
                             const Control* __restrict__ ctl, int64_t Dh,
                             float* __restrict__ out /* (A) */) {
  __shared__ float wts[RESIDENT_SPLITK_MAX_SPLITS];
  __shared__ float redf[32];
  __shared__ double red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t h = blockIdx.x, S = ctl->n_splits;
  const float* pm = part_ml + h * S * 2;
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x)
    if (pm[2 * s + 1] > 0.f) mx = fmaxf(mx, pm[2 * s]);
  mx = warp_max(mx);
  if (lane == 0) redf[warp] = mx;
  __syncthreads();
  float M = lane < nw ? redf[lane] : -INFINITY;
  M = warp_max(M);  // every warp forms the same M from the same redf
  double lt = 0.0;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
    const float w = pm[2 * s + 1] > 0.f ? expf(pm[2 * s] - M) : 0.f;
    wts[s] = w;
    lt += double(pm[2 * s + 1]) * double(w);
  }
  lt = block_sum_d(lt, red);  // its barriers also publish wts
  const float inv = float(1.0 / lt);
  const float* pa = part_acc + h * S * Dh;
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
    for (int64_t s = 0; s < S; ++s) a = fmaf(pa[s * Dh + d], wts[s], a);
    out[h * Dh + d] = a * inv;
  }
}

// The argmax's order (numpy.argmax's) is session_math::argmax_beats, shared with the CPU engine.
using session_math::argmax_beats;

// logits (V) = H (V, D) . xf (D), xf staged in shared memory, plus the argmax on the device:
// each block writes its best (value, first index), and the last block to finish (a ticket from
// ctl->done after a __threadfence) reduces them, writes ctl->argmax and rearms ctl->done. The
// order is numpy.argmax's (argmax_beats).
__global__ void k_head_argmax(const float* __restrict__ H, const float* __restrict__ xf, int64_t D,
                              int64_t V, int64_t rows_per_block, float* __restrict__ logits,
                              float* __restrict__ blk_val /* (grid) */,
                              int64_t* __restrict__ blk_idx /* (grid) */, Control* ctl) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ float bv[32];
  __shared__ int64_t bi[32];
  __shared__ bool last;
  stage(xf, D, xs);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(V, r0 + rows_per_block);
  float best = -INFINITY;
  int64_t besti = -1;
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
    const float v = warp_dot(H + r * D, xs, D, lane);
    if (lane == 0) logits[r] = v;
    if (argmax_beats(v, r, best, besti)) best = v, besti = r;
  }
  if (lane == 0) bv[warp] = best, bi[warp] = besti;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = -INFINITY;
    int64_t bix = -1;
    for (int w = 0; w < MATVEC_WARPS; ++w)
      if (argmax_beats(bv[w], bi[w], b, bix)) b = bv[w], bix = bi[w];
    blk_val[blockIdx.x] = b;
    blk_idx[blockIdx.x] = bix;
    __threadfence();  // the partial is visible device-wide before this block takes its ticket
    last = atomicAdd(&ctl->done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // Every other block's partial was fenced before its ticket; read them from L2 (__ldcg).
  float b = -INFINITY;
  int64_t bix = -1;
  for (int64_t k = threadIdx.x; k < gridDim.x; k += blockDim.x) {
    const float v = __ldcg(blk_val + k);
    const int64_t i = __ldcg(blk_idx + k);
    if (argmax_beats(v, i, b, bix)) b = v, bix = i;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bix, o);
    if (argmax_beats(ov, oi, b, bix)) b = ov, bix = oi;
  }
  __syncthreads();
  if (lane == 0) bv[warp] = b, bi[warp] = bix;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < MATVEC_WARPS; ++w)
      if (argmax_beats(bv[w], bi[w], b, bix)) b = bv[w], bix = bi[w];
    ctl->argmax = bix;  // every row is a candidate (V >= 1), so bix is in [0, V)
    ctl->done = 0;
  }
}

// Y (M, N) (+)= X (M, K) . W (N, K)^T for M < 32: one weight row per warp, read once per
// NARROW_ROWS activation rows (<= 4 passes), the accumulators a compile-time-indexed array.
// grid plan matvec launch over N rows.
__global__ void k_gemm_narrow(const float* __restrict__ X, const float* __restrict__ W,
                              float* __restrict__ Y, int64_t M, int64_t N, int64_t K,
                              int64_t rows_per_block, bool accumulate) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  for (int64_t n = r0 + warp; n < r1; n += MATVEC_WARPS) {
    const float* w = W + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += NARROW_ROWS) {
      float acc[NARROW_ROWS];
#pragma unroll
      for (int i = 0; i < NARROW_ROWS; ++i) acc[i] = 0.f;
      for (int64_t k = lane; k < K; k += 32) {
        const float wk = __ldg(w + k);
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

// Y (M, N) (+)= X (M, K) . W (N, K)^T, 64 x 64 tiles through shared memory, 4 x 4 outputs per
// thread, K in BK = 16 slices; out-of-range cells load zeros and are not stored.
// grid (ceil(N / 64), ceil(M / 64)), GEMM_THREADS.
__global__ void __launch_bounds__(GEMM_THREADS)
k_gemm_wide(const float* __restrict__ X, const float* __restrict__ W, float* __restrict__ Y,
            int64_t M, int64_t N, int64_t K, bool accumulate) {
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
      Bs[kk][r] = (n0 + r < N && k < K) ? W[(n0 + r) * K + k] : 0.f;
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
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (m < M && n < N) {
        float* y = Y + m * N + n;
        *y = accumulate ? *y + acc[i][j] : acc[i][j];
      }
    }
}

// g (n) = silu(g) * u, elementwise (prefill's MLP activation).
__global__ void k_silu_mul(float* __restrict__ g, const float* __restrict__ u, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) g[i] = session_math::silu_mul(g[i], u[i]);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

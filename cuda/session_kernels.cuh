// The CUDA resident session's device code: the decode and prefill kernels session_cuda.cu
// launches (see its header for the stage list, the numerics and the limits), and the control
// block the head leaves for the host. What a launch sequence computes on comes from its rows
// (StepRow: token, position, slot, attention path), written by the host before it runs. The
// per-element math (RMSNorm's scale, the SiLU and GELU gates, the soft cap, RoPE, the argmax
// order) is session_math.hpp's, the bf16/f16 conversions half.hpp's and the int8 block rule
// quant.hpp's, all shared with the CPU engine.
//
// Weight formats: every kernel that reads a weight matrix is a template over the session's
// format F (f32, bf16, f16, int8; the host instantiates the one the session holds). Decode
// streams each row with 16-byte loads (4 floats, 8 halves or 16 int8 codes a lane) and widens in
// registers; the input vector is staged in shared memory as F's products consume it, the CPU
// engine's rule (session_cpu.cpp, ActScratch::prepare): float32 for f32 and f16, rounded to bf16
// for bf16 (a product of two bf16 values is exact in float32), quantized to int8 blocks for int8
// (Q8_0 x Q8_0: each block's 32 products summed exactly in int32 by dp4a, then entering float32
// once times the two block scales). Prefill rounds or quantizes its activation rows the same way:
// bf16 rows (k_round_bf16) multiply the bf16 weights on tensor cores (lossk's tile GEMM) or,
// below 32 rows, widened to float32; int8 rows quantized by the same rule (k_quantize_rows)
// multiply the int8 weights in integers block by block (k_gemm_q8, dp4a), decode's products.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "algenta/half.hpp"
#include "algenta/quant.hpp"
#include "algenta/session_math.hpp"
#include "common.cuh"
#include "algenta/session_cuda_plan.hpp"

namespace algenta {
namespace residentk {
namespace {

using namespace cudaplan;

// ---- device helpers ---------------------------------------------------------------------------

using gpu::block_sum_d;
using gpu::ld;
using gpu::st;
using gpu::warp_max;
using gpu::warp_sum;
using gpu::warp_sum_d;

// dst (n) = w (n) * (x (n) * 1/sqrt(mean(x^2) + eps)), by the whole block; dst in global memory
// (kGlobalDst) or shared. Squares summed in double (as the CPU engine), the inverse rounded to
// float once. x and w are read-only here.
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

// ---- weight matrices in the session's format ----------------------------------------------
// A resident matrix (rows, K) as the kernels read it: row r's K elements start r * K elements
// into w, in format F; for int8, s holds its block scales (rows, ceil(K / 32)), else null.
struct DevMat {
  const void* w;
  const float* s;
};

// Two 16-bit values packed in u (the lower first) widened to float32, exactly.
template <Dtype F>
__device__ __forceinline__ float2 widen2(uint32_t u) {
  if (F == Dtype::BF16)  // a bfloat16 is the top half of a float32
    return make_float2(half::f32_from_bits(u << 16), half::f32_from_bits(u & 0xffff0000u));
#ifdef __CUDA_ARCH__
  __half2 h;  // the conversion instruction: same values as half.hpp's, a fraction of the work
  memcpy(&h, &u, 4);
  return __half22float2(h);
#else
  return make_float2(half::f16_to_f32(uint16_t(u)), half::f16_to_f32(uint16_t(u >> 16)));
#endif
}

// Element k of row r of m widened to float32: exact for f32, bf16 and f16; for int8 the code
// times its block's scale, as the CPU engine's widen_q8. Called under bounds tests (the GEMM
// tiles' edges), so its loads are gpu::ld_guarded, never __ldg.
template <Dtype F>
__device__ __forceinline__ float w_at(const DevMat& m, int64_t r, int64_t K, int64_t k) {
  const int64_t i = r * K + k;
  if constexpr (F == Dtype::F32) {
    return gpu::ld_guarded(static_cast<const float*>(m.w) + i);
  } else if constexpr (F == Dtype::BF16 || F == Dtype::F16) {
    return widen2<F>(gpu::ld_guarded(static_cast<const uint16_t*>(m.w) + i)).x;
  } else {  // int8: only its matrices have scales (m.s is null for the others)
    const int64_t nb = ceil_div(K, RESIDENT_INT8_BLOCK);
    return float(gpu::ld_guarded(static_cast<const int8_t*>(m.w) + i)) *
           gpu::ld_guarded(m.s + r * nb + k / RESIDENT_INT8_BLOCK);
  }
}

// ---- the start of a decode kernel --------------------------------------------------------------
// A decode step launches its kernels as programmatic dependent launches (gpu::launch, common.cuh):
// each may start while the kernel before it runs. step_begin() is every such kernel's first
// global access: the wait for the kernel before it, then the next kernel's launch. A matvec first
// asks L2 for the opening bytes of its block's weight rows (prefetch_rows), which no kernel of the
// step writes, so they stream in while the kernel before still runs.
__device__ __forceinline__ void step_begin() {
  gpu::pdl_wait();
  gpu::pdl_launch_dependents();
}
// Rows [r0, r1) of a matvec block: rows_per_block of them from blockIdx.x's first, within N.
struct RowRange {
  int64_t r0, r1;
};
__device__ __forceinline__ RowRange block_rows(int64_t rows_per_block, int64_t N) {
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  return RowRange{r0, min(N, r0 + rows_per_block)};
}
template <Dtype F>
__device__ __forceinline__ void prefetch_rows(const DevMat& m, RowRange rows, int64_t K) {
  constexpr int64_t eb = F == Dtype::F32 ? 4 : F == Dtype::Int8 ? 1 : 2;  // dtype_info is host-only
  if (rows.r1 > rows.r0)
    gpu::prefetch_l2(static_cast<const char*>(m.w) + rows.r0 * K * eb,
                     (rows.r1 - rows.r0) * K * eb);
}

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

// One warp: elements [k0, k1) of row r of m (K) . each of the nrows <= R staged vectors
// (consume<F>'s form) of the row kernels, v0 and the next ones stride bytes apart; every lane
// returns the sums in out. 16-byte loads where each row is 16-byte aligned, which the arena
// (256-byte aligned tensors) gives exactly when K * elem_bytes % 16 == 0 (int8 also needs whole
// blocks: K % 32 == 0); other K take one element (int8: one block) a lane at a time. A slice
// (decode_matvec_launch) starts on a 16-byte unit, for int8 on a block. Each weight load serves
// every row; each row's multiply-adds run in the order they run for that row alone (R = 1), so a
// row's sum does not depend on the rows beside it (batch invariance).
template <Dtype F, int R>
__device__ __forceinline__ void warp_dot_rows(const DevMat& m, int64_t r, const Staged& v0,
                                              int64_t stride, int nrows, int64_t K, int lane,
                                              int64_t k0, int64_t k1, float (&out)[R]) {
  float acc[R];
#pragma unroll
  for (int b = 0; b < R; ++b) acc[b] = 0.f;
  // Row b takes part when it exists; R == 1 needs no test (nrows is 1).
#define ALGENTA_ROWS_FOR(b) \
  _Pragma("unroll") for (int b = 0; b < R; ++b) if (R == 1 || b < nrows)
  if (F == Dtype::F32) {
    const float* w = static_cast<const float*>(m.w) + r * K;
    if ((K & 3) == 0) {
      const float4* w4 = reinterpret_cast<const float4*>(w);
      const int64_t K4 = k1 >> 2;
#pragma unroll MATVEC_LOADS
      for (int64_t i = (k0 >> 2) + lane; i < K4; i += 32) {
        const float4 a = __ldg(w4 + i);
        ALGENTA_ROWS_FOR(b) {
          const float4 x = reinterpret_cast<const float4*>(staged_row(v0, stride, b).x)[i];
          acc[b] = fmaf(a.x, x.x, acc[b]);
          acc[b] = fmaf(a.y, x.y, acc[b]);
          acc[b] = fmaf(a.z, x.z, acc[b]);
          acc[b] = fmaf(a.w, x.w, acc[b]);
        }
      }
    } else {
      for (int64_t i = k0 + lane; i < k1; i += 32) {
        const float a = __ldg(w + i);
        ALGENTA_ROWS_FOR(b) acc[b] = fmaf(a, staged_row(v0, stride, b).x[i], acc[b]);
      }
    }
  } else if (F == Dtype::BF16 || F == Dtype::F16) {
    const uint16_t* w = static_cast<const uint16_t*>(m.w) + r * K;
    if ((K & 7) == 0) {
      const int4* w8 = reinterpret_cast<const int4*>(w);
      const int64_t K8 = k1 >> 3;
#pragma unroll MATVEC_LOADS
      for (int64_t i = (k0 >> 3) + lane; i < K8; i += 32) {
        const int4 a = __ldg(w8 + i);
        const float2 p0 = widen2<F>(uint32_t(a.x)), p1 = widen2<F>(uint32_t(a.y));
        const float2 p2 = widen2<F>(uint32_t(a.z)), p3 = widen2<F>(uint32_t(a.w));
        ALGENTA_ROWS_FOR(b) {
          const float4* x4 = reinterpret_cast<const float4*>(staged_row(v0, stride, b).x);
          const float4 b0 = x4[2 * i], b1 = x4[2 * i + 1];
          acc[b] = fmaf(p0.x, b0.x, acc[b]);
          acc[b] = fmaf(p0.y, b0.y, acc[b]);
          acc[b] = fmaf(p1.x, b0.z, acc[b]);
          acc[b] = fmaf(p1.y, b0.w, acc[b]);
          acc[b] = fmaf(p2.x, b1.x, acc[b]);
          acc[b] = fmaf(p2.y, b1.y, acc[b]);
          acc[b] = fmaf(p3.x, b1.z, acc[b]);
          acc[b] = fmaf(p3.y, b1.w, acc[b]);
        }
      }
    } else {
      for (int64_t i = k0 + lane; i < k1; i += 32) {
        const float a = widen2<F>(__ldg(w + i)).x;
        ALGENTA_ROWS_FOR(b) acc[b] = fmaf(a, staged_row(v0, stride, b).x[i], acc[b]);
      }
    }
  } else {  // int8
    const int8_t* w = static_cast<const int8_t*>(m.w) + r * K;
    const int64_t nb = ceil_div(K, RESIDENT_INT8_BLOCK);
    const float* sw = m.s + r * nb;
    if ((K & 31) == 0) {
      // 16 codes a lane a load, so lanes 2j and 2j + 1 hold the two halves of one block: their
      // exact int32 sums meet through one shuffle and the block enters float32 once, as
      // float(sum) * (sw * sx) (the CPU engine's dot_q8q8). The trip count is the same for every
      // lane, so each reaches the shuffle.
      const int4* w16 = reinterpret_cast<const int4*>(w);
      const int64_t K16 = k1 >> 4;
#pragma unroll MATVEC_LOADS
      for (int64_t i0 = k0 >> 4; i0 < K16; i0 += 32) {
        const int64_t i = i0 + lane;
        int4 a = make_int4(0, 0, 0, 0);
        float s = 0.f;
        if (i < K16) a = gpu::ld_guarded(w16 + i), s = gpu::ld_guarded(sw + (i >> 1));
        ALGENTA_ROWS_FOR(b) {
          const Staged v = staged_row(v0, stride, b);
          int isum = 0;
          if (i < K16) {
            const int4 x = reinterpret_cast<const int4*>(v.q)[i];
            isum = __dp4a(a.x, x.x, isum);
            isum = __dp4a(a.y, x.y, isum);
            isum = __dp4a(a.z, x.z, isum);
            isum = __dp4a(a.w, x.w, isum);
          }
          isum += __shfl_xor_sync(0xffffffffu, isum, 1);
          if (i < K16 && (lane & 1) == 0) acc[b] = fmaf(float(isum), s * v.s[i >> 1], acc[b]);
        }
      }
    } else {
      for (int64_t blk = k0 / RESIDENT_INT8_BLOCK + lane; blk * RESIDENT_INT8_BLOCK < k1;
           blk += 32) {
        const int64_t b0 = blk * RESIDENT_INT8_BLOCK, b1 = min(K, b0 + RESIDENT_INT8_BLOCK);
        ALGENTA_ROWS_FOR(b) {
          const Staged v = staged_row(v0, stride, b);
          int isum = 0;
          for (int64_t k = b0; k < b1; ++k) isum += int(__ldg(w + k)) * int(v.q[k]);
          acc[b] = fmaf(float(isum), __ldg(sw + blk) * v.s[blk], acc[b]);
        }
      }
    }
  }
#undef ALGENTA_ROWS_FOR
#pragma unroll
  for (int b = 0; b < R; ++b) out[b] = warp_sum(acc[b]);
}

// warp_dot_rows of one staged vector (decode's one row; the head's argmax launch).
template <Dtype F>
__device__ __forceinline__ float warp_dot(const DevMat& m, int64_t r, const Staged& v, int64_t K,
                                          int lane, int64_t k0, int64_t k1) {
  float out[1];
  warp_dot_rows<F, 1>(m, r, v, 0, 1, K, lane, k0, k1, out);
  return out[0];
}

// ---- a decode matvec block's warps over its rows ---------------------------------------------
// As decode_matvec_launch arranged them (session_cuda_plan.hpp): with split 1 each warp takes
// every MATVEC_WARPS-th row of the block whole; with split s > 1 the block has MATVEC_WARPS / s
// rows, one a group of s warps, warp j of a group on the j-th of s equal slices of K, the
// slices' sums joined in warp order (a fixed order: a row's sum depends on s alone). dot(r, k0,
// k1, d) gives a warp's one or two products (float2: gate and up together) of weight row r over
// [k0, k1) with each of the block's R staged rows in d, in every lane; out(r, b, d) runs in one
// lane a weight row and staged row b < nrows with the joined products.
template <int R, class Dot, class Out>
__device__ __forceinline__ void for_rows(int64_t rows_per_block, int64_t N, int64_t K, int split,
                                         int nrows, Dot dot, Out out) {
  __shared__ float2 part[MATVEC_WARPS][R];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const RowRange rows = block_rows(rows_per_block, N);
  const int64_t r0 = rows.r0, r1 = rows.r1;
  float2 d[R];
  if (split == 1) {
    for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
      dot(r, int64_t(0), K, d);
      if (lane == 0)
        for (int b = 0; b < nrows; ++b) out(r, b, d[b]);
    }
    return;
  }
  const int j = warp % split;
  const int64_t r = r0 + warp / split, n = K / split;
  if (r < r1)
    dot(r, j * n, j * n + n, d);
  else
    for (int b = 0; b < R; ++b) d[b] = make_float2(0.f, 0.f);
  if (lane == 0)
    for (int b = 0; b < R; ++b) part[warp][b] = d[b];
  __syncthreads();  // every thread of the block: split is the same for all
  if (j != 0 || lane != 0 || r >= r1) return;
  for (int b = 0; b < nrows; ++b) {
    float2 sum = part[warp][b];
    for (int i = 1; i < split; ++i) sum.x += part[warp + i][b].x, sum.y += part[warp + i][b].y;
    out(r, b, sum);
  }
}

// The staged rows [m0, m0 + nrows) of a row kernel's block: blockIdx.y's pass of nr rows
// among the launch's M.
struct PassRows {
  int64_t m0;
  int nrows;
};
__device__ __forceinline__ PassRows pass_rows(int64_t M, int nr) {
  const int64_t m0 = int64_t(blockIdx.y) * nr;
  return PassRows{m0, int(min(int64_t(nr), M - m0))};
}

// ---- the KV cache in its format ---------------------------------------------------------------
// Element i of a KV cache of format KV (f32, bf16, f16: session_math's kv_narrow / kv_widen, the
// CPU engine's rounding), stored and loaded.
template <Dtype KV>
__device__ __forceinline__ void kv_store(void* c, int64_t i, float v) {
  if (KV == Dtype::F32)
    st(static_cast<float*>(c) + i, v);
  else
    st(static_cast<uint16_t*>(c) + i, session_math::kv_narrow(KV, v));
}
template <Dtype KV>
__device__ __forceinline__ float kv_load(const void* c, int64_t i) {
  if (KV == Dtype::F32) return ld(static_cast<const float*>(c) + i);
  return session_math::kv_widen(KV, ld(static_cast<const uint16_t*>(c) + i));
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

// ---- control block in device memory ----------------------------------------------------------
// What the head kernel leaves for the host. What a step depends on from the host is its rows
// (StepRow, session_cuda_plan.hpp), copied in before it runs, so a step's launch sequence (and
// so its CUDA graph) is the same at every position.
struct Control {
  int64_t argmax;     // written by k_head_argmax: the first maximum of the logits
  unsigned int done;  // head blocks finished in the current launch (last-block reduction)
};

// ---- kernels ------------------------------------------------------------------------------

// X (M, D) row r = E[rows[r].tok] widened to float32, times `scale` where it is > 0 (a family
// that scales its embeddings). grid (ceil(D / ROW_THREADS), M). Tokens validated on the host.
template <Dtype F>
__global__ void k_embed(DevMat E /* (V, D) */, const StepRow* __restrict__ rows,
                        float* __restrict__ X /* (M, D) */, int64_t D, float scale) {
  step_begin();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.y;
  if (i >= D) return;
  const float e = w_at<F>(E, ld(&rows[r].tok), D, i);
  st(X + r * D + i, scale > 0.f ? e * scale : e);
}

// Y (M, D) row r = rmsnorm(X row r) * w. grid M, ROW_THREADS.
__global__ void k_rmsnorm_rows(const float* __restrict__ X /* (M, D) */,
                               const float* __restrict__ w /* (D) */, int64_t D, double eps,
                               float* __restrict__ Y /* (M, D) */) {
  step_begin();
  const int64_t r = blockIdx.x;
  block_rmsnorm<true>(X + r * D, w, D, eps, Y + r * D);
}

// ---- the row kernels --------------------------------------------------------------------------
// Decode's matvecs over M rows (tokens of any slots and positions): grid (the plan's matvec
// grid, ceil(M / nr)), block y staging rows [y * nr, ...) (at most nr <= R of them, each
// stage_stride(K, F) bytes of dynamic shared memory) and multiplying each weight load by all of
// them (warp_dot_rows). Decode's single row is R = nr = M = 1; a batched step or a multi-slot
// prefill R = PASS_ROWS. A row's result is the same bits whichever R, nr and M carry it.

// Y (M, N) = rmsnorm(X (M, K)) * nw . W (N, K)^T.
template <Dtype F, int R>
__global__ void k_norm_qkv(DevMat W, const float* __restrict__ X, const float* __restrict__ nw,
                           int64_t K, int64_t N, double eps, int64_t rows_per_block,
                           int split, int64_t M, int nr, float* __restrict__ Y) {
  extern __shared__ float4 smem4[];
  prefetch_rows<F>(W, block_rows(rows_per_block, N), K);
  step_begin();
  const PassRows pr = pass_rows(M, nr);
  const int64_t stride = stage_stride(K, F);
  const Staged v = staged(smem4, K);
  stage_rows<F>(X, nw, K, eps, v, stride, pr);
  for_rows<R>(
      rows_per_block, N, K, split, pr.nrows,
      [&](int64_t r, int64_t k0, int64_t k1, float2 (&d)[R]) {
        float o[R];
        warp_dot_rows<F, R>(W, r, v, stride, pr.nrows, K, threadIdx.x & 31, k0, k1, o);
        for (int b = 0; b < R; ++b) d[b] = make_float2(o[b], 0.f);
      },
      [&](int64_t r, int b, float2 d) { st(Y + (pr.m0 + b) * N + r, d.x); });
}

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
                              const float* __restrict__ X, const float* __restrict__ nw, int64_t D,
                              int64_t Fd, double eps, int64_t rows_per_block, int split,
                              const float* __restrict__ gb, const float* __restrict__ ub,
                              bool gelu, int64_t M, int nr, float* __restrict__ Act) {
  extern __shared__ float4 smem4[];
  const RowRange rows = block_rows(rows_per_block, Fd);
  prefetch_rows<F>(Wg, rows, D);
  prefetch_rows<F>(Wu, rows, D);
  step_begin();
  const PassRows pr = pass_rows(M, nr);
  const int64_t stride = stage_stride(D, F);
  const Staged v = staged(smem4, D);
  stage_rows<F>(X, nw, D, eps, v, stride, pr);
  for_rows<R>(
      rows_per_block, Fd, D, split, pr.nrows,
      [&](int64_t r, int64_t k0, int64_t k1, float2 (&d)[R]) {
        const int lane = threadIdx.x & 31;
        float g[R], u[R];
        warp_dot_rows<F, R>(Wg, r, v, stride, pr.nrows, D, lane, k0, k1, g);
        warp_dot_rows<F, R>(Wu, r, v, stride, pr.nrows, D, lane, k0, k1, u);
        for (int b = 0; b < R; ++b) d[b] = make_float2(g[b], u[b]);
      },
      [&](int64_t r, int b, float2 gu) {
        st(Act + (pr.m0 + b) * Fd + r, gate_act(gu.x, gu.y, gb, ub, r, gelu));
      });
}

// X (M, N) += A (M, K) W (N, K)^T (+ bias b where given). With Y given (a sandwich family) the
// sum goes to Y instead, for k_out_norm_residual. Cell (m, n) of X is read and written only by
// the warp that owns weight row n: no atomics.
template <Dtype F, int R>
__global__ void k_matvec_residual(DevMat W, const float* __restrict__ A, int64_t K, int64_t N,
                                  int64_t rows_per_block, int split,
                                  const float* __restrict__ b, int64_t M, int nr,
                                  float* __restrict__ Y, float* __restrict__ X) {
  extern __shared__ float4 smem4[];
  prefetch_rows<F>(W, block_rows(rows_per_block, N), K);
  step_begin();
  const PassRows pr = pass_rows(M, nr);
  const int64_t stride = stage_stride(K, F);
  const Staged v = staged(smem4, K);
  stage_rows<F>(A, nullptr, K, 0.0, v, stride, pr);
  for_rows<R>(
      rows_per_block, N, K, split, pr.nrows,
      [&](int64_t r, int64_t k0, int64_t k1, float2 (&d)[R]) {
        float o[R];
        warp_dot_rows<F, R>(W, r, v, stride, pr.nrows, K, threadIdx.x & 31, k0, k1, o);
        for (int i = 0; i < R; ++i) d[i] = make_float2(o[i], 0.f);
      },
      [&](int64_t r, int i, float2 d) {
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
__global__ void k_out_norm_residual(float* __restrict__ X, const float* __restrict__ Y,
                                    const float* __restrict__ w, int64_t D, double eps) {
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
__global__ void k_bias_residual(float* __restrict__ X, float* __restrict__ Y,
                                const float* __restrict__ b, int64_t M, int64_t D,
                                bool sandwich) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * D) return;
  const float o = b ? ld(Y + i) + gpu::ld_guarded(b + i % D) : ld(Y + i);
  if (sandwich)
    st(Y + i, o);
  else
    st(X + i, ld(X + i) + o);
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

// Attention of query head h, key split s, query row `row`: grid (Hq, S_grid, M), ATTN_THREADS.
// n_keys = P + 1 (causal, P the row's position) in the row's slot. The row's n_splits says its
// path: 0 the standard one (S = 1, finalized here: out (M, A) normalized), else S = n_splits
// splits writing unnormalized partials (acc, m, l) for k_attn_merge (S may be 1 there too: the
// deep path's launch count does not depend on S); an empty split writes m = -inf, l = 0,
// acc = 0. The grid is sized to the plan's maximum S (S_max) wherever a row may split, so one
// graph serves every split count: blocks past a row's S exit at once. The split covers
// splitk_range(n_keys, S, s). Each warp walks every ATTN_WARPS-th key of the split with an
// online softmax (running max m, sum l, output accumulator rescaled by exp(m_old - m_new)),
// then the block merges its warps.
// Shared memory: q (Dh), per-warp accumulators (ATTN_WARPS, Dh), per-warp (m, l).
template <Dtype KV>
__global__ void k_attn_partial(const float* __restrict__ qkv /* (M, Q) */, int64_t Q,
                               const void* __restrict__ Kc /* (Hkv, T, Dh) of KV, slot 0 */,
                               const void* __restrict__ Vc /* (Hkv, T, Dh) of KV, slot 0 */,
                               const StepRow* __restrict__ rows, int64_t slot_stride, int64_t T,
                               int64_t G, int64_t Dh, float scale, int64_t window, float softcap,
                               int64_t S_max, float* __restrict__ out /* (M, A) */,
                               float* __restrict__ part_acc /* (M, Hq, S_max, Dh) */,
                               float* __restrict__ part_ml /* (M, Hq, S_max, 2) */) {
  extern __shared__ float4 smem4[];
  step_begin();
  float* qs = reinterpret_cast<float*>(smem4);
  float* acc = qs + Dh;
  float* ml = acc + ATTN_WARPS * Dh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.x, s = blockIdx.y, row = blockIdx.z;
  const int64_t n_splits = ld(&rows[row].n_splits);
  const bool finalize = n_splits == 0;
  const int64_t S = finalize ? 1 : n_splits;
  if (s >= S) return;  // the whole block: no barrier has been reached yet
  const int64_t Hq = gridDim.x, A = Hq * Dh;
  // Causal through n keys; a sliding layer (window > 0) sees only the last `window` of them.
  const int64_t n = ld(&rows[row].pos) + 1;
  const int64_t lo = window > 0 && n > window ? n - window : 0;
  int64_t k0, k1;
  splitk_range(n - lo, S, s, &k0, &k1);
  k0 += lo, k1 += lo;

  const float* q = qkv + row * Q + h * Dh;
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) qs[d] = ld(q + d);
  float* my = acc + warp * Dh;
  for (int64_t d = lane; d < Dh; d += 32) my[d] = 0.f;
  __syncthreads();

  const int64_t kv = ld(&rows[row].slot) * slot_stride + (h / G) * T * Dh;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = k0 + warp; j < k1; j += ATTN_WARPS) {
    const int64_t kr = kv + j * Dh;
    float dot = 0.f;
    for (int64_t d = lane; d < Dh; d += 32) dot = fmaf(qs[d], kv_load<KV>(Kc, kr + d), dot);
    float sc = warp_sum(dot) * scale;
    if (softcap > 0.f) sc = session_math::softcap(sc, softcap);
    const float mn = fmaxf(m, sc);
    const float corr = expf(m - mn);  // m = -inf on the first key: corr = 0, nothing to rescale
    const float pj = expf(sc - mn);
    l = l * corr + pj;
    for (int64_t d = lane; d < Dh; d += 32) my[d] = fmaf(my[d], corr, pj * kv_load<KV>(Vc, kr + d));
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
      st(out + row * A + h * Dh + d, a / lt);  // one split covers keys lo..P: lt >= 1
    else
      st(part_acc + ((row * Hq + h) * S_max + s) * Dh + d, a);
  }
  if (!finalize && threadIdx.x == 0) {
    st(part_ml + ((row * Hq + h) * S_max + s) * 2, M);
    st(part_ml + ((row * Hq + h) * S_max + s) * 2 + 1, lt);
  }
}

// out (M, A) row `row`, head h = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M =
// max m_s over the non-empty splits, for a row that split (n_splits = S >= 1, at most
// RESIDENT_SPLITK_MAX_SPLITS); a row on the standard path was finalized by k_attn_partial and
// its blocks exit. grid (Hq, M), ROW_THREADS.
__global__ void k_attn_merge(const float* __restrict__ part_acc /* (M, Hq, S_max, Dh) */,
                             const float* __restrict__ part_ml /* (M, Hq, S_max, 2) */,
                             const StepRow* __restrict__ rows, int64_t S_max, int64_t Dh,
                             float* __restrict__ out /* (M, A) */) {
  __shared__ float wts[RESIDENT_SPLITK_MAX_SPLITS];
  __shared__ float redf[32];
  __shared__ double red[32];
  step_begin();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t h = blockIdx.x, row = blockIdx.y, Hq = gridDim.x;
  const int64_t S = ld(&rows[row].n_splits);
  if (S == 0) return;  // the whole block, before any barrier
  const float* pm = part_ml + (row * Hq + h) * S_max * 2;
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x)
    if (ld(pm + 2 * s + 1) > 0.f) mx = fmaxf(mx, ld(pm + 2 * s));
  mx = warp_max(mx);
  if (lane == 0) redf[warp] = mx;
  __syncthreads();
  float M = lane < nw ? redf[lane] : -INFINITY;
  M = warp_max(M);  // every warp forms the same M from the same redf
  double lt = 0.0;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
    const float ls = ld(pm + 2 * s + 1);
    const float w = ls > 0.f ? expf(ld(pm + 2 * s) - M) : 0.f;
    wts[s] = w;
    lt += double(ls) * double(w);
  }
  lt = block_sum_d(lt, red);  // its barriers also publish wts
  const float inv = float(1.0 / lt);
  const float* pa = part_acc + (row * Hq + h) * S_max * Dh;
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
    for (int64_t s = 0; s < S; ++s) a = fmaf(ld(pa + s * Dh + d), wts[s], a);
    st(out + (row * Hq + h) * Dh + d, a * inv);
  }
}

// The argmax's order (numpy.argmax's) is session_math::argmax_beats, shared with the CPU engine.
using session_math::argmax_beats;

// Logits (M, V) = Xf (M, D) H (V, D)^T (a row kernel, one warp a vocabulary row), and with
// R == 1 (decode's one row) the argmax on the device: each block writes its best (value, first
// index), and the last block to finish (a ticket from ctl->done after a __threadfence) reduces
// them, writes ctl->argmax and rearms ctl->done. The order is numpy.argmax's (argmax_beats).
template <Dtype F, int R>
__global__ void k_head_argmax(DevMat H, const float* __restrict__ Xf, int64_t D, int64_t V,
                              int64_t rows_per_block, float softcap, int64_t M, int nr,
                              float* __restrict__ logits, float* __restrict__ blk_val /* (grid) */,
                              int64_t* __restrict__ blk_idx /* (grid) */, Control* ctl) {
  extern __shared__ float4 smem4[];
  const Staged xs = staged(smem4, D);
  __shared__ float bv[32];
  __shared__ int64_t bi[32];
  __shared__ bool last;
  const RowRange rows = block_rows(rows_per_block, V);
  const int64_t r0 = rows.r0, r1 = rows.r1;
  prefetch_rows<F>(H, rows, D);
  step_begin();
  const PassRows pr = pass_rows(M, nr);
  const int64_t stride = stage_stride(D, F);
  stage_rows<F>(Xf, nullptr, D, 0.0, xs, stride, pr);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float best = -INFINITY;
  int64_t besti = -1;
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {
    float o[R];
    warp_dot_rows<F, R>(H, r, xs, stride, pr.nrows, D, lane, 0, D, o);
    for (int b = 0; b < pr.nrows; ++b) {
      float v = o[b];
      if (softcap > 0.f) v = session_math::softcap(v, softcap);  // a family's final soft cap
      if (lane == 0) st(logits + (pr.m0 + b) * V + r, v);
      if (R == 1 && argmax_beats(v, r, best, besti)) best = v, besti = r;
    }
  }
  if (R > 1) return;  // the whole block: no argmax over several rows
  if (lane == 0) bv[warp] = best, bi[warp] = besti;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = -INFINITY;
    int64_t bix = -1;
    for (int w = 0; w < MATVEC_WARPS; ++w)
      if (argmax_beats(bv[w], bi[w], b, bix)) b = bv[w], bix = bi[w];
    st(blk_val + blockIdx.x, b);
    st(blk_idx + blockIdx.x, bix);
    __threadfence();  // release: the partial is visible device-wide before this block's ticket
    last = atomicAdd(&ctl->done, 1u) == gridDim.x - 1;
    // acquire: the last block's reads below are ordered after the ticket that saw every other
    // block's (each fenced before it was taken); without it the reads may be satisfied early
    if (last) __threadfence();
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
    st(&ctl->argmax, bix);  // every row is a candidate (V >= 1), so bix is in [0, V)
    st(&ctl->done, 0u);
  }
}

// Y (M, N) (+)= X (M, K) . W (N, K)^T for M < 32: one weight row per warp, read once per
// NARROW_ROWS activation rows (<= 4 passes), the accumulators a compile-time-indexed array; W's
// elements widened to float32 (w_at), X already as consumed (k_round_bf16 for bf16).
// grid plan matvec launch over N rows.
template <Dtype F>
__global__ void k_gemm_narrow(const float* __restrict__ X, DevMat W, float* __restrict__ Y,
                              int64_t M, int64_t N, int64_t K, int64_t rows_per_block,
                              bool accumulate) {
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
k_gemm_wide(const float* __restrict__ X, DevMat W, float* __restrict__ Y, int64_t M, int64_t N,
            int64_t K, bool accumulate) {
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
__global__ void k_round_bf16(float* __restrict__ X, int64_t K) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  float* x = X + int64_t(blockIdx.y) * K + i;
  st(x, half::bf16_to_f32(half::f32_to_bf16(ld(x))));
}

// X (M, K) quantized as decode's consume<Int8> quantizes a vector: each block of 32 of a row by
// quant::q8_block into its codes Xq (M, ldq; bytes past K zero) and scale Xs (M, ldq / 32).
// grid (ceil(ldq / 32 / ROW_THREADS), M), one thread a block.
__global__ void k_quantize_rows(const float* __restrict__ X, int64_t K, int64_t ldq,
                                int8_t* __restrict__ Xq, float* __restrict__ Xs) {
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
// products decode's warp_dot<Int8> forms. 64 x 64 tiles, 4 x 4 outputs a thread, a block of 32
// along K a step. grid (ceil(N / 64), ceil(M / 64)), GEMM_THREADS.
__global__ void __launch_bounds__(GEMM_THREADS)
k_gemm_q8(const int8_t* __restrict__ Xq, int64_t ldq, const float* __restrict__ Xs, DevMat W,
          float* __restrict__ Y, int64_t M, int64_t N, int64_t K, bool accumulate) {
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

// g (M, Fd) = act(g + bg) * (u + bu), elementwise (prefill's MLP activation, gate_act).
__global__ void k_gate_act(float* __restrict__ g, const float* __restrict__ u, int64_t n,
                           int64_t Fd, const float* __restrict__ gb, const float* __restrict__ ub,
                           bool gelu) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) g[i] = gate_act(g[i], u[i], gb, ub, i % Fd, gelu);
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

// The decode matvec: one warp's dot products of a weight row with the block's staged vectors
// (warp_dot_rows, one branch a weight format), and a block's warps over its weight rows
// (for_rows). The row kernels (k_norm_qkv, k_norm_gateup, k_matvec_residual, k_head_argmax) are
// these two with their stage's prologue (the staged, normed input: session_stage.cuh) and
// epilogue (what each output cell becomes).
//
// The row kernels: decode's matvecs over M rows (tokens of any slots and positions): grid (the
// plan's matvec grid, ceil(M / nr)), block y staging rows [y * nr, ...) (at most nr <= R of
// them, each stage_stride(K, F) bytes of dynamic shared memory) and multiplying each weight load
// by all of them (warp_dot_rows). Decode's single row is R = nr = M = 1; a batched step or a
// multi-slot prefill R = PASS_ROWS. A row's result is the same bits whichever R, nr and M carry
// it.
//
// What each weight format multiplies (the CPU engine's products, format for format): each row
// streams with 16-byte loads (4 floats, 8 halves or 16 int8 codes a lane) and widens in
// registers;
//   f32   float32 weights . the float32 vector, fmaf in element order per lane;
//   bf16, f16  the weights widened exactly to float32 (widen2) . the staged vector (bf16:
//         rounded to bf16 as staged, so each product is exact in float32);
//   int8  Q8_0 x Q8_0: each block's 32 code products summed exactly in int32 by dp4a, then
//         entering float32 once, times the two block scales.
// Each lane's partial sums then meet in a warp shuffle (gpu::warp_sum) and, with split s > 1,
// the s slices' sums in warp order: an order fixed by the launch plan, not by timing. It is not
// the CPU engine's order, so a sum agrees with the CPU's to float32 rounding times the widths.
// Never materialized: a product's partial sums beyond one shared float2 a (warp, row).
#pragma once

#include "session_device.cuh"
#include "session_stage.cuh"

namespace algenta {
namespace residentk {
namespace {

// acc + the four products a.x * x.x, ..., a.w * x.w, multiply-added in that order.
__device__ __forceinline__ float fma4(float4 a, float4 x, float acc) {
  acc = fmaf(a.x, x.x, acc);
  acc = fmaf(a.y, x.y, acc);
  acc = fmaf(a.z, x.z, acc);
  acc = fmaf(a.w, x.w, acc);
  return acc;
}

// fn(i, a) for a lane's 16-byte units of a weight row w over [k0, k1): unit i holds elements
// [i << SHIFT, (i + 1) << SHIFT) as the V a is (4 floats or 8 halves), loaded read-only; the
// lanes take every 32nd unit from lane's own, MATVEC_LOADS loads in flight.
template <class V, int SHIFT, class Fn>
__device__ __forceinline__ void for_units(const void* w, int64_t k0, int64_t k1, int lane, Fn fn) {
  const V* wv = reinterpret_cast<const V*>(w);
  const int64_t n = k1 >> SHIFT;
#pragma unroll MATVEC_LOADS
  for (int64_t i = (k0 >> SHIFT) + lane; i < n; i += 32) fn(i, __ldg(wv + i));
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
      for_units<float4, 2>(w, k0, k1, lane, [&](int64_t i, const float4& a) {
        ALGENTA_ROWS_FOR(b) {
          const float4 x = reinterpret_cast<const float4*>(staged_row(v0, stride, b).x)[i];
          acc[b] = fma4(a, x, acc[b]);
        }
      });
    } else {
      for (int64_t i = k0 + lane; i < k1; i += 32) {
        const float a = __ldg(w + i);
        ALGENTA_ROWS_FOR(b) acc[b] = fmaf(a, staged_row(v0, stride, b).x[i], acc[b]);
      }
    }
  } else if (F == Dtype::BF16 || F == Dtype::F16) {
    const uint16_t* w = static_cast<const uint16_t*>(m.w) + r * K;
    if ((K & 7) == 0) {
      for_units<int4, 3>(w, k0, k1, lane, [&](int64_t i, const int4& a) {
        const float2 p0 = widen2<F>(uint32_t(a.x)), p1 = widen2<F>(uint32_t(a.y));
        const float2 p2 = widen2<F>(uint32_t(a.z)), p3 = widen2<F>(uint32_t(a.w));
        ALGENTA_ROWS_FOR(b) {
          const float4* x4 = reinterpret_cast<const float4*>(staged_row(v0, stride, b).x);
          const float4 b0 = x4[2 * i], b1 = x4[2 * i + 1];
          acc[b] = fma4(make_float4(p0.x, p0.y, p1.x, p1.y), b0, acc[b]);
          acc[b] = fma4(make_float4(p2.x, p2.y, p3.x, p3.y), b1, acc[b]);
        }
      });
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

// The body of a row kernel of one product, W (N, K) . X (M, K)^T with X's rows normed by nw
// where given: the weights' prefetch, the staged pass (begin_pass), then for_rows; out(pr, r, b,
// d) in one lane with weight row r's product with staged row b (row pr.m0 + b of X) in d.x.
template <Dtype F, int R, class Out>
__device__ __forceinline__ void row_matvec(const DevMat& W, const float* __restrict__ X,
                                           const float* __restrict__ nw, double eps, int64_t K,
                                           int64_t N, int64_t rows_per_block, int split,
                                           int64_t M, int nr, Out out) {
  extern __shared__ float4 smem4[];
  prefetch_rows<F>(W, block_rows(rows_per_block, N), K);
  const RowPass p = begin_pass<F>(smem4, X, nw, K, eps, M, nr);
  for_rows<R>(
      rows_per_block, N, K, split, p.pr.nrows,
      [&](int64_t r, int64_t k0, int64_t k1, float2 (&d)[R]) {
        float o[R];
        warp_dot_rows<F, R>(W, r, p.v, p.stride, p.pr.nrows, K, threadIdx.x & 31, k0, k1, o);
        for (int b = 0; b < R; ++b) d[b] = make_float2(o[b], 0.f);
      },
      [&](int64_t r, int b, float2 d) { out(p.pr, r, b, d); });
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

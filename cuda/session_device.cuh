// The CUDA session's device vocabulary, shared by every stage header (session_*.cuh): the
// resident weight matrix as the kernels see it (DevMat) and its elements widened to float32
// (w_at), the opening of every decode kernel (step_begin: the programmatic-dependent-launch
// wait, then the next kernel's launch; prefetch_rows: a matvec block's weight rows asked of L2
// before the wait), the rows a block owns, and the KV cache's elements in their format. No
// kernel lives here. The per-element math is session_math.hpp's, the bf16/f16 conversions
// half.hpp's and the int8 block rule quant.hpp's, all shared with the CPU engine.
//
// Dimension legend (every session_*.cuh): M rows a launch carries (tokens of any slots and
// positions), D d_model, Fd d_ff, Hq query heads, Hkv key/value heads, G = Hq/Hkv, Dh d_head,
// Q = (Hq + 2*Hkv)*Dh fused q/k/v rows, A = Hq*Dh, V vocab, T capacity, P a row's position,
// S split-K splits, K a product's reduction width, N its output rows, R a row kernel's width.
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

using gpu::block_sum_d;
using gpu::ld;
using gpu::st;
using gpu::warp_max;
using gpu::warp_sum;
using gpu::warp_sum_d;

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

}  // namespace
}  // namespace residentk
}  // namespace algenta

// The CUDA resident decode engine: Qwen3 in float32, weights and a fixed-capacity KV cache held
// in device memory for the session's whole life; the same model, stage for stage, as the CPU
// engine (cpp/src/session_cpu.cpp), which is its reference. The registry, the refusals and the
// position are SessionBase's (cpp/include/algenta/session_base.hpp), shared with the CPU engine.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, G = Hq/Hkv, Dh d_head,
// Q = (Hq + 2*Hkv)*Dh fused q/k/v rows, A = Hq*Dh, F d_ff, L layers, V vocab, T capacity,
// P position, M prefill block rows, S split-K splits.
//
// Decode launches, per token, exactly the stages residentk_dispatch_budget counts:
//   fixed:     k_embed (x = E[tok])  ...  k_rmsnorm_rows (xf)  ...  k_head_argmax (logits, argmax)
//   per layer: 1 k_norm_qkv        qkv = Wqkv rmsnorm(x)         (norm fused: each block stages it)
//              2 k_qk_norm_rope    per head q/k RMSNorm + RoPE; K and V written to slot P in place
//              3 k_attn_partial    softmax(q K[0..P]^T / sqrt(Dh)) V[0..P], online softmax
//                (+ k_attn_merge when residentk_splitk_should_split(P+1): S partials, then merge,
//                 the residentk_dispatch_budget_deep count)
//              4 k_matvec_residual x += Wo attn
//              5 k_norm_gateup     act = silu(Wg rmsnorm(x)) * (Wu rmsnorm(x))
//              6 k_matvec_residual x += Wd act
// Never materialized: the normed x (each block rebuilds it in shared memory, D floats, instead
// of a separate launch), gate and up separately, any [T]-sized score row (online softmax keeps a
// running max and sum per warp), the logits on the host in greedy decoding (the head kernel's
// last block reduces the per-block maxima and leaves the argmax on the device).
//
// Each step's token, position and split count reach the device in one copy into a control block
// the kernels read, so a step's launch sequence depends on nothing else: two CUDA graphs (the
// standard path; the split-K path, its grid sized once to the plan's maximum split count, the
// blocks past this step's count exiting at once) are captured when the session opens and one is
// replayed per token. ALGENTA_CUDA_GRAPHS=0 at session open launches kernel by kernel instead.
//
// Prefill runs blocks of M <= PREFILL_BLOCK tokens as GEMMs: k_gemm_narrow (one weight row per
// warp, NARROW_ROWS activation rows per pass, for M < 32) or k_gemm_wide (64 x 64 shared-memory
// tiles), as residentk_prefill_gemm_use_narrow_tile decides; attention is k_attn_partial with one
// split per (head, row), causal through n_keys = P + row + 1.
//
// Numerics: float32 throughout; RMSNorm sums squares in double and rounds the inverse once, as
// the CPU engine; RoPE uses the same host-built table. Dot products reduce in a different order
// than the CPU engine (lanes, then a warp shuffle), so logits agree with it to float32 rounding
// times the reduction widths, not bit for bit (the tests' tolerance is documented in
// tests/test_residentk_cuda.py).
//
// Limits: shapes residentk_shape_check accepts (the largest staged vector max(D, F, A) fits the
// compiled shared-memory tier, and the device's opt-in per-block limit, checked at open). All
// host-side sizes, grids and offsets come from session_cuda_plan.hpp (tested on the CPU).
// Prefill attention is the decode kernel run once per (head, row), not a tiled flash kernel:
// correct at any length, but O(M * P) key reads per layer with no reuse across rows.
// Errors: every CUDA call is checked; a failure throws StatusError 608 naming the call. A host
// without a usable device gets 605 before any allocation. Nothing here aborts or exits.
//
// Verified: every kernel and host path here runs in CI on the CPU emulator (cuda/emu,
// ALGENTA_CUDA_EMU) in forward, reverse and random thread order against the CPU engine. Not
// covered there: device expf rounding, memory ordering between blocks beyond what the
// emulator's sequentially consistent atomics give, timing. Those need a device run
// (tests/test_residentk_cuda.py and perf/bench_decode_gpu.py, see README).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "algenta/residentk.hpp"
#include "algenta/session_base.hpp"
#include "algenta/session_math.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"
#include "session_cuda_plan.hpp"

namespace algenta {
namespace residentk {

namespace {

using namespace cudaplan;

[[noreturn]] void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Resident, code, msg);
}

// Any CUDA error -> 608. The pending error is cleared first so a later, unrelated call does not
// report it again (a sticky error such as a device fault keeps failing, and keeps saying so).
void ck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  refuse(RESIDENT_ERR_LAUNCH_FAILED, std::string("CUDA call failed: ") + what + ": " +
                                         cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define CK(call) ck((call), #call)

// ---- device helpers ---------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total.
// red: 32 doubles of shared memory. Two barriers; the caller may reuse red afterwards.
__device__ double block_sum_d(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_d(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double t = lane < nw ? red[lane] : 0.0;
  t = warp_sum_d(t);
  __syncthreads();  // red is free again once every warp has read it
  return t;
}

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

// ---- host side ------------------------------------------------------------------------------

static_assert(GEMM_BM == GEMM_BN, "k_gemm_wide loads both tiles with one index: BM == BN");
static_assert(GEMM_THREADS == 256 && GEMM_BM == 64 && GEMM_BN == 64,
              "k_gemm_wide: 16 x 16 threads, each 4 x 4 outputs of a 64 x 64 tile");
static_assert((GEMM_BM * GEMM_BK) % GEMM_THREADS == 0, "k_gemm_wide: whole tile loads per thread");
static_assert(MATVEC_THREADS % WARP == 0 && MATVEC_WARPS == MATVEC_THREADS / WARP &&
                  MATVEC_WARPS <= 32,
              "matvec kernels: whole warps, one partial per warp in a 32-entry shared array");
static_assert(ATTN_THREADS == ATTN_WARPS * WARP && ATTN_WARPS <= 32,
              "k_attn_partial: whole warps; per-warp (m, l) pairs in the plan's smem size");
static_assert(ROW_THREADS % WARP == 0 && ROW_THREADS <= 1024,
              "block reductions: whole warps, at most 32 of them");

// A device allocation freed on scope exit, so a 608 halfway through opening frees what was taken.
// Never zeroed here: what must start at zero is cleared on the session's stream (a cudaMemset on
// the legacy default stream is not ordered before work on a non-blocking stream).
struct DevMem {
  void* p = nullptr;
  DevMem() = default;
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  ~DevMem() {
    if (p) cudaFree(p);
  }
  void alloc(int64_t bytes, const char* what) {
    ck(cudaMalloc(&p, size_t(bytes > 0 ? bytes : 16)), what);
  }
  float* f() const { return static_cast<float*>(p); }
};

// Pinned host memory: copies from and to it are truly asynchronous (a pageable source makes the
// runtime stage it and a pageable destination drains the stream), and they read or write it
// when they run, not when they are enqueued: a slot is rewritten only after the stream that
// reads it was synchronized.
template <class T>
struct Pinned {
  T* p = nullptr;
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (p) cudaFreeHost(p);
  }
  void alloc(int64_t n, const char* what) {
    ck(cudaMallocHost(reinterpret_cast<void**>(&p), size_t(n) * sizeof(T)), what);
  }
};

// The session's non-blocking stream, destroyed with the session (also when opening throws).
struct Stream {
  cudaStream_t s = nullptr;
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
  void create() { ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  operator cudaStream_t() const { return s; }
};

// Loads a kernel's module now (cudaFuncGetAttributes): with lazy loading, CUDA 12's default, a
// kernel's first launch loads it, which must not happen inside a graph capture. A kernel with
// dynamic shared memory also gets the opt-in above 48 KiB, set to the same value (all the
// device allows beside its static arrays) by every session: the attribute is per function and
// process-wide, and a smaller model opened later must not lower it under a larger open session.
template <class F>
void load_kernel(F* fn, const char* what, int optin_smem) {
  const void* f = reinterpret_cast<const void*>(fn);
  cudaFuncAttributes a{};
  ck(cudaFuncGetAttributes(&a, f), what);
  if (optin_smem > 0)
    ck(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            optin_smem - int(a.sharedSizeBytes)),
       what);
}

class CudaSession final : public SessionBase {
 public:
  CudaSession(const SessionConfig& c, int64_t max_ctx) : SessionBase(c, max_ctx) {
    // The device kernels read float32 weights only (narrow formats are the CPU engine's).
    if (c.weights != WeightFormat::F32)
      refuse(RESIDENT_ERR_WEIGHT_LENGTH,
             std::string("device='cuda' holds float32 weights only; weights='") +
                 residentk_weight_format_name(c.weights) + "' runs on device='cpu'");
    const CudaBackend& be = cuda_backend();
    if (!be.usable)
      refuse(RESIDENT_ERR_NO_ACCELERATOR,
             "device='cuda': the CUDA backend is built in but this host has no usable CUDA "
             "device (" + be.why + "); use device='cpu'");
    CK(cudaGetDevice(&dev_));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, dev_));
    plan_ = make_plan(c, max_ctx, prop.multiProcessorCount);
    if (plan_.status != RESIDENT_OK) refuse(plan_.status, plan_.why);

    // Shared memory per block: the staged vector (max(D, F, A) floats) plus the kernels' own
    // static arrays (under 1 KiB) must fit the device's opt-in limit.
    const int64_t staged_bytes = plan_.staged_floats * 4;
    if (staged_bytes + 1024 > int64_t(prop.sharedMemPerBlockOptin))
      refuse(RESIDENT_ERR_DIMENSION_TOO_LARGE,
             "largest staged vector (" + std::to_string(staged_bytes) + " bytes) exceeds " +
                 prop.name + "'s per-block shared memory (" +
                 std::to_string(prop.sharedMemPerBlockOptin) + " bytes)");

    // Everything the session will ever hold, checked against free device memory before the
    // first allocation, so an oversized session is one clear 608 rather than a partial open.
    const int64_t bytes = 4 * (plan_.weight_floats + plan_.kv_floats + plan_.rope_floats +
                               plan_.act_floats + plan_.prefill_floats) +
                          8 * (plan_.head_mv.grid + plan_.prefill_rows) + int64_t(sizeof(Control));
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    if (bytes > int64_t(free_b))
      refuse(RESIDENT_ERR_LAUNCH_FAILED,
             "the session needs " + std::to_string(bytes) + " bytes of device memory, " +
                 std::to_string(free_b) + " are free on " + prop.name);

    stream_.create();
    // Nothing below is zeroed but the control block: every weight is written before the first
    // token can run (the registry refuses a step until all are), KV slots are written before
    // attention reads them, and every scratch cell is written by the kernel before its reader.
    weights_dev_.alloc(4 * plan_.weight_floats, "cudaMalloc(weights)");
    kv_.alloc(4 * plan_.kv_floats, "cudaMalloc(kv cache)");
    rope_.alloc(4 * plan_.rope_floats, "cudaMalloc(rope table)");
    act_.alloc(4 * plan_.act_floats, "cudaMalloc(decode activations)");
    pre_.alloc(4 * plan_.prefill_floats, "cudaMalloc(prefill activations)");
    blk_idx_.alloc(8 * plan_.head_mv.grid, "cudaMalloc(argmax scratch)");
    ids_.alloc(8 * plan_.prefill_rows, "cudaMalloc(prefill ids)");
    ctl_.alloc(sizeof(Control), "cudaMalloc(control)");
    CK(cudaMemsetAsync(ctl_.p, 0, sizeof(Control), stream_));
    host_.alloc(4, "cudaMallocHost(control slot)");
    staging_.alloc(STAGING_FLOATS, "cudaMallocHost(weight staging)");

    const std::vector<float> rope = rope_table(c, plan_.capacity);
    upload(rope_.f(), rope.data(), int64_t(rope.size()));

    const int optin = int(prop.sharedMemPerBlockOptin);
    load_kernel(k_embed, "k_embed", 0);
    load_kernel(k_rmsnorm_rows, "k_rmsnorm_rows", 0);
    load_kernel(k_norm_qkv, "k_norm_qkv", optin);
    load_kernel(k_norm_gateup, "k_norm_gateup", optin);
    load_kernel(k_matvec_residual, "k_matvec_residual", optin);
    load_kernel(k_head_argmax, "k_head_argmax", optin);
    load_kernel(k_qk_norm_rope, "k_qk_norm_rope", 0);
    load_kernel(k_attn_partial, "k_attn_partial", optin);
    load_kernel(k_attn_merge, "k_attn_merge", 0);
    load_kernel(k_gemm_narrow, "k_gemm_narrow", 0);
    load_kernel(k_gemm_wide, "k_gemm_wide", 0);
    load_kernel(k_silu_mul, "k_silu_mul", 0);

    // The two decode graphs (standard path, and split-K with the split count read on the
    // device), captured once: only kernels, reading the control block when they run.
    const char* g = std::getenv("ALGENTA_CUDA_GRAPHS");
    use_graphs_ = !(g && std::string(g) == "0");
    if (use_graphs_) {
      capture(standard_, false);
      capture(deep_, true);
    }
    CK(cudaStreamSynchronize(stream_));
  }

  ~CudaSession() override {
    if (stream_.s) cudaStreamSynchronize(stream_.s);
    cudaGetLastError();  // a destructor reports nothing; leave no pending error behind
  }

  const char* device() const override { return "cuda"; }

 protected:
  // A tensor's float32 rows are staged in pinned memory a chunk at a time and uploaded into
  // their arena offset (loading never holds a float32 copy of a whole tensor on the side).
  float* stage_weight(const TensorSpec&, int64_t, int64_t) override {
    use_device();
    return staging_.p;
  }
  void commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) override {
    // The staging slot is reused by the next chunk: wait for this copy before returning.
    upload(weights_dev_.f() + arena_offset(t) + r0 * t.cols(), staging_.p, (r1 - r0) * t.cols());
  }
  int64_t weight_chunk_elems() const override { return STAGING_FLOATS; }

  void run_prefill(const int64_t* ids, int64_t n, float* logits) override {
    use_device();
    for (int64_t b = 0; b < n; b += plan_.prefill_rows) {
      const int64_t m = std::min(plan_.prefill_rows, n - b);
      prefill_block(ids + b, m, pos_ + b, b + m == n ? logits : nullptr);
    }
  }

  void run_step(int64_t id, float* logits) override {
    use_device();
    decode(id);
    CK(cudaMemcpyAsync(logits, act_.f() + plan_.logits, size_t(c_.vocab) * 4,
                       cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  int64_t run_step_greedy(int64_t id) override {
    use_device();
    decode(id);
    CK(cudaMemcpyAsync(&host_.p[3], &ctl()->argmax, sizeof(int64_t), cudaMemcpyDeviceToHost,
                       stream_));
    CK(cudaStreamSynchronize(stream_));
    return host_.p[3];
  }

 private:
  static constexpr int64_t STAGING_FLOATS = int64_t(1) << 20;  // 4 MiB of pinned staging

  // An instantiated decode graph, destroyed with the session (also when opening throws).
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t kernels = 0;
    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
      if (exec) cudaGraphExecDestroy(exec);
    }
  };

  // Offset (floats) of a table entry in the weight arena (q, k and v share the fused rows).
  int64_t arena_offset(const TensorSpec& t) const {
    const int64_t D = c_.d_model, Dh = c_.d_head;
    const LayerOffsets* l = t.layer >= 0 ? &plan_.layers[size_t(t.layer)] : nullptr;
    switch (t.field) {
      case Field::Embed: return plan_.embed;
      case Field::LmHead: return plan_.head;
      case Field::FinalNorm: return plan_.final_norm;
      case Field::InNorm: return l->in_norm;
      case Field::QProj: return l->wqkv;
      case Field::KProj: return l->wqkv + c_.h_q * Dh * D;
      case Field::VProj: return l->wqkv + (c_.h_q + c_.h_kv) * Dh * D;
      case Field::QNorm: return l->q_norm;
      case Field::KNorm: return l->k_norm;
      case Field::OProj: return l->wo;
      case Field::PostNorm: return l->post_norm;
      case Field::Gate: return l->wg;
      case Field::Up: return l->wu;
      case Field::Down: return l->wd;
    }
    return 0;
  }

  Control* ctl() const { return static_cast<Control*>(ctl_.p); }
  const float* W(int64_t off) const { return weights_dev_.f() + off; }
  float* kcache(int64_t l) const { return kv_.f() + l * plan_.kv_layer_stride; }
  float* vcache(int64_t l) const { return kcache(l) + c_.h_kv * plan_.capacity * c_.d_head; }
  float* A(int64_t off) const { return act_.f() + off; }
  float* P(int64_t off) const { return pre_.f() + off; }

  void launched(const char* what) { ck(cudaGetLastError(), what); }
  // The CUDA current device is per host thread: a call from another thread (or after the caller
  // switched devices) must run on the device this session's memory lives on.
  void use_device() { CK(cudaSetDevice(dev_)); }

  // Host -> device on the session's stream, finished before returning (src may be reused).
  void upload(float* dst, const float* src, int64_t n) {
    CK(cudaMemcpyAsync(dst, src, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  // tok, pos and n_splits into the control block, from the pinned slot. Every call that enqueues
  // work synchronizes before returning, so the previous copy out of the slot has completed.
  void set_control(int64_t tok, int64_t pos, int64_t n_splits) {
    host_.p[0] = tok;
    host_.p[1] = pos;
    host_.p[2] = n_splits;
    CK(cudaMemcpyAsync(ctl(), host_.p, size_t(CONTROL_IN_BYTES), cudaMemcpyHostToDevice,
                       stream_));
  }

  // Y (M, N) (+)= X (M, K) W^T, tile chosen by residentk_prefill_gemm_use_narrow_tile(M).
  void gemm(const float* X, int64_t M, int64_t K, const float* Wt, int64_t N, float* Y,
            bool accumulate) {
    const GemmGrid g = prefill_gemm_grid(M, N, plan_.sms);
    if (g.narrow) {
      k_gemm_narrow<<<unsigned(g.gx), MATVEC_THREADS, 0, stream_>>>(X, Wt, Y, M, N, K,
                                                                    g.rows_per_block, accumulate);
      launched("k_gemm_narrow");
    } else {
      k_gemm_wide<<<dim3(unsigned(g.gx), unsigned(g.gy)), GEMM_THREADS, 0, stream_>>>(
          X, Wt, Y, M, N, K, accumulate);
      launched("k_gemm_wide");
    }
  }

  // The per-row q/k norm + RoPE + KV write and attention launches shared by decode (M = 1) and
  // prefill.
  void norm_rope(const LayerOffsets& l, int64_t li, float* qkv, int64_t M) {
    k_qk_norm_rope<<<dim3(unsigned(c_.h_q + 2 * c_.h_kv), unsigned(M)),
                     unsigned(plan_.norm_rope_threads), 0, stream_>>>(
        qkv, plan_.q_rows, W(l.q_norm), W(l.k_norm), rope_.f(), ctl(), c_.h_q, c_.h_kv,
        c_.d_head, plan_.capacity, c_.rms_eps, kcache(li), vcache(li));
    launched("k_qk_norm_rope");
  }
  void attention(int64_t li, const float* qkv, int64_t M, int64_t S_grid, bool splits_on_device,
                 bool finalize, float* out) {
    const float scale = float(1.0 / std::sqrt(double(c_.d_head)));
    k_attn_partial<<<dim3(unsigned(c_.h_q), unsigned(S_grid), unsigned(M)), ATTN_THREADS,
                     size_t(plan_.attn_smem_bytes), stream_>>>(
        qkv, plan_.q_rows, kcache(li), vcache(li), ctl(), plan_.capacity, c_.h_q / c_.h_kv,
        c_.d_head, scale, splits_on_device, finalize, out, A(plan_.part_acc), A(plan_.part_ml));
    launched("k_attn_partial");
  }

  // One decode token at P = pos_: token, position and split count go to the control block,
  // then the step's kernels run, replayed from the graph of its path (standard or split-K;
  // ALGENTA_CUDA_GRAPHS=0 launches them one by one instead). dispatches_ counts kernels.
  void decode(int64_t id) {
    const SplitPlan sp = splitk_plan(pos_ + 1, plan_.sms, c_.h_q);
    set_control(id, pos_, sp.n_splits);
    if (use_graphs_) {
      const Graph& g = sp.split ? deep_ : standard_;
      CK(cudaGraphLaunch(g.exec, stream_));
      dispatches_ = g.kernels;
    } else {
      dispatches_ = enqueue_decode(sp.split);
    }
  }

  void capture(Graph& out, bool deep) {
    CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    int64_t kernels = 0;
    try {
      kernels = enqueue_decode(deep);
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream_, &g);  // leave the stream out of capture mode, then rethrow
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t g = nullptr;
    CK(cudaStreamEndCapture(stream_, &g));
    const cudaError_t err = cudaGraphInstantiate(&out.exec, g, 0);
    cudaGraphDestroy(g);
    ck(err, "cudaGraphInstantiate(decode step)");
    out.kernels = kernels;
  }

  // Enqueues one decode step's kernels on stream_ (token, P and S read on the device); returns
  // how many. The split-K path sizes its grid to the plan's maximum split count.
  int64_t enqueue_decode(bool deep) {
    const int64_t D = c_.d_model, F = c_.d_ff, Aw = plan_.attn_width;
    int64_t n = 0;
    k_embed<<<dim3(unsigned(ceil_div(D, ROW_THREADS)), 1), ROW_THREADS, 0, stream_>>>(
        W(plan_.embed), &ctl()->tok, A(plan_.x), D);
    launched("k_embed");
    ++n;
    for (int64_t li = 0; li < c_.n_layers; ++li) {
      const LayerOffsets& l = plan_.layers[size_t(li)];
      k_norm_qkv<<<unsigned(plan_.qkv_mv.grid), MATVEC_THREADS, size_t(D) * 4, stream_>>>(
          W(l.wqkv), A(plan_.x), W(l.in_norm), D, plan_.q_rows, c_.rms_eps,
          plan_.qkv_mv.rows_per_block, A(plan_.qkv));
      launched("k_norm_qkv");
      ++n;
      norm_rope(l, li, A(plan_.qkv), 1);
      ++n;
      attention(li, A(plan_.qkv), 1, deep ? plan_.max_splits : 1, deep, !deep, A(plan_.attn));
      ++n;
      if (deep) {
        k_attn_merge<<<unsigned(c_.h_q), ROW_THREADS, 0, stream_>>>(
            A(plan_.part_acc), A(plan_.part_ml), ctl(), c_.d_head, A(plan_.attn));
        launched("k_attn_merge");
        ++n;
      }
      k_matvec_residual<<<unsigned(plan_.o_mv.grid), MATVEC_THREADS, size_t(Aw) * 4, stream_>>>(
          W(l.wo), A(plan_.attn), Aw, D, plan_.o_mv.rows_per_block, A(plan_.x));
      launched("k_matvec_residual(o_proj)");
      ++n;
      k_norm_gateup<<<unsigned(plan_.gateup_mv.grid), MATVEC_THREADS, size_t(D) * 4, stream_>>>(
          W(l.wg), W(l.wu), A(plan_.x), W(l.post_norm), D, F, c_.rms_eps,
          plan_.gateup_mv.rows_per_block, A(plan_.act));
      launched("k_norm_gateup");
      ++n;
      k_matvec_residual<<<unsigned(plan_.down_mv.grid), MATVEC_THREADS, size_t(F) * 4, stream_>>>(
          W(l.wd), A(plan_.act), F, D, plan_.down_mv.rows_per_block, A(plan_.x));
      launched("k_matvec_residual(down)");
      ++n;
    }
    n += head(A(plan_.x));
    return n;
  }

  // Final norm of row x (D), the head and its argmax (into the control block).
  int64_t head(const float* x) {
    const int64_t D = c_.d_model;
    k_rmsnorm_rows<<<1, ROW_THREADS, 0, stream_>>>(x, W(plan_.final_norm), D, c_.rms_eps,
                                                   A(plan_.xf));
    launched("k_rmsnorm_rows(final)");
    k_head_argmax<<<unsigned(plan_.head_mv.grid), MATVEC_THREADS, size_t(D) * 4, stream_>>>(
        W(plan_.head), A(plan_.xf), D, c_.vocab, plan_.head_mv.rows_per_block, A(plan_.logits),
        A(plan_.argmax_val), static_cast<int64_t*>(blk_idx_.p), ctl());
    launched("k_head_argmax");
    return 2;
  }

  // M tokens at positions p0..p0+M-1; the last one's logits when asked.
  void prefill_block(const int64_t* ids, int64_t M, int64_t p0, float* logits) {
    const int64_t D = c_.d_model, F = c_.d_ff, Q = plan_.q_rows, Aw = plan_.attn_width;
    set_control(0, p0, 1);
    CK(cudaMemcpyAsync(ids_.p, ids, size_t(M) * 8, cudaMemcpyHostToDevice, stream_));
    float *X = P(plan_.p_x), *Xn = P(plan_.p_xn), *QKV = P(plan_.p_qkv), *At = P(plan_.p_attn);
    float *Gt = P(plan_.p_gate), *U = P(plan_.p_up);
    k_embed<<<dim3(unsigned(ceil_div(D, ROW_THREADS)), unsigned(M)), ROW_THREADS, 0, stream_>>>(
        W(plan_.embed), static_cast<const int64_t*>(ids_.p), X, D);
    launched("k_embed(prefill)");
    for (int64_t li = 0; li < c_.n_layers; ++li) {
      const LayerOffsets& l = plan_.layers[size_t(li)];
      k_rmsnorm_rows<<<unsigned(M), ROW_THREADS, 0, stream_>>>(X, W(l.in_norm), D, c_.rms_eps, Xn);
      launched("k_rmsnorm_rows(input)");
      gemm(Xn, M, D, W(l.wqkv), Q, QKV, false);
      norm_rope(l, li, QKV, M);
      attention(li, QKV, M, 1, false, true, At);
      gemm(At, M, Aw, W(l.wo), D, X, true);
      k_rmsnorm_rows<<<unsigned(M), ROW_THREADS, 0, stream_>>>(X, W(l.post_norm), D, c_.rms_eps,
                                                               Xn);
      launched("k_rmsnorm_rows(post)");
      gemm(Xn, M, D, W(l.wg), F, Gt, false);
      gemm(Xn, M, D, W(l.wu), F, U, false);
      k_silu_mul<<<unsigned(ceil_div(M * F, ROW_THREADS)), ROW_THREADS, 0, stream_>>>(Gt, U, M * F);
      launched("k_silu_mul");
      gemm(Gt, M, F, W(l.wd), D, X, true);
    }
    if (logits) {
      head(X + (M - 1) * D);
      CK(cudaMemcpyAsync(logits, A(plan_.logits), size_t(c_.vocab) * 4, cudaMemcpyDeviceToHost,
                         stream_));
    }
    // The control slot and the ids buffer are reused by the next block: finish this one first.
    CK(cudaStreamSynchronize(stream_));
  }

  int dev_ = 0;
  Plan plan_;
  Stream stream_;  // declared before the buffers: destroyed after them (cudaFree syncs first)
  Pinned<int64_t> host_;    // [0..2] tok, pos, n_splits going in; [3] the argmax coming out
  Pinned<float> staging_;   // weight rows on their way to the arena
  DevMem weights_dev_, kv_, rope_, act_, pre_, blk_idx_, ids_, ctl_;
  Graph standard_, deep_;   // destroyed first: they refer to the buffers above
  bool use_graphs_ = true;
};

}  // namespace

std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx) {
  return std::unique_ptr<Session>(new CudaSession(cfg, max_ctx));
}

double cuda_copy_bandwidth(int64_t bytes, int reps) {
  if (bytes < 1 || reps < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "bytes and reps must be >= 1");
  const CudaBackend& be = cuda_backend();
  if (!be.usable) refuse(RESIDENT_ERR_NO_ACCELERATOR, "no usable CUDA device: " + be.why);
  DevMem a, b;
  a.alloc(bytes, "cudaMalloc(bandwidth src)");
  b.alloc(bytes, "cudaMalloc(bandwidth dst)");
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  CK(cudaEventCreate(&e0));
  if (cudaEventCreate(&e1) != cudaSuccess) {
    cudaEventDestroy(e0);
    ck(cudaGetLastError(), "cudaEventCreate");
  }
  double best = 0.0;
  cudaError_t err = cudaMemcpy(b.p, a.p, size_t(bytes), cudaMemcpyDeviceToDevice);  // warm-up
  for (int r = 0; r < reps && err == cudaSuccess; ++r) {
    float ms = 0.f;
    if ((err = cudaEventRecord(e0)) != cudaSuccess) break;
    if ((err = cudaMemcpyAsync(b.p, a.p, size_t(bytes), cudaMemcpyDeviceToDevice)) != cudaSuccess)
      break;
    if ((err = cudaEventRecord(e1)) != cudaSuccess) break;
    if ((err = cudaEventSynchronize(e1)) != cudaSuccess) break;
    if ((err = cudaEventElapsedTime(&ms, e0, e1)) != cudaSuccess) break;
    if (ms > 0.f) best = std::max(best, 2.0 * double(bytes) / (double(ms) * 1e-3));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  ck(err, "cudaMemcpy(device to device, timed)");
  return best;
}

}  // namespace residentk
}  // namespace algenta

// The CUDA resident decode engine: Qwen3 in float32, weights and a fixed-capacity KV cache held
// in device memory for the session's whole life; the same model, stage for stage, as the CPU
// engine (cpp/src/session_cpu.cpp), which is its reference.
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
// last block reduces the per-block maxima and writes the next token id on the device).
//
// The position P and the current token id live in device memory (Control): k_qk_norm_rope and
// the attention kernels read P there, and the head kernel advances it, so a decode step's launch
// sequence depends on the host only through the split count. Each step is therefore captured
// once per split count as a CUDA graph and replayed (one cudaGraphLaunch per token instead of
// 3 + 6L launches); ALGENTA_CUDA_GRAPHS=0 at session open launches kernel by kernel instead.
//
// Prefill runs blocks of M <= PREFILL_BLOCK tokens as GEMMs: k_gemm_narrow (one weight row per
// warp, NARROW_ROWS activation rows per pass, for M < 32) or k_gemm_wide (64 x 64 shared-memory
// tiles), as residentk_prefill_gemm_use_narrow_tile decides; attention is k_attn_partial with one
// split per (head, row), causal through n_keys = P + row + 1.
//
// Numerics: float32 throughout; RMSNorm sums squares in double and rounds the inverse once, as
// the CPU engine; RoPE uses the same host-built double-precision table rounded to float. Dot
// products reduce in a different order than the CPU engine (lanes, then a warp shuffle), so
// logits agree with it to float32 rounding times the reduction widths, not bit for bit (the
// tests' tolerance is documented in tests/test_residentk_cuda.py).
//
// Limits: shapes residentk_shape_check accepts (the largest staged vector max(D, F, A) fits the
// compiled shared-memory tier, and the device's opt-in per-block limit, checked at open). All
// host-side sizes, grids and offsets come from session_cuda_plan.hpp (tested on the CPU).
// Prefill attention is the decode kernel run once per (head, row), not a tiled flash kernel:
// correct at any length, but O(M * P) key reads per layer with no reuse across rows.
// Errors: every CUDA call is checked; a failure throws StatusError 608 naming the call. A host
// without a usable device gets 605 before any allocation. Nothing here aborts or exits.
//
// Status: compiled for sm_80/86/90 in the ALGENTA_GPU build and its host-side plan tested on the
// CPU; written on a host without a GPU, so the golden tests (tests/test_residentk_cuda.py) and
// perf/bench_decode_gpu.py have not yet run on a device, and nothing here is tuned by measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/session_cuda_plan.hpp"
#include "algenta/status_error.hpp"

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
  const float inv = float(1.0 / sqrt(ss / double(n) + eps));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = w[i] * (x[i] * inv);
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
struct Control {
  int64_t tok;        // the token the next decode step embeds (argmax of the last head launch)
  int64_t pos;        // P: tokens in the KV cache
  unsigned int done;  // head blocks finished in the current launch (last-block reduction)
};

// ---- kernels ------------------------------------------------------------------------------

// X (M, D) row r = E[ids[r]]. grid (ceil(D / ROW_THREADS), M). ids validated on the host, or
// written by k_head_argmax (always in [0, V)).
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
    if (lane == 0) act[r] = g / (1.0f + expf(-g)) * u;
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
    const float inv = float(1.0 / sqrt(ss / double(Dh) + eps));
    if (half == 0) {  // Dh == 1: no rotation pair exists
      if (threadIdx.x == 0) v[0] = w[0] * (v[0] * inv);
    }
    const float* cs = rope + p * (half > 0 ? half : 1);
    const float* sn = cs + T * (half > 0 ? half : 1);
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const float a = w[i] * (v[i] * inv), b = w[i + half] * (v[i + half] * inv);
      v[i] = a * cs[i] - b * sn[i];
      v[i + half] = b * cs[i] + a * sn[i];
    }
    __syncthreads();
  }
  if (h >= Hq) {
    const int64_t g = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
    float* dst = (h < Hq + Hkv ? Kc : Vc) + (g * T + p) * Dh;
    for (int64_t i = threadIdx.x; i < Dh; i += blockDim.x) dst[i] = v[i];
  }
}

// Attention of query head h, key split s, query row `row`: grid (Hq, S, M), ATTN_THREADS.
// n_keys = P + row + 1 (causal); the split covers splitk_range(n_keys, S, s). Each warp walks
// every ATTN_WARPS-th key of the split with an online softmax (running max m, sum l, output
// accumulator rescaled by exp(m_old - m_new)), then the block merges its warps.
// finalize (S must be 1): writes out (M, A) normalized. Otherwise writes the unnormalized
// partial (acc, m, l) for k_attn_merge (S may be 1 there too: the deep path's launch count does
// not depend on S); an empty split writes m = -inf, l = 0, acc = 0.
// Shared memory: q (Dh), per-warp accumulators (ATTN_WARPS, Dh), per-warp (m, l).
__global__ void k_attn_partial(const float* __restrict__ qkv /* (M, Q) */, int64_t Q,
                               const float* __restrict__ Kc /* (Hkv, T, Dh) */,
                               const float* __restrict__ Vc /* (Hkv, T, Dh) */,
                               const Control* __restrict__ ctl, int64_t T, int64_t G, int64_t Dh,
                               float scale, bool finalize, float* __restrict__ out /* (M, A) */,
                               float* __restrict__ part_acc /* (Hq, S, Dh) */,
                               float* __restrict__ part_ml /* (Hq, S, 2) */) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* acc = qs + Dh;
  float* ml = acc + ATTN_WARPS * Dh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.x, s = blockIdx.y, S = gridDim.y, row = blockIdx.z;
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
// non-empty splits. grid Hq, ROW_THREADS; S <= RESIDENT_SPLITK_MAX_SPLITS.
__global__ void k_attn_merge(const float* __restrict__ part_acc /* (Hq, S, Dh) */,
                             const float* __restrict__ part_ml /* (Hq, S, 2) */, int64_t S,
                             int64_t Dh, float* __restrict__ out /* (A) */) {
  __shared__ float wts[RESIDENT_SPLITK_MAX_SPLITS];
  __shared__ float redf[32];
  __shared__ double red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t h = blockIdx.x;
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

// Does candidate (v, i) beat the best so far (b, bix)? Index -1 is "no candidate"; a larger
// value wins, and on equal values the smaller index (numpy.argmax's first maximum).
__device__ __forceinline__ bool beats(float v, int64_t i, float b, int64_t bix) {
  return i >= 0 && (bix < 0 || v > b || (v == b && i < bix));
}

// logits (V) = H (V, D) . xf (D), xf staged in shared memory, plus the argmax on the device:
// each block writes its best (value, first index), and the last block to finish (a ticket from
// ctl->done after a __threadfence) reduces them, writes ctl->tok, advances ctl->pos by
// `advance` and rearms ctl->done. Ties go to the smallest index (numpy.argmax's first maximum).
__global__ void k_head_argmax(const float* __restrict__ H, const float* __restrict__ xf, int64_t D,
                              int64_t V, int64_t rows_per_block, float* __restrict__ logits,
                              float* __restrict__ blk_val /* (grid) */,
                              int64_t* __restrict__ blk_idx /* (grid) */, Control* ctl,
                              int64_t advance) {
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
  for (int64_t r = r0 + warp; r < r1; r += MATVEC_WARPS) {  // r increases: '>' keeps the first
    const float v = warp_dot(H + r * D, xs, D, lane);
    if (lane == 0) logits[r] = v;
    if (besti < 0 || v > best) best = v, besti = r;
  }
  if (lane == 0) bv[warp] = best, bi[warp] = besti;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = -INFINITY;
    int64_t bix = -1;
    for (int w = 0; w < MATVEC_WARPS; ++w)
      if (beats(bv[w], bi[w], b, bix)) b = bv[w], bix = bi[w];
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
    if (beats(v, i, b, bix)) b = v, bix = i;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bix, o);
    if (beats(ov, oi, b, bix)) b = ov, bix = oi;
  }
  __syncthreads();
  if (lane == 0) bv[warp] = b, bi[warp] = bix;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < MATVEC_WARPS; ++w)
      if (beats(bv[w], bi[w], b, bix)) b = bv[w], bix = bi[w];
    // Only all-NaN logits leave no candidate; token 0 then keeps the next embed in bounds.
    ctl->tok = bix < 0 ? 0 : bix;
    ctl->pos += advance;
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
  if (i < n) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

// ---- host side ------------------------------------------------------------------------------

// A device allocation freed on scope exit, so a 608 halfway through opening frees what was taken.
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
    ck(cudaMemset(p, 0, size_t(bytes > 0 ? bytes : 16)), what);
  }
  float* f() const { return static_cast<float*>(p); }
};

void allow_dynamic_smem(const void* fn, int optin, const char* what) {
  cudaFuncAttributes a{};
  ck(cudaFuncGetAttributes(&a, fn), what);
  ck(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          optin - int(a.sharedSizeBytes)),
     what);
}

// Pinned host memory (the token id going in, the argmax coming out): copies from and to it are
// truly asynchronous, where a pageable source makes the runtime stage it and drain the stream.
struct PinnedIds {
  int64_t* p = nullptr;  // [0] token in, [1] argmax out
  PinnedIds() = default;
  PinnedIds(const PinnedIds&) = delete;
  PinnedIds& operator=(const PinnedIds&) = delete;
  ~PinnedIds() {
    if (p) cudaFreeHost(p);
  }
  void alloc() {
    ck(cudaMallocHost(reinterpret_cast<void**>(&p), 2 * sizeof(int64_t)), "cudaMallocHost");
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

class CudaSession final : public Session {
 public:
  CudaSession(const SessionConfig& c, int64_t max_ctx) : c_(c), max_ctx_(max_ctx) {
    // The contract's checks first, on the host, with no device call (the SM count does not
    // change a refusal, so the fallback count serves).
    Plan pre = make_plan(c, max_ctx, FALLBACK_SMS);
    if (pre.status != RESIDENT_OK) refuse(pre.status, pre.why);
    if (!cuda_device_usable())
      refuse(RESIDENT_ERR_NO_ACCELERATOR,
             "device='cuda': CUDA kernels are compiled in but this host has no usable CUDA "
             "device; use device='cpu'");
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

    weights_.alloc(4 * plan_.weight_floats, "cudaMalloc(weights)");
    kv_.alloc(4 * plan_.kv_floats, "cudaMalloc(kv cache)");
    rope_.alloc(4 * plan_.rope_floats, "cudaMalloc(rope table)");
    act_.alloc(4 * plan_.act_floats, "cudaMalloc(decode activations)");
    pre_.alloc(4 * plan_.prefill_floats, "cudaMalloc(prefill activations)");
    blk_idx_.alloc(8 * plan_.head_mv.grid, "cudaMalloc(argmax scratch)");
    ids_.alloc(8 * plan_.prefill_rows, "cudaMalloc(prefill ids)");
    ctl_.alloc(sizeof(Control), "cudaMalloc(control)");

    stream_.create();
    pinned_.alloc();

    // RoPE table exactly as the CPU engine builds it (double angles, rounded once).
    const int64_t T = plan_.capacity, Dh = c.d_head, half = Dh / 2, hw = half > 0 ? half : 1;
    std::vector<float> rope(size_t(2 * T * hw), 0.f);
    for (int64_t p = 0; p < T; ++p)
      for (int64_t i = 0; i < half; ++i) {
        const double inv_freq = std::pow(c.rope_theta, -double(2 * i) / double(Dh));
        const double a = double(p) * inv_freq;
        rope[size_t(p * hw + i)] = float(std::cos(a));
        rope[size_t(T * hw + p * hw + i)] = float(std::sin(a));
      }
    upload(rope_.f(), rope.data(), int64_t(rope.size()));

    // Dynamic shared memory above 48 KiB needs an explicit opt-in per kernel. The attribute is
    // per function and process-wide, so it is set to the same value (all the device allows
    // beside the kernel's static arrays) by every session: a smaller model opened later must
    // not lower the limit under a larger session that is still open.
    const int optin = int(prop.sharedMemPerBlockOptin);
    allow_dynamic_smem(reinterpret_cast<const void*>(k_norm_qkv), optin, "k_norm_qkv");
    allow_dynamic_smem(reinterpret_cast<const void*>(k_norm_gateup), optin, "k_norm_gateup");
    allow_dynamic_smem(reinterpret_cast<const void*>(k_matvec_residual), optin,
                       "k_matvec_residual");
    allow_dynamic_smem(reinterpret_cast<const void*>(k_head_argmax), optin, "k_head_argmax");
    allow_dynamic_smem(reinterpret_cast<const void*>(k_attn_partial), optin, "k_attn_partial");
    // The allocations' cudaMemset ran on the legacy default stream, which a non-blocking
    // stream does not wait for: finish them before any kernel of this session can run.
    CK(cudaDeviceSynchronize());
    const char* g = std::getenv("ALGENTA_CUDA_GRAPHS");
    use_graphs_ = !(g && std::string(g) == "0");
    build_names();
  }

  ~CudaSession() override {
    if (stream_.s) cudaStreamSynchronize(stream_.s);
    for (auto& kv : graphs_) cudaGraphExecDestroy(kv.second.exec);
    cudaGetLastError();  // a destructor reports nothing; leave no pending error behind
  }

  const SessionConfig& config() const override { return c_; }
  const char* device() const override { return "cuda"; }
  int64_t max_ctx() const override { return max_ctx_; }
  int64_t capacity() const override { return plan_.capacity; }
  int64_t position() const override { return pos_; }
  int64_t dispatches_per_token() const override { return dispatches_; }

  void set_weight(const std::string& name, const std::vector<int64_t>& shape,
                  const float* data) override {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    Slot& s = slot_for(name, shape);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(data[i]))
        refuse(RESIDENT_ERR_NON_FINITE, "tensor '" + name +
                                            "' holds a non-finite value at flat index " +
                                            std::to_string(i));
    upload(weights_.f() + s.offset, data, n);
    s.set = true;
  }

  void set_weight_bf16(const std::string& name, const std::vector<int64_t>& shape,
                       const uint16_t* bits) override {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    Slot& s = slot_for(name, shape);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    s.set = false;  // a refusal halfway through leaves the tensor unset, never half old
    // bf16 is the top half of a float32: widening is exact. Widened on the host a chunk at a
    // time (4 MiB), so loading never holds a float32 copy of a whole tensor on the side.
    constexpr int64_t CHUNK = int64_t(1) << 20;
    std::vector<float> buf(size_t(std::min(n, CHUNK)));
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
      const int64_t cn = std::min(CHUNK, n - c0);
      for (int64_t i = 0; i < cn; ++i) {
        const uint32_t u = uint32_t(bits[c0 + i]) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        if (!std::isfinite(f))
          refuse(RESIDENT_ERR_NON_FINITE, "tensor '" + name +
                                              "' holds a non-finite value at flat index " +
                                              std::to_string(c0 + i));
        buf[size_t(i)] = f;
      }
      upload(weights_.f() + s.offset + c0, buf.data(), cn);
    }
    s.set = true;
  }

  std::vector<int64_t> weight_shape(const std::string& name) const override {
    auto it = slots_.find(name);
    return it == slots_.end() ? std::vector<int64_t>{} : it->second.shape;
  }

  std::vector<std::string> missing_weights() const override {
    std::vector<std::string> out;
    for (const std::string& n : order_)
      if (!slots_.at(n).set) out.push_back(n);
    return out;
  }

  void prefill(const int64_t* ids, int64_t n, float* logits) override {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    if (n < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "prefill needs at least one token");
    check_ready();
    check_fits(n);
    for (int64_t i = 0; i < n; ++i) check_id(ids[i]);
    for (int64_t b = 0; b < n; b += plan_.prefill_rows) {
      const int64_t m = std::min(plan_.prefill_rows, n - b);
      prefill_block(ids + b, m, b + m == n ? logits : nullptr);
    }
  }

  void step(int64_t id, float* logits) override {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    check_ready();
    check_fits(1);
    check_id(id);
    decode(id);
    CK(cudaMemcpyAsync(logits, act_.f() + plan_.logits, size_t(c_.vocab) * 4,
                       cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  int64_t step_greedy(int64_t id) {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    check_ready();
    check_fits(1);
    check_id(id);
    decode(id);
    CK(cudaMemcpyAsync(&pinned_.p[1], &ctl()->tok, sizeof(int64_t), cudaMemcpyDeviceToHost,
                       stream_));
    CK(cudaStreamSynchronize(stream_));
    return pinned_.p[1];
  }

  void reset() override {
    const std::lock_guard<std::mutex> lock(mu_);
    use_device();
    set_device_pos(0);
    CK(cudaStreamSynchronize(stream_));
    pos_ = 0;
  }

 private:
  struct Slot {
    std::vector<int64_t> shape;
    int64_t offset;  // floats into the weight arena
    bool set = false;
  };

  static std::string fmt(const std::vector<int64_t>& s) {
    std::string o = "[";
    for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
    return o + "]";
  }

  // The slot of an HF name whose shape matches the config's, or 607.
  Slot& slot_for(const std::string& name, const std::vector<int64_t>& shape) {
    auto it = slots_.find(name);
    if (it == slots_.end())
      refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + name + "' is not part of this model");
    Slot& s = it->second;
    if (shape != s.shape)
      refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + name + "' has shape " + fmt(shape) +
                                             ", the config declares " + fmt(s.shape));
    return s;
  }

  void add(const std::string& name, std::vector<int64_t> shape, int64_t offset) {
    slots_[name] = Slot{std::move(shape), offset, false};
    order_.push_back(name);
  }

  void build_names() {
    const int64_t D = c_.d_model, Dh = c_.d_head, F = c_.d_ff, Hq = c_.h_q, Hkv = c_.h_kv;
    add("model.embed_tokens.weight", {c_.vocab, D}, plan_.embed);
    for (int64_t i = 0; i < c_.n_layers; ++i) {
      const LayerOffsets& l = plan_.layers[size_t(i)];
      const std::string p = "model.layers." + std::to_string(i) + ".";
      add(p + "input_layernorm.weight", {D}, l.in_norm);
      add(p + "self_attn.q_proj.weight", {Hq * Dh, D}, l.wqkv);
      add(p + "self_attn.k_proj.weight", {Hkv * Dh, D}, l.wqkv + Hq * Dh * D);
      add(p + "self_attn.v_proj.weight", {Hkv * Dh, D}, l.wqkv + (Hq + Hkv) * Dh * D);
      add(p + "self_attn.q_norm.weight", {Dh}, l.q_norm);
      add(p + "self_attn.k_norm.weight", {Dh}, l.k_norm);
      add(p + "self_attn.o_proj.weight", {D, Hq * Dh}, l.wo);
      add(p + "post_attention_layernorm.weight", {D}, l.post_norm);
      add(p + "mlp.gate_proj.weight", {F, D}, l.wg);
      add(p + "mlp.up_proj.weight", {F, D}, l.wu);
      add(p + "mlp.down_proj.weight", {D, F}, l.wd);
    }
    add("model.norm.weight", {D}, plan_.final_norm);
    if (!c_.tie_word_embeddings) add("lm_head.weight", {c_.vocab, D}, plan_.head);
  }

  void check_ready() const {
    for (const std::string& n : order_)
      if (!slots_.at(n).set)
        refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + n + "' was never set");
  }
  void check_fits(int64_t n) const {
    if (pos_ + n > plan_.capacity)
      refuse(RESIDENT_ERR_CONTEXT_FULL, "position " + std::to_string(pos_.load()) + " + " +
                                            std::to_string(n) + " tokens exceeds the capacity " +
                                            std::to_string(plan_.capacity) +
                                            " of this session's KV cache");
  }
  void check_id(int64_t id) const {
    if (id < 0 || id >= c_.vocab)
      refuse(RESIDENT_ERR_EMPTY_DIMENSION, "token id " + std::to_string(id) + " outside [0, " +
                                               std::to_string(c_.vocab) + ")");
  }

  Control* ctl() const { return static_cast<Control*>(ctl_.p); }
  const float* W(int64_t off) const { return weights_.f() + off; }
  float* kcache(int64_t l) const { return kv_.f() + l * plan_.kv_layer_stride; }
  float* vcache(int64_t l) const { return kcache(l) + c_.h_kv * plan_.capacity * c_.d_head; }
  float* A(int64_t off) const { return act_.f() + off; }
  float* P(int64_t off) const { return pre_.f() + off; }

  // Pageable-source async copies are staged before the call returns, so the local may go.
  void set_device_pos(int64_t p) {
    CK(cudaMemcpyAsync(&ctl()->pos, &p, sizeof(int64_t), cudaMemcpyHostToDevice, stream_));
  }
  void launched(const char* what) { ck(cudaGetLastError(), what); }
  // The CUDA current device is per host thread: a call from another thread (or after the caller
  // switched devices) must run on the device this session's memory lives on.
  void use_device() { CK(cudaSetDevice(dev_)); }

  // Host -> device on the session's stream, finished before returning: a pageable-source copy
  // may return before its DMA lands, and the caller may reuse or free its buffer at once.
  void upload(float* dst, const float* src, int64_t n) {
    CK(cudaMemcpyAsync(dst, src, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
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

  // The per-row attention and q/k/RoPE launches shared by decode (M = 1) and prefill.
  void norm_rope(const LayerOffsets& l, int64_t li, float* qkv, int64_t M) {
    k_qk_norm_rope<<<dim3(unsigned(c_.h_q + 2 * c_.h_kv), unsigned(M)),
                     unsigned(plan_.norm_rope_threads), 0, stream_>>>(
        qkv, plan_.q_rows, W(l.q_norm), W(l.k_norm), rope_.f(), ctl(), c_.h_q, c_.h_kv,
        c_.d_head, plan_.capacity, c_.rms_eps, kcache(li), vcache(li));
    launched("k_qk_norm_rope");
  }
  void attention(int64_t li, const float* qkv, int64_t M, int64_t S, bool finalize, float* out) {
    const float scale = float(1.0 / std::sqrt(double(c_.d_head)));
    k_attn_partial<<<dim3(unsigned(c_.h_q), unsigned(S), unsigned(M)), ATTN_THREADS,
                     size_t(plan_.attn_smem_bytes), stream_>>>(
        qkv, plan_.q_rows, kcache(li), vcache(li), ctl(), plan_.capacity, c_.h_q / c_.h_kv,
        c_.d_head, scale, finalize, out, A(plan_.part_acc), A(plan_.part_ml));
    launched("k_attn_partial");
  }

  // One decode token at P = pos_: the token id goes to the device, then the step's launches
  // run, replayed from a CUDA graph captured once per split count (the kernels read P and the
  // token from Control, so one graph serves every position with that split count) or, with
  // ALGENTA_CUDA_GRAPHS=0, launched one by one. dispatches_ is the kernel count either way.
  void decode(int64_t id) {
    // Every call that enqueues work synchronizes before returning, so the previous step's copy
    // out of pinned_.p[0] has completed and the slot is free to rewrite.
    pinned_.p[0] = id;
    CK(cudaMemcpyAsync(&ctl()->tok, &pinned_.p[0], sizeof(int64_t), cudaMemcpyHostToDevice,
                       stream_));
    const SplitPlan sp = splitk_plan(pos_ + 1, plan_.sms, c_.h_q);
    if (use_graphs_) {
      const Graph& g = graph_for(sp);
      CK(cudaGraphLaunch(g.exec, stream_));
      dispatches_ = g.kernels;
    } else {
      dispatches_ = enqueue_decode(sp);
    }
    ++pos_;
  }

  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t kernels = 0;
  };

  const Graph& graph_for(const SplitPlan& sp) {
    const int64_t key = sp.split ? sp.n_splits : 0;
    auto it = graphs_.find(key);
    if (it != graphs_.end()) return it->second;
    CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    int64_t kernels = 0;
    try {
      kernels = enqueue_decode(sp);
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream_, &g);  // leave the stream out of capture mode, then rethrow
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t g = nullptr;
    CK(cudaStreamEndCapture(stream_, &g));
    Graph out;
    out.kernels = kernels;
    const cudaError_t err = cudaGraphInstantiate(&out.exec, g, 0);
    cudaGraphDestroy(g);
    ck(err, "cudaGraphInstantiate(decode step)");
    return graphs_.emplace(key, out).first->second;
  }

  // Enqueues one decode step's kernels on stream_ (P and the token read on the device);
  // returns how many.
  int64_t enqueue_decode(const SplitPlan& sp) {
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
      attention(li, A(plan_.qkv), 1, sp.n_splits, !sp.split, A(plan_.attn));
      ++n;
      if (sp.split) {
        k_attn_merge<<<unsigned(c_.h_q), ROW_THREADS, 0, stream_>>>(
            A(plan_.part_acc), A(plan_.part_ml), sp.n_splits, c_.d_head, A(plan_.attn));
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
    n += head(A(plan_.x), 1);
    return n;
  }

  // Final norm of row x (D) and the head + argmax; advances the device position by `advance`.
  int64_t head(const float* x, int64_t advance) {
    const int64_t D = c_.d_model;
    k_rmsnorm_rows<<<1, ROW_THREADS, 0, stream_>>>(x, W(plan_.final_norm), D, c_.rms_eps,
                                                   A(plan_.xf));
    launched("k_rmsnorm_rows(final)");
    k_head_argmax<<<unsigned(plan_.head_mv.grid), MATVEC_THREADS, size_t(D) * 4, stream_>>>(
        W(plan_.head), A(plan_.xf), D, c_.vocab, plan_.head_mv.rows_per_block, A(plan_.logits),
        A(plan_.argmax_val), static_cast<int64_t*>(blk_idx_.p), ctl(), advance);
    launched("k_head_argmax");
    return 2;
  }

  void prefill_block(const int64_t* ids, int64_t M, float* logits) {
    const int64_t D = c_.d_model, F = c_.d_ff, Q = plan_.q_rows, Aw = plan_.attn_width;
    set_device_pos(pos_);
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
      attention(li, QKV, M, 1, true, At);
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
      head(X + (M - 1) * D, 0);
      CK(cudaMemcpyAsync(logits, A(plan_.logits), size_t(c_.vocab) * 4, cudaMemcpyDeviceToHost,
                         stream_));
    }
    set_device_pos(pos_ + M);
    // The ids copy reads the caller's buffer asynchronously: finish before returning.
    CK(cudaStreamSynchronize(stream_));
    pos_ += M;
  }

  SessionConfig c_;
  int64_t max_ctx_ = 0;
  // Every call that writes the cache, the weights, the scratch or Control holds mu_ (the session
  // contract: calls from threads sharing a session are serialized, never interleaved inside a
  // step). The position and the launch count are atomics so the property reads need no lock.
  std::mutex mu_;
  std::atomic<int64_t> pos_{0}, dispatches_{0};
  int dev_ = 0;
  Plan plan_;
  Stream stream_;  // declared before the buffers: destroyed after them (cudaFree syncs first)
  PinnedIds pinned_;
  DevMem weights_, kv_, rope_, act_, pre_, blk_idx_, ids_, ctl_;
  std::map<std::string, Slot> slots_;
  std::vector<std::string> order_;
  std::map<int64_t, Graph> graphs_;  // by split count (0: the standard path)
  bool use_graphs_ = true;
};

}  // namespace

std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx) {
  return std::unique_ptr<Session>(new CudaSession(cfg, max_ctx));
}

int64_t cuda_step_greedy(Session& s, int64_t id) {
  CudaSession* c = dynamic_cast<CudaSession*>(&s);
  if (!c)
    throw StatusError(Family::Resident, RESIDENT_ERR_EMPTY_DIMENSION,
                      "cuda_step_greedy needs a session opened with device='cuda'");
  return c->step_greedy(id);
}

double cuda_copy_bandwidth(int64_t bytes, int reps) {
  if (bytes < 1 || reps < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "bytes and reps must be >= 1");
  if (!cuda_device_usable())
    refuse(RESIDENT_ERR_NO_ACCELERATOR, "no usable CUDA device on this host");
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

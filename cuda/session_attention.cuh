// Attention of decode stage 3 (and of prefill: the same kernels, one split per (head, row)):
// softmax(q K[lo..P]^T * scale) V[lo..P] for each query head of each row, reading the row's slot
// of the KV cache in its format (f32, bf16, f16 widened exactly to float32).
//   k_attn_partial  a block a (head, split, row): each warp an online softmax (running max m,
//                   sum l, accumulator rescaled by exp(m_old - m_new)) over every ATTN_WARPS-th
//                   key of its split, the warps merged in warp order; finalized in place on the
//                   standard path, else the split's unnormalized (acc, m, l) for the merge;
//   k_attn_merge    a row's S splits joined in split order, normalized once.
// Never materialized: a [T]-sized score row (each warp keeps one running max and sum), the
// softmax weights. The split count of a row is read on the device (StepRow::n_splits), so one
// captured graph serves every position.
// Numerics: float32 dot products (lanes, then a shuffle), expf (a device's expf is not the
// CPU's: logits agree with the CPU engine to float32 rounding, not bit for bit), the family's
// soft cap (session_math::softcap) and sliding window applied before the softmax. An empty
// warp or split (l == 0, m = -inf) is skipped rather than weighted by exp(-inf - -inf) = NaN.
// Limits: at most RESIDENT_SPLITK_MAX_SPLITS splits (splitk_plan); Dh within the plan's
// attention shared memory (q, ATTN_WARPS accumulators, their (m, l)).
#pragma once

#include "session_device.cuh"

namespace algenta {
namespace residentk {
namespace {

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

}  // namespace
}  // namespace residentk
}  // namespace algenta

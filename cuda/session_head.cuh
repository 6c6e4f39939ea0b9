// The model's last stage: logits (M, V) = Xf (M, D) . H (V, D)^T, a row kernel
// (session_matvec.cuh, one warp a vocabulary row) with the family's final soft cap in its
// epilogue, and for decode's one row (R == 1) the greedy argmax on the device, so greedy decoding
// never copies the logits to the host: each block reduces its warps' best (value, first index),
// the last block to finish (a ticket after a __threadfence) reduces the blocks' and leaves the
// index in the control block for the host.
// Numerics and hazards: the order is numpy.argmax's (the first maximum; session_math::
// argmax_beats, shared with the CPU engine). The partials cross blocks through global memory:
// each is fenced before its block's ticket (release) and the last block fences after its ticket
// (acquire) and reads them from L2 (__ldcg), never a stale L1 line.
// Limits: V >= 1; the control block's ticket counter is rearmed by the last block, so launches
// of the head on one control block must not overlap (one stream).
#pragma once

#include "session_matvec.cuh"

namespace algenta {
namespace residentk {
namespace {

// ---- control block in device memory ----------------------------------------------------------
// What the head kernel leaves for the host. What a step depends on from the host is its rows
// (StepRow, session_cuda_plan.hpp), copied in before it runs, so a step's launch sequence (and
// so its CUDA graph) is the same at every position.
struct Control {
  int64_t argmax;     // written by k_head_argmax: the first maximum of the logits
  unsigned int done;  // head blocks finished in the current launch (last-block reduction)
};

// The argmax's order (numpy.argmax's) is session_math::argmax_beats, shared with the CPU engine.
using session_math::argmax_beats;

// Logits (M, V) = Xf (M, D) H (V, D)^T (a row kernel, one warp a vocabulary row), and with
// R == 1 (decode's one row) the argmax on the device: each block writes its best (value, first
// index), and the last block to finish (a ticket from ctl->done after a __threadfence) reduces
// them, writes ctl->argmax and rearms ctl->done. The order is numpy.argmax's (argmax_beats).
template <Dtype F, int R>
__global__ void k_head_argmax(DevMat H /* (V, D) */, const float* __restrict__ Xf /* (M, D) */,
                              int64_t D, int64_t V, int64_t rows_per_block, float softcap,
                              int64_t M, int nr, float* __restrict__ logits /* (M, V) */,
                              float* __restrict__ blk_val /* (grid) */,
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

}  // namespace
}  // namespace residentk
}  // namespace algenta

// The embedding row of each token a launch carries: the first stage of a decode step and of a
// prefill block. Fuses the widening of the resident row (any weight format: w_at, exact for f32,
// bf16 and f16, code times block scale for int8) with the family's embedding scale, so no
// float32 copy of the table exists anywhere. The token ids come from the rows (StepRow) the host
// wrote and validated before the launch; D is the only width.
#pragma once

#include "session_device.cuh"

namespace algenta {
namespace residentk {
namespace {

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

}  // namespace
}  // namespace residentk
}  // namespace algenta

// The int8 block quantizer, written once: the session's int8 weights are quantized with it at
// load, and its int8 decode quantizes each activation vector with it once per matrix-vector
// product (the Q8_0 x Q8_0 scheme of llama.cpp, with float32 scales). Host C++ and CUDA alike.
//
// Rule, per block of at most RESIDENT_INT8_BLOCK values: s = amax / 127 in float32; q = x / s
// rounded to nearest even (rintf, in the default rounding mode), clamped to [-127, 127] (the
// clamp only guards rounding at amax itself); an all-zero block has s = 0 and q = 0. -128 never
// occurs, so a q's magnitude always fits an unsigned byte and its negation an int8: the integer
// dot kernels rely on both.
#pragma once
#include <cmath>
#include <cstdint>

#include "algenta/hd.hpp"

namespace algenta {
namespace quant {

// x (n <= 32 values) -> q (n), returns the block's scale s (x ~ q * s). A NaN or infinite x
// makes s NaN or infinite, so the products it enters are not finite either: a broken activation
// reaches the logits (and the sampler's refusal) as it would unquantized, never as finite noise.
ALGENTA_HD float q8_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    amax = (a > amax || a != a) ? a : amax;  // a NaN, once seen, stays
  }
  const float s = amax / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    const float r = s > 0.f ? rintf(x[i] / s) : 0.f;
    // comparisons, not fminf/fmaxf (a libm call per value without -ffinite-math-only); a NaN
    // r (only with a NaN or infinite s) stores 0 instead of an undefined conversion
    const float c = r < -127.f ? -127.f : (r > 127.f ? 127.f : r);
    q[i] = c == c ? int8_t(c) : int8_t(0);
  }
  return s;
}

}  // namespace quant
}  // namespace algenta

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

#include "algenta/half.hpp"
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

// llama.cpp's Q4_0 rule (ggml's quantize_row_q4_0_ref), for a block of n <= 32 values: the value
// of largest magnitude (the first of equals) sets d = max / -8, so it lands on code 0; each code
// is trunc(x * (1/d) + 8.5) capped at 15 (x ~ (code - 8) * d); d is stored as float16 (rounded to
// nearest even) and returned widened. Written without fused multiply-adds (this header's host
// users compile without FMA), as ggml's reference and the gguf package round it. A block this
// rule wrote requantizes to itself from its widened values (tests/test_residentk_q4.py), so a
// Q4_0 file loads exactly. An infinite d (|max| past 8 * 65504) is returned as infinity: the
// caller refuses it (609).
ALGENTA_HD float q4_0_block(const float* x, int64_t n, uint8_t* q) {
  float amax = 0.f, max = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    if (amax < a) {
      amax = a;
      max = x[i];
    }
  }
  const float d = max / -8.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float t = x[i] * id;
    const int c = int(int8_t(t + 8.5f));  // ggml's (int8_t) cast: truncation toward zero
    q[i] = uint8_t(c < 15 ? c : 15);
  }
  return half::f16_to_f32(half::f32_to_f16(d));
}

}  // namespace quant
}  // namespace algenta

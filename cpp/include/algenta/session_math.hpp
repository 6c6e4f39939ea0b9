// The per-element arithmetic of a decode step that the CPU engine (session_cpu.cpp) and the CUDA
// engine (cuda/session_*.cu, also under the emulator) both compute: RMSNorm's scale, the SiLU
// and GELU gates, the soft cap, the rotate-half RoPE pair and the argmax order. Each engine
// keeps its own reduction structure (one thread's loop, a block's tree) around these; what an
// element's value is, is written here once.
#pragma once

#include <cmath>
#include <cstdint>

#include "algenta/dtype.hpp"
#include "algenta/exp_tanh.hpp"
#include "algenta/half.hpp"
#include "algenta/hd.hpp"

namespace algenta {
namespace session_math {

// RMSNorm as transformers' Qwen3RMSNorm: out = w * (x * inv), inv = 1/sqrt(mean(x^2) + eps),
// the squares summed in double by the caller (ss), the inverse rounded to float once.
ALGENTA_HD float rms_inv(double ss, int64_t n, double eps) {
#if defined(__CUDA_ARCH__)
  return float(1.0 / sqrt(ss / double(n) + eps));
#else
  return float(1.0 / std::sqrt(ss / double(n) + eps));
#endif
}
ALGENTA_HD float rms_apply(float x, float w, float inv) { return w * (x * inv); }

// silu(g) * u, the gate of the MLP, in float: g / (1 + exp(-g)) * u as transformers writes it,
// with exp taken by exp_nonpos of -|g| so a loop of it vectorizes (libm's expf, a call per
// element, was 4% of a 128-token prefill). For g < 0 the same quotient is (g e) / (1 + e) with
// e = exp(g), which never overflows. Within 2.4e-7 relative of silu computed in double, 2.0e-7
// where the multiply-adds contract to FMAs (every 97th float of |g| in [1e-30, 80]; libm's form
// 1.6e-7); past g = -87 it returns g exp(-87) / (1 + exp(-87)), about |g| 1.6e-38, where silu
// is smaller still.
ALGENTA_HD float silu_mul(float g, float u) {
  const bool neg = g < 0.0f;
  const float e = expm::exp_nonpos(neg ? g : -g);
  return (neg ? g * e : g) / (1.0f + e) * u;
}

// tanh(x) as (1 - e) / (1 + e) with e = exp(-2|x|) by exp_nonpos, the sign put back
// (exp_tanh.hpp): branch-free (a soft cap runs over a whole vocabulary every token, the GELU gate
// over d_ff every layer) and the same function on both engines. Within 9.4e-8 of tanh absolutely
// (float's own tanhf: 1.04e-7; both measured over every 97th float of |x| < 40), so relative
// error grows only as |x| -> 0; exactly +-1 past |x| = 9.
ALGENTA_HD float tanh_approx(float x) {
  const float a = x < 0.0f ? -x : x;
  return expm::tanh_of_exp<float>(x, expm::exp_nonpos(-2.0f * a));
}

// gelu(g) * u with gelu's tanh approximation (transformers' gelu_pytorch_tanh, Gemma's gate),
// in float, in torch's order: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
ALGENTA_HD float gelu_tanh_mul(float g, float u) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;
  const float inner = beta * (g + kappa * (g * g * g));
  return 0.5f * g * (1.0f + tanh_approx(inner)) * u;
}

// cap * tanh(x / cap): Gemma 2's soft cap of attention scores and logits, in float, in
// transformers' order (divide, tanh, multiply).
ALGENTA_HD float softcap(float x, float cap) { return tanh_approx(x / cap) * cap; }

// Rotate-half RoPE of the pair (a, b) = (h[i], h[i + Dh/2]) by the angle whose cosine and sine
// are c and s.
ALGENTA_HD void rope_pair(float a, float b, float c, float s, float* ra, float* rb) {
  *ra = a * c - b * s;
  *rb = b * c + a * s;
}

// Does candidate (v, i) beat the best so far (b, bix)? numpy.argmax's order: a NaN beats every
// number, a larger number beats a smaller one, and between equals (two NaNs included) the
// smaller index wins. Index -1 is "no candidate".
ALGENTA_HD bool argmax_beats(float v, int64_t i, float b, int64_t bix) {
  if (i < 0) return false;
  if (bix < 0) return true;
  const bool vn = v != v, bn = b != b;  // isnan without naming std:: or ::, for both compilers
  if (vn != bn) return vn;
  if (!vn && v != b) return v > b;
  return i < bix;
}

// A key or value element as a 16-bit KV cache holds it (kv bf16 or f16: rounded to nearest even
// once, when its position is written; past float16's 65504 it becomes infinity, as a float16
// model's cache would), and back (exact). A float32 cache holds the value itself.
ALGENTA_HD uint16_t kv_narrow(Dtype kv, float v) {
  return kv == Dtype::BF16 ? half::f32_to_bf16(v) : half::f32_to_f16(v);
}
ALGENTA_HD float kv_widen(Dtype kv, uint16_t h) {
  return kv == Dtype::BF16 ? half::bf16_to_f32(h) : half::f16_to_f32(h);
}

}  // namespace session_math
}  // namespace algenta

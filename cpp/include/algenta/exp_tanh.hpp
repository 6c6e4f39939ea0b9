// exp and tanh as both families compute them, written once: exp's range reduction and Taylor
// polynomial (float32 and float64) and tanh from exp(-2|x|). Each template takes a scalar (host
// C++ and CUDA device code: session_math.hpp) or a GCC vector of lanes (the per-ISA CPU kernels:
// cpp/src/kernels/vmath.hpp), and performs the same operations in the same order either way, so
// a lane rounds as the scalar does wherever both are compiled with the same contraction.
//
// exp(x) = 2^n * p(r): n = round(x / ln2) by the shifter trick (adding 1.5 * 2^m rounds to an
// integer, exact for |n| < 2^(m-1)), r = x - n*ln2 with a two-constant Cody-Waite split (ln2_hi
// has few enough significant bits that n * ln2_hi is exact, so r is exact to well below an ulp),
// p a Taylor polynomial: degree 7 for float (truncation < 6e-9 relative on |r| <= ln2/2), degree
// 13 for double (< 1e-17). exp(0) is exactly 1. Neither precision ever sees x > 0 from its
// callers: a logit minus its max or its lse, -|x|, a score minus the row's max.
//
// Two underflow rules, each the entry point of the family that needs it (both keep the bits
// each family had before they shared this polynomial; neither can replace the other):
//  - exp_nonpos (the session: attention's softmax, the SiLU and GELU gates, the soft cap; this
//    file and vmath.hpp's vexp_nonpos): x below -87 is taken as -87, so the result is never
//    below exp(-87) ~ 1.6e-38 and never 0. Branch-free with a clamp in front, which is what lets
//    GCC vectorize a loop of the scalar (and the device compute it without a branch).
//  - vmath.hpp's vexp (lossk: the log-sum-exp, the softmax gradient, the soft cap; float and
//    double): lanes whose result would fall below the smallest normal (x < -87, x < -708) are
//    flushed to +0, so a logit far below the max adds exactly nothing to a sum or a gradient.
//    The session's floor would leave exp(-87) in every such d_logit and entropy term instead.
// The integer n becomes 2^n differently too (its float converted to an integer for exp_nonpos,
// the shifted sum's low bits for vexp: AVX2 has no vector double-to-int64 conversion); the two
// give the same scale for every |n| < 2^22, far past any argument either family passes.
#pragma once

#include <cstdint>

#include "algenta/half.hpp"
#include "algenta/hd.hpp"

namespace algenta {
namespace expm {

// p (scalar or lanes) = c_top r^k + ... + c_0 by Horner's rule, coefficients from the top:
// p = c_top; p = p * r + c for each following c, in order (each step one FMA where it contracts).
template <class F, class S, class... Cs>
ALGENTA_HD F horner(F r, S top, Cs... cs) {
  F p = F{} + top;
  ((p = p * r + cs), ...);
  return p;
}

template <class S>
struct ExpConst;
template <>
struct ExpConst<float> {
  static constexpr float shifter = 0x1.8p23f;  // 1.5 * 2^23
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693145751953125f;  // 14 significant bits: n * hi exact
  static constexpr float ln2_lo = 1.42860682030941723e-6f;
};
template <>
struct ExpConst<double> {
  static constexpr double shifter = 0x1.8p52;  // 1.5 * 2^52
  static constexpr double log2e = 1.4426950408889634;
  static constexpr double ln2_hi = 0.693147180559890330187;  // 41 significant bits
  static constexpr double ln2_lo = 5.4979230187083711552e-14;
};

// exp(x) = 2^n * p, n an integer held in a float (n = t - shifter); t = x / ln2 + shifter keeps
// n in its low significand bits.
template <class F>
struct ExpParts {
  F p, t, n;
};

template <class S, class F>
ALGENTA_HD ExpParts<F> exp_parts(F x) {
  typedef ExpConst<S> C;
  ExpParts<F> e;
  e.t = x * C::log2e + C::shifter;
  e.n = e.t - C::shifter;
  const F r = (x - e.n * C::ln2_hi) - e.n * C::ln2_lo;
  if constexpr (sizeof(S) == 4)
    e.p = horner(r, 1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                 0.5f, 1.0f, 1.0f);
  else
    e.p = horner(r, 1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0);
  return e;
}

// exp(x) for x <= 0 with the session's floor (see above), float32. Within 1.1e-7 relative of exp
// (measured over every 97th float in (-87, 0]); below -87 it returns exp(-87) instead of a
// smaller value (the callers add it to 1 or to a sum that holds exp(0)).
ALGENTA_HD float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const ExpParts<float> e = exp_parts<float>(x);
  return e.p * half::f32_from_bits(uint32_t(int32_t(e.n) + 127) << 23);
}

// tanh(x) from e = exp(-2|x|) (by the caller's exp and its underflow rule): (1 - e) / (1 + e)
// with x's sign put back. No cancellation once |x| is away from 0 (e <= exp(-1.25) past 0.625,
// where lossk switches to its polynomial); exactly +-1 once e is below half an ulp of 1, so both
// underflow rules give the same bits here.
template <class S, class F>
ALGENTA_HD F tanh_of_exp(F x, F e) {
  const F t = (S(1) - e) / (S(1) + e);
  return x < S(0) ? -t : t;
}

}  // namespace expm
}  // namespace algenta

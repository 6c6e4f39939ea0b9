// exp and tanh on lanes, per instruction set: algenta/exp_tanh.hpp's polynomial and tanh on the
// vectors of simd.hpp, behind the two underflow rules that header describes:
//   vexp (lossk, float and double): results below the smallest normal flush to +0;
//   vexp_nonpos (the session, float): arguments below -87 are taken as -87, as its scalar
//     expm::exp_nonpos does, operation for operation (the scalar did not vectorize inside a
//     loop: its float-to-int conversion and clamp kept GCC scalar).
// sexp / stanh run a scalar through the vector routine, so a loop's tail rounds as its body.
#pragma once
#include <cstring>

#include "algenta/exp_tanh.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

template <class VT>
struct LaneOf;
template <>
struct LaneOf<vf> {
  typedef float type;
  static constexpr int bias = 127, mant = 23;  // exponent bias, significand bits
  static constexpr float flush_below = -87.0f;  // exp(-87) ~ 1.6e-38, FLT_MIN 1.18e-38
};
template <>
struct LaneOf<vd> {
  typedef double type;
  static constexpr int bias = 1023, mant = 52;
  static constexpr double flush_below = -708.0;  // exp(-708) ~ 3.3e-308, DBL_MIN 2.2e-308
};

// lossk's exp: 2^n built from the shifted sum's low bits (t's bits minus the shifter's are n),
// the lanes below flush_below set to +0. Callers pass x <= 0 (a logit minus its max or its lse).
template <class VT>
inline VT vexp(VT x) {
  typedef LaneOf<VT> L;
  typedef typename L::type S;
  typedef typename V<S>::itype IT;
  const VT shifter = VT{} + expm::ExpConst<S>::shifter;
  const expm::ExpParts<VT> e = expm::exp_parts<S>(x);
  IT tb, sb;
  std::memcpy(&tb, &e.t, sizeof tb);
  std::memcpy(&sb, &shifter, sizeof sb);
  const IT ex = ((tb - sb) + L::bias) << L::mant;
  VT scale;
  std::memcpy(&scale, &ex, sizeof scale);
  VT y = e.p * scale;
  const IT tiny = x < L::flush_below;  // lane mask: all ones where true
  IT yb;
  std::memcpy(&yb, &y, sizeof yb);
  yb = yb & ~tiny;
  std::memcpy(&y, &yb, sizeof y);
  return y;
}

// The session's exp on lanes: expm::exp_nonpos's operations in its order.
inline vf vexp_nonpos(vf x) {
  const vf floor = vf{} - 87.0f;
  x = x < floor ? floor : x;
  const expm::ExpParts<vf> e = expm::exp_parts<float>(x);
  const vi32 b = (__builtin_convertvector(e.n, vi32) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &b, sizeof two_n);
  return e.p * two_n;
}

// exp of a scalar through the vector routine, so tails and bodies round identically.
template <class T>
inline T sexp(T x) {
  typedef typename V<T>::type VT;
  VT v = VT{} + x;
  return vexp(v)[0];
}

// ---- lossk's tanh (the soft cap) --------------------------------------------------------------
// |x| < 0.625: x + x z P(z), z = x^2 (Cephes' tanhf polynomial for float; its rational P(z)/Q(z)
// for double), where 1 - e below would cancel; else expm::tanh_of_exp with e = vexp(-2|x|) <=
// exp(-1.25), no cancellation, and e flushing to 0 far out gives exactly +-1. Both branches are
// computed and selected per lane. About 2 ulp in either precision.
inline vf vtanh(vf x) {
  const vf ax = vselect<vf, vi32>(x < 0.0f, -x, x);
  const vf z = x * x;
  const vf p = expm::horner(z, -5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f,
                            1.33314422036e-1f, -3.33332819422e-1f);
  const vf small = x + x * z * p;
  const vf big = expm::tanh_of_exp<float>(x, vexp(-2.0f * ax));
  return vselect<vf, vi32>(ax < 0.625f, small, big);
}

inline vd vtanh(vd x) {
  const vd ax = vselect<vd, vi64>(x < 0.0, -x, x);
  const vd z = x * x;
  const vd p = expm::horner(z, -9.64399179425052238628e-1, -9.92877231001918586564e1,
                            -1.61468768441708447952e3);
  vd q = z + 1.12811678491632931402e2;
  q = q * z + 2.23548839060100448583e3;
  q = q * z + 4.84406305325125486048e3;
  const vd small = x + x * (z * p / q);
  const vd big = expm::tanh_of_exp<double>(x, vexp(-2.0 * ax));
  return vselect<vd, vi64>(ax < 0.625, small, big);
}

template <class T>
inline T stanh(T x) {
  typedef typename V<T>::type VT;
  VT v = VT{} + x;
  return vtanh(v)[0];
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

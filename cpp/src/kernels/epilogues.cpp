// lossk's per-token epilogues, compiled once per instruction set: the statistics of one vocab
// block of logits (max, sum of exp, the weighted sum of logits and the entropy's sum: the unit
// the log-sum-exp merges in order), the logits' epilogue (bias, soft cap, temperature) on a tile
// while it is hot, and the softmax gradient that turns a token's logits into its d_logits in
// place. float32 and float64 alike, on vmath.hpp's exp and tanh (the flushing rule: a logit far
// below the max adds exactly nothing).
//
// Fuses the epilogue into the logits' tile and the gradient into the same buffer: the [n, V]
// probabilities never exist. Never allocates.
// Numerics: every vector body has a scalar tail that goes through the same vector routine (sexp,
// stanh), so an element's bits do not depend on where the block or the chunk starts; sums run in
// lane-wise double accumulators folded in lane order, a fixed order for a given n.
#include <cstdint>
#include <limits>

#include "algenta/kernels.hpp"
#include "parts.hpp"
#include "simd.hpp"
#include "vmath.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

template <class T>
BlockStats block_stats(const T* z, int64_t n, const T* w, bool entropy) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  BlockStats s{-std::numeric_limits<double>::infinity(), 0.0, 0.0, 0.0};
  if (n <= 0) return s;
  // m = the first z[v] (in index order) equal to the block's largest value, NaNs other than a
  // leading one ignored: what `m = z[v] > m ? z[v] : m` over v gives, on vectors (as a scalar
  // chain it dominated the forward). Lanes keep their own first strict maximum; only the sign of
  // a zero maximum depends on which lane saw it first, so that case scans for it.
  T m = z[0];
  if (m == m) {
    int64_t v = 0;
    if (n >= L) {
      VT mv = m - VT{};  // every lane z[0] (not NaN): a NaN lane would never compare again
      for (; v + L <= n; v += L) {
        const VT x = loadu<VT>(z + v);
        mv = x > mv ? x : mv;
      }
      for (int l = 0; l < L; ++l) m = mv[l] > m ? mv[l] : m;
    }
    for (; v < n; ++v) m = z[v] > m ? z[v] : m;
    if (m == T(0))
      for (v = 0; v < n; ++v)
        if (z[v] == m) {
          m = z[v];
          break;
        }
  }
  // Lane-wise double accumulators, folded in lane order at the end: a fixed order for a
  // given n, independent of where the block sits in the vocabulary.
  double se[L], sz[L], sd[L];
  for (int l = 0; l < L; ++l) se[l] = sz[l] = sd[l] = 0.0;
  const double md = double(m);
  int64_t v = 0;
  for (; v + L <= n; v += L) {
    VT x = loadu<VT>(z + v);
    VT e = vexp(x - m);
    for (int l = 0; l < L; ++l) se[l] += double(e[l]);
    // max - z in double: exact for float32 logits; each term >= 0
    if (entropy)
      for (int l = 0; l < L; ++l) sd[l] += double(e[l]) * (md - double(x[l]));
    if (w) {
      const VT wv = loadu<VT>(w + v);
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]) * double(wv[l]);
    } else {
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]);
    }
  }
  for (int l = 0; v < n; ++v, ++l) {
    const double e = double(sexp<T>(z[v] - m));
    se[l] += e;
    sz[l] += w ? double(z[v]) * double(w[v]) : double(z[v]);
    if (entropy) sd[l] += e * (md - double(z[v]));
  }
  double a = 0.0, b = 0.0, d = 0.0;
  for (int l = 0; l < L; ++l) {
    a += se[l];
    b += sz[l];
    d += sd[l];
  }
  s.max = md;
  s.sumexp = a;
  s.sumz = b;
  s.sument = d;
  return s;
}

ALGENTA_KERN_INSTANTIATE(block_stats, float, double)  // for tables.cpp

template <class T>
void logit_epilogue(T* z, int64_t n, const T* bias, double cap, double temperature) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  if (bias)
    for (int64_t v = 0; v < n; ++v) z[v] += bias[v];
  int64_t v = 0;
  if (!(cap > 0.0)) {
    if (temperature == 1.0) return;
    // A true division, as PyTorch's `logits / T` rounds (lossk_math.hpp, tempered_cap).
    const T tt = T(temperature);
    for (; v + L <= n; v += L) storeu(z + v, loadu<VT>(z + v) / tt);
    for (; v < n; ++v) z[v] = z[v] / tt;
    return;
  }
  // z / cap as z * (1 / cap): one rounding fewer per element than a division, and the same
  // spelling everywhere, so every chunk and thread count caps a logit to the same bits. The
  // amplitude is cap / T (exactly cap at T = 1).
  const T c = T(cap / temperature), ic = T(1.0 / cap);
  for (; v + L <= n; v += L) storeu(z + v, vtanh(loadu<VT>(z + v) * ic) * c);
  for (; v < n; ++v) z[v] = stanh<T>(z[v] * ic) * c;
}

ALGENTA_KERN_INSTANTIATE(logit_epilogue, float, double)  // for tables.cpp

template <class T>
void softmax_grad(T* z, int64_t n, double lse, double a, double b, const T* w, double cap,
                  double e, double m) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  const T l = T(lse), ta = T(a), tb = T(b), te = T(e), tm = T(m);
  const bool capped = cap > 0.0;
  const T ic = capped ? T(1.0 / cap) : T(0);
  if (e != 0.0) {
    // The entropy's share: p_v (a + e (z_v - m)), z_v - m formed first (exact near the max,
    // where p_v is large), then the same cap slope and background as below.
    int64_t v = 0;
    for (; v + L <= n; v += L) {
      const VT x = loadu<VT>(z + v);
      VT g = vexp(x - l) * (ta + te * (x - tm)) - (w ? loadu<VT>(w + v) : VT{} + T(1)) * tb;
      if (capped) {
        const VT t = x * ic;
        g *= (T(1) - t) * (T(1) + t);
      }
      storeu(z + v, g);
    }
    for (; v < n; ++v) {
      const T x = z[v];
      T g = sexp<T>(x - l) * (ta + te * (x - tm)) - tb * (w ? w[v] : T(1));
      if (capped) {
        const T t = x * ic;
        g *= (T(1) - t) * (T(1) + t);
      }
      z[v] = g;
    }
    return;
  }
  auto one = [&](T x, T wv) {
    T g = sexp<T>(x - l) * ta - tb * wv;
    if (capped) {
      const T t = x * ic;
      g *= (T(1) - t) * (T(1) + t);  // 1 - tanh^2 without cancelling near |t| = 1
    }
    return g;
  };
  int64_t v = 0;
  for (; v + L <= n; v += L) {
    const VT x = loadu<VT>(z + v);
    VT g = vexp(x - l) * ta - (w ? loadu<VT>(w + v) : VT{} + T(1)) * tb;
    if (capped) {
      const VT t = x * ic;
      g *= (T(1) - t) * (T(1) + t);
    }
    storeu(z + v, g);
  }
  for (; v < n; ++v) z[v] = one(z[v], w ? w[v] : T(1));
}

ALGENTA_KERN_INSTANTIATE(softmax_grad, float, double)

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

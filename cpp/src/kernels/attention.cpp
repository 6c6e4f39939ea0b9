// Attention's kernels for the resident session, compiled once per instruction set: queries
// against one KV head's cache rows (float32 queries; float32, bf16 or f16 keys and values, each
// vector widened exactly right after its load, scalar tails by half.hpp's one definition) and
// the softmax of a row of scores.
//
// A prefill has many queries per KV head (the G query heads of each row, and several rows); taken
// one at a time, each score is a key row's loads and a horizontal sum, each output update a
// store-to-load chain through memory. These take up to QD (scores) or QV (outputs) queries per
// pass, loading each key or value vector once for all of them and holding the sums in registers;
// decode takes the same kernels with its one query. Never allocates.
//
// Numerics. A score: the row in groups of ACC vectors, vector a of each group into accumulator a
// (whole vectors past the last group into accumulator 0, the zero-padded tail into 1), combined
// as (a0 + a1) + (a2 + a3), the lanes then summed as a halving tree (simd.hpp's hsum; hsums for
// W keys side by side). An output: one multiply-add an element a key, keys in order. Each
// query's bits are its own whatever group it is in, so a row attends with the same bits whether
// it was prefilled or stepped (tests/test_residentk_split.py). The softmax: see softmax below.
//
// Legend: n the head's width (d_head); W = VBYTES/4 float lanes; ACC accumulators.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "parts.hpp"
#include "simd.hpp"
#include "vmath.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

constexpr int W = lanes<float>();
constexpr int ACC = 4;

constexpr int QD = VBYTES == 64 ? 6 : 3;  // 4 accumulators a query, kept in registers
constexpr int QV = VBYTES == 64 ? 4 : 3;  // 4 output vectors a query, kept in registers

// a KV row's vectors and scalars in each cache format, widened exactly (simd.hpp's loads; the
// scalar tails by half.hpp, the same values)
template <Dtype F>
struct Kv;
template <>
struct Kv<Dtype::F32> {
  typedef float T;
  static vf ld(const float* p) { return *(const vfu*)p; }
  static float sc(float v) { return v; }
};
template <>
struct Kv<Dtype::BF16> {
  typedef uint16_t T;
  static vf ld(const uint16_t* p) { return ld_bf16(p); }
  static float sc(uint16_t v) { return half::bf16_to_f32(v); }
};
template <>
struct Kv<Dtype::F16> {
  typedef uint16_t T;
  static vf ld(const uint16_t* p) { return ld_f16(p); }
  static float sc(uint16_t v) { return half::f16_to_f32(v); }
};

// r[t] = the combined accumulators of q[t] (n) . k (n) for NQ queries (the vector hsum takes)
template <Dtype F, int NQ>
static inline void kv_dot_vecs(const float* const* q, const typename Kv<F>::T* k, int64_t n,
                               vf* r) {
  vf acc[NQ][ACC];
  for (int t = 0; t < NQ; ++t)  // element by element: `= {}` became a rep stos to the stack
    for (int a = 0; a < ACC; ++a) acc[t][a] = vf{};
  int64_t i = 0;
  for (; i + ACC * W <= n; i += ACC * W)
    for (int a = 0; a < ACC; ++a) {
      const vf kv = Kv<F>::ld(k + i + a * W);
      for (int t = 0; t < NQ; ++t) acc[t][a] += *(const vfu*)(q[t] + i + a * W) * kv;
    }
  for (; i + W <= n; i += W) {
    const vf kv = Kv<F>::ld(k + i);
    for (int t = 0; t < NQ; ++t) acc[t][0] += *(const vfu*)(q[t] + i) * kv;
  }
  if (i < n) {  // the padded tail
    vf tk = {};
    for (int l = 0; i + l < n; ++l) tk[l] = Kv<F>::sc(k[i + l]);
    for (int t = 0; t < NQ; ++t) {
      vf tq = {};
      for (int l = 0; i + l < n; ++l) tq[l] = q[t][i + l];
      acc[t][1] += tq * tk;
    }
  }
  for (int t = 0; t < NQ; ++t) r[t] = (acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]);
}

// s[t * lds + j - j0] = q[t] (n) . row j of K (rows n apart), j in [j0, j1), for NQ queries:
// W keys at a time summed side by side (hsums), the last few one by one
template <Dtype F, int NQ>
static void kv_dots_n(const float* const* q, const typename Kv<F>::T* K, int64_t n, int64_t j0,
                      int64_t j1, float* s, int64_t lds) {
  int64_t j = j0;
  for (; j + W <= j1; j += W) {
    vf r[NQ][W], kr[NQ];
    for (int u = 0; u < W; ++u) {
      kv_dot_vecs<F, NQ>(q, K + (j + u) * n, n, kr);
      for (int t = 0; t < NQ; ++t) r[t][u] = kr[t];
    }
    for (int t = 0; t < NQ; ++t) hsums(r[t], s + t * lds + (j - j0));
  }
  for (; j < j1; ++j) {
    vf kr[NQ];
    kv_dot_vecs<F, NQ>(q, K + j * n, n, kr);
    for (int t = 0; t < NQ; ++t) s[t * lds + (j - j0)] = hsum(kr[t]);
  }
}

// out[t] (n) += p[t * ldp + j - j0] * row j of V, j = j0, j0 + 1, ..., j1 - 1, for NQ queries
template <Dtype F, int NQ>
static void kv_axpys_n(const float* p, int64_t ldp, const typename Kv<F>::T* V, int64_t n,
                       int64_t j0, int64_t j1, float* const* out) {
  constexpr int SV = 4;  // vectors of a slice of the row
  int64_t i = 0;
  for (; i + SV * W <= n; i += SV * W) {
    vf acc[NQ][SV];
    for (int t = 0; t < NQ; ++t)
      for (int v = 0; v < SV; ++v) acc[t][v] = *(const vfu*)(out[t] + i + v * W);
    for (int64_t j = j0; j < j1; ++j) {
      vf pv[NQ];
      for (int t = 0; t < NQ; ++t) pv[t] = vf{} + p[t * ldp + (j - j0)];
      for (int v = 0; v < SV; ++v) {
        const vf x = Kv<F>::ld(V + j * n + i + v * W);
        for (int t = 0; t < NQ; ++t) acc[t][v] = acc[t][v] + pv[t] * x;
      }
    }
    for (int t = 0; t < NQ; ++t)
      for (int v = 0; v < SV; ++v) *(vfu*)(out[t] + i + v * W) = acc[t][v];
  }
  for (; i + W <= n; i += W)
    for (int t = 0; t < NQ; ++t) {
      vf acc = *(const vfu*)(out[t] + i);
      for (int64_t j = j0; j < j1; ++j)
        acc = acc + (vf{} + p[t * ldp + (j - j0)]) * Kv<F>::ld(V + j * n + i);
      *(vfu*)(out[t] + i) = acc;
    }
  for (; i < n; ++i)  // axpy's scalar tail
    for (int t = 0; t < NQ; ++t)
      for (int64_t j = j0; j < j1; ++j) out[t][i] += p[t * ldp + (j - j0)] * Kv<F>::sc(V[j * n + i]);
}

// nq queries in groups of G, the last group's size picked at run time (R counts down to 1)
template <int G, int R, class Fn>
static inline void groups_of(int nq, Fn&& fn) {
  if constexpr (R == G) {
    int t = 0;
    for (; t + G <= nq; t += G) fn(std::integral_constant<int, G>{}, t);
    if (t < nq) groups_of<G, G - 1>(nq - t, [&](auto c, int u) { fn(c, t + u); });
  } else if constexpr (R >= 1) {
    if (nq == R) return fn(std::integral_constant<int, R>{}, 0);
    groups_of<G, R - 1>(nq, fn);
  }
}

template <Dtype F>
static void kv_dots_t(const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
                      int64_t j1, float* s, int64_t lds) {
  const auto* k = static_cast<const typename Kv<F>::T*>(K);
  groups_of<QD, QD>(nq, [&](auto c, int t) {
    kv_dots_n<F, decltype(c)::value>(q + t, k, n, j0, j1, s + t * lds, lds);
  });
}
template <Dtype F>
static void kv_axpys_t(const float* p, int64_t ldp, int nq, const void* V, int64_t n, int64_t j0,
                       int64_t j1, float* const* out) {
  const auto* v = static_cast<const typename Kv<F>::T*>(V);
  groups_of<QV, QV>(nq, [&](auto c, int t) {
    kv_axpys_n<F, decltype(c)::value>(p + t * ldp, ldp, v, n, j0, j1, out + t);
  });
}

}  // namespace

void kv_dots(Dtype f, const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
                    int64_t j1, float* s, int64_t lds) {
  if (f == Dtype::F32) return kv_dots_t<Dtype::F32>(q, nq, K, n, j0, j1, s, lds);
  if (f == Dtype::BF16) return kv_dots_t<Dtype::BF16>(q, nq, K, n, j0, j1, s, lds);
  kv_dots_t<Dtype::F16>(q, nq, K, n, j0, j1, s, lds);
}
void kv_axpys(Dtype f, const float* p, int64_t ldp, int nq, const void* V, int64_t n,
                     int64_t j0, int64_t j1, float* const* out) {
  if (f == Dtype::F32) return kv_axpys_t<Dtype::F32>(p, ldp, nq, V, n, j0, j1, out);
  if (f == Dtype::BF16) return kv_axpys_t<Dtype::BF16>(p, ldp, nq, V, n, j0, j1, out);
  kv_axpys_t<Dtype::F16>(p, ldp, nq, V, n, j0, j1, out);
}

// s (n) <- softmax(s) in place, attention's weights (callers scale and soft-cap s first):
// exp(s_j - max) by vmath.hpp's vexp_nonpos (libm's expf is a call per key, never vectorized), their
// sum in double in 16 partial sums (element j in sum j mod 16, the partials then added in order:
// no 4-cycle add chain a key, and the same order on every instruction set), each weight e_j *
// float(1 / sum). Keys more than 87 below the max weigh exp(-87) / sum instead of less
// (exp_nonpos' floor), under 1e-37 of the largest weight.
void softmax(float* s, int64_t n) {
  if (n <= 0) return;
  constexpr int NV16 = 16 / W;  // vectors in a group of 16
  const int64_t full = n / 16 * 16;
  alignas(64) float tail[16];  // the last partial group, padded
  for (int64_t k = 0; k < 16; ++k) tail[k] = full + k < n ? s[full + k] : s[0];
  vf mv = *(const vf*)tail;
  for (int64_t i = 0; i < full; i += W) {
    const vf x = *(const vfu*)(s + i);
    mv = mv < x ? x : mv;
  }
  for (int v = 1; v < NV16; ++v) mv = mv < *(const vf*)(tail + v * W) ? *(const vf*)(tail + v * W) : mv;
  float mx = mv[0];
  for (int l = 1; l < W; ++l) mx = std::max(mx, mv[l]);
  double part[16] = {};
  // exp of one group of 16 at g (in place), added to the partial sums; `m` of them are real
  const auto group = [&](float* g, int64_t m) {
    alignas(64) float e[16];
    for (int v = 0; v < NV16; ++v) *(vf*)(e + v * W) = vexp_nonpos(*(const vfu*)(g + v * W) - mx);
    for (int64_t k = m; k < 16; ++k) e[k] = 0.f;  // padding adds nothing to the sums
    for (int k = 0; k < 16; ++k) part[k] += double(e[k]);
    for (int v = 0; v < NV16; ++v) *(vfu*)(g + v * W) = *(const vf*)(e + v * W);
  };
  for (int64_t i = 0; i < full; i += 16) group(s + i, 16);
  if (full < n) {
    group(tail, n - full);
    for (int64_t k = 0; full + k < n; ++k) s[full + k] = tail[k];
  }
  double tot = part[0];
  for (int k = 1; k < 16; ++k) tot += part[k];
  const float inv = float(1.0 / tot);
  for (int64_t j = 0; j < n; ++j) s[j] = s[j] * inv;
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

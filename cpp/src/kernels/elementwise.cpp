// The resident session's element-wise and reduction kernels, compiled once per instruction set:
// the soft cap and the MLP's gates (session_math.hpp's per-element arithmetic, vectorized by
// GCC over fixed groups of 16), RMSNorm's sum of squares, the rounding of activations to bf16
// for the bf16 panels, and the read-bandwidth probe's streaming sum.
//
// Never allocates. Numerics: an element takes the same instructions wherever it sits (by16), so
// the stages are bit-identical between decode and prefill; sum_sq is the same on every
// instruction set (exact squares in double, a fixed order of partial sums).
#include <algorithm>
#include <cstdint>

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "algenta/session_math.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

constexpr int W = lanes<float>();
constexpr int ACC = 4;  // the probe's accumulators a stream

// The bandwidth probe's optional software prefetch: the hardware prefetcher alone left row-by-row
// weight dots short of their read rate on an AMX Xeon (perf/RESULTS.md), so the probe also reads
// with the lines PF_AHEAD bytes ahead requested; past the end a prefetch is only a hint (it never
// faults). Timing only: no result depends on it.
constexpr int64_t PF_AHEAD = 2048;
static inline void prefetch_ahead(const void* p, int lines) {
  const char* c = static_cast<const char*>(p) + PF_AHEAD;
  for (int l = 0; l < lines; ++l) __builtin_prefetch(c + 64 * l, 0, 3);
}
constexpr int lines_of(int64_t bytes) { return bytes < 64 ? 1 : int(bytes / 64); }

// fn over [0, n) in groups of 16 elements, each group through one fixed 16-wide pass over a
// zero-padded copy: every element takes the same instructions wherever it sits (a vector body
// and a scalar epilogue may round differently, and a decode task and a prefill row start at
// different places), so the families' elementwise stages stay bit-identical between decode
// and prefill; the fixed trip count is what the compiler vectorizes.
template <class Fn>
static inline void by16(int64_t n, Fn&& fn) {
  for (int64_t i0 = 0; i0 < n; i0 += 16) fn(i0, std::min<int64_t>(16, n - i0));
}
// A group's copy in (x + bias, bias may be null; zeros past m) and out. The pass between never
// changes; a whole group (every one but a row's last) copies in fixed 16-trip loops the compiler
// turns into vector moves: a value at a time, the copies cost more than the gate they feed.
static inline void in16(const float* x, const float* bias, int64_t m, float* a) {
  if (m == 16 && bias) {
    for (int k = 0; k < 16; ++k) a[k] = x[k] + bias[k];
  } else if (m == 16) {
    for (int k = 0; k < 16; ++k) a[k] = x[k];
  } else {
    for (int64_t k = 0; k < 16; ++k) a[k] = k < m ? (bias ? x[k] + bias[k] : x[k]) : 0.f;
  }
}
static inline void out16(const float* a, int64_t m, float* y) {
  if (m == 16) {
    for (int k = 0; k < 16; ++k) y[k] = a[k];
  } else {
    for (int64_t k = 0; k < m; ++k) y[k] = a[k];
  }
}

}  // namespace

// sum of a (n), for the read-bandwidth probe: vector loads in `streams` (1, 2 or 4)
// contiguous parts read side by side, with or without prefetch_ahead. Which pattern reads fastest
// is the host's (perf/RESULTS.md); decode's products read four or more streams a thread on AVX2
// and AVX-512 (one panel's four k blocks; four int8 panels on AVX2, eight on AVX-512). The probe
// keeps the best, so a roofline share is against the best streaming read of the host. Streams 2
// and 3 add into the accumulators of 0 and 1 (a sink, not a result).
float sum(const float* a, int64_t n, int streams, bool prefetch) {
  vf acc[2][ACC] = {};
  const int ns = streams >= 4 ? 4 : streams == 2 ? 2 : 1;
  const int64_t part = n / ns / (ACC * W) * (ACC * W);
  for (int64_t i = 0; i < part; i += ACC * W)
    for (int st = 0; st < ns; ++st) {
      const float* p = a + st * part + i;
      if (prefetch) prefetch_ahead(p, lines_of(ACC * W * 4));
      for (int k = 0; k < ACC; ++k) acc[st % 2][k] += *(const vfu*)(p + k * W);
    }
  float s = hsum((acc[0][0] + acc[0][1]) + (acc[0][2] + acc[0][3])) +
            hsum((acc[1][0] + acc[1][1]) + (acc[1][2] + acc[1][3]));
  for (int64_t i = ns * part; i < n; ++i) s += a[i];
  return s;
}

// x (n)'s squares summed in double for RMSNorm: square i into partial sum i mod 16, the 16
// partials then added in order. Each square of a float is exact in double, so every
// instruction set gets the same bits; one chain of n dependent adds (the loop this replaced) was
// bound by the add's latency.
double sum_sq(const float* x, int64_t n) {
  double part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) part[k] += double(x[i + k]) * double(x[i + k]);
  for (int k = 0; i + k < n; ++k) part[k] += double(x[i + k]) * double(x[i + k]);
  double s = part[0];
  for (int k = 1; k < 16; ++k) s += part[k];
  return s;
}

// bf16 activations (q8panels.cpp quantizes the int8 ones): the activation vector is rounded to
// bf16 once per product (xb the bits, xr their float32 values, both zero-padded to Q8_ACT_PAD
// elements), as transformers' and llama.cpp's bf16 matmuls multiply bf16 inputs. A product of two bf16 values is exact in float32, so the paths multiply
// the same products and differ only in how they sum them: vdpbf16ps pair panels on AVX512-BF16,
// the float32 GEMM's chain on widened panels and xr elsewhere. (vdpbf16ps treats subnormal inputs
// and results as zero, |v| < 1.2e-38: the only values where the paths' products differ.)
void round_bf16(const float* x, int64_t n, uint16_t* xb, float* xr) {
  const int64_t padded = act_padded(n);
  for (int64_t i = 0; i < n; ++i) xb[i] = half::f32_to_bf16(x[i]);
  for (int64_t i = n; i < padded; ++i) xb[i] = 0;
  if (!xr) return;
  for (int64_t i = 0; i < n; ++i) xr[i] = half::bf16_to_f32(xb[i]);
  for (int64_t i = n; i < padded; ++i) xr[i] = 0.f;
}

// z (n) = cap * tanh(z / cap) in place (session_math::softcap).
void softcap(float* z, int64_t n, float cap) {
  by16(n, [&](int64_t i0, int64_t m) {
    alignas(64) float x[16];
    in16(z + i0, nullptr, m, x);
    for (int k = 0; k < 16; ++k) x[k] = session_math::softcap(x[k], cap);
    out16(x, m, z + i0);
  });
}

// out (n) = act(g + gb) * (u + ub), act the MLP's gate (session_math::silu_mul or
// gelu_tanh_mul), biases may be null; out may be g.
template <float (*Act)(float, float)>
void gate_mul(const float* g, const float* u, const float* gb, const float* ub, float* out,
              int64_t n) {
  by16(n, [&](int64_t i0, int64_t m) {
    alignas(64) float a[16], b[16];
    in16(g + i0, gb ? gb + i0 : nullptr, m, a);
    in16(u + i0, ub ? ub + i0 : nullptr, m, b);
    for (int k = 0; k < 16; ++k) a[k] = Act(a[k], b[k]);
    out16(a, m, out + i0);
  });
}

// The table's entries (tables.cpp), instantiated here.
ALGENTA_KERN_INSTANTIATE(gate_mul, session_math::silu_mul, session_math::gelu_tanh_mul)

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// The CPU session's kernels: decode's matrix-vector products (float32 and f16 rows against
// float32 activations, bf16 rows against bf16 activations, int8 rows against int8 blocks) and the
// int8 prefill GEMM, compiled once per instruction set beside kernels_isa.cpp (CMakeLists.txt puts
// both in each per-ISA object), so the session and lossk share one dispatch: the table
// cpu_dispatch.cpp picks carries these as IsaTable::session. Written with GCC vector
// extensions; -ffp-contract (GCC's default) fuses the multiply-adds under FMA.
//
// Fuses nothing across calls; never allocates; reads each weight element exactly once.
// Numerics: a dot product keeps ACC independent vector accumulators (lane l of accumulator a
// sums elements i = a*W + l mod ACC*W), combines them in a fixed tree and adds the scalar tail
// last, so its bits depend only on n and the data, never on the thread that computes it.
//
// Legend: n vector length; W = VBYTES/4 float lanes; ACC accumulators.
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "algenta/quant.hpp"
#include "algenta/residentk.hpp"

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif

#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX2__)
#define VBYTES 32
#else
#define VBYTES 16
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

using residentk::RESIDENT_INT8_BLOCK;

typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4)));  // unaligned view
constexpr int W = VBYTES / 4;
constexpr int ACC = 4;

// Weight rows stream back to back (each 1-4 KB); the hardware prefetcher alone left the narrow
// formats' decode 10-15% short of their read rate on an AMX Xeon (2 threads: bf16 57.6 -> 51.9
// ms a token with this, at the Qwen3-0.6B shape). Each dot asks for the lines PF_AHEAD bytes past
// the ones it is reading, across the end of its row into the next; past the last row a prefetch
// is only a hint (it never faults). Timing only: no result depends on it.
constexpr int64_t PF_AHEAD = 2048;
static inline void prefetch_ahead(const void* p, int lines) {
  const char* c = static_cast<const char*>(p) + PF_AHEAD;
  for (int l = 0; l < lines; ++l) __builtin_prefetch(c + 64 * l, 0, 3);
}
constexpr int lines_of(int64_t bytes) { return bytes < 64 ? 1 : int(bytes / 64); }

static inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// a (n) . b (n). The last n % W elements go through one zero-padded vector, like the others:
// a scalar tail would leave the compiler free to contract (or not) its multiply-adds into FMAs
// differently in each copy of this loop, and the narrow-format dots below must give exactly
// this function's bits on the same (widened) values.
static float dot(const float* a, const float* b, int64_t n) {
  vf acc[ACC] = {};
  int64_t i = 0;
  for (; i + ACC * W <= n; i += ACC * W) {
    prefetch_ahead(a + i, lines_of(ACC * W * 4));
    for (int k = 0; k < ACC; ++k)
      acc[k] += *(const vfu*)(a + i + k * W) * *(const vfu*)(b + i + k * W);
  }
  for (; i + W <= n; i += W) acc[0] += *(const vfu*)(a + i) * *(const vfu*)(b + i);
  if (i < n) {
    vf ta = {}, tb = {};
    for (int l = 0; i + l < n; ++l) ta[l] = a[i + l], tb[l] = b[i + l];
    acc[1] += ta * tb;
  }
  return hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

// y[o] (+)= Wt[o, :] . x for o in [r0, r1); Wt (rows, n) row-major, x (n).
static void matvec_rows(const float* Wt, const float* x, int64_t n, int64_t r0, int64_t r1,
                        float* y, bool accumulate) {
  for (int64_t o = r0; o < r1; ++o) {
    const float d = dot(Wt + o * n, x, n);
    y[o] = accumulate ? y[o] + d : d;
  }
}

// The narrow prefill tile: Y[r, o] (+)= Wt[o, :] . X[r, :] for m rows of X. Each weight row is
// read from memory once and reused from L1 for all m rows, so a short prompt costs one weight
// stream like a decode step instead of m of them. Y (m, ldy), X (m, n).
//
// Register blocks of RO weight rows x RT activation rows share their loads (a dot() per cell
// would issue two loads per multiply-add and be load-bound). Every cell is one accumulator
// chain in the same order (full vectors, then one zero-padded vector, then hsum) whatever block
// it lands in, so its bits do not depend on where a thread's rows start or on m.
template <int RO, int RT>
static inline void tile_block(const float* Wt, const float* X, int64_t n, int64_t o, int64_t r,
                              float* Y, int64_t ldy, bool accumulate) {
  vf a[RO][RT] = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf w[RO];
    for (int k = 0; k < RO; ++k) w[k] = *(const vfu*)(Wt + (o + k) * n + i);
    for (int t = 0; t < RT; ++t) {
      const vf x = *(const vfu*)(X + (r + t) * n + i);
      for (int k = 0; k < RO; ++k) a[k][t] += w[k] * x;
    }
  }
  if (i < n) {
    vf w[RO] = {};
    for (int k = 0; k < RO; ++k)
      for (int l = 0; i + l < n; ++l) w[k][l] = Wt[(o + k) * n + i + l];
    for (int t = 0; t < RT; ++t) {
      vf x = {};
      for (int l = 0; i + l < n; ++l) x[l] = X[(r + t) * n + i + l];
      for (int k = 0; k < RO; ++k) a[k][t] += w[k] * x;
    }
  }
  for (int k = 0; k < RO; ++k)
    for (int t = 0; t < RT; ++t) {
      const float d = hsum(a[k][t]);
      float& y = Y[(r + t) * ldy + o + k];
      y = accumulate ? y + d : d;
    }
}

template <int RO>
static inline void tile_rows(const float* Wt, const float* X, int64_t m, int64_t n, int64_t o,
                             float* Y, int64_t ldy, bool accumulate) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile_block<RO, 4>(Wt, X, n, o, r, Y, ldy, accumulate);
  for (; r < m; ++r) tile_block<RO, 1>(Wt, X, n, o, r, Y, ldy, accumulate);
}

static void matmat_rows_narrow(const float* Wt, const float* X, int64_t m, int64_t n, int64_t r0,
                               int64_t r1, float* Y, int64_t ldy, bool accumulate) {
  int64_t o = r0;
  for (; o + 2 <= r1; o += 2) tile_rows<2>(Wt, X, m, n, o, Y, ldy, accumulate);
  if (o < r1) tile_rows<1>(Wt, X, m, n, o, Y, ldy, accumulate);
}

// y (n) += p * v (n)
static void axpy(float p, const float* v, float* y, int64_t n) {
  int64_t i = 0;
  const vf pv = vf{} + p;
  for (; i + W <= n; i += W) *(vfu*)(y + i) = *(const vfu*)(y + i) + pv * *(const vfu*)(v + i);
  for (; i < n; ++i) y[i] += p * v[i];
}

// sum of a (n), for the read-bandwidth probe: the same loads as dot, one stream.
static float sum(const float* a, int64_t n) {
  vf acc[ACC] = {};
  int64_t i = 0;
  for (; i + ACC * W <= n; i += ACC * W) {
    prefetch_ahead(a + i, lines_of(ACC * W * 4));  // as the dots stream: the same roofline
    for (int k = 0; k < ACC; ++k) acc[k] += *(const vfu*)(a + i + k * W);
  }
  float s = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) s += a[i];
  return s;
}

// ---- narrow weight rows (bf16, f16, int8), widened in registers --------------------------------
// A row is read once, as its narrow bytes; each vector is widened to float32 right after the
// load and multiplied in float32, with the same accumulator layout and fixed combination order
// as dot(), so a row's result depends only on its data and n.
typedef unsigned short vh __attribute__((vector_size(VBYTES / 2), aligned(2)));  // W halves
typedef signed char vq __attribute__((vector_size(VBYTES / 4), aligned(1)));     // W int8
typedef unsigned int vu __attribute__((vector_size(VBYTES)));
typedef int vi __attribute__((vector_size(VBYTES)));

// Scalar tails widen with the one definition (algenta/half.hpp); exact, as the vector loads.
static inline float s_bf16(uint16_t h) { return half::bf16_to_f32(h); }
static inline float s_f16(uint16_t h) { return half::f16_to_f32(h); }

// The loads below use intrinsics where GCC's generic vector conversions come out as scalar
// inserts or split halves (int8 -> float32 on every ISA, bf16 on AVX2): a widening load must
// cost about what the multiply-add after it costs, or the narrow formats stop being
// bandwidth-bound.
static inline vf ld_bf16(const uint16_t* p) {
#if VBYTES == 32
  return (vf)_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#elif VBYTES == 64
  return (vf)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__SSE2__)
  // interleaving zeros below each half puts it in the high 16 bits of its 32-bit lane
  return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(),
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return (vf)(__builtin_convertvector(*(const vh*)p, vu) << 16);
#endif
}

static inline vf ld_f16(const uint16_t* p) {
#if VBYTES == 32
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif VBYTES == 64
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  const vu h = __builtin_convertvector(*(const vh*)p, vu);
  const vu em = h & 0x7fffu;
  const vf f = (vf)(em << 13) * 0x1p112f;
  const vu special = (vu)(em >= 0x7c00u);  // all ones where infinity/NaN
  const vu bits = ((vu)f & ~special) | (((em << 13) | 0x7f800000u) & special);
  return (vf)(bits | ((h & 0x8000u) << 16));
#endif
}

static inline vf ld_q8(const int8_t* p) {
#if VBYTES == 32
  return (vf)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif VBYTES == 64
  return (vf)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__SSE2__)
  // SSE2 has no sign-extending load: put each byte at the top of its 32-bit lane, then an
  // arithmetic shift brings it down with its sign
  int32_t four;
  std::memcpy(&four, p, 4);
  __m128i v = _mm_cvtsi32_si128(four);
  v = _mm_unpacklo_epi8(v, v);
  v = _mm_unpacklo_epi16(v, v);
  return (vf)_mm_cvtepi32_ps(_mm_srai_epi32(v, 24));
#else
  return __builtin_convertvector(__builtin_convertvector(*(const vq*)p, vi), vf);
#endif
}

template <vf (*LD)(const uint16_t*), float (*SC)(uint16_t)>
static float dot_h(const uint16_t* a, const float* b, int64_t n) {
  vf acc[ACC] = {};
  int64_t i = 0;
  for (; i + ACC * W <= n; i += ACC * W) {
    prefetch_ahead(a + i, lines_of(ACC * W * 2));
    for (int k = 0; k < ACC; ++k) acc[k] += LD(a + i + k * W) * *(const vfu*)(b + i + k * W);
  }
  for (; i + W <= n; i += W) acc[0] += LD(a + i) * *(const vfu*)(b + i);
  if (i < n) {  // as dot()'s tail
    vf ta = {}, tb = {};
    for (int l = 0; i + l < n; ++l) ta[l] = SC(a[i + l]), tb[l] = b[i + l];
    acc[1] += ta * tb;
  }
  return hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}
static float dot_bf16(const uint16_t* a, const float* b, int64_t n) {
  return dot_h<ld_bf16, s_bf16>(a, b, n);
}
static float dot_f16(const uint16_t* a, const float* b, int64_t n) {
  return dot_h<ld_f16, s_f16>(a, b, n);
}

// ---- bf16 rows against bf16 activations ------------------------------------------------------
// The activation vector is rounded to bf16 once per matrix-vector product (round_bf16: xb the
// bits, xr their float32 values, both zero-padded to Q8_ACT_PAD elements), as transformers' and
// llama.cpp's bf16 matmuls multiply bf16 inputs. A product of two bf16 values is exact in
// float32, so every path multiplies the same products and differs only in how it sums them:
// vdpbf16ps on AVX512-BF16 (a weight pair and an activation pair a lane, straight from the
// row: no packing), the widening dot on xr elsewhere. (vdpbf16ps treats subnormal inputs and
// results as zero, |v| < 1.2e-38: the only values where the paths' products differ.)
static void round_bf16(const float* x, int64_t n, uint16_t* xb, float* xr) {
  const int64_t padded = (n + Q8_ACT_PAD - 1) / Q8_ACT_PAD * Q8_ACT_PAD;
  for (int64_t i = 0; i < n; ++i) {
    xb[i] = half::f32_to_bf16(x[i]);
    xr[i] = half::bf16_to_f32(xb[i]);
  }
  for (int64_t i = n; i < padded; ++i) xb[i] = 0, xr[i] = 0.f;
}

static float dot_bf16_bf16(const uint16_t* w, const uint16_t* xb, const float* xr, int64_t n) {
#if defined(__AVX512BF16__)
  (void)xr;
  // 32 elements a vector (16 pairs), four accumulators combined in a fixed tree; a last partial
  // vector through masked loads (which never touch the masked-off bytes)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t i = 0;
  auto ld = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (; i + 128 <= n; i += 128) {
    prefetch_ahead(w + i, lines_of(128 * 2));
    for (int k = 0; k < 4; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], ld(w + i + 32 * k), ld(xb + i + 32 * k));
  }
  for (; i + 32 <= n; i += 32) acc[0] = _mm512_dpbf16_ps(acc[0], ld(w + i), ld(xb + i));
  if (i < n) {
    const __mmask32 m = (__mmask32)((uint64_t(1) << (n - i)) - 1);
    acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_maskz_loadu_epi16(m, w + i),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, xb + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                            _mm512_add_ps(acc[2], acc[3])));
#else
  (void)xb;
  return dot_bf16(w, xr, n);
#endif
}

// ---- int8 rows against int8 activations (Q8_0 x Q8_0) -----------------------------------------
// The activation vector is quantized once per matrix-vector product (quantize_q8, the same
// quant::q8_block rule as the weights) into xq (signed), xa = |xq| (unsigned) and one scale per
// block. A block's 32 products then sum exactly in 32-bit integers (|q| <= 127), on the integer
// dot-product units where the instruction set has them: vpdpbusd (AVX512-VNNI) multiplies
// unsigned by signed bytes, so the sign of x moves onto w (w * sign(x), exact: w != -128) and
// |x| is the unsigned operand; without VNNI, vpmaddubsw + vpmaddwd compute the same (a pair of
// products is at most 2 * 127^2, below int16's saturation). Each lane's exact partial sum enters
// float32 once, times sw_b * sx_b, in two accumulators combined in a fixed order, so a row's
// bits depend only on its data and n. Full blocks of 32 go through the vectors; a last partial
// block (n % 32) is summed in scalar integers.
static inline int32_t q8_isum(const int8_t* w, const int8_t* x, int64_t n) {
  int32_t t = 0;
  for (int64_t i = 0; i < n; ++i) t += int32_t(w[i]) * int32_t(x[i]);
  return t;
}

static void quantize_q8(const float* x, int64_t n, int8_t* xq, uint8_t* xa, float* xs) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  for (int64_t i = 0, b = 0; i < n; i += B, ++b)
    xs[b] = quant::q8_block(x + i, std::min(B, n - i), xq + i);
  const int64_t padded = (n + Q8_ACT_PAD - 1) / Q8_ACT_PAD * Q8_ACT_PAD;
  for (int64_t i = 0; i < n; ++i) xa[i] = uint8_t(xq[i] < 0 ? -xq[i] : xq[i]);
  for (int64_t i = n; i < padded; ++i) xq[i] = 0, xa[i] = 0;
}

#if VBYTES == 64
// int32 partial sums of two blocks (lanes 0-7 the first, 8-15 the second).
static inline __m512i q8_pair(const int8_t* w, const int8_t* xq, const uint8_t* xa) {
  const __m512i wv = _mm512_loadu_si512(w);
  const __mmask64 neg = _mm512_movepi8_mask(_mm512_loadu_si512(xq));
  const __m512i ws = _mm512_mask_sub_epi8(wv, neg, _mm512_setzero_si512(), wv);
  const __m512i a = _mm512_loadu_si512(xa);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, ws);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(a, ws), _mm512_set1_epi16(1));
#endif
}
#elif VBYTES == 32
// int32 partial sums of one block (8 lanes).
static inline __m256i q8_one(const int8_t* w, const int8_t* xq, const uint8_t* xa) {
  const __m256i ws = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, ws), _mm256_set1_epi16(1));
}
#endif

static float dot_q8q8(const int8_t* w, const float* sw, const int8_t* xq, const uint8_t* xa,
                      const float* xs, int64_t n) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  static_assert(RESIDENT_INT8_BLOCK == 32, "the vector loops hold whole blocks of 32");
  int64_t i = 0, b = 0;
  float s = 0.f;
#if VBYTES == 64
  // four blocks an iteration: one load of their four scale pairs, broadcast to 8 lanes each
  const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 4 * B <= n; i += 4 * B, b += 4) {
    prefetch_ahead(w + i, lines_of(4 * B));
    const __m512 c = _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(sw + b), _mm_loadu_ps(xs + b)));
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_pair(w + i, xq + i, xa + i)),
                           _mm512_permutexvar_ps(lo, c), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_pair(w + i + 2 * B, xq + i + 2 * B, xa + i + 2 * B)),
                           _mm512_permutexvar_ps(hi, c), acc1);
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif VBYTES == 32
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 2 * B <= n; i += 2 * B, b += 2) {
    prefetch_ahead(w + i, lines_of(2 * B));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_one(w + i, xq + i, xa + i)),
                           _mm256_set1_ps(sw[b] * xs[b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_one(w + i + B, xq + i + B, xa + i + B)),
                           _mm256_set1_ps(sw[b + 1] * xs[b + 1]), acc1);
  }
  const __m256 t = _mm256_add_ps(acc0, acc1);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  for (int l = 0; l < 4; ++l) s += h[l];
#endif
  // the rest (all of it in the generic build): whole blocks, then a partial one
  for (; i < n; i += B, ++b) s += float(q8_isum(w + i, xq + i, std::min(B, n - i))) * (sw[b] * xs[b]);
  return s;
}

// ---- int8 prefill GEMM on vpdpbusd (AVX512-VNNI builds only) ---------------------------------
// Y[r, o] (+)= sum_b sw[o, b] * sx[r, b] * sum_{i in b} wq[o, i] * xq[r, i] for M activation rows
// and N weight rows, the products decode's dot_q8q8 computes, with K-quads of 16 weight rows in
// the 16 lanes of one register and 4 activation bytes broadcast to all of them, so one block's
// integer sums for 16 rows land in 16 lanes with no reduction (64 multiply-adds an instruction,
// four times the float32 FMA's). vpdpbusd multiplies unsigned by signed bytes: the activations
// go in as xq + 128 (unsigned) and 128 * sum_i wq[o, i] comes off each block (exact, int32).
// Each cell: blocks in increasing order, one float32 multiply-add each (integer block sum times
// sw * sx), so its bits do not depend on M, N or where a thread's rows start.
#if defined(__AVX512VNNI__) && VBYTES == 64
constexpr int64_t QP_ROWS = 16;  // weight rows a panel
constexpr int QP_RT = 4;          // activation rows a micro-tile
constexpr int QP_NV = 2;          // panels a micro-tile

// Bytes of workspace for N weight rows of K columns: the panels, their block sums and scales.
static int64_t gemm_q8_ws_bytes(int64_t N, int64_t K) {
  const int64_t B = RESIDENT_INT8_BLOCK, nb = (K + B - 1) / B;
  const int64_t panels = (N + QP_ROWS - 1) / QP_ROWS + QP_NV;  // whole micro-tiles
  return panels * nb * (B * QP_ROWS + 2 * QP_ROWS * 4) + 64;
}

template <int RT>
static inline void q8_tile(int64_t nb, const uint8_t* const* xu, const float* const* xs,
                           const int8_t* wp, const int32_t* wsum, const float* wsc,
                           float* const* y, int ncols, bool accumulate) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  constexpr int64_t PB = B * QP_ROWS;  // bytes of one panel's block
  __m512 f[RT][QP_NV];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < QP_NV; ++v) f[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a[RT][QP_NV];
    for (int r = 0; r < RT; ++r)
      for (int v = 0; v < QP_NV; ++v) a[r][v] = _mm512_setzero_si512();
    for (int t = 0; t < int(B / 4); ++t) {
      __m512i w[QP_NV];
      for (int v = 0; v < QP_NV; ++v)
        w[v] = _mm512_loadu_si512(wp + (v * nb + b) * PB + t * 64);
      for (int r = 0; r < RT; ++r) {
        int32_t quad;
        std::memcpy(&quad, xu[r] + b * B + t * 4, 4);
        const __m512i x = _mm512_set1_epi32(quad);
        for (int v = 0; v < QP_NV; ++v) a[r][v] = _mm512_dpbusd_epi32(a[r][v], x, w[v]);
      }
    }
    for (int v = 0; v < QP_NV; ++v) {
      const __m512i off = _mm512_loadu_si512(wsum + (v * nb + b) * QP_ROWS);
      const __m512 sw = _mm512_loadu_ps(wsc + (v * nb + b) * QP_ROWS);
      for (int r = 0; r < RT; ++r)
        f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][v], off)),
                                  _mm512_mul_ps(sw, _mm512_set1_ps(xs[r][b])), f[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < QP_NV; ++v) {
      const int lo = v * int(QP_ROWS), n = std::min(int(QP_ROWS), ncols - lo);
      if (n <= 0) continue;
      const __mmask16 m = __mmask16((1u << n) - 1);
      __m512 out = f[r][v];
      if (accumulate) out = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y[r] + lo), out);
      _mm512_mask_storeu_ps(y[r] + lo, m, out);
    }
}

// xu (M rows of ldx bytes, each K quantized by quantize_q8 then + 128, zero-padded: 128) and xs
// (M rows of ldxs block scales); weight rows wq (N, K) with their scales (N, blocks); Y (M, ldy).
static void gemm_q8(int64_t M, int64_t N, int64_t K, const uint8_t* xu, int64_t ldx,
                    const float* xs, int64_t ldxs, const int8_t* wq, const float* wscale,
                    float* Y, int64_t ldy, bool accumulate, void* ws) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  const int64_t nb = (K + B - 1) / B;
  const int64_t panels = (N + QP_ROWS - 1) / QP_ROWS;
  const int64_t tiles = (panels + QP_NV - 1) / QP_NV, all = tiles * QP_NV;
  int8_t* wp = static_cast<int8_t*>(ws);
  int32_t* wsum = reinterpret_cast<int32_t*>(wp + all * nb * B * QP_ROWS);
  float* wsc = reinterpret_cast<float*>(wsum + all * nb * QP_ROWS);
  // pack: panel p, block b, quad t: lane l holds wq[p*16 + l][b*32 + 4t .. +4] (zero past N, K);
  // whole panels and blocks by gathers (one quad of each of 16 rows), the block sums from the
  // packed quads (vpdpbusd by ones: lane l sums row l), the edges in scalar
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                           4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(int(K)));
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t p = 0; p < all; ++p)
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* dst = wp + (p * nb + b) * B * QP_ROWS;
      if ((p + 1) * QP_ROWS <= N && (b + 1) * B <= K) {
        const int8_t* src = wq + p * QP_ROWS * K + b * B;
        __m512i sum = _mm512_setzero_si512();
        for (int t = 0; t < int(B / 4); ++t) {
          const __m512i q = _mm512_i32gather_epi32(rows, src + 4 * t, 1);
          _mm512_storeu_si512(dst + t * 64, q);
          sum = _mm512_dpbusd_epi32(sum, ones, q);
        }
        _mm512_storeu_si512(wsum + (p * nb + b) * QP_ROWS, _mm512_slli_epi32(sum, 7));
        for (int64_t l = 0; l < QP_ROWS; ++l)
          wsc[(p * nb + b) * QP_ROWS + l] = wscale[(p * QP_ROWS + l) * nb + b];
        continue;
      }
      for (int64_t l = 0; l < QP_ROWS; ++l) {
        const int64_t o = p * QP_ROWS + l;
        int32_t sum = 0;
        for (int64_t i = 0; i < B; ++i) {
          const int64_t k = b * B + i;
          const int8_t q = (o < N && k < K) ? wq[o * K + k] : int8_t(0);
          dst[(i / 4) * 64 + l * 4 + (i % 4)] = q;
          sum += q;
        }
        wsum[(p * nb + b) * QP_ROWS + l] = 128 * sum;
        wsc[(p * nb + b) * QP_ROWS + l] = o < N ? wscale[o * nb + b] : 0.f;
      }
    }
  for (int64_t tl = 0; tl < tiles; ++tl) {
    const int64_t p0 = tl * QP_NV;
    const int ncols = int(std::min<int64_t>(QP_NV * QP_ROWS, N - p0 * QP_ROWS));
    const int8_t* tp = wp + p0 * nb * B * QP_ROWS;
    const int32_t* ts = wsum + p0 * nb * QP_ROWS;
    const float* tc = wsc + p0 * nb * QP_ROWS;
    for (int64_t r0 = 0; r0 < M; r0 += QP_RT) {
      const int rt = int(std::min<int64_t>(QP_RT, M - r0));
      const uint8_t* xr[QP_RT];
      const float* sr[QP_RT];
      float* yr[QP_RT];
      for (int r = 0; r < rt; ++r) {
        xr[r] = xu + (r0 + r) * ldx;
        sr[r] = xs + (r0 + r) * ldxs;
        yr[r] = Y + (r0 + r) * ldy + p0 * QP_ROWS;
      }
      switch (rt) {
        case 4: q8_tile<4>(nb, xr, sr, tp, ts, tc, yr, ncols, accumulate); break;
        case 3: q8_tile<3>(nb, xr, sr, tp, ts, tc, yr, ncols, accumulate); break;
        case 2: q8_tile<2>(nb, xr, sr, tp, ts, tc, yr, ncols, accumulate); break;
        default: q8_tile<1>(nb, xr, sr, tp, ts, tc, yr, ncols, accumulate); break;
      }
    }
  }
}
#define ALGENTA_GEMM_Q8 gemm_q8, gemm_q8_ws_bytes
#else
#define ALGENTA_GEMM_Q8 nullptr, nullptr
#endif

// A narrow row widened to float32 into d (n): prefill's weight tiles and embedding rows.
static void widen_bf16(const uint16_t* a, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) *(vfu*)(d + i) = ld_bf16(a + i);
  for (; i < n; ++i) d[i] = s_bf16(a[i]);
}
static void widen_f16(const uint16_t* a, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) *(vfu*)(d + i) = ld_f16(a + i);
  for (; i < n; ++i) d[i] = s_f16(a[i]);
}
static void widen_q8(const int8_t* q, const float* sc, float* d, int64_t n) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  int64_t i = 0, b = 0;
  for (; i + B <= n; i += B, ++b) {
    const vf s = vf{} + sc[b];
    for (int64_t k = 0; k < B; k += W) *(vfu*)(d + i + k) = ld_q8(q + i + k) * s;
  }
  for (; i < n; ++i) d[i] = float(q[i]) * sc[b];
}

}  // namespace

extern const SessionOps session_ops;
const SessionOps session_ops = {dot,      matvec_rows, matmat_rows_narrow, axpy,
                                sum,      dot_bf16,    dot_f16,            round_bf16,
                                dot_bf16_bf16, quantize_q8, dot_q8q8,      widen_bf16,
                                widen_f16, widen_q8, ALGENTA_GEMM_Q8};

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// The one SIMD vocabulary of the per-ISA CPU kernels (every file in cpp/src/kernels/, each
// compiled once per instruction set with ALGENTA_ISA_NS, CMakeLists.txt): the build's vector
// width, GCC vector types over it, unaligned loads and stores, half-precision bits widened to and
// narrowed from float32 (a scalar or a whole vector), lane selection, horizontal sums and the
// AVX-512 dword transpose. lossk's and the session's kernels take their vectors from here, so a
// widened bf16 weight or a summed score is one operation wherever it is used.
//
// GCC/Clang vector extensions serve SSE2, AVX2/FMA and AVX-512 from one source; intrinsics only
// where the generic form compiles to scalar inserts or split halves (a widening load must cost
// about what the multiply-add after it costs, or the narrow formats stop being bandwidth-bound),
// in the horizontal sums and in the transpose. -ffp-contract=fast (GCC's default) fuses the
// multiply-adds where FMA exists. In the per-ISA namespace, so each instruction set's copy is its
// own.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "algenta/half.hpp"

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif

// Bytes of one vector register: the preprocessor's copy, for code written per width.
#if defined(__AVX512F__)
#define ALGENTA_VBYTES 64
#elif defined(__AVX2__)
#define ALGENTA_VBYTES 32
#else
#define ALGENTA_VBYTES 16
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

constexpr int VBYTES = ALGENTA_VBYTES;

typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4)));  // an unaligned view
typedef double vd __attribute__((vector_size(VBYTES)));
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef int64_t vi64 __attribute__((vector_size(VBYTES)));

// The vector of T, and the integer vector of its lanes' bits (comparison masks are these).
template <class T>
struct V;
template <>
struct V<float> {
  typedef vf type;
  typedef vi32 itype;
};
template <>
struct V<double> {
  typedef vd type;
  typedef vi64 itype;
};

template <class T>
constexpr int lanes() {
  return VBYTES / int(sizeof(T));
}

template <class VT>
inline VT loadu(const void* p) {
  VT v;
  std::memcpy(&v, p, sizeof(VT));
  return v;
}
template <class VT>
inline void storeu(void* p, const VT& v) {
  std::memcpy(p, &v, sizeof(VT));
}

// a where mask (all ones) else b, lane by lane, on the bits.
template <class VT, class IT>
inline VT vselect(IT mask, VT a, VT b) {
  IT ia, ib;
  std::memcpy(&ia, &a, sizeof ia);
  std::memcpy(&ib, &b, sizeof ib);
  const IT r = (ia & mask) | (ib & ~mask);
  VT out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

template <class T>
inline T* align64(T* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>((u + 63) & ~uintptr_t(63));
}

// ---- half precision -------------------------------------------------------------------------
// Half-precision elements as packing sees them (layout-compatible with their uint16_t bits).
struct BF16 {
  uint16_t u;
};
struct F16 {
  uint16_t u;
};
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(BF16 x) { return half::bf16_to_f32(x.u); }
inline float widen(F16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.u);  // the same exact value as half::f16_to_f32, one instruction
#else
  return half::f16_to_f32(x.u);
#endif
}

// float32 -> half bits with the one definition of rounding (half.hpp).
inline uint16_t narrow_bf16(float f) { return half::f32_to_bf16(f); }
inline uint16_t narrow_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);  // == half::f32_to_f16 for every non-NaN
#else
  return half::f32_to_f16(f);
#endif
}

// One vector of halves widened exactly to float32, the load of every kernel that reads them (the
// KV cache's rows in attention, the resident weight panels), so a bf16 or f16 value is the same
// float32 on every path of one instruction set.
typedef unsigned short vh16 __attribute__((vector_size(VBYTES / 2), aligned(2)));
typedef unsigned int vu32 __attribute__((vector_size(VBYTES)));

// VBYTES / 4 bf16 values at p (any alignment) as float32.
static inline vf ld_bf16(const uint16_t* p) {
#if ALGENTA_VBYTES == 64
  return (vf)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif ALGENTA_VBYTES == 32
  return (vf)_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#elif defined(__SSE2__)
  // interleaving zeros below each half puts it in the high 16 bits of its 32-bit lane
  return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(),
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return (vf)(__builtin_convertvector(*(const vh16*)p, vu32) << 16);
#endif
}

// VBYTES / 4 float16 values at p as float32 (subnormals, infinities and NaN exact too).
static inline vf ld_f16(const uint16_t* p) {
#if ALGENTA_VBYTES == 64
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif ALGENTA_VBYTES == 32
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  const vu32 h = __builtin_convertvector(*(const vh16*)p, vu32);
  const vu32 em = h & 0x7fffu;
  const vf f = (vf)(em << 13) * 0x1p112f;
  const vu32 special = (vu32)(em >= 0x7c00u);  // all ones where infinity/NaN
  const vu32 bits = ((vu32)f & ~special) | (((em << 13) | 0x7f800000u) & special);
  return (vf)(bits | ((h & 0x8000u) << 16));
#endif
}

// ---- horizontal sums ------------------------------------------------------------------------
// A vector's lanes summed as a halving tree: the upper half added onto the lower while more than
// four lanes remain, then (l0 + l1) + (l2 + l3). hsums forms the same sums for lanes<float>()
// vectors at once with shuffles that pair two vectors' halves in one register (30 shuffles and
// 15 adds for 16 vectors on AVX-512, 14 and 7 for 8 on AVX2), where lanes summed in order took a
// full transpose (64 shuffles for 16); hsum a vector at a time is a chain of lane extracts and
// dependent adds.
static inline float hsum(vf v) {
  constexpr int W = lanes<float>();
  float a[W];
  for (int l = 0; l < W; ++l) a[l] = v[l];
  for (int h = W / 2; h >= 4; h /= 2)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// s[p] = hsum(v[p]) for the lanes<float>() vectors v, the same adds in the same order. Each
// round adds two registers whose lanes pair the halves of what is left of two vectors' sums;
// input i is the vector key16(i) (key8(i)), the order that leaves vector p's sum in lane p.
constexpr int key16(int i) { return 4 * (i % 4) + i / 4; }
constexpr int key8(int i) { return 4 * (i % 2) + i / 2; }
#if ALGENTA_VBYTES == 64
typedef __m512 vreg;
#define ALGENTA_PS(op) _mm512_##op##_ps
// halves: lanes 0-7 of a and of b, plus lanes 8-15 of each
inline vreg fold_halves(vreg a, vreg b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
}
// quarters: 128-bit blocks 0 and 2 of a and of b, plus blocks 1 and 3
inline vreg fold_quarters(vreg a, vreg b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}
#elif ALGENTA_VBYTES == 32
typedef __m256 vreg;
#define ALGENTA_PS(op) _mm256_##op##_ps
inline vreg fold_halves(vreg a, vreg b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif
#if ALGENTA_VBYTES >= 32
// within each 128-bit block: lanes 0 and 2 of a and of b, plus lanes 1 and 3 (either width)
inline vreg fold_pairs(vreg a, vreg b) {
  return ALGENTA_PS(add)(ALGENTA_PS(shuffle)(a, b, 0x88), ALGENTA_PS(shuffle)(a, b, 0xdd));
}
#endif
static inline void hsums(const vf* v, float* s) {
#if ALGENTA_VBYTES == 64
  // round 1, halves: x[p] holds inputs 2p and 2p + 1 folded to 8 lanes each
  vreg x[8], y[4], z[2];
  for (int p = 0; p < 8; ++p) x[p] = fold_halves(vreg(v[key16(2 * p)]), vreg(v[key16(2 * p + 1)]));
  // round 2, quarters: block j of y[q] holds input 4q + j folded to 4 lanes
  for (int q = 0; q < 4; ++q) y[q] = fold_quarters(x[2 * q], x[2 * q + 1]);
  // rounds 3 and 4 within 128-bit blocks: (l0 + l1) and (l2 + l3), then their sum; lane i of
  // block j ends with input j + 4i, which key16 made key 4j + i
  for (int r = 0; r < 2; ++r) z[r] = fold_pairs(y[2 * r], y[2 * r + 1]);
  _mm512_storeu_ps(s, fold_pairs(z[0], z[1]));
#elif ALGENTA_VBYTES == 32
  // the same rounds on 8 lanes: halves, then within 128-bit blocks; lane i of block j ends with
  // input j + 2i, which key8 made key 4j + i
  vreg x[4], y[2];
  for (int p = 0; p < 4; ++p) x[p] = fold_halves(vreg(v[key8(2 * p)]), vreg(v[key8(2 * p + 1)]));
  for (int r = 0; r < 2; ++r) y[r] = fold_pairs(x[2 * r], x[2 * r + 1]);
  _mm256_storeu_ps(s, fold_pairs(y[0], y[1]));
#else
  for (int p = 0; p < lanes<float>(); ++p) s[p] = hsum(v[p]);
#endif
}

#if defined(__AVX512F__)
// ---- the AVX-512 dword transpose ------------------------------------------------------------
// 16 x 16 dwords: r[i] <- column i of the rows r[0..15] (four rounds of unpack / lane shuffle).
// It turns k-contiguous rows of bf16 pairs into both bf16 dot-product packings (vdpbf16ps panels
// in x86/bf16dot.cpp, AMX tiles in amx/amx.cpp).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i+4, i+8, i+12 hold the quarters
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// Internal, per instruction set: one vector of half-precision bits widened exactly to float32,
// the load both kernel files use (the session's decode dots in session_kernels.cpp and the
// resident weight panels' GEMM in kernels_isa.cpp), so a bf16 or f16 weight is the same float32
// value on every path of one instruction set. In the per-ISA namespace, so each copy is its own.
//
// Intrinsics where GCC's generic vector conversions come out as scalar inserts or split halves:
// a widening load must cost about what the multiply-add after it costs, or the narrow formats
// stop being bandwidth-bound.
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

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace halves {

#if defined(__AVX512F__)
#define ALGENTA_HV_BYTES 64
#elif defined(__AVX2__)
#define ALGENTA_HV_BYTES 32
#else
#define ALGENTA_HV_BYTES 16
#endif
constexpr int HV_BYTES = ALGENTA_HV_BYTES;
typedef float hvf __attribute__((vector_size(HV_BYTES)));
typedef unsigned short hvh __attribute__((vector_size(HV_BYTES / 2), aligned(2)));
typedef unsigned int hvu __attribute__((vector_size(HV_BYTES)));

// HV_BYTES / 4 bf16 values at p (any alignment) as float32.
static inline hvf ld_bf16(const uint16_t* p) {
#if ALGENTA_HV_BYTES == 64
  return (hvf)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif ALGENTA_HV_BYTES == 32
  return (hvf)_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#elif defined(__SSE2__)
  // interleaving zeros below each half puts it in the high 16 bits of its 32-bit lane
  return (hvf)_mm_unpacklo_epi16(_mm_setzero_si128(),
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return (hvf)(__builtin_convertvector(*(const hvh*)p, hvu) << 16);
#endif
}

// HV_BYTES / 4 float16 values at p as float32 (subnormals, infinities and NaN exact too).
static inline hvf ld_f16(const uint16_t* p) {
#if ALGENTA_HV_BYTES == 64
  return (hvf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif ALGENTA_HV_BYTES == 32
  return (hvf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  const hvu h = __builtin_convertvector(*(const hvh*)p, hvu);
  const hvu em = h & 0x7fffu;
  const hvf f = (hvf)(em << 13) * 0x1p112f;
  const hvu special = (hvu)(em >= 0x7c00u);  // all ones where infinity/NaN
  const hvu bits = ((hvu)f & ~special) | (((em << 13) | 0x7f800000u) & special);
  return (hvf)(bits | ((h & 0x8000u) << 16));
#endif
}

}  // namespace halves
}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

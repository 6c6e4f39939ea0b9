// bfloat16 and IEEE binary16 <-> float32, written once for host C++ and CUDA device code alike:
// the CPU kernels, the CPU session and the CUDA backend all round and widen with these, so a
// "bf16 gradient" or a "bf16 weight" means the same bits on every backend.
//
// Widening is exact (every half and bfloat16 value is a float32). Narrowing rounds to nearest
// even; NaN stays a quiet NaN; a value past the half format's range becomes infinity, as a
// hardware conversion does; float32 subnormals are rounded, never flushed (so these are not the
// AVX512-BF16 `vcvtneps2bf16` conversion, which flushes subnormal inputs to zero).
#pragma once
#include <cstdint>
#include <cstring>

#include "algenta/hd.hpp"

namespace algenta {
namespace half {

ALGENTA_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

ALGENTA_HD float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16 is the top half of a float32.
ALGENTA_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

// Round to nearest even on the 16 bits dropped: adding 0x7fff plus the kept LSB carries into the
// kept half exactly when the dropped half is above one half ulp, or equal to it with an odd LSB.
// A finite value past bfloat16's largest rounds up into the infinity encoding by the same carry.
ALGENTA_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN: keep quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

ALGENTA_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
    const float f = float(m) * 5.9604644775390625e-8f;
    return f32_from_bits(f32_bits(f) | sign);
  }
  if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13));  // inf, NaN
  return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

ALGENTA_HD uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {                                  // below 2^-14: a subnormal half
    // a * 2^24 is exact and < 1024; adding 1.5 * 2^23 rounds it to an integer, nearest even,
    // in the default rounding mode (no libm call, so the same on the device).
    const float a = f32_from_bits(x) * 16777216.0f;
    const float r = (a + 12582912.0f) - 12582912.0f;
    return uint16_t(sign | uint32_t(r));
  }
  x += 0x0fffu + ((x >> 13) & 1u);
  return uint16_t(sign | ((x - 0x38000000u) >> 13));
}

}  // namespace half
}  // namespace algenta

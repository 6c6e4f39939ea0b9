// The CUDA emulator's stand-in for <cuda_fp16.h>: __half as its 16 bits, exact widening and
// round-to-nearest-even narrowing (infinity past the range), as the device converts.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __half {
  uint16_t __x;
};

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.__x & 0x8000u) << 16;
  const uint32_t e = (h.__x >> 10) & 0x1fu, m = h.__x & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    bits = ::algenta_emu::bits_as<uint32_t>(float(m) * 5.9604644775390625e-8f) | sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  return ::algenta_emu::bits_as<float>(bits);
}

inline __half __float2half_rn(float f) {
  uint32_t x = ::algenta_emu::bits_as<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return __half{uint16_t(sign | 0x7e00u)};
  if (x >= 0x477ff000u) return __half{uint16_t(sign | 0x7c00u)};
  if (x < 0x38800000u)
    return __half{uint16_t(sign | uint32_t(std::nearbyint(::algenta_emu::bits_as<float>(x) *
                                                          16777216.0f)))};
  x += 0x0fffu + ((x >> 13) & 1u);
  return __half{uint16_t(sign | ((x - 0x38000000u) >> 13))};
}
inline __half __float2half(float f) { return __float2half_rn(f); }

// The CUDA emulator's stand-in for <cuda_bf16.h>: __nv_bfloat16 as its 16 bits, with the
// round-to-nearest-even conversions the device performs (see cuda/emu/README.md).
#pragma once
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t __x;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  return ::algenta_emu::bits_as<float>(uint32_t(h.__x) << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = ::algenta_emu::bits_as<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// Internal, AVX-512 builds: the 16 x 16 dword transpose of one register file, which turns
// k-contiguous rows of bf16 pairs into both bf16 dot-product packings (vdpbf16ps panels in
// kernels_isa.cpp, AMX tiles in kernels_amx.cpp). In the per-ISA namespace, so each instruction
// set's copy stays its own.
#pragma once
#include <immintrin.h>

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

#if defined(__AVX512F__)
// 16 x 16 dwords: r[i] <- column i of the rows r[0..15] (four rounds of unpack / lane shuffle).
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

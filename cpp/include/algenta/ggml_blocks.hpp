// llama.cpp's block formats as a GGUF file stores them, written once for every reader: the
// layout of one block and its dequantization to float32, exactly as ggml's reference
// dequantizers (ggml-quants.c) and the `gguf` package's NumPy ones compute it (tests check
// block by block against the latter). Host C++ and CUDA alike (ALGENTA_HD).
//
// Numerics: every product here is exact in float32 except Q6_K's (d * scale) * q, whose 25
// significant bits round once, in that order, as ggml rounds them; Q4_K's d1 * q - m1 rounds
// once (the product is exact), so a fused multiply-add gives the same bits.
//
//   Q8_0  32 values,  34 B: f16 d, int8 q[32]                         x = q * d
//   Q4_0  32 values,  18 B: f16 d, 16 B of nibbles (low: 0..15, high: 16..31)  x = (n - 8) * d
//   Q4_K 256 values, 144 B: f16 d, f16 dmin, 12 B of 6-bit scales and mins, 128 B of nibbles;
//        8 sub-blocks of 32: x = d * sc * n - dmin * m
//   Q6_K 256 values, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, int8 scales[16], f16 d;
//        16 sub-blocks of 16: x = (d * sc) * (q - 32)
#pragma once
#include <cstdint>
#include <cstring>

#include "algenta/half.hpp"
#include "algenta/hd.hpp"

namespace algenta {
namespace ggml {

ALGENTA_HD float f16_at(const unsigned char* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return half::f16_to_f32(h);
}

// 32 values of one Q8_0 block (34 bytes at b).
ALGENTA_HD void dequant_q8_0(const unsigned char* b, float* y) {
  const float d = f16_at(b);
  for (int i = 0; i < 32; ++i) y[i] = float(int8_t(b[2 + i])) * d;
}

// 32 values of one Q4_0 block (18 bytes).
ALGENTA_HD void dequant_q4_0(const unsigned char* b, float* y) {
  const float d = f16_at(b);
  for (int i = 0; i < 16; ++i) {
    y[i] = float(int(b[2 + i] & 0xF) - 8) * d;
    y[i + 16] = float(int(b[2 + i] >> 4) - 8) * d;
  }
}

// Sub-block j's (0..7) 6-bit scale and min from Q4_K's packed 12 bytes: j < 4 in the low six
// bits of bytes j and j + 4; j >= 4 in byte j + 4's nibbles with two high bits from the top of
// bytes j - 4 and j.
ALGENTA_HD void q4_k_scale_min(int j, const unsigned char* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 256 values of one Q4_K block (144 bytes): sub-blocks 2i and 2i + 1 share 32 bytes of
// nibbles, low then high.
ALGENTA_HD void dequant_q4_k(const unsigned char* b, float* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const unsigned char* s = b + 4;
  const unsigned char* q = b + 16;
  for (int g = 0; g < 4; ++g) {
    int sc, m;
    q4_k_scale_min(2 * g, s, &sc, &m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    q4_k_scale_min(2 * g + 1, s, &sc, &m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) y[64 * g + l] = d1 * float(q[32 * g + l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[64 * g + 32 + l] = d2 * float(q[32 * g + l] >> 4) - m2;
  }
}

// 256 values of one Q6_K block (210 bytes), two halves of 128: value l + 32 * k of a half takes
// its low nibble from ql (k even: low, odd: high nibble of ql[l + 32 * (k & 1)]) and its two
// high bits from qh[l] >> 2k.
ALGENTA_HD void dequant_q6_k(const unsigned char* b, float* y) {
  const unsigned char* ql = b;
  const unsigned char* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * float(sc[is + 0])) * float(q1);
      y[l + 32] = (d * float(sc[is + 2])) * float(q2);
      y[l + 64] = (d * float(sc[is + 4])) * float(q3);
      y[l + 96] = (d * float(sc[is + 6])) * float(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

}  // namespace ggml
}  // namespace algenta

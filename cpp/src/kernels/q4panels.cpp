// The resident session's Q4_0 weight panels (llama.cpp's Q4_0 weights times Q8_0 activations on
// integer dot products), compiled once per instruction set: the same activation rows as the
// int8 panels (quantize_q8, once per product) and the same tile order; the weights are 4-bit
// codes unpacked in registers. AVX2's vpmaddubsw + vpmaddwd on AVX2 and every AVX-512 build (no
// 512-bit Q4_0 tile yet: the 256-bit one is the code the AVX2 hosts test), scalar integer sums
// on the generic build.
//
// Fuses the activation's per-block scale with the weight's into one FMA a block; never allocates
// (no scratch); reads each weight byte once a product. Numerics: a cell is exactly the int8
// panels' cell for weight codes (q - 8) with the block's float16 scale widened:
//   f = 0;  for b in order: f = fma(float(isum_b), sw[o][b] * sx[r][b], f);  y = (y +) f
// isum_b exact in int32 (|q - 8| <= 8, |x| <= 127), so every path and every M gives the same bits
// (tests/test_residentk_q4.py checks them against the int8 panels fed those codes).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "algenta/residentk.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

using residentk::RESIDENT_INT8_BLOCK;

// ---- Q4_0 weight panels ---------------------------------------------------------------------
// A block of PANEL_ROWS weight rows is Q4_PANELS panels of Q4_LANES rows; a panel holds, for each
// 32-value block b of k in order, 4 groups j of 64 bytes (row l's four bytes at j * 64 + l * 4:
// byte i's low nibble is the code of value 4j + i, its high nibble that of value 4(j + 4) + i,
// so one 64-byte group unpacks into the int8 panels' quads j and j + 4), then the rows' 16
// float16 scales: Q4_PB bytes a panel block, 18 a row-block as in a GGUF file.
constexpr int64_t Q4_LANES = 16;
constexpr int64_t Q4_PANELS = PANEL_ROWS / Q4_LANES;
constexpr int64_t Q4_CODES = RESIDENT_INT8_BLOCK / 2 * Q4_LANES;  // 256
constexpr int64_t Q4_PB = Q4_CODES + Q4_LANES * 2;               // codes + float16 scales
static_assert(RESIDENT_INT8_BLOCK == 32, "the kernels hold whole blocks of 32");

int64_t q4_blocks(int64_t K) { return (K + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK; }

// the byte of value i (0..31) of row l in a panel block, and whether it is the high nibble
inline int64_t q4_at(int64_t l, int64_t i) { return ((i / 4) % 4) * 64 + l * 4 + i % 4; }
inline bool q4_high(int64_t i) { return i >= 16; }

}  // namespace

int64_t q4_block_bytes(int64_t K) { return Q4_PANELS * q4_blocks(K) * Q4_PB; }

// row: K codes 0..15 (one a byte, quant::q4_0_block's), scales: a block's float16 scale widened
void q4_put_row(void* blkv, int64_t K, int64_t c, const void* rowv, const float* scales) {
  uint8_t* blk = static_cast<uint8_t*>(blkv);
  const uint8_t* row = static_cast<const uint8_t*>(rowv);
  const int64_t nb = q4_blocks(K), p = c / Q4_LANES, l = c % Q4_LANES;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* pb = blk + (p * nb + b) * Q4_PB;
    for (int64_t i = 0; i < RESIDENT_INT8_BLOCK; ++i) {
      const int64_t k = b * RESIDENT_INT8_BLOCK + i;
      const uint8_t code = k < K ? uint8_t(row[k] & 0xF) : uint8_t(8);  // past K: weight 0
      uint8_t& byte = pb[q4_at(l, i)];
      byte = q4_high(i) ? uint8_t((byte & 0x0F) | (code << 4)) : uint8_t((byte & 0xF0) | code);
    }
    const uint16_t h = half::f32_to_f16(scales[b]);  // exact: the scale came from float16
    std::memcpy(pb + Q4_CODES + l * 2, &h, 2);
  }
}

void q4_get_row(const void* blkv, int64_t K, int64_t c, float* dst) {
  const uint8_t* blk = static_cast<const uint8_t*>(blkv);
  const int64_t nb = q4_blocks(K), p = c / Q4_LANES, l = c % Q4_LANES;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = blk + (p * nb + b) * Q4_PB;
    uint16_t h;
    std::memcpy(&h, pb + Q4_CODES + l * 2, 2);
    const float sc = half::f16_to_f32(h);
    for (int64_t i = 0; i < RESIDENT_INT8_BLOCK && b * RESIDENT_INT8_BLOCK + i < K; ++i) {
      const uint8_t byte = pb[q4_at(l, i)];
      const int code = q4_high(i) ? byte >> 4 : byte & 0xF;
      dst[b * RESIDENT_INT8_BLOCK + i] = float(code - 8) * sc;
    }
  }
}

int64_t q4_ws_bytes(int64_t) { return 64; }

namespace {

struct Q4Rows {
  const int8_t* q[4];
  const float* s[4];
  float* y[4];
};

#if ALGENTA_VBYTES >= 32
// AVX2 (and the AVX-512 builds): a panel is two 8-lane halves. A 32-byte half-group unpacks into
// two int8 quads (low nibbles: quad j, high: quad j + 4), 8 subtracted to give the signed codes;
// the integer sums are the int8 panels' (vpsignb moves x's sign onto w, vpmaddubsw multiplies
// |x| by it, vpmaddwd adds the pairs: a pair is at most 2 * 8 * 127, far from int16's limit).
template <int RT, int NP>
static inline void q4_tile(int64_t nb, const uint8_t* const* pw, const Q4Rows& x, int ncols,
                           bool accumulate) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[RT][NP][2];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < NP; ++v) f[r][v][0] = f[r][v][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a[RT][NP][2];
    for (int r = 0; r < RT; ++r)
      for (int v = 0; v < NP; ++v) a[r][v][0] = a[r][v][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      if constexpr (RT == 1) {
        // One decode row: the unsigned codes are vpmaddubsw's unsigned operand as they are
        // (sum (q - 8) x = sum q x - 8 sum x, the last term taken off once a block below), and
        // each half-group is unpacked and multiplied at once, so the live registers are the
        // sums and x's two vectors, not NP panels of unpacked codes. Pairs reach 2 * 15 * 127.
        int32_t ql, qh;
        std::memcpy(&ql, x.q[0] + b * RESIDENT_INT8_BLOCK + j * 4, 4);
        std::memcpy(&qh, x.q[0] + b * RESIDENT_INT8_BLOCK + (j + 4) * 4, 4);
        const __m256i xl = _mm256_set1_epi32(ql), xh = _mm256_set1_epi32(qh);
        for (int v = 0; v < NP; ++v)
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(pw[v] + b * Q4_PB + j * 64 + h * 32));
            const __m256i pl = _mm256_maddubs_epi16(_mm256_and_si256(raw, lo4), xl);
            const __m256i ph =
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4), xh);
            a[0][v][h] =
                _mm256_add_epi32(a[0][v][h], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
          }
        if (j == 3) {
          int32_t sx = 0;
          for (int i = 0; i < RESIDENT_INT8_BLOCK; ++i) sx += x.q[0][b * RESIDENT_INT8_BLOCK + i];
          const __m256i off = _mm256_set1_epi32(8 * sx);
          for (int v = 0; v < NP; ++v)
            for (int h = 0; h < 2; ++h) a[0][v][h] = _mm256_sub_epi32(a[0][v][h], off);
        }
        continue;
      }
      __m256i wl[NP][2], wh[NP][2];
      for (int v = 0; v < NP; ++v)
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(pw[v] + b * Q4_PB + j * 64 + h * 32));
          wl[v][h] = _mm256_sub_epi8(_mm256_and_si256(raw, lo4), eight);
          wh[v][h] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4), eight);
        }
      for (int r = 0; r < RT; ++r) {
        int32_t ql, qh;
        std::memcpy(&ql, x.q[r] + b * RESIDENT_INT8_BLOCK + j * 4, 4);
        std::memcpy(&qh, x.q[r] + b * RESIDENT_INT8_BLOCK + (j + 4) * 4, 4);
        const __m256i xl = _mm256_set1_epi32(ql), xh = _mm256_set1_epi32(qh);
        const __m256i al = _mm256_abs_epi8(xl), ah = _mm256_abs_epi8(xh);
        for (int v = 0; v < NP; ++v)
          for (int h = 0; h < 2; ++h) {
            const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(wl[v][h], xl));
            const __m256i ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(wh[v][h], xh));
            a[r][v][h] = _mm256_add_epi32(a[r][v][h],
                                          _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
          }
      }
    }
    for (int v = 0; v < NP; ++v)
      for (int h = 0; h < 2; ++h) {
        const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(pw[v] + b * Q4_PB + Q4_CODES + h * 16)));
        for (int r = 0; r < RT; ++r)
          f[r][v][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][v][h]),
                                       _mm256_mul_ps(sw, _mm256_set1_ps(x.s[r][b])), f[r][v][h]);
      }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < NP; ++v)
      for (int h = 0; h < 2; ++h) {
        float out[8];
        _mm256_storeu_ps(out, f[r][v][h]);
        const int lo = v * int(Q4_LANES) + h * 8;
        for (int l = 0; l < 8 && lo + l < ncols; ++l)
          x.y[r][lo + l] = accumulate ? x.y[r][lo + l] + out[l] : out[l];
      }
}
#else
// Generic: scalar integer sums, the same float32 steps as the int8 panels' generic tile.
template <int RT, int NP>
static inline void q4_tile(int64_t nb, const uint8_t* const* pw, const Q4Rows& x, int ncols,
                           bool accumulate) {
  for (int v = 0; v < NP; ++v)
    for (int l = 0; l < int(Q4_LANES) && v * int(Q4_LANES) + l < ncols; ++l)
      for (int r = 0; r < RT; ++r) {
        float f = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* pb = pw[v] + b * Q4_PB;
          int32_t isum = 0;
          for (int i = 0; i < RESIDENT_INT8_BLOCK; ++i) {
            const uint8_t byte = pb[q4_at(l, i)];
            const int code = q4_high(i) ? byte >> 4 : byte & 0xF;
            isum += int32_t(code - 8) * int32_t(x.q[r][b * RESIDENT_INT8_BLOCK + i]);
          }
          uint16_t h;
          std::memcpy(&h, pb + Q4_CODES + l * 2, 2);
          f += float(isum) * (half::f16_to_f32(h) * x.s[r][b]);
        }
        float& y = x.y[r][v * Q4_LANES + l];
        y = accumulate ? y + f : f;
      }
}
#endif

// One decode row takes Q4_DECODE_PANELS panels a tile (more streams in flight), as the int8
// panels do; a prefill tile two panels by up to four rows.
constexpr int Q4_DECODE_PANELS = VBYTES >= 32 ? 4 : 2;

template <int NP>
static inline void q4_decode_tile(int np, int64_t nb, const uint8_t* const* pw, const Q4Rows& x,
                                  int ncols, bool accumulate) {
  if constexpr (NP > 2) {
    if (np == NP) return q4_tile<1, NP>(nb, pw, x, ncols, accumulate);
    q4_decode_tile<NP - 1>(np, nb, pw, x, ncols, accumulate);
  }
}

}  // namespace

void q4_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* Wv, float* Y,
             int64_t ldy, bool accumulate, void*) {
  if (M <= 0 || N <= 0) return;
  const uint8_t* W = static_cast<const uint8_t*>(Wv);
  const int64_t nb = q4_blocks(K);
  const int64_t npanels = (N + Q4_LANES - 1) / Q4_LANES;
  const int step = M == 1 ? Q4_DECODE_PANELS : 2;
  for (int64_t p0 = 0; p0 < npanels; p0 += step) {
    const int np = int(std::min<int64_t>(step, npanels - p0));
    const uint8_t* pw[Q4_DECODE_PANELS];
    for (int v = 0; v < np; ++v) pw[v] = W + (p0 + v) * nb * Q4_PB;
    const int ncols = int(std::min<int64_t>(np * Q4_LANES, N - p0 * Q4_LANES));
    if (np > 2) {
      Q4Rows x;
      x.q[0] = X.q, x.s[0] = X.s, x.y[0] = Y + p0 * Q4_LANES;
      q4_decode_tile<Q4_DECODE_PANELS>(np, nb, pw, x, ncols, accumulate);
      continue;
    }
    const bool two = np == 2;
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int rt = int(std::min<int64_t>(4, M - r0));
      Q4Rows x;
      for (int r = 0; r < rt; ++r) {
        x.q[r] = X.q + (r0 + r) * X.ld;
        x.s[r] = X.s + (r0 + r) * X.lds;
        x.y[r] = Y + (r0 + r) * ldy + p0 * Q4_LANES;
      }
#define ALGENTA_Q4_TILE(RT) \
  (two ? q4_tile<RT, 2>(nb, pw, x, ncols, accumulate) : q4_tile<RT, 1>(nb, pw, x, ncols, accumulate))
      switch (rt) {
        case 4: ALGENTA_Q4_TILE(4); break;
        case 3: ALGENTA_Q4_TILE(3); break;
        case 2: ALGENTA_Q4_TILE(2); break;
        default: ALGENTA_Q4_TILE(1); break;
      }
#undef ALGENTA_Q4_TILE
    }
  }
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// The resident session's int8 weight panels (Q8_0 weights times Q8_0 activations on integer dot
// products), compiled once per instruction set: the activation rows quantized once per product by
// the weights' rule, the panels' layout, and the tiles that multiply them (vpdpbusd on
// AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2 and AVX-512 without VNNI, scalar integer sums on
// the generic build).
//
// Fuses the activation's per-block scale with the weight's into one FMA a block; never allocates
// (scratch: q8_ws_bytes); reads each weight byte once a product. Numerics: at the panels' layout
// below (each cell's integer sums are exact, so its bits never depend on the path, M, or its
// neighbours).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "algenta/kernels.hpp"
#include "algenta/quant.hpp"
#include "algenta/residentk.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

using residentk::RESIDENT_INT8_BLOCK;

constexpr int W = lanes<float>();

// int8: the activation vector quantized once per product, by the weights' rule (quant::q8_block),
// into codes (zero-padded to Q8_ACT_PAD) and one scale a block. Whole blocks on vectors where the
// instruction set rounds them (AVX2, AVX-512): the same operations per value as q8_block, a true
// division, rounding to nearest even (rintf's, in the default mode), the clamp and NaN -> 0, so
// the same codes and scales (a block's NaN scale aside, whose payload may come from another of
// its NaNs). One value at a time, q8_block's division and its max chain kept the loop scalar.
#if ALGENTA_VBYTES >= 32
typedef int8_t v8q __attribute__((vector_size(W)));
static inline vf round_even(vf v) {
#if ALGENTA_VBYTES == 64
  return (vf)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return (vf)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}
#endif
}  // namespace

void quantize_q8(const float* x, int64_t n, int8_t* xq, float* xs) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  int64_t i = 0, b = 0;
#if ALGENTA_VBYTES >= 32
  constexpr int NVB = int(B) / W;  // vectors a block
  for (; i + B <= n; i += B, ++b) {
    vf v[NVB], m = vf{};
    for (int u = 0; u < NVB; ++u) {
      v[u] = *(const vfu*)(x + i + u * W);
      const vf a = (vf)((vi32)v[u] & 0x7fffffff);
      m = (a > m) | (a != a) ? a : m;  // a NaN, once seen, stays (q8_block's rule)
    }
    float amax = 0.f;
    for (int l = 0; l < W; ++l) amax = (m[l] > amax || m[l] != m[l]) ? m[l] : amax;
    const float sc = amax / 127.f;
    xs[b] = sc;
    for (int u = 0; u < NVB; ++u) {
      vf c = vf{};
      if (sc > 0.f) {
        const vf r = round_even(v[u] / sc);
        c = r < -127.f ? vf{} - 127.f : (r > 127.f ? vf{} + 127.f : r);
        c = c == c ? c : vf{};
      }
      *(v8q*)(xq + i + u * W) = __builtin_convertvector(__builtin_convertvector(c, vi32), v8q);
    }
  }
#endif
  for (; i < n; i += B, ++b) xs[b] = quant::q8_block(x + i, std::min(B, n - i), xq + i);
  const int64_t padded = act_padded(n);
  for (int64_t j = n; j < padded; ++j) xq[j] = 0;
}

namespace {

// ---- int8 weight panels (Q8_0 x Q8_0) --------------------------------------------------------
// A block of PANEL_ROWS weight rows is Q8_PANELS panels of Q8_LANES rows; a panel holds, for each
// 32-value block b of k in order, its codes as 8 k-quads x Q8_LANES rows x 4 bytes (row l's quad
// t at t * 64 + l * 4: one 64-byte vector carries a quad of every row) and then the rows' 16
// float32 scales: Q8_PB bytes a panel block, streamed in order by a decode step.
//
// Each output cell (weight row o, activation row r) is
//   f = 0;  for b in order: f = fma(float(isum_b), sw[o][b] * sx[r][b], f);  y = (y +) f
// with isum_b = sum over the block of w * x, exact in int32 (|codes| <= 127). Integer sums do not
// depend on how they are formed, so every path (vpdpbusd, vpmaddubsw + vpmaddwd, scalar) and
// every M gives a cell the same bits; the FMA instruction sets agree with each other, and the
// generic build (no FMA) rounds the product before the add, as its own consistent rule.
constexpr int64_t Q8_LANES = 16;
constexpr int64_t Q8_PANELS = PANEL_ROWS / Q8_LANES;
constexpr int64_t Q8_PB = RESIDENT_INT8_BLOCK * Q8_LANES + Q8_LANES * 4;  // codes + scales
static_assert(RESIDENT_INT8_BLOCK == 32, "the kernels hold whole blocks of 32 (8 quads)");

int64_t q8_blocks(int64_t K) { return (K + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK; }

}  // namespace

int64_t q8_block_bytes(int64_t K) { return Q8_PANELS * q8_blocks(K) * Q8_PB; }

void q8_put_row(void* blkv, int64_t K, int64_t c, const void* rowv, const float* scales) {
  int8_t* blk = static_cast<int8_t*>(blkv);
  const int8_t* row = static_cast<const int8_t*>(rowv);
  const int64_t nb = q8_blocks(K), p = c / Q8_LANES, l = c % Q8_LANES;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* pb = blk + (p * nb + b) * Q8_PB;
    for (int64_t i = 0; i < RESIDENT_INT8_BLOCK; ++i) {
      const int64_t k = b * RESIDENT_INT8_BLOCK + i;
      pb[(i / 4) * 64 + l * 4 + i % 4] = k < K ? row[k] : int8_t(0);
    }
    std::memcpy(pb + RESIDENT_INT8_BLOCK * Q8_LANES + l * 4, scales + b, 4);
  }
}

void q8_get_row(const void* blkv, int64_t K, int64_t c, float* dst) {
  const int8_t* blk = static_cast<const int8_t*>(blkv);
  const int64_t nb = q8_blocks(K), p = c / Q8_LANES, l = c % Q8_LANES;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* pb = blk + (p * nb + b) * Q8_PB;
    float sc;
    std::memcpy(&sc, pb + RESIDENT_INT8_BLOCK * Q8_LANES + l * 4, 4);
    for (int64_t i = 0; i < RESIDENT_INT8_BLOCK && b * RESIDENT_INT8_BLOCK + i < K; ++i)
      dst[b * RESIDENT_INT8_BLOCK + i] = float(pb[(i / 4) * 64 + l * 4 + i % 4]) * sc;
  }
}

int64_t q8_ws_bytes(int64_t K) { return 2 * q8_blocks(K) * 64 + 64; }

namespace {

// Rows of one activation tile: codes, scales, outputs.
struct Q8Rows {
  const int8_t* q[4];
  const float* s[4];
  float* y[4];
};

#if ALGENTA_VBYTES == 64
// AVX-512: a panel's block is one 16-lane integer sum per row. VNNI: vpdpbusd multiplies
// unsigned by signed bytes, so x goes in as x + 128 (x ^ 0x80) and 128 * sum(w) comes off
// (`off`, exact). Without VNNI: the sign of x moves onto w (w * sign(x), exact: w != -128), |x|
// is the unsigned operand of vpmaddubsw, and vpmaddwd adds the pairs (a pair of products is at
// most 2 * 127^2, below int16's saturation).
static inline __m512i q8_quads(const int8_t* q, int64_t at) {
  int32_t quad;
  std::memcpy(&quad, q + at, 4);
  return _mm512_set1_epi32(quad);
}

// 128 * (sum of each row's codes in block b) for panel pw: vpdpbusd of the codes by 128.
#if defined(__AVX512VNNI__)
static inline __m512i q8_off(const int8_t* pw) {
  const __m512i k128 = _mm512_set1_epi8(char(-128));  // 0x80 as the unsigned operand
  __m512i s = _mm512_setzero_si512();
  for (int t = 0; t < 8; ++t) s = _mm512_dpbusd_epi32(s, k128, _mm512_loadu_si512(pw + t * 64));
  return s;
}
#endif

// Weight panels pw[0..NP) (their block b at pw[v] + b * Q8_PB) times RT activation rows.
template <int RT, int NP>
static inline void q8_tile(int64_t nb, const int8_t* const* pw, const Q8Rows& x,
                           const __m512i* off, int ncols, bool accumulate) {
  __m512 f[RT][NP];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < NP; ++v) f[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a[RT][NP];
    for (int v = 0; v < NP; ++v) {
#if defined(__AVX512VNNI__)
      // start each sum at -128 * sum(w): exact, and the product then adds 128 * sum(w) back
      const __m512i o = off ? off[v * nb + b] : q8_off(pw[v] + b * Q8_PB);
      for (int r = 0; r < RT; ++r) a[r][v] = _mm512_sub_epi32(_mm512_setzero_si512(), o);
#else
      (void)off;
      for (int r = 0; r < RT; ++r) a[r][v] = _mm512_setzero_si512();
#endif
    }
    for (int t = 0; t < 8; ++t) {
      __m512i w[NP];
      for (int v = 0; v < NP; ++v) w[v] = _mm512_loadu_si512(pw[v] + b * Q8_PB + t * 64);
      for (int r = 0; r < RT; ++r) {
        const __m512i xv = q8_quads(x.q[r], b * RESIDENT_INT8_BLOCK + t * 4);
#if defined(__AVX512VNNI__)
        const __m512i xu = _mm512_xor_si512(xv, _mm512_set1_epi8(char(-128)));
        for (int v = 0; v < NP; ++v) a[r][v] = _mm512_dpbusd_epi32(a[r][v], xu, w[v]);
#else
        const __mmask64 neg = _mm512_movepi8_mask(xv);
        const __m512i ax = _mm512_abs_epi8(xv);
        for (int v = 0; v < NP; ++v) {
          const __m512i ws = _mm512_mask_sub_epi8(w[v], neg, _mm512_setzero_si512(), w[v]);
          a[r][v] = _mm512_add_epi32(
              a[r][v], _mm512_madd_epi16(_mm512_maddubs_epi16(ax, ws), _mm512_set1_epi16(1)));
        }
#endif
      }
    }
    for (int v = 0; v < NP; ++v) {
      const __m512 sw = _mm512_loadu_ps(reinterpret_cast<const float*>(
          pw[v] + b * Q8_PB + RESIDENT_INT8_BLOCK * Q8_LANES));
      for (int r = 0; r < RT; ++r)
        f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][v]),
                                  _mm512_mul_ps(sw, _mm512_set1_ps(x.s[r][b])), f[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < NP; ++v) {
      const int lo = v * int(Q8_LANES), n = std::min(int(Q8_LANES), ncols - lo);
      if (n <= 0) continue;
      const __mmask16 m = __mmask16((1u << n) - 1);
      __m512 out = f[r][v];
      if (accumulate) out = _mm512_add_ps(_mm512_maskz_loadu_ps(m, x.y[r] + lo), out);
      _mm512_mask_storeu_ps(x.y[r] + lo, m, out);
    }
}
#elif ALGENTA_VBYTES == 32
// AVX2: a panel is two 8-lane halves; the integer sums by vpmaddubsw + vpmaddwd on |x| and
// w * sign(x) (vpsignb), as AVX-512 without VNNI.
template <int RT, int NP>
static inline void q8_tile(int64_t nb, const int8_t* const* pw, const Q8Rows& x, const void*,
                           int ncols, bool accumulate) {
  __m256 f[RT][NP][2];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < NP; ++v) f[r][v][0] = f[r][v][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a[RT][NP][2];
    for (int r = 0; r < RT; ++r)
      for (int v = 0; v < NP; ++v) a[r][v][0] = a[r][v][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      __m256i w[NP][2];
      for (int v = 0; v < NP; ++v)
        for (int h = 0; h < 2; ++h)
          w[v][h] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(pw[v] + b * Q8_PB + t * 64 + h * 32));
      for (int r = 0; r < RT; ++r) {
        int32_t quad;
        std::memcpy(&quad, x.q[r] + b * RESIDENT_INT8_BLOCK + t * 4, 4);
        const __m256i xv = _mm256_set1_epi32(quad);
        const __m256i ax = _mm256_abs_epi8(xv);
        for (int v = 0; v < NP; ++v)
          for (int h = 0; h < 2; ++h)
            a[r][v][h] = _mm256_add_epi32(
                a[r][v][h],
                _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[v][h], xv)),
                                  _mm256_set1_epi16(1)));
      }
    }
    for (int v = 0; v < NP; ++v)
      for (int h = 0; h < 2; ++h) {
        const __m256 sw = _mm256_loadu_ps(reinterpret_cast<const float*>(
            pw[v] + b * Q8_PB + RESIDENT_INT8_BLOCK * Q8_LANES + h * 32));
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
        const int lo = v * int(Q8_LANES) + h * 8;
        for (int l = 0; l < 8 && lo + l < ncols; ++l)
          x.y[r][lo + l] = accumulate ? x.y[r][lo + l] + out[l] : out[l];
      }
}
#else
// Generic: scalar integer sums, the same float32 steps (no FMA on this instruction set: the
// product is rounded before the add, the same way for every M).
template <int RT, int NP>
static inline void q8_tile(int64_t nb, const int8_t* const* pw, const Q8Rows& x, const void*,
                           int ncols, bool accumulate) {
  for (int v = 0; v < NP; ++v)
    for (int l = 0; l < int(Q8_LANES) && v * int(Q8_LANES) + l < ncols; ++l)
      for (int r = 0; r < RT; ++r) {
        float f = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int8_t* pb = pw[v] + b * Q8_PB;
          int32_t isum = 0;
          for (int i = 0; i < RESIDENT_INT8_BLOCK; ++i)
            isum += int32_t(pb[(i / 4) * 64 + l * 4 + i % 4]) *
                    int32_t(x.q[r][b * RESIDENT_INT8_BLOCK + i]);
          float sw;
          std::memcpy(&sw, pb + RESIDENT_INT8_BLOCK * Q8_LANES + l * 4, 4);
          f += float(isum) * (sw * x.s[r][b]);
        }
        float& y = x.y[r][v * Q8_LANES + l];
        y = accumulate ? y + f : f;
      }
}
#endif

// Y (M, ldy) (+)= the int8 rows X.q (M, X.ld bytes; scales X.s, X.lds a row) times the first N
// rows of the blocks at W: two panels (32 weight rows) by up to four activation rows a tile.
// Panels are visited in order, and a pair's integer offsets (VNNI) formed once for all M rows.
// One decode row (M == 1) takes up to Q8_DECODE_PANELS panels a tile: each panel is its own
// stream, and one core keeps more lines in flight over more streams: four on AVX2, eight on
// AVX-512 (32 registers), each measured fastest (perf/RESULTS.md). The same bits: a cell's sums
// do not depend on its neighbours. The SSE2 build keeps two (not timed).
constexpr int Q8_DECODE_PANELS = VBYTES == 64 ? 8 : VBYTES == 32 ? 4 : 2;

// One decode row times np (3..NP) panels: q8_tile<1, np>.
template <int NP>
static inline void q8_decode_tile(int np, int64_t nb, const int8_t* const* pw, const Q8Rows& x,
                                  int ncols, bool accumulate) {
  if constexpr (NP > 2) {
    if (np == NP) return q8_tile<1, NP>(nb, pw, x, nullptr, ncols, accumulate);
    q8_decode_tile<NP - 1>(np, nb, pw, x, ncols, accumulate);
  }
}

}  // namespace

void q8_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* Wv, float* Y,
             int64_t ldy, bool accumulate, void* ws) {
  if (M <= 0 || N <= 0) return;
  const int8_t* W = static_cast<const int8_t*>(Wv);
  const int64_t nb = q8_blocks(K);
  const int64_t npanels = (N + Q8_LANES - 1) / Q8_LANES;
  const int step = M == 1 ? Q8_DECODE_PANELS : 2;
  for (int64_t p0 = 0; p0 < npanels; p0 += step) {
    const int np = int(std::min<int64_t>(step, npanels - p0));
    const int8_t* pw[Q8_DECODE_PANELS];
    for (int v = 0; v < np; ++v) pw[v] = W + (p0 + v) * nb * Q8_PB;
    const int ncols = int(std::min<int64_t>(np * Q8_LANES, N - p0 * Q8_LANES));
    if (np > 2) {  // one decode row (step is 2 otherwise)
      Q8Rows x;
      x.q[0] = X.q, x.s[0] = X.s, x.y[0] = Y + p0 * Q8_LANES;
      q8_decode_tile<Q8_DECODE_PANELS>(np, nb, pw, x, ncols, accumulate);
      continue;
    }
    const bool two = np == 2;
#if ALGENTA_VBYTES == 64
    __m512i* off = nullptr;
#if defined(__AVX512VNNI__)
    if (M > 1) {  // one decode row forms them inline instead of reading the panels twice
      off = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(ws) + 63) & ~uintptr_t(63));
      for (int v = 0; v < np; ++v)
        for (int64_t b = 0; b < nb; ++b) off[v * nb + b] = q8_off(pw[v] + b * Q8_PB);
    }
#else
    (void)ws;
#endif
#else
    const void* off = nullptr;
    (void)ws;
#endif
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int rt = int(std::min<int64_t>(4, M - r0));
      Q8Rows x;
      for (int r = 0; r < rt; ++r) {
        x.q[r] = X.q + (r0 + r) * X.ld;
        x.s[r] = X.s + (r0 + r) * X.lds;
        x.y[r] = Y + (r0 + r) * ldy + p0 * Q8_LANES;
      }
#define ALGENTA_Q8_TILE(RT)                                           \
  (two ? q8_tile<RT, 2>(nb, pw, x, off, ncols, accumulate)            \
       : q8_tile<RT, 1>(nb, pw, x, off, ncols, accumulate))
      switch (rt) {
        case 4: ALGENTA_Q8_TILE(4); break;
        case 3: ALGENTA_Q8_TILE(3); break;
        case 2: ALGENTA_Q8_TILE(2); break;
        default: ALGENTA_Q8_TILE(1); break;
      }
#undef ALGENTA_Q8_TILE
    }
  }
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

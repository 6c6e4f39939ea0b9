// The CPU session's kernels: the KV cache's dot products (float32 queries against float32, bf16
// or f16 keys), the activation preparation of each weight format, the int8 weight panels (Q8_0 x
// Q8_0 on integer dot products), and the SessionOps table that joins them with the float and
// bf16 panels of kernels_isa.cpp. Compiled once per instruction set beside kernels_isa.cpp
// (CMakeLists.txt puts both in each per-ISA object), so the session and lossk share one
// dispatch. Written with GCC vector extensions and intrinsics; -ffp-contract (GCC's default)
// fuses the multiply-adds under FMA.
//
// Fuses nothing across calls; never allocates; reads each weight element once a product.
// Numerics: an attention score keeps ACC independent vector accumulators (lane l of accumulator a
// sums elements i = a*W + l mod ACC*W), combines them in a fixed tree and sums the lanes in order,
// so its bits depend only on n and the data, never on the thread or the group that computes it.
//
// Legend: n vector length; W = VBYTES/4 float lanes; ACC accumulators.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "algenta/quant.hpp"
#include "algenta/residentk.hpp"
#include "algenta/session_math.hpp"
#include "panels.hpp"
#include "simd_halves.hpp"

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
typedef int32_t vi __attribute__((vector_size(VBYTES)));
constexpr int W = VBYTES / 4;
constexpr int ACC = 4;

// The bandwidth probe's optional software prefetch: the hardware prefetcher alone left row-by-row
// weight dots 10-15% short of their read rate on an AMX Xeon (2 threads: bf16 57.6 -> 51.9 ms a
// token at the Qwen3-0.6B shape, before the weights moved into panels, whose decode streams whole
// contiguous blocks), so the probe also reads with the lines PF_AHEAD bytes ahead requested; past
// the end a prefetch is only a hint (it never faults). Timing only: no result depends on it.
constexpr int64_t PF_AHEAD = 2048;
static inline void prefetch_ahead(const void* p, int lines) {
  const char* c = static_cast<const char*>(p) + PF_AHEAD;
  for (int l = 0; l < lines; ++l) __builtin_prefetch(c + 64 * l, 0, 3);
}
constexpr int lines_of(int64_t bytes) { return bytes < 64 ? 1 : int(bytes / 64); }

// A score's lanes summed as a halving tree: the upper half added onto the lower while more than
// four lanes remain, then (l0 + l1) + (l2 + l3). hsums forms the same sums for W vectors at once
// with shuffles that pair two vectors' halves in one register (30 shuffles and 15 adds for 16
// keys on AVX-512, 14 and 7 for 8 on AVX2). Lanes summed in order took a full transpose (64
// shuffles for 16 keys), which weighs most where a score has few multiply-adds: at d_head 64
// (four a key and query on AVX-512) a 512-token bf16 prefill of a 6-layer d_model 512 model took
// 146.2 -> 136.7 ms with the tree (Zen 4, one thread); at d_head 128 within noise.
static inline float hsum(vf v) {
  float a[W];
  for (int l = 0; l < W; ++l) a[l] = v[l];
  for (int h = W / 2; h >= 4; h /= 2)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// s[p] = hsum(v[p]) for the W vectors v, the same adds in the same order. Each round adds two
// registers whose lanes pair the halves of what is left of two vectors' sums; input i is the
// vector key16(i) (key8(i)), the order that leaves key p's sum in lane p. (hsum a vector at a
// time is a chain of lane extracts and dependent adds: it made the prefill's score pass cost
// 3.6x its output pass for the same multiply-adds, Zen 4, 512-token f32 prefill.)
constexpr int key16(int i) { return 4 * (i % 4) + i / 4; }
constexpr int key8(int i) { return 4 * (i % 2) + i / 2; }
static inline void hsums(const vf* v, float* s) {
#if VBYTES == 64
  // round 1, halves: x[p] holds inputs 2p and 2p + 1 folded to 8 lanes each
  __m512 x[8], y[4], z[2];
  for (int p = 0; p < 8; ++p) {
    const __m512 a = __m512(v[key16(2 * p)]), b = __m512(v[key16(2 * p + 1)]);
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  }
  // round 2, quarters: block j of y[q] holds input 4q + j folded to 4 lanes
  for (int q = 0; q < 4; ++q)
    y[q] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0xdd));
  // rounds 3 and 4 within 128-bit blocks: (l0 + l1) and (l2 + l3), then their sum; lane i of
  // block j ends with input j + 4i, which key16 made key 4j + i
  for (int r = 0; r < 2; ++r)
    z[r] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0x88),
                         _mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0xdd));
  _mm512_storeu_ps(s, _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                    _mm512_shuffle_ps(z[0], z[1], 0xdd)));
#elif VBYTES == 32
  // the same rounds on 8 lanes: halves, then within 128-bit blocks; lane i of block j ends with
  // input j + 2i, which key8 made key 4j + i
  __m256 x[4], y[2];
  for (int p = 0; p < 4; ++p) {
    const __m256 a = __m256(v[key8(2 * p)]), b = __m256(v[key8(2 * p + 1)]);
    x[p] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int r = 0; r < 2; ++r)
    y[r] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * r], x[2 * r + 1], 0x88),
                         _mm256_shuffle_ps(x[2 * r], x[2 * r + 1], 0xdd));
  _mm256_storeu_ps(s, _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88),
                                    _mm256_shuffle_ps(y[0], y[1], 0xdd)));
#else
  for (int p = 0; p < W; ++p) s[p] = hsum(v[p]);
#endif
}

// sum of a (n), for the read-bandwidth probe: vector loads in `streams` (1, 2 or 4)
// contiguous parts read side by side, with or without prefetch_ahead. Which pattern reads fastest
// is the host's: on Zen 3 (2 vCPUs) one thread read 16 GB/s in one prefetched stream, 21 without
// the prefetches and 25 in two streams (the AMX Xeon's row dots wanted the prefetches, above);
// decode's products read four or more streams a thread on AVX2 and AVX-512 (one panel's four k
// blocks; four int8 panels on AVX2, eight on AVX-512). The probe keeps the best, so a roofline
// share is against the best streaming read of the host. Streams 2 and 3 add into the
// accumulators of 0 and 1 (a sink, not a result).
static float sum(const float* a, int64_t n, int streams, bool prefetch) {
  vf acc[2][ACC] = {};
  const int ns = streams >= 4 ? 4 : streams == 2 ? 2 : 1;
  const int64_t part = n / ns / (ACC * W) * (ACC * W);
  for (int64_t i = 0; i < part; i += ACC * W)
    for (int st = 0; st < ns; ++st) {
      const float* p = a + st * part + i;
      if (prefetch) prefetch_ahead(p, lines_of(ACC * W * 4));
      for (int k = 0; k < ACC; ++k) acc[st % 2][k] += *(const vfu*)(p + k * W);
    }
  float s = hsum((acc[0][0] + acc[0][1]) + (acc[0][2] + acc[0][3])) +
            hsum((acc[1][0] + acc[1][1]) + (acc[1][2] + acc[1][3]));
  for (int64_t i = ns * part; i < n; ++i) s += a[i];
  return s;
}

// x (n)'s squares summed in double for RMSNorm: square i into partial sum i mod 16, the 16
// partials then added in order. Each square of a float is exact in double, so every
// instruction set gets the same bits; one chain of n dependent adds (the loop this replaced)
// took 4 cycles an element, 3% of a 512-token prefill.
static double sum_sq(const float* x, int64_t n) {
  double part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) part[k] += double(x[i + k]) * double(x[i + k]);
  for (int k = 0; i + k < n; ++k) part[k] += double(x[i + k]) * double(x[i + k]);
  double s = part[0];
  for (int k = 1; k < 16; ++k) s += part[k];
  return s;
}

// ---- the KV cache's bf16 and f16 rows, widened in registers ------------------------------------
// Each vector is widened to float32 right after its load and multiplied in float32; scalar tails
// widen with the one definition (algenta/half.hpp), exact as the vector loads.
static inline float s_bf16(uint16_t h) { return half::bf16_to_f32(h); }
static inline float s_f16(uint16_t h) { return half::f16_to_f32(h); }

// one vector of halves widened exactly (simd_halves.hpp, shared with the weight panels)
static inline vf ld_bf16(const uint16_t* p) { return halves::ld_bf16(p); }
static inline vf ld_f16(const uint16_t* p) { return halves::ld_f16(p); }

// ---- activations as the narrow formats multiply them -----------------------------------------
// bf16: the activation vector is rounded to bf16 once per product (xb the bits, xr their float32
// values, both zero-padded to Q8_ACT_PAD elements), as transformers' and llama.cpp's bf16 matmuls
// multiply bf16 inputs. A product of two bf16 values is exact in float32, so the paths multiply
// the same products and differ only in how they sum them: vdpbf16ps pair panels on AVX512-BF16,
// the float32 GEMM's chain on widened panels and xr elsewhere. (vdpbf16ps treats subnormal inputs
// and results as zero, |v| < 1.2e-38: the only values where the paths' products differ.)
static void round_bf16(const float* x, int64_t n, uint16_t* xb, float* xr) {
  const int64_t padded = act_padded(n);
  for (int64_t i = 0; i < n; ++i) xb[i] = half::f32_to_bf16(x[i]);
  for (int64_t i = n; i < padded; ++i) xb[i] = 0;
  if (!xr) return;
  for (int64_t i = 0; i < n; ++i) xr[i] = half::bf16_to_f32(xb[i]);
  for (int64_t i = n; i < padded; ++i) xr[i] = 0.f;
}

// int8: the activation vector quantized once per product, by the weights' rule (quant::q8_block),
// into codes (zero-padded to Q8_ACT_PAD) and one scale a block. Whole blocks on vectors where the
// instruction set rounds them (AVX2, AVX-512): the same operations per value as q8_block, a true
// division, rounding to nearest even (rintf's, in the default mode), the clamp and NaN -> 0, so
// the same codes and scales (a block's NaN scale aside, whose payload may come from another of
// its NaNs). One value at a time, q8_block's division and its max chain cost about 13 cycles a
// value: 12% of a 16-token int8 prefill's profile on Zen 4.
#if VBYTES >= 32
typedef int8_t v8q __attribute__((vector_size(W)));
static inline vf round_even(vf v) {
#if VBYTES == 64
  return (vf)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return (vf)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}
#endif
static void quantize_q8(const float* x, int64_t n, int8_t* xq, float* xs) {
  constexpr int64_t B = RESIDENT_INT8_BLOCK;
  int64_t i = 0, b = 0;
#if VBYTES >= 32
  constexpr int NVB = int(B) / W;  // vectors a block
  for (; i + B <= n; i += B, ++b) {
    vf v[NVB], m = vf{};
    for (int u = 0; u < NVB; ++u) {
      v[u] = *(const vfu*)(x + i + u * W);
      const vf a = (vf)((vi)v[u] & 0x7fffffff);
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
      *(v8q*)(xq + i + u * W) = __builtin_convertvector(__builtin_convertvector(c, vi), v8q);
    }
  }
#endif
  for (; i < n; i += B, ++b) xs[b] = quant::q8_block(x + i, std::min(B, n - i), xq + i);
  const int64_t padded = act_padded(n);
  for (int64_t j = n; j < padded; ++j) xq[j] = 0;
}

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

static int64_t q8_blocks(int64_t K) { return (K + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK; }
static int64_t q8_block_bytes(int64_t K) { return Q8_PANELS * q8_blocks(K) * Q8_PB; }

static void q8_put_row(void* blkv, int64_t K, int64_t c, const void* rowv, const float* scales) {
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

static void q8_get_row(const void* blkv, int64_t K, int64_t c, float* dst) {
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

static int64_t q8_ws_bytes(int64_t K) { return 2 * q8_blocks(K) * 64 + 64; }

// Rows of one activation tile: codes, scales, outputs.
struct Q8Rows {
  const int8_t* q[4];
  const float* s[4];
  float* y[4];
};

#if VBYTES == 64
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
#elif VBYTES == 32
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
// stream, and one core keeps more lines in flight over more streams. AVX2, four: Zen 3, one
// thread, a 604 MB matrix: 17.4-18.0 GB/s with two panels, 22.8-23.2 with four (a plain read
// 21-23); a one-thread decode step of the Qwen3-0.6B shape 40-43 -> 36-37 ms (medians; two
// threads within the VM's noise). AVX-512 (32 registers), eight: Zen 4 (AVX-512 VNNI), tiles
// alternated step by step in one process at that shape, medians of 60 steps: one thread 31.8 ms
// (two panels) -> 30.1 (four), two threads 18.9 -> 17.6; then, in the session's two-block
// decode tasks (session_cpu.cpp, step_task_rows), one thread 31.9 (four) -> 29.5 (eight), two
// threads 23.5 -> 22.5. The same bits: a cell's sums do not depend on its neighbours. The SSE2
// build keeps two (not timed).
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

static void q8_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* Wv,
                    float* Y, int64_t ldy, bool accumulate, void* ws) {
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
#if VBYTES == 64
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

// ---- the float and bf16 panels (kernels_isa.cpp) behind the table's one signature -------------
template <int KIND>
static int64_t fp_block_bytes(int64_t K) {
  return fpanel_block_elems(K) * (KIND == PANEL_F32 ? 4 : 2);
}
template <int KIND>
static void fp_put_row(void* blk, int64_t K, int64_t c, const void* row, const float*) {
  fpanel_put_row(KIND, blk, K, c, row);
}
template <int KIND>
static void fp_get_row(const void* blk, int64_t K, int64_t c, float* dst) {
  fpanel_get_row(KIND, blk, K, c, dst);
}
template <int KIND>
static void fp_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
                    int64_t ldy, bool accumulate, void* ws) {
  fpanel_gemm(KIND, M, N, K, X.f, X.ld, static_cast<const float*>(X.packed), W, Y, ldy,
              accumulate, static_cast<float*>(ws));
}
static int64_t fp_ws_bytes(int64_t) { return fpanel_ws_elems() * 4; }
static void fp_pack(int64_t M, int64_t K, const PanelAct& X, void* dst) {
  fpanel_pack(M, K, X.f, X.ld, static_cast<float*>(dst));
}

#if defined(__AVX512BF16__)
static int64_t dp_block_bytes(int64_t K) { return dpanel_block_u32(K) * 4; }
static void dp_put_row(void* blk, int64_t K, int64_t c, const void* row, const float*) {
  dpanel_put_row(static_cast<uint32_t*>(blk), K, c, static_cast<const uint16_t*>(row));
}
static void dp_get_row(const void* blk, int64_t K, int64_t c, float* dst) {
  dpanel_get_row(static_cast<const uint32_t*>(blk), K, c, dst);
}
static void dp_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
                    int64_t ldy, bool accumulate, void* ws) {
  dpanel_gemm(M, N, K, X.b, X.ld, static_cast<const uint32_t*>(X.packed),
              static_cast<const uint32_t*>(W), Y, ldy, accumulate, static_cast<float*>(ws));
}
static void dp_pack(int64_t M, int64_t K, const PanelAct& X, void* dst) {
  dpanel_pack(M, K, X.b, X.ld, static_cast<uint32_t*>(dst));
}
#define ALGENTA_BF16_PANELS                                                                  \
  {dp_block_bytes, dp_put_row, dp_get_row, dp_gemm, fp_ws_bytes, ACT_BF16_BITS, "vdpbf16ps", \
   dpanel_packed_u32, dp_pack}
#else
#define ALGENTA_BF16_PANELS                                                              \
  {fp_block_bytes<PANEL_BF16>, fp_put_row<PANEL_BF16>, fp_get_row<PANEL_BF16>,           \
   fp_gemm<PANEL_BF16>, fp_ws_bytes, ACT_F32, "fp32 on widened bf16", fpanel_packed_elems,   \
   fp_pack}
#endif

#if VBYTES == 64 && defined(__AVX512VNNI__)
#define ALGENTA_Q8_PATH "vpdpbusd"
#elif VBYTES >= 32
#define ALGENTA_Q8_PATH "vpmaddubsw"
#else
#define ALGENTA_Q8_PATH "scalar"
#endif

// ---- attention: queries against one KV head ----------------------------------------------------
// A prefill has many queries per KV head (the G query heads of each row, and several rows); taken
// one at a time, each score is a key row's loads and a horizontal sum, each output update a
// store-to-load chain through memory: about 85 cycles a (query, key) pair on a Zen 3 core, a fifth
// of a 512-token f32 prefill there. These take up to QD (scores) or QV (outputs) queries per pass,
// loading each key or value vector once for all of them and holding the sums in registers; decode
// takes the same kernels with its one query. A score: the row in groups of ACC vectors, vector a
// of each group into accumulator a (whole vectors past the last group into accumulator 0, the
// zero-padded tail into 1), combined as (a0 + a1) + (a2 + a3), the lanes then summed as a
// halving tree (hsum; hsums for W keys side by side). An output: one multiply-add an element a
// key, keys in order. Each query's bits are its own whatever group it is in, so a row attends
// with the same bits whether it was prefilled or stepped (tests/test_residentk_split.py).
constexpr int QD = VBYTES == 64 ? 6 : 3;  // 4 accumulators a query, kept in registers
constexpr int QV = VBYTES == 64 ? 4 : 3;  // 4 output vectors a query, kept in registers

// a KV row's vectors and scalars in each cache format, widened exactly (as the dots above)
template <Dtype F>
struct Kv;
template <>
struct Kv<Dtype::F32> {
  typedef float T;
  static vf ld(const float* p) { return *(const vfu*)p; }
  static float sc(float v) { return v; }
};
template <>
struct Kv<Dtype::BF16> {
  typedef uint16_t T;
  static vf ld(const uint16_t* p) { return ld_bf16(p); }
  static float sc(uint16_t v) { return s_bf16(v); }
};
template <>
struct Kv<Dtype::F16> {
  typedef uint16_t T;
  static vf ld(const uint16_t* p) { return ld_f16(p); }
  static float sc(uint16_t v) { return s_f16(v); }
};

// r[t] = the combined accumulators of q[t] (n) . k (n) for NQ queries (the vector hsum takes)
template <Dtype F, int NQ>
static inline void kv_dot_vecs(const float* const* q, const typename Kv<F>::T* k, int64_t n,
                               vf* r) {
  vf acc[NQ][ACC];
  for (int t = 0; t < NQ; ++t)  // element by element: `= {}` became a rep stos to the stack
    for (int a = 0; a < ACC; ++a) acc[t][a] = vf{};
  int64_t i = 0;
  for (; i + ACC * W <= n; i += ACC * W)
    for (int a = 0; a < ACC; ++a) {
      const vf kv = Kv<F>::ld(k + i + a * W);
      for (int t = 0; t < NQ; ++t) acc[t][a] += *(const vfu*)(q[t] + i + a * W) * kv;
    }
  for (; i + W <= n; i += W) {
    const vf kv = Kv<F>::ld(k + i);
    for (int t = 0; t < NQ; ++t) acc[t][0] += *(const vfu*)(q[t] + i) * kv;
  }
  if (i < n) {  // the padded tail
    vf tk = {};
    for (int l = 0; i + l < n; ++l) tk[l] = Kv<F>::sc(k[i + l]);
    for (int t = 0; t < NQ; ++t) {
      vf tq = {};
      for (int l = 0; i + l < n; ++l) tq[l] = q[t][i + l];
      acc[t][1] += tq * tk;
    }
  }
  for (int t = 0; t < NQ; ++t) r[t] = (acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]);
}

// s[t * lds + j - j0] = q[t] (n) . row j of K (rows n apart), j in [j0, j1), for NQ queries:
// W keys at a time summed side by side (hsums), the last few one by one
template <Dtype F, int NQ>
static void kv_dots_n(const float* const* q, const typename Kv<F>::T* K, int64_t n, int64_t j0,
                      int64_t j1, float* s, int64_t lds) {
  int64_t j = j0;
  for (; j + W <= j1; j += W) {
    vf r[NQ][W], kr[NQ];
    for (int u = 0; u < W; ++u) {
      kv_dot_vecs<F, NQ>(q, K + (j + u) * n, n, kr);
      for (int t = 0; t < NQ; ++t) r[t][u] = kr[t];
    }
    for (int t = 0; t < NQ; ++t) hsums(r[t], s + t * lds + (j - j0));
  }
  for (; j < j1; ++j) {
    vf kr[NQ];
    kv_dot_vecs<F, NQ>(q, K + j * n, n, kr);
    for (int t = 0; t < NQ; ++t) s[t * lds + (j - j0)] = hsum(kr[t]);
  }
}

// out[t] (n) += p[t * ldp + j - j0] * row j of V, j = j0, j0 + 1, ..., j1 - 1, for NQ queries
template <Dtype F, int NQ>
static void kv_axpys_n(const float* p, int64_t ldp, const typename Kv<F>::T* V, int64_t n,
                       int64_t j0, int64_t j1, float* const* out) {
  constexpr int SV = 4;  // vectors of a slice of the row
  int64_t i = 0;
  for (; i + SV * W <= n; i += SV * W) {
    vf acc[NQ][SV];
    for (int t = 0; t < NQ; ++t)
      for (int v = 0; v < SV; ++v) acc[t][v] = *(const vfu*)(out[t] + i + v * W);
    for (int64_t j = j0; j < j1; ++j) {
      vf pv[NQ];
      for (int t = 0; t < NQ; ++t) pv[t] = vf{} + p[t * ldp + (j - j0)];
      for (int v = 0; v < SV; ++v) {
        const vf x = Kv<F>::ld(V + j * n + i + v * W);
        for (int t = 0; t < NQ; ++t) acc[t][v] = acc[t][v] + pv[t] * x;
      }
    }
    for (int t = 0; t < NQ; ++t)
      for (int v = 0; v < SV; ++v) *(vfu*)(out[t] + i + v * W) = acc[t][v];
  }
  for (; i + W <= n; i += W)
    for (int t = 0; t < NQ; ++t) {
      vf acc = *(const vfu*)(out[t] + i);
      for (int64_t j = j0; j < j1; ++j)
        acc = acc + (vf{} + p[t * ldp + (j - j0)]) * Kv<F>::ld(V + j * n + i);
      *(vfu*)(out[t] + i) = acc;
    }
  for (; i < n; ++i)  // axpy's scalar tail
    for (int t = 0; t < NQ; ++t)
      for (int64_t j = j0; j < j1; ++j) out[t][i] += p[t * ldp + (j - j0)] * Kv<F>::sc(V[j * n + i]);
}

// nq queries in groups of G, the last group's size picked at run time (R counts down to 1)
template <int G, int R, class Fn>
static inline void groups_of(int nq, Fn&& fn) {
  if constexpr (R == G) {
    int t = 0;
    for (; t + G <= nq; t += G) fn(std::integral_constant<int, G>{}, t);
    if (t < nq) groups_of<G, G - 1>(nq - t, [&](auto c, int u) { fn(c, t + u); });
  } else if constexpr (R >= 1) {
    if (nq == R) return fn(std::integral_constant<int, R>{}, 0);
    groups_of<G, R - 1>(nq, fn);
  }
}

template <Dtype F>
static void kv_dots_t(const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
                      int64_t j1, float* s, int64_t lds) {
  const auto* k = static_cast<const typename Kv<F>::T*>(K);
  groups_of<QD, QD>(nq, [&](auto c, int t) {
    kv_dots_n<F, decltype(c)::value>(q + t, k, n, j0, j1, s + t * lds, lds);
  });
}
template <Dtype F>
static void kv_axpys_t(const float* p, int64_t ldp, int nq, const void* V, int64_t n, int64_t j0,
                       int64_t j1, float* const* out) {
  const auto* v = static_cast<const typename Kv<F>::T*>(V);
  groups_of<QV, QV>(nq, [&](auto c, int t) {
    kv_axpys_n<F, decltype(c)::value>(p + t * ldp, ldp, v, n, j0, j1, out + t);
  });
}

static void kv_dots(Dtype f, const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
                    int64_t j1, float* s, int64_t lds) {
  if (f == Dtype::F32) return kv_dots_t<Dtype::F32>(q, nq, K, n, j0, j1, s, lds);
  if (f == Dtype::BF16) return kv_dots_t<Dtype::BF16>(q, nq, K, n, j0, j1, s, lds);
  kv_dots_t<Dtype::F16>(q, nq, K, n, j0, j1, s, lds);
}
static void kv_axpys(Dtype f, const float* p, int64_t ldp, int nq, const void* V, int64_t n,
                     int64_t j0, int64_t j1, float* const* out) {
  if (f == Dtype::F32) return kv_axpys_t<Dtype::F32>(p, ldp, nq, V, n, j0, j1, out);
  if (f == Dtype::BF16) return kv_axpys_t<Dtype::BF16>(p, ldp, nq, V, n, j0, j1, out);
  kv_axpys_t<Dtype::F16>(p, ldp, nq, V, n, j0, j1, out);
}

// fn over [0, n) in groups of 16 elements, each group through one fixed 16-wide pass over a
// zero-padded copy: every element takes the same instructions wherever it sits (a vector body
// and a scalar epilogue may round differently, and a decode task and a prefill row start at
// different places), so the families' elementwise stages stay bit-identical between decode
// and prefill; the fixed trip count is what the compiler vectorizes.
template <class Fn>
static inline void by16(int64_t n, Fn&& fn) {
  for (int64_t i0 = 0; i0 < n; i0 += 16) fn(i0, std::min<int64_t>(16, n - i0));
}
// A group's copy in (x + bias, bias may be null; zeros past m) and out. The pass between never
// changes; a whole group (every one but a row's last) copies in fixed 16-trip loops the compiler
// turns into vector moves: a value at a time, the copies cost more than the gate they feed
// (10 cycles an element, 5% of a 128-token prefill, Zen 4).
static inline void in16(const float* x, const float* bias, int64_t m, float* a) {
  if (m == 16 && bias) {
    for (int k = 0; k < 16; ++k) a[k] = x[k] + bias[k];
  } else if (m == 16) {
    for (int k = 0; k < 16; ++k) a[k] = x[k];
  } else {
    for (int64_t k = 0; k < 16; ++k) a[k] = k < m ? (bias ? x[k] + bias[k] : x[k]) : 0.f;
  }
}
static inline void out16(const float* a, int64_t m, float* y) {
  if (m == 16) {
    for (int k = 0; k < 16; ++k) y[k] = a[k];
  } else {
    for (int64_t k = 0; k < m; ++k) y[k] = a[k];
  }
}

// z (n) = cap * tanh(z / cap) in place (session_math::softcap).
static void softcap(float* z, int64_t n, float cap) {
  by16(n, [&](int64_t i0, int64_t m) {
    alignas(64) float x[16];
    in16(z + i0, nullptr, m, x);
    for (int k = 0; k < 16; ++k) x[k] = session_math::softcap(x[k], cap);
    out16(x, m, z + i0);
  });
}

// session_math::exp_nonpos on W lanes, its operations in its order (the scalar one did not
// vectorize inside a loop: its float-to-int conversion and clamp kept GCC scalar)
static inline vf exp_nonpos_v(vf x) {
  const vf floor = vf{} - 87.0f;
  x = x < floor ? floor : x;
  const vf big = vf{} + 12582912.0f;
  const vf n = (x * 1.44269504088896341f + big) - big;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  vf p = vf{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return p * two_n;
}

// s (n) <- softmax(s) in place, attention's weights (callers scale and soft-cap s first):
// exp(s_j - max) by exp_nonpos_v (libm's expf, a call per key, was a sixth of a 512-token
// prefill's attention on Zen 3), their sum in double in 16 partial sums (element j in sum j mod
// 16, the partials then added in order: no 4-cycle add chain a key, and the same order on every
// instruction set), each weight e_j * float(1 / sum). Keys more than 87 below the max weigh
// exp(-87) / sum instead of less (exp_nonpos' floor), under 1e-37 of the largest weight.
static void softmax(float* s, int64_t n) {
  if (n <= 0) return;
  constexpr int NV16 = 16 / W;  // vectors in a group of 16
  const int64_t full = n / 16 * 16;
  alignas(64) float tail[16];  // the last partial group, padded
  for (int64_t k = 0; k < 16; ++k) tail[k] = full + k < n ? s[full + k] : s[0];
  vf mv = *(const vf*)tail;
  for (int64_t i = 0; i < full; i += W) {
    const vf x = *(const vfu*)(s + i);
    mv = mv < x ? x : mv;
  }
  for (int v = 1; v < NV16; ++v) mv = mv < *(const vf*)(tail + v * W) ? *(const vf*)(tail + v * W) : mv;
  float mx = mv[0];
  for (int l = 1; l < W; ++l) mx = std::max(mx, mv[l]);
  double part[16] = {};
  // exp of one group of 16 at g (in place), added to the partial sums; `m` of them are real
  const auto group = [&](float* g, int64_t m) {
    alignas(64) float e[16];
    for (int v = 0; v < NV16; ++v) *(vf*)(e + v * W) = exp_nonpos_v(*(const vfu*)(g + v * W) - mx);
    for (int64_t k = m; k < 16; ++k) e[k] = 0.f;  // padding adds nothing to the sums
    for (int k = 0; k < 16; ++k) part[k] += double(e[k]);
    for (int v = 0; v < NV16; ++v) *(vfu*)(g + v * W) = *(const vf*)(e + v * W);
  };
  for (int64_t i = 0; i < full; i += 16) group(s + i, 16);
  if (full < n) {
    group(tail, n - full);
    for (int64_t k = 0; full + k < n; ++k) s[full + k] = tail[k];
  }
  double tot = part[0];
  for (int k = 1; k < 16; ++k) tot += part[k];
  const float inv = float(1.0 / tot);
  for (int64_t j = 0; j < n; ++j) s[j] = s[j] * inv;
}

// out (n) = act(g + gb) * (u + ub), act the MLP's gate (session_math::silu_mul or
// gelu_tanh_mul), biases may be null; out may be g.
template <float (*Act)(float, float)>
static void gate_mul(const float* g, const float* u, const float* gb, const float* ub,
                     float* out, int64_t n) {
  by16(n, [&](int64_t i0, int64_t m) {
    alignas(64) float a[16], b[16];
    in16(g + i0, gb ? gb + i0 : nullptr, m, a);
    in16(u + i0, ub ? ub + i0 : nullptr, m, b);
    for (int k = 0; k < 16; ++k) a[k] = Act(a[k], b[k]);
    out16(a, m, out + i0);
  });
}

}  // namespace

extern const SessionOps session_ops;
const SessionOps session_ops = {
    sum,
    kv_dots,
    kv_axpys,
    round_bf16,
    quantize_q8,
    softcap,
    softmax,
    sum_sq,
    gate_mul<session_math::silu_mul>,
    gate_mul<session_math::gelu_tanh_mul>,
    {
        {fp_block_bytes<PANEL_F32>, fp_put_row<PANEL_F32>, fp_get_row<PANEL_F32>,
         fp_gemm<PANEL_F32>, fp_ws_bytes, ACT_F32, "fp32", fpanel_packed_elems, fp_pack},
        ALGENTA_BF16_PANELS,
        {fp_block_bytes<PANEL_F16>, fp_put_row<PANEL_F16>, fp_get_row<PANEL_F16>,
         fp_gemm<PANEL_F16>, fp_ws_bytes, ACT_F32, "fp32 on widened f16", fpanel_packed_elems,
         fp_pack},
        {q8_block_bytes, q8_put_row, q8_get_row, q8_gemm, q8_ws_bytes, ACT_Q8, ALGENTA_Q8_PATH},
    },
};

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

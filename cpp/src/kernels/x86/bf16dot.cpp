// bfloat16 dot products on AVX512-BF16 (vdpbf16ps), compiled into the avx512bf16 and amx
// instruction sets only (empty elsewhere): lossk's Bf16DotOps (the logits, d_hidden and d_weight
// of bf16 inputs, and, on avx512bf16, the session's bf16 prefill through gemm_bb) and the
// session's bf16 weight panels, whose decode and prefill both run the pair micro-kernel's chain.
// Intrinsics throughout; the packing transposes with simd.hpp's transpose16.
//
// Operands are packed as k-pairs: one uint32 holds the bf16 values of k = 2p (low half) and
// 2p + 1 (high half), the unit vdpbf16ps multiplies: per float32 lane, acc += a[2p] b[2p] +
// a[2p+1] b[2p+1], the products exact (8-bit significands), the sum in float32. Pairs always
// start at k = 0 of the whole product (K blocks hold DP_KC values, an even count), so a cell's
// chain, and with it its bits, never depends on where the caller split K; an odd K pads its last
// pair with a zero. Every operand is bf16: the caller rounds float32 d_logits to bf16 first (with
// the one rounding both backends use, half::f32_to_bf16). The instruction treats subnormal
// inputs and results as zero (below 1.2e-38, far under anything a loss or its gradient carries).
// Never allocates: scratch is the float32 GEMM's gemm_ws_elems() (lossk) or fpanel_ws_elems()
// (the panels), which the static_asserts below check hold these kernels' panels.
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "../gemm.hpp"
#include "../parts.hpp"
#include "../simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

#if defined(__AVX512BF16__)
constexpr int DP_MR = 12;  // 12 x 2 zmm accumulators, as the float32 kernel
constexpr int DP_NV = 2;
constexpr int64_t DP_NR = DP_NV * 16;
// k blocks of 512 values (256 pairs): a d_weight cell's chain over a 512-token chunk stays in
// registers for the whole chunk, and a B micro-panel (256 pairs x 32 columns, 32 KB) is still
// read from L1/L2 far faster than the dot products consume it. NC halves to keep B's block in L2.
constexpr int64_t DP_KC = 512;
constexpr int64_t DP_NC = 32 * DP_NR;
static_assert(DP_KC % 2 == 0 && MC % DP_MR == 0, "k blocks hold whole pairs, MC whole panels");
static_assert(MC * (DP_KC / 2) + (DP_KC / 2) * DP_NC + DP_MR * DP_NR + 3 * 64 <=
                  MC * KC + KC * NC<float>() + MR<float> * nr<float>() + 3 * 64,
              "the float32 kernels' workspace holds the pair-packed panels");

inline uint32_t kpair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

int64_t dp_pairs(int64_t k) { return (k + 1) / 2; }

// A block (mc x kc) of bf16 -> panels of DP_MR rows: Ap[panel][p][r] = pair(A[r][2p],
// A[r][2p+1]), zero rows past mc and a zero high half past kc.
inline void dp_pack_a(int64_t mc, int64_t kc, const BF16* A, int64_t rsa, int64_t csa,
                      uint32_t* Ap) {
  const int64_t kp = dp_pairs(kc), kfull = kc / 2;
  for (int64_t i0 = 0; i0 < mc; i0 += DP_MR) {
    const int64_t mr = mc - i0 < DP_MR ? mc - i0 : DP_MR;
    uint32_t* dst = Ap + i0 * kp;
    if (csa == 1) {  // k-contiguous rows (hidden, d_logits): a pair is two adjacent bf16
      for (int64_t r = 0; r < mr; ++r) {
        const BF16* src = A + (i0 + r) * rsa;
        for (int64_t p = 0; p < kfull; ++p) {
          uint32_t u;
          std::memcpy(&u, src + 2 * p, 4);  // little-endian: k = 2p in the low half
          dst[p * DP_MR + r] = u;
        }
        if (kp > kfull) dst[kfull * DP_MR + r] = kpair(src[kc - 1].u, 0);
      }
    } else if (rsa == 1 && mr == DP_MR) {  // d_logits read transposed: two k rows interleaved
      for (int64_t p = 0; p < kp; ++p) {
        const BF16* __restrict lo = A + i0 + 2 * p * csa;
        const BF16* __restrict hi = 2 * p + 1 < kc ? lo + csa : nullptr;
        uint32_t* __restrict d = dst + p * DP_MR;
        if (hi)
          for (int r = 0; r < DP_MR; ++r) d[r] = kpair(lo[r].u, hi[r].u);
        else
          for (int r = 0; r < DP_MR; ++r) d[r] = kpair(lo[r].u, 0);
      }
    } else {
      for (int64_t p = 0; p < kp; ++p) {
        const BF16* lo = A + i0 * rsa + 2 * p * csa;
        const bool has_hi = 2 * p + 1 < kc;
        for (int64_t r = 0; r < mr; ++r)
          dst[p * DP_MR + r] =
              kpair(lo[r * rsa].u, has_hi ? lo[r * rsa + csa].u : uint16_t(0));
      }
    }
    for (int64_t r = mr; r < DP_MR; ++r)
      for (int64_t p = 0; p < kp; ++p) dst[p * DP_MR + r] = 0;
  }
}

// B block (kc x nc) of bf16 -> panels of DP_NR columns: Bp[panel][p][c] = pair(B[2p][c],
// B[2p+1][c]), zero columns past nc.
inline void dp_pack_b(int64_t kc, int64_t nc, const BF16* B, int64_t rsb, int64_t csb,
                      uint32_t* Bp) {
  const int64_t kp = dp_pairs(kc), kfull = kc / 2;
  for (int64_t j0 = 0; j0 < nc; j0 += DP_NR) {
    const int64_t w = nc - j0 < DP_NR ? nc - j0 : DP_NR;
    uint32_t* dst = Bp + j0 * kp;
    if (rsb == 1) {
      // k-contiguous columns (B = W^T): a pair is two adjacent bf16 in memory, so 16 columns
      // x 16 pairs are 16 rows of 64 bytes, transposed in registers.
      int64_t c0 = 0;
      for (; c0 + 16 <= w; c0 += 16) {
        int64_t p0 = 0;
        for (; p0 + 16 <= kfull; p0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = _mm512_loadu_si512(static_cast<const void*>(B + (j0 + c0 + i) * csb + 2 * p0));
          transpose16(r);
          for (int i = 0; i < 16; ++i)
            _mm512_storeu_si512(static_cast<void*>(dst + (p0 + i) * DP_NR + c0), r[i]);
        }
        for (int64_t c = c0; c < c0 + 16; ++c) {
          const BF16* src = B + (j0 + c) * csb;
          for (int64_t p = p0; p < kfull; ++p)
            dst[p * DP_NR + c] = kpair(src[2 * p].u, src[2 * p + 1].u);
        }
      }
      for (int64_t c = c0; c < w; ++c) {
        const BF16* src = B + (j0 + c) * csb;
        for (int64_t p = 0; p < kfull; ++p) dst[p * DP_NR + c] = kpair(src[2 * p].u, src[2 * p + 1].u);
      }
      if (kp > kfull)
        for (int64_t c = 0; c < w; ++c) dst[kfull * DP_NR + c] = kpair(B[(j0 + c) * csb + kc - 1].u, 0);
    } else {
      // column-contiguous (W, or the chunk's hidden rows): two rows interleaved.
      for (int64_t p = 0; p < kp; ++p) {
        const BF16* lo = B + 2 * p * rsb + j0 * csb;
        const BF16* hi = lo + rsb;
        const bool has_hi = 2 * p + 1 < kc;
        uint32_t* d = dst + p * DP_NR;
        for (int64_t c = 0; c < w; ++c)
          d[c] = kpair(lo[c * csb].u, has_hi ? hi[c * csb].u : uint16_t(0));
      }
    }
    for (int64_t c = w; c < DP_NR; ++c)
      for (int64_t p = 0; p < kp; ++p) dst[p * DP_NR + c] = 0;
  }
}

// R x DP_NR tile: C = (mode, as ukernel_rows) + sum_p a[p][:] . b[p][:], one chain per cell in
// pair order.
template <int R>
void dp_ukernel(int64_t kp, const uint32_t* __restrict a, const uint32_t* __restrict b, float* c,
                int64_t ldc, int mode) {
  const bool stream = mode & TILE_STREAM;
  mode &= ~TILE_STREAM;
  __m512 acc[R][DP_NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < DP_NV; ++j)
      acc[i][j] = mode == TILE_CONTINUE ? _mm512_loadu_ps(c + i * ldc + j * 16)
                                        : _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[DP_NV];
    if (stream)  // the lines of B a pair step reads (DP_NR pairs of 4 bytes)
      for (int l = 0; l < DP_NR * 4 / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(b + p * DP_NR) + B_AHEAD + 64 * l, _MM_HINT_T0);
    for (int j = 0; j < DP_NV; ++j)
      bv[j] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(b + p * DP_NR + j * 16));
    for (int i = 0; i < R; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(int(a[p * DP_MR + i]));
      for (int j = 0; j < DP_NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ai, bv[j]);
    }
  }
  if (mode == TILE_ADD)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < DP_NV; ++j)
        acc[i][j] = _mm512_add_ps(_mm512_loadu_ps(c + i * ldc + j * 16), acc[i][j]);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < DP_NV; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
}

using DpUkernelFn = void (*)(int64_t, const uint32_t*, const uint32_t*, float*, int64_t, int);

template <int... Rs>
constexpr std::array<DpUkernelFn, sizeof...(Rs)> dp_ukernel_table(std::integer_sequence<int, Rs...>) {
  return {{&dp_ukernel<Rs + 1>...}};
}

inline const std::array<DpUkernelFn, DP_MR>& dp_ukernels() {
  static constexpr std::array<DpUkernelFn, DP_MR> table =
      dp_ukernel_table(std::make_integer_sequence<int, DP_MR>{});
  return table;
}

// The micro-tiles of one (k block, row block, column block) of pair-packed panels: C (mc x nc,
// row stride ldc) (+)= Ak (mc x kp pairs) times Bk (kp pairs x nc), as gemm_tiles.
inline void dp_tiles(int64_t mc, int64_t nc, int64_t kp, const uint32_t* Ak, const uint32_t* Bk,
                     float* C, int64_t ldc, bool load, float* tile) {
  for (int64_t jr = 0; jr < nc; jr += DP_NR) {
    const int64_t nr_ = nc - jr < DP_NR ? nc - jr : DP_NR;
    for (int64_t ir = 0; ir < mc; ir += DP_MR) {
      const int64_t mr_ = mc - ir < DP_MR ? mc - ir : DP_MR;
      float* c = C + ir * ldc + jr;
      const DpUkernelFn uk = dp_ukernels()[size_t(mr_ - 1)];
      if (nr_ == DP_NR) {
        uk(kp, Ak + ir * kp, Bk + jr * kp, c, ldc, load ? TILE_CONTINUE : TILE_SET);
      } else {  // column edge: the same kernel on a zero-padded full-width tile
        if (load)
          for (int64_t i = 0; i < mr_; ++i)
            for (int64_t j = 0; j < nr_; ++j) tile[i * DP_NR + j] = c[i * ldc + j];
        uk(kp, Ak + ir * kp, Bk + jr * kp, tile, DP_NR, load ? TILE_CONTINUE : TILE_SET);
        for (int64_t i = 0; i < mr_; ++i)
          for (int64_t j = 0; j < nr_; ++j) c[i * ldc + j] = tile[i * DP_NR + j];
      }
    }
  }
}

// gemm_core's driver over pair-packed panels. A: bf16 (packed here, block by block) or Afull
// (packed by dp_pack_a_rows, amp rows, this call's rows from a0); B: bf16 or Bfull (packed by
// dp_pack_b_full). ws: the float32 kernels' gemm_ws_elems(), which is larger than needed.
void dp_gemm_core(int64_t M, int64_t N, int64_t K, const BF16* A, int64_t rsa, int64_t csa,
                  const BF16* B, int64_t rsb, int64_t csb, const uint32_t* Afull, int64_t amp,
                  int64_t a0, const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate,
                  float* ws) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = 0.0f;
    return;
  }
  uint32_t* Ap = reinterpret_cast<uint32_t*>(align64(ws));
  uint32_t* Bp = align64(Ap + MC * (DP_KC / 2));
  float* tile = reinterpret_cast<float*>(align64(Bp + (DP_KC / 2) * DP_NC));
  const int64_t npad = (N + DP_NR - 1) / DP_NR * DP_NR;
  for (int64_t jc = 0; jc < N; jc += DP_NC) {
    const int64_t nc = N - jc < DP_NC ? N - jc : DP_NC;
    for (int64_t pc = 0; pc < K; pc += DP_KC) {
      const int64_t kc = K - pc < DP_KC ? K - pc : DP_KC, kp = dp_pairs(kc);
      const bool load = accumulate || pc > 0;  // later k blocks continue the same chain
      const uint32_t* Bk;
      if (Bfull) {
        Bk = Bfull + (pc / 2) * npad + jc * kp;
      } else {
        dp_pack_b(kc, nc, B + pc * rsb + jc * csb, rsb, csb, Bp);
        Bk = Bp;
      }
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = M - ic < MC ? M - ic : MC;
        const uint32_t* Ak;
        if (Afull) {
          Ak = Afull + (pc / 2) * amp + (a0 + ic) * kp;
        } else {
          dp_pack_a(mc, kc, A + ic * rsa + pc * csa, rsa, csa, Ap);
          Ak = Ap;
        }
        dp_tiles(mc, nc, kp, Ak, Bk, C + ic * ldc + jc, ldc, load, tile);
      }
    }
  }
}

int64_t dp_packed_a_elems(int64_t M, int64_t K) {
  return dp_pairs(K) * ((M + DP_MR - 1) / DP_MR * DP_MR) + 16;
}

void dp_pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                    int64_t csa, uint32_t* Afull) {
  const int64_t mp = (M + DP_MR - 1) / DP_MR * DP_MR;
  const BF16* a = reinterpret_cast<const BF16*>(A);
  for (int64_t pc = 0; pc < K; pc += DP_KC) {
    const int64_t kc = K - pc < DP_KC ? K - pc : DP_KC;
    dp_pack_a(r1 - r0, kc, a + r0 * rsa + pc * csa, rsa, csa,
              Afull + (pc / 2) * mp + r0 * dp_pairs(kc));
  }
}

int64_t dp_packed_b_elems(int64_t K, int64_t N) {
  return dp_pairs(K) * ((N + DP_NR - 1) / DP_NR * DP_NR) + 16;
}

int64_t dp_packed_b_max_cols() { return DP_NC; }

void dp_pack_b_full(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                    uint32_t* Bfull) {
  const int64_t npad = (N + DP_NR - 1) / DP_NR * DP_NR;
  const BF16* b = reinterpret_cast<const BF16*>(B);
  for (int64_t pc = 0; pc < K; pc += DP_KC) {
    const int64_t kc = K - pc < DP_KC ? K - pc : DP_KC;
    dp_pack_b(kc, N, b + pc * rsb, rsb, csb, Bfull + (pc / 2) * npad);
  }
}

void dp_gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K,
                  const uint32_t* Afull, const uint32_t* Bfull, float* C, int64_t ldc,
                  bool accumulate, float* ws) {
  const int64_t mp = (Mfull + DP_MR - 1) / DP_MR * DP_MR;
  dp_gemm_core(M, N, K, nullptr, 0, 0, nullptr, 0, 0, Afull, mp, row0, Bfull, C, ldc,
                     accumulate, ws);
}

void dp_gemm_bb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc,
                bool accumulate, float* ws) {
  dp_gemm_core(M, N, K, reinterpret_cast<const BF16*>(A), rsa, csa,
                     reinterpret_cast<const BF16*>(B), rsb, csb, nullptr, 0, 0, nullptr, C, ldc,
                     accumulate, ws);
}

void dp_gemm_bpb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                 const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate, float* ws) {
  dp_gemm_core(M, N, K, reinterpret_cast<const BF16*>(A), rsa, csa, nullptr, 0, 0, nullptr,
                     0, 0, Bfull, C, ldc, accumulate, ws);
}

int64_t dp_row_quantum() { return DP_MR; }

// ---- the resident session's bf16 weight panels on vdpbf16ps -----------------------------------
// A block of PANEL_ROWS weight rows held as dp_pack_b_full holds B = the rows transposed (k
// blocks of DP_KC, pair-packed DP_NR-column panels), multiplied by the pair GEMM's micro-kernel
// in prefill and by dpanel_gemv (dp_ukernel<1>'s chain, x not packed) in a decode step: per
// cell one chain per k block and the block sums added in order, whatever the number of rows, as
// the float32 panels (fpanels.cpp). Also on amx hosts: a decode step cannot reproduce a tile's
// internal order, so the session's bf16 stays on vdpbf16ps there and lossk alone takes the tiles.
int64_t dpanel_block_u32(int64_t K) { return dp_pairs(K) * PANEL_ROWS; }
static_assert(MC * (DP_KC / 2) + DP_MR * DP_NR <= MC * KC + MR<float> * nr<float>(),
              "dpanel_gemm's packed rows and edge tile fit fpanel_ws_elems()");

void dpanel_put_row(uint32_t* blk, int64_t K, int64_t c, const uint16_t* row) {
  static_assert(PANEL_ROWS % DP_NR == 0 && DP_KC % 2 == 0, "whole panels, whole pairs");
  for (int64_t k = 0; k < K; ++k) {
    const int64_t pc = k / DP_KC * DP_KC, kc = K - pc < DP_KC ? K - pc : DP_KC;
    const int64_t at = (pc / 2) * PANEL_ROWS + (c / DP_NR) * DP_NR * dp_pairs(kc) +
                       ((k - pc) / 2) * DP_NR + c % DP_NR;
    uint16_t* halves = reinterpret_cast<uint16_t*>(blk + at);  // little-endian: even k low
    halves[k % 2] = row[k];
  }
}

void dpanel_get_row(const uint32_t* blk, int64_t K, int64_t c, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t pc = k / DP_KC * DP_KC, kc = K - pc < DP_KC ? K - pc : DP_KC;
    const int64_t at = (pc / 2) * PANEL_ROWS + (c / DP_NR) * DP_NR * dp_pairs(kc) +
                       ((k - pc) / 2) * DP_NR + c % DP_NR;
    dst[k] = half::bf16_to_f32(reinterpret_cast<const uint16_t*>(blk + at)[k % 2]);
  }
}

// y (N) (+)= x (K bf16 bits, zero past K up to an even count) times the blocks at W.
void dpanel_gemv(int64_t N, int64_t K, const uint16_t* x, const uint32_t* W, float* y,
                 bool accumulate) {
  const int64_t bu = dpanel_block_u32(K);
  for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
    const uint32_t* blk = W + (jb / PANEL_ROWS) * bu;
    const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
    for (int64_t jr = 0; jr < nb; jr += 2 * DP_NR) {
      const int np = jr + DP_NR < nb ? 2 : 1;
      const int64_t w = nb - jr < 2 * DP_NR ? nb - jr : 2 * DP_NR;
      __m512 tot[2][DP_NV];
      for (int p = 0; p < 2; ++p)
        for (int j = 0; j < DP_NV; ++j) {
          const int64_t lo = p * DP_NR + j * 16;
          const __mmask16 m = lo >= w ? 0 : w - lo >= 16 ? 0xffff : __mmask16((1u << (w - lo)) - 1);
          tot[p][j] = accumulate ? _mm512_maskz_loadu_ps(m, y + jb + jr + lo) : _mm512_setzero_ps();
        }
      for (int64_t pc = 0; pc < K; pc += DP_KC) {
        const int64_t kc = K - pc < DP_KC ? K - pc : DP_KC, kp = dp_pairs(kc);
        const uint32_t* b0 = blk + (pc / 2) * PANEL_ROWS + jr * kp;
        const uint32_t* b1 = b0 + DP_NR * kp;
        __m512 acc[2][DP_NV];
        for (int p = 0; p < 2; ++p)
          for (int j = 0; j < DP_NV; ++j) acc[p][j] = _mm512_setzero_ps();
        for (int64_t q = 0; q < kp; ++q) {
          uint32_t pr;
          std::memcpy(&pr, x + pc + 2 * q, 4);
          const __m512bh ai = (__m512bh)_mm512_set1_epi32(int(pr));
          for (int j = 0; j < DP_NV; ++j) {
            acc[0][j] = _mm512_dpbf16_ps(
                acc[0][j], ai, (__m512bh)_mm512_loadu_si512(static_cast<const void*>(b0 + q * DP_NR + j * 16)));
            if (np == 2)
              acc[1][j] = _mm512_dpbf16_ps(
                  acc[1][j], ai, (__m512bh)_mm512_loadu_si512(static_cast<const void*>(b1 + q * DP_NR + j * 16)));
          }
        }
        const bool first = pc == 0 && !accumulate;
        for (int p = 0; p < 2; ++p)
          for (int j = 0; j < DP_NV; ++j)
            tot[p][j] = first ? acc[p][j] : _mm512_add_ps(tot[p][j], acc[p][j]);
      }
      for (int p = 0; p < np; ++p)
        for (int j = 0; j < DP_NV; ++j) {
          const int64_t lo = p * DP_NR + j * 16;
          if (lo >= w) continue;
          const __mmask16 m = w - lo >= 16 ? 0xffff : __mmask16((1u << (w - lo)) - 1);
          _mm512_mask_storeu_ps(y + jb + jr + lo, m, tot[p][j]);
        }
    }
  }
}

// X (M rows of K bf16 bits, ldx apart) packed once as dpanel_gemm packs each (k block, row
// block) of it (dp_pack_a_rows' layout), so a prefill projection's tasks share one copy instead
// of each repacking it (a task is 256 weight rows).
int64_t dpanel_packed_u32(int64_t M, int64_t K) { return dp_packed_a_elems(M, K); }
void dpanel_pack(int64_t M, int64_t K, const uint16_t* X, int64_t ldx, uint32_t* dst) {
  dp_pack_a_rows(M, K, 0, M, X, ldx, 1, dst);
}

// Y (M, ldy) (+)= X (M rows of K bf16 bits, ldx apart; or Xp, packed by dpanel_pack) times the
// first N rows of the blocks at W.
void dpanel_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* X, int64_t ldx,
                 const uint32_t* Xp, const uint32_t* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws) {
  if (M <= 0 || N <= 0) return;
  if (M == 1 && !Xp) return dpanel_gemv(N, K, X, W, Y, accumulate);
  const BF16* A = reinterpret_cast<const BF16*>(X);
  const int64_t bu = dpanel_block_u32(K), mp = (M + DP_MR - 1) / DP_MR * DP_MR;
  uint32_t* Ap = reinterpret_cast<uint32_t*>(align64(ws));
  float* tile = reinterpret_cast<float*>(align64(Ap + MC * (DP_KC / 2)));
  for (int64_t pc = 0; pc < K; pc += DP_KC) {
    const int64_t kc = K - pc < DP_KC ? K - pc : DP_KC, kp = dp_pairs(kc);
    const bool first = pc == 0 && !accumulate;  // as fpanel_gemm_t: block sums added in order
    for (int64_t ic = 0; ic < M; ic += MC) {
      const int64_t mc = M - ic < MC ? M - ic : MC;
      const uint32_t* Ak = Xp ? Xp + (pc / 2) * mp + ic * kp : Ap;
      if (!Xp) dp_pack_a(mc, kc, A + ic * ldx + pc, ldx, 1, Ap);
      for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
        const uint32_t* Bk = W + (jb / PANEL_ROWS) * bu + (pc / 2) * PANEL_ROWS;
        const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
        float* C = Y + ic * ldy + jb;
        for (int64_t jr = 0; jr < nb; jr += DP_NR) {
          const int64_t nr_ = nb - jr < DP_NR ? nb - jr : DP_NR;
          for (int64_t ir = 0; ir < mc; ir += DP_MR) {
            const int64_t mr_ = mc - ir < DP_MR ? mc - ir : DP_MR;
            const DpUkernelFn uk = dp_ukernels()[size_t(mr_ - 1)];
            float* c = C + ir * ldy + jr;
            const int pf = ir == 0 ? TILE_STREAM : 0;
            if (nr_ == DP_NR) {  // the block sum joins the cell in the kernel's epilogue
              uk(kp, Ak + ir * kp, Bk + jr * kp, c, ldy, (first ? TILE_SET : TILE_ADD) | pf);
              continue;
            }
            uk(kp, Ak + ir * kp, Bk + jr * kp, tile, DP_NR, TILE_SET | pf);
            for (int64_t i = 0; i < mr_; ++i)
              for (int64_t j = 0; j < nr_; ++j)
                c[i * ldy + j] = first ? tile[i * DP_NR + j] : c[i * ldy + j] + tile[i * DP_NR + j];
          }
        }
      }
    }
  }
}
#endif  // __AVX512BF16__

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// lossk's GEMMs, compiled once per instruction set (CMakeLists.txt): the packed, register-blocked
// float32 / float64 GEMM of gemm.hpp's micro-kernel, driven over cache blocks, with entries that
// pack B (or A) once for many products; the same GEMM with bfloat16 / float16 sources widened
// exactly as they are packed; and the half-precision conversions lossk stores with.
//
// Fuses: nothing across calls; each call packs its own A and B panels (zero-padded to MR x NR),
// so callers may hand it any strided view. Never allocates: scratch comes from the caller.
// Numerics: every output cell is ONE multiply-add chain over k in increasing order, started from
// 0 or continued from C (kernels.hpp): later k blocks continue the chain through C, so a cell's
// bits never depend on how K, M or N were split.
// Limits: dimensions must fit int64 products (the lossk ceilings guarantee it).
#include <cstdint>

#include "algenta/kernels.hpp"
#include "gemm.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

// Each entry of the table (tables.cpp) is instantiated after its definition.
template <class T>
int64_t gemm_ws_elems() {
  // packed A (MC x KC), packed B (KC x NC), one edge tile; padded for 64-byte alignment.
  const int64_t n = MC * KC + KC * NC<T>() + MR<T> * nr<T>() + 3 * 64;
#if defined(__AMX_BF16__)
  // the bf16 dot products take the same scratch (float32 tables only)
  if (sizeof(T) == 4 && amx_ws_u32() > n) return amx_ws_u32();
#endif
  return n;
}
ALGENTA_KERN_INSTANTIATE(gemm_ws_elems, float, double)

// B block (kc x nc) -> panels of NR columns: Bp[panel][k][c], zero columns past nc.
template <class T, class S>
void pack_b(int64_t kc, int64_t nc, const S* B, int64_t rsb, int64_t csb, T* Bp) {
  constexpr int64_t NR = nr<T>();
  for (int64_t j0 = 0; j0 < nc; j0 += NR) {
    const int64_t w = nc - j0 < NR ? nc - j0 : NR;
    T* dst = Bp + j0 * kc;
    if (csb == 1) {
      for (int64_t k = 0; k < kc; ++k) {
        const S* src = B + k * rsb + j0;
        T* d = dst + k * NR;
        int64_t c = 0;
        for (; c < w; ++c) d[c] = widen(src[c]);
        for (; c < NR; ++c) d[c] = T(0);
      }
    } else if (rsb == 1 && w == NR) {
      // k-contiguous columns (B = W^T): contiguous stores, NR sequential read streams.
      // 8-deep k blocks: each column's 8 k-values are one short contiguous read, and the 8
      // destination rows they land in stay in L1 while the block is written.
      const S* src = B + j0 * csb;
      int64_t k0 = 0;
      for (; k0 + 8 <= kc; k0 += 8)
          for (int64_t c = 0; c < NR; ++c) {
            const S* s = src + c * csb + k0;
            T* d = dst + k0 * NR + c;
            d[0 * NR] = widen(s[0]); d[1 * NR] = widen(s[1]); d[2 * NR] = widen(s[2]);
            d[3 * NR] = widen(s[3]); d[4 * NR] = widen(s[4]); d[5 * NR] = widen(s[5]);
            d[6 * NR] = widen(s[6]); d[7 * NR] = widen(s[7]);
          }
      for (int64_t k = k0; k < kc; ++k)
        for (int64_t c = 0; c < NR; ++c) dst[k * NR + c] = widen(src[c * csb + k]);
    } else {
      for (int64_t c = 0; c < w; ++c) {
        const S* src = B + (j0 + c) * csb;
        for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = widen(src[k * rsb]);
      }
      for (int64_t c = w; c < NR; ++c)
        for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = T(0);
    }
  }
}

// The micro-tiles of one (k block, row block, column block): C (mc x nc, row stride ldc) (+)=
// packed A rows Ak (mc x kc) times packed B panels Bk (kc x nc), continuing each cell's chain
// from C when load is set.
template <class T>
void gemm_tiles(int64_t mc, int64_t nc, int64_t kc, const T* Ak, const T* Bk, T* C, int64_t ldc,
                bool load, T* tile) {
  constexpr int64_t NR = nr<T>();
  for (int64_t jr = 0; jr < nc; jr += NR) {
    const int64_t nr_ = nc - jr < NR ? nc - jr : NR;
    for (int64_t ir = 0; ir < mc; ir += MR<T>) {
      const int64_t mr_ = mc - ir < MR<T> ? mc - ir : MR<T>;
      T* c = C + ir * ldc + jr;
      const UkernelFn<T> uk = ukernels<T>()[size_t(mr_ - 1)];
      if (nr_ == NR) {
        uk(kc, Ak + ir * kc, Bk + jr * kc, c, ldc, load ? TILE_CONTINUE : TILE_SET);
      } else {
        // Column edge: the same micro-kernel on a full-width tile copy (zero-padded B
        // columns), so edge cells take the same instruction sequence as interior ones.
        if (load)
          for (int64_t i = 0; i < mr_; ++i)
            for (int64_t j = 0; j < nr_; ++j) tile[i * NR + j] = c[i * ldc + j];
        uk(kc, Ak + ir * kc, Bk + jr * kc, tile, NR, load ? TILE_CONTINUE : TILE_SET);
        for (int64_t i = 0; i < mr_; ++i)
          for (int64_t j = 0; j < nr_; ++j) c[i * ldc + j] = tile[i * NR + j];
      }
    }
  }
}

// Shared driver. Bfull, when given, is B already packed by pack_b_full (N <= NC): the k block
// starting at pc lives at Bfull + pc * round_up(N, NR). Afull, when given, is a larger A packed
// by pack_a_rows with amp = round_up(its rows, MR<T>); this call's rows start at its row a0.
template <class T, class SA = T, class SB = T>
void gemm_core(int64_t M, int64_t N, int64_t K, const SA* A, int64_t rsa, int64_t csa,
               const SB* B, int64_t rsb, int64_t csb, const T* Afull, int64_t amp, int64_t a0,
               const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws) {
  constexpr int64_t NR = nr<T>();
  constexpr int64_t NCB = NC<T>();
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(0);
    return;
  }
  T* Ap = align64(ws);
  T* Bp = align64(Ap + MC * KC);
  T* tile = align64(Bp + KC * NCB);
  const int64_t npad = (N + NR - 1) / NR * NR;
  for (int64_t jc = 0; jc < N; jc += NCB) {
    const int64_t nc = N - jc < NCB ? N - jc : NCB;
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = K - pc < KC ? K - pc : KC;
      const bool load = accumulate || pc > 0;  // later k blocks continue the same chain
      const T* Bk;
      if (Bfull) {
        Bk = Bfull + pc * npad;
      } else {
        pack_b(kc, nc, B + pc * rsb + jc * csb, rsb, csb, Bp);
        Bk = Bp;
      }
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = M - ic < MC ? M - ic : MC;
        const T* Ak;
        if (Afull) {
          Ak = Afull + pc * amp + (a0 + ic) * kc;
        } else {
          pack_a(mc, kc, A + ic * rsa + pc * csa, rsa, csa, Ap);
          Ak = Ap;
        }
        gemm_tiles<T>(mc, nc, kc, Ak, Bk, C + ic * ldc + jc, ldc, load, tile);
      }
    }
  }
}

template <class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa, const T* B,
          int64_t rsb, int64_t csb, T* C, int64_t ldc, bool accumulate, T* ws) {
  gemm_core<T, T, T>(M, N, K, A, rsa, csa, B, rsb, csb, nullptr, 0, 0, nullptr, C, ldc,
                     accumulate, ws);
}
ALGENTA_KERN_INSTANTIATE(gemm, float, double)

// gemm with B's elements stored as halves (H: BF16 or F16), widened as B is packed.
template <class H>
void gemm_bh(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
             const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, bool accumulate,
             float* ws) {
  gemm_core<float, float, H>(M, N, K, A, rsa, csa, reinterpret_cast<const H*>(B), rsb, csb,
                             nullptr, 0, 0, nullptr, C, ldc, accumulate, ws);
}
ALGENTA_KERN_INSTANTIATE(gemm_bh, BF16, F16)

template <class T>
int64_t packed_b_elems(int64_t K, int64_t N) {
  return K * ((N + nr<T>() - 1) / nr<T>() * nr<T>()) + 16;
}
ALGENTA_KERN_INSTANTIATE(packed_b_elems, float, double)

template <class T>
int64_t packed_b_max_cols() {
  return NC<T>();
}
ALGENTA_KERN_INSTANTIATE(packed_b_max_cols, float, double)

template <class T, class S>
void pack_b_full(int64_t K, int64_t N, const S* B, int64_t rsb, int64_t csb, T* Bfull) {
  const int64_t npad = (N + nr<T>() - 1) / nr<T>() * nr<T>();
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    pack_b<T, S>(kc, N, B + pc * rsb, rsb, csb, Bfull + pc * npad);
  }
}
ALGENTA_KERN_INSTANTIATE(pack_b_full, float, double)

template <class H>
void pack_b_full_h(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                   float* Bfull) {
  pack_b_full<float, H>(K, N, reinterpret_cast<const H*>(B), rsb, csb, Bfull);
}
ALGENTA_KERN_INSTANTIATE(pack_b_full_h, BF16, F16)

template <class T>
void gemm_pb(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa,
             const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws) {
  gemm_core<T, T, T>(M, N, K, A, rsa, csa, nullptr, 0, 0, nullptr, 0, 0, Bfull, C, ldc, accumulate,
                     ws);
}
ALGENTA_KERN_INSTANTIATE(gemm_pb, float, double)

template <class H>
void pack_a_rows_h(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                   int64_t csa, float* Afull) {
  pack_a_rows<float, H>(M, K, r0, r1, reinterpret_cast<const H*>(A), rsa, csa, Afull);
}
ALGENTA_KERN_INSTANTIATE(pack_a_rows_h, BF16, F16)

template <class T>
void gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K, const T* Afull,
               const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws) {
  const int64_t mp = (Mfull + MR<T> - 1) / MR<T> * MR<T>;
  gemm_core<T, T, T>(M, N, K, nullptr, 0, 0, nullptr, 0, 0, Afull, mp, row0, Bfull, C, ldc,
                     accumulate,
               ws);
}
ALGENTA_KERN_INSTANTIATE(packed_a_elems, float, double)  // gemm.hpp
ALGENTA_KERN_INSTANTIATE(pack_a_rows, float, double)
ALGENTA_KERN_INSTANTIATE(gemm_papb, float, double)

template <class T>
int64_t row_quantum() {
  return MR<T>;
}
ALGENTA_KERN_INSTANTIATE(row_quantum, float, double)

// Half-precision storage: lossk narrows its bf16 / f16 outputs and widens its inputs here.
template <int KIND>
void narrow_h(const float* src, uint16_t* dst, int64_t n) {
  // One element at a time, front to back: dst may be src's own storage (in-place narrowing),
  // where element i's result lands on bytes already read.
  for (int64_t i = 0; i < n; ++i) {
    const float f = src[i];
    dst[i] = KIND == HALF_BF16 ? narrow_bf16(f) : narrow_f16(f);
  }
}

template <int KIND>
void widen_h(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    dst[i] = KIND == HALF_BF16 ? widen(BF16{src[i]}) : widen(F16{src[i]});
}

ALGENTA_KERN_INSTANTIATE(narrow_h, HALF_BF16, HALF_F16)
ALGENTA_KERN_INSTANTIATE(widen_h, HALF_BF16, HALF_F16)

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

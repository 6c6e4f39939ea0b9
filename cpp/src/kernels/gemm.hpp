// The packed, register-blocked GEMM's common parts, per instruction set: the register tile and
// cache blocking, A's packing (widening bfloat16 / float16 sources on the way), the packed B
// panel's vector load, and the micro-kernel with its tile modes. gemm.cpp drives them for lossk's
// float32 / float64 GEMMs; fpanels.cpp runs the same micro-kernel on the session's resident
// weight panels, so a panel cell takes the GEMM's own multiply-add sequence.
//
// Numerics: a micro-kernel cell is ONE multiply-add chain over its k block in increasing order,
// started from 0 or from C (TileMode); edge rows and columns run the same per-cell sequence on
// zero-padded panels, so a cell's bits never depend on where it sits in a tile. Blocking and
// prefetch distances are timing only: no result depends on them.
#pragma once
#include <array>
#include <cstdint>
#include <utility>

#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

// Register tile MR x (NV vectors): MR * NV accumulators plus NV B vectors and one broadcast
// must fit the register file (32 zmm on AVX-512, 16 ymm/xmm otherwise).
#if defined(__AVX512F__)
// float32 12 x 2 zmm, float64 6 x 4 zmm: 24 accumulators each, and 256-wide vocab blocks split
// into whole NR panels.
template <class T>
constexpr int MR = sizeof(T) == 8 ? 6 : 12;
template <class T>
constexpr int NV = sizeof(T) == 8 ? 4 : 2;
#else
template <class T>
constexpr int MR = 6;
template <class T>
constexpr int NV = 2;
#endif


// Blocking. KC: k-depth of one packed panel pair (an MR x KC A panel lives in L1 across the
// jr loop). MC x KC of A sits in L2, KC x NC of B in L2/L3. Tuned for Zen 2 / Skylake-class
// caches; correctness never depends on them.
constexpr int64_t KC = 256;
constexpr int64_t MC = 96;  // a multiple of every MR above
static_assert(MC % MR<float> == 0 && MC % MR<double> == 0, "MC must hold whole MR panels");
template <class T>
constexpr int64_t nr() {
  return NV<T> * lanes<T>();
}
template <class T>
constexpr int64_t NC() {
  return 64 * nr<T>();
}

// A block (mc x kc) -> panels of MR rows: Ap[panel][k][r], zero rows past mc. S is the source
// element type (T, or a half type widened here).
template <class T, class S>
void pack_a(int64_t mc, int64_t kc, const S* A, int64_t rsa, int64_t csa, T* Ap) {
  for (int64_t i0 = 0; i0 < mc; i0 += MR<T>) {
    const int64_t mr = mc - i0 < MR<T> ? mc - i0 : MR<T>;
    T* dst = Ap + i0 * kc;
    if (csa == 1 && mr == MR<T>) {
      // k-contiguous rows: walk k outside so the stores are contiguous and the MR<T> source rows
      // are read as parallel sequential streams (hot in L1 after the first touch of a line).
      const S* src = A + i0 * rsa;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < MR<T>; ++r) dst[k * MR<T> + r] = widen(src[r * rsa + k]);
    } else if (csa == 1) {
      for (int64_t r = 0; r < mr; ++r) {
        const S* src = A + (i0 + r) * rsa;
        for (int64_t k = 0; k < kc; ++k) dst[k * MR<T> + r] = widen(src[k]);
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        const S* src = A + i0 * rsa + k * csa;
        for (int64_t r = 0; r < mr; ++r) dst[k * MR<T> + r] = widen(src[r * rsa]);
      }
    }
    for (int64_t r = mr; r < MR<T>; ++r)
      for (int64_t k = 0; k < kc; ++k) dst[k * MR<T> + r] = T(0);
  }
}

// One vector of a packed B panel: T itself, or (the session's resident weight panels) halves
// widened exactly as they are loaded, so a half panel multiplies the values a float32 panel
// packed from the same bits would hold.
template <class VT, class T>
inline VT ldp(const T* p) {
  return loadu<VT>(p);
}
template <>
inline vf ldp<vf, F16>(const F16* p) {
  return ld_f16(reinterpret_cast<const uint16_t*>(p));
}
template <>
inline vf ldp<vf, BF16>(const BF16* p) {
  return ld_bf16(reinterpret_cast<const uint16_t*>(p));
}

// How a micro-kernel meets C. TILE_SET: its chain starts at 0 and is stored; TILE_CONTINUE: the
// chain continues from C (a GEMM's later k blocks); TILE_ADD: the chain starts at 0 and its sum is
// added to C, one float add per cell (a panel product's later k blocks, whose block sums join the
// cell in order as a decode step's do). Adding in the epilogue, not through a tile copy, saves the
// copy's loads and stores.
enum TileMode : int { TILE_SET = 0, TILE_CONTINUE = 1, TILE_ADD = 2 };
// Or'ed into a mode: the tile is the first to read its B panel, which comes from memory (a
// resident weight panel, not a packed copy), so the kernel asks for the lines B_AHEAD bytes past
// those it reads: the panels of a row block lie back to back, so the requests run on into the
// next panel. With few rows a panel's multiply-adds take about as long as its bytes take to
// arrive on one core, and the hardware prefetcher alone left the first tile waiting; asked for by
// every tile, not the first, the tiles on a widened copy already in cache ran slower
// (perf/RESULTS.md). Timing only: no result depends on it.
constexpr int TILE_STREAM = 4;
constexpr int64_t B_AHEAD = 4096;

// R x NR tile (R <= MR rows of an MR-row panel): C = (mode) + sum_k a[k][:] b[k][:], one chain
// per cell in k order. Every R runs the same per-cell multiply-add sequence, so a row's bits do
// not depend on how many rows share its tile; edge rows just skip the padded work.
// PB: the packed B's element type (T, or a half type widened by ldp).
template <class T, int R, class PB = T>
void ukernel_rows(int64_t kc, const T* __restrict a, const PB* __restrict b, T* c, int64_t ldc,
                  int mode) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  constexpr int NR = NV<T> * L;
  const bool stream = mode & TILE_STREAM;
  mode &= ~TILE_STREAM;
  VT acc[R][NV<T>];
  if (mode == TILE_CONTINUE) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV<T>; ++j) acc[i][j] = loadu<VT>(c + i * ldc + j * L);
  } else {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV<T>; ++j) acc[i][j] = VT{};
  }
  constexpr int LINES = NR * int(sizeof(PB)) >= 128 ? NR * int(sizeof(PB)) / 64 : 1;  // a k step's
  for (int64_t k = 0; k < kc; ++k) {
    VT bv[NV<T>];
    if (stream)
      for (int l = 0; l < LINES; ++l)
        __builtin_prefetch(reinterpret_cast<const char*>(b + k * NR) + B_AHEAD + 64 * l, 0, 3);
    for (int j = 0; j < NV<T>; ++j) bv[j] = ldp<VT>(b + k * NR + j * L);
    for (int i = 0; i < R; ++i) {
      const T ai = a[k * MR<T> + i];
      for (int j = 0; j < NV<T>; ++j) acc[i][j] += bv[j] * ai;
    }
  }
  if (mode == TILE_ADD)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV<T>; ++j) acc[i][j] = loadu<VT>(c + i * ldc + j * L) + acc[i][j];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV<T>; ++j) storeu(c + i * ldc + j * L, acc[i][j]);
}

template <class T, class PB = T>
using UkernelFn = void (*)(int64_t, const T*, const PB*, T*, int64_t, int);

template <class T, class PB, int... Rs>
constexpr std::array<UkernelFn<T, PB>, sizeof...(Rs)> ukernel_table(
    std::integer_sequence<int, Rs...>) {
  return {{&ukernel_rows<T, Rs + 1, PB>...}};
}

// ukernels<T>()[r - 1] computes r rows.
template <class T, class PB = T>
const std::array<UkernelFn<T, PB>, MR<T>>& ukernels() {
  static constexpr std::array<UkernelFn<T, PB>, MR<T>> table =
      ukernel_table<T, PB>(std::make_integer_sequence<int, MR<T>>{});
  return table;
}

template <class T>
int64_t packed_a_elems(int64_t M, int64_t K) {
  return K * ((M + MR<T> - 1) / MR<T> * MR<T>) + 16;
}

// Rows [r0, r1) of the full packed A (M x K): r0 a multiple of MR, so callers can pack disjoint
// row ranges in parallel.
template <class T, class S>
void pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const S* A, int64_t rsa,
                 int64_t csa, T* Afull) {
  const int64_t mp = (M + MR<T> - 1) / MR<T> * MR<T>;
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    pack_a<T, S>(r1 - r0, kc, A + r0 * rsa + pc * csa, rsa, csa, Afull + pc * mp + r0 * kc);
  }
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta

// Hot CPU kernels, compiled once per instruction set (see CMakeLists.txt): a packed,
// register-blocked GEMM micro-kernel (packing widens bfloat16 / float16 sources on the way), the
// bf16 dot-product GEMM of AVX512-BF16 builds (vdpbf16ps on pair-packed bf16 panels), and the
// vectorized exp and tanh behind the log-sum-exp, the soft cap and the softmax gradient.
// Written with GCC/Clang vector extensions so one source serves SSE2, AVX2/FMA and AVX-512;
// -ffp-contract (GCC's default) fuses the multiply-adds where FMA exists.
//
// Fuses: nothing across calls; each call packs its own A and B panels (zero-padded to MR x NR),
// so callers may hand it any strided view. Never allocates: scratch comes from the caller.
// Limits: dimensions must fit int64 products (the lossk ceilings guarantee it).
#include <array>
#include <cmath>
#include <type_traits>
#include <utility>
#include <cstring>
#include <limits>

#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "panels.hpp"
#include "simd_halves.hpp"

#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "x86_transpose.hpp"
#endif

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

// Register tile MR x (NV vectors): MR * NV accumulators plus NV B vectors and one broadcast
// must fit the register file (32 zmm on AVX-512, 16 ymm/xmm otherwise).
#if defined(__AVX512F__)
constexpr int VBYTES = 64;
// float32 12 x 2 zmm, float64 6 x 4 zmm (about 10% faster than 12 x 2 on Zen 4): 24
// accumulators each, and 256-wide vocab blocks split into whole NR panels.
template <class T>
constexpr int MR = sizeof(T) == 8 ? 6 : 12;
template <class T>
constexpr int NV = sizeof(T) == 8 ? 4 : 2;
#elif defined(__AVX2__)
constexpr int VBYTES = 32;
template <class T>
constexpr int MR = 6;
template <class T>
constexpr int NV = 2;
#else
constexpr int VBYTES = 16;
template <class T>
constexpr int MR = 6;
template <class T>
constexpr int NV = 2;
#endif

typedef float vf __attribute__((vector_size(VBYTES)));
typedef double vd __attribute__((vector_size(VBYTES)));
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef int64_t vi64 __attribute__((vector_size(VBYTES)));

template <class T>
struct V;
template <>
struct V<float> {
  typedef vf type;
  typedef vi32 itype;
};
template <>
struct V<double> {
  typedef vd type;
  typedef vi64 itype;
};

template <class T>
constexpr int lanes() {
  return VBYTES / int(sizeof(T));
}

template <class VT>
inline VT loadu(const void* p) {
  VT v;
  std::memcpy(&v, p, sizeof(VT));
  return v;
}
template <class VT>
inline void storeu(void* p, const VT& v) {
  std::memcpy(p, &v, sizeof(VT));
}

// Half-precision sources as packing sees them (layout-compatible with their uint16_t bits).
struct BF16 {
  uint16_t u;
};
struct F16 {
  uint16_t u;
};
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(BF16 x) { return half::bf16_to_f32(x.u); }
inline float widen(F16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.u);  // the same exact value as half::f16_to_f32, one instruction
#else
  return half::f16_to_f32(x.u);
#endif
}

// float32 -> half bits with the one definition of rounding (half.hpp).
inline uint16_t narrow_bf16(float f) { return half::f32_to_bf16(f); }
inline uint16_t narrow_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);  // == half::f32_to_f16 for every non-NaN
#else
  return half::f32_to_f16(f);
#endif
}

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

#if defined(__AMX_BF16__)
int64_t amx_ws_u32();  // kernels_amx.cpp: the tile GEMMs' scratch, in 4-byte elements
#endif

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

template <class T>
inline T* align64(T* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>((u + 63) & ~uintptr_t(63));
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

// One vector of a packed B panel: T itself, or (the session's resident weight panels) halves
// widened exactly as they are loaded, so a half panel multiplies the values a float32 panel
// packed from the same bits would hold.
template <class VT, class T>
inline VT ldp(const T* p) {
  return loadu<VT>(p);
}
template <>
inline vf ldp<vf, F16>(const F16* p) {
  return halves::ld_f16(reinterpret_cast<const uint16_t*>(p));
}
template <>
inline vf ldp<vf, BF16>(const BF16* p) {
  return halves::ld_bf16(reinterpret_cast<const uint16_t*>(p));
}

// How a micro-kernel meets C. TILE_SET: its chain starts at 0 and is stored; TILE_CONTINUE: the
// chain continues from C (a GEMM's later k blocks); TILE_ADD: the chain starts at 0 and its sum is
// added to C, one float add per cell (a panel product's later k blocks, whose block sums join the
// cell in order as a decode step's do). Adding in the epilogue, not through a tile copy, saves the
// copy's loads and stores, 4-5% of a 128-token f32 or bf16 prefill's profile on Zen 4.
enum TileMode : int { TILE_SET = 0, TILE_CONTINUE = 1, TILE_ADD = 2 };
// Or'ed into a mode: the tile is the first to read its B panel, which comes from memory (a
// resident weight panel, not a packed copy), so the kernel asks for the lines B_AHEAD bytes past
// those it reads: the panels of a row block lie back to back, so the requests run on into the
// next panel. With few rows a panel's multiply-adds take about as long as its bytes take to
// arrive on one core, and the hardware prefetcher alone left the first tile waiting: Zen 4, one
// thread, the Qwen3-0.6B shape, best of three alternated rounds, a 16-token prefill f32 191 ->
// 184 ms, bf16 104 -> 97, f16 184 -> 171; at 128 tokens, where more tiles share each panel,
// within the noise (-1 to +2%). Asked for by every tile, not the first, the f16 prefill's tiles
// on a widened copy already in cache ran 2-3% slower. Timing only: no result depends on it.
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

// gemm with B's elements stored as halves (H: BF16 or F16), widened as B is packed.
template <class H>
void gemm_bh(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
             const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, bool accumulate,
             float* ws) {
  gemm_core<float, float, H>(M, N, K, A, rsa, csa, reinterpret_cast<const H*>(B), rsb, csb,
                             nullptr, 0, 0, nullptr, C, ldc, accumulate, ws);
}

template <class T>
int64_t packed_b_elems(int64_t K, int64_t N) {
  return K * ((N + nr<T>() - 1) / nr<T>() * nr<T>()) + 16;
}

template <class T>
int64_t packed_b_max_cols() {
  return NC<T>();
}

template <class T, class S = T>
void pack_b_full(int64_t K, int64_t N, const S* B, int64_t rsb, int64_t csb, T* Bfull) {
  const int64_t npad = (N + nr<T>() - 1) / nr<T>() * nr<T>();
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    pack_b<T, S>(kc, N, B + pc * rsb, rsb, csb, Bfull + pc * npad);
  }
}

template <class H>
void pack_b_full_h(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                   float* Bfull) {
  pack_b_full<float, H>(K, N, reinterpret_cast<const H*>(B), rsb, csb, Bfull);
}

template <class T>
void gemm_pb(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa,
             const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws) {
  gemm_core<T, T, T>(M, N, K, A, rsa, csa, nullptr, 0, 0, nullptr, 0, 0, Bfull, C, ldc, accumulate,
                     ws);
}

template <class T>
int64_t packed_a_elems(int64_t M, int64_t K) {
  return K * ((M + MR<T> - 1) / MR<T> * MR<T>) + 16;
}

// Rows [r0, r1) of the full packed A (M x K): r0 a multiple of MR, so callers can pack disjoint
// row ranges in parallel.
template <class T, class S = T>
void pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const S* A, int64_t rsa,
                 int64_t csa, T* Afull) {
  const int64_t mp = (M + MR<T> - 1) / MR<T> * MR<T>;
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    pack_a<T, S>(r1 - r0, kc, A + r0 * rsa + pc * csa, rsa, csa, Afull + pc * mp + r0 * kc);
  }
}

template <class H>
void pack_a_rows_h(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                   int64_t csa, float* Afull) {
  pack_a_rows<float, H>(M, K, r0, r1, reinterpret_cast<const H*>(A), rsa, csa, Afull);
}

template <class T>
void gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K, const T* Afull,
               const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws) {
  const int64_t mp = (Mfull + MR<T> - 1) / MR<T> * MR<T>;
  gemm_core<T, T, T>(M, N, K, nullptr, 0, 0, nullptr, 0, 0, Afull, mp, row0, Bfull, C, ldc,
                     accumulate,
               ws);
}

template <class T>
int64_t row_quantum() {
  return MR<T>;
}

// ---- the resident session's weight panels (float32 and halves) -------------------------------
// A session weight matrix (N rows of K) is resident as blocks of PANEL_ROWS rows, each held the
// way pack_b_full holds B = the block's rows transposed (K x PANEL_ROWS): k blocks of KC, each
// NR-column panel's kc rows contiguous. Prefill multiplies such blocks with the GEMM's own
// micro-kernel and never packs a weight; a decode step multiplies them in fpanel_gemv, which runs
// the micro-kernel's sequence for one row without packing x. Each output cell sums each k block
// (KC values) in its own multiply-add chain from 0 (acc += b[k] * x[k], k increasing) and adds
// the block sums in order to the cell (y + s0 + s1 + ... when accumulating, s0 + s1 + ...
// otherwise): blocked summation, whose rounding error grows with KC + K / KC terms instead of K
// (one chain over all of K put the f32 engine 7x further from transformers at d_ff 3072). So each
// cell has one sequence for any number of activation rows: a prompt's logits are the same
// whether it is prefilled at once, in pieces or stepped. Half panels (bf16, f16 bits, same
// layout) are widened exactly as they are loaded.
template <class PB>
struct PanelOf;
template <>
struct PanelOf<float> {
  static constexpr int kind = PANEL_F32;
};
template <>
struct PanelOf<BF16> {
  static constexpr int kind = PANEL_BF16;
};
template <>
struct PanelOf<F16> {
  static constexpr int kind = PANEL_F16;
};

int64_t fpanel_block_elems(int64_t K) { return K * PANEL_ROWS; }

// Element (k, c) of a block: pack_b's panel layout with npad = PANEL_ROWS.
inline int64_t fpanel_at(int64_t K, int64_t k, int64_t c) {
  constexpr int64_t NR = nr<float>();
  static_assert(PANEL_ROWS % NR == 0, "a block holds whole panels");
  const int64_t pc = k / KC * KC, kc = K - pc < KC ? K - pc : KC;
  return pc * PANEL_ROWS + (c / NR) * NR * kc + (k - pc) * NR + c % NR;
}

template <class PB>
void fpanel_put_row_t(PB* blk, int64_t K, int64_t c, const PB* row) {
  for (int64_t k = 0; k < K; ++k) blk[fpanel_at(K, k, c)] = row[k];
}

void fpanel_put_row(int kind, void* blk, int64_t K, int64_t c, const void* row) {
  if (kind == PANEL_F32)
    fpanel_put_row_t(static_cast<float*>(blk), K, c, static_cast<const float*>(row));
  else
    fpanel_put_row_t(static_cast<uint16_t*>(blk), K, c, static_cast<const uint16_t*>(row));
}

void fpanel_get_row(int kind, const void* blk, int64_t K, int64_t c, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t at = fpanel_at(K, k, c);
    if (kind == PANEL_F32)
      dst[k] = static_cast<const float*>(blk)[at];
    else if (kind == PANEL_BF16)
      dst[k] = widen(static_cast<const BF16*>(blk)[at]);
    else
      dst[k] = widen(static_cast<const F16*>(blk)[at]);
  }
}

// The micro-tiles of one (k block, row block, panel block): each tile's k-block sums formed from
// 0, then C = first ? sums : C + sums, in the micro-kernel's epilogue for whole tiles and through
// `tile` at a column edge. stream: Bk is read from memory (TILE_STREAM on each panel's first tile).
template <class PB>
void fpanel_tiles(int64_t mc, int64_t nb, int64_t kc, const float* Ap, const PB* Bk, float* C,
                  int64_t ldc, bool first, float* tile, bool stream) {
  constexpr int64_t NR = nr<float>();
  for (int64_t jr = 0; jr < nb; jr += NR) {
    const int64_t nr_ = nb - jr < NR ? nb - jr : NR;
    for (int64_t ir = 0; ir < mc; ir += MR<float>) {
      const int64_t mr_ = mc - ir < MR<float> ? mc - ir : MR<float>;
      const UkernelFn<float, PB> uk = ukernels<float, PB>()[size_t(mr_ - 1)];
      float* c = C + ir * ldc + jr;
      const int pf = stream && ir == 0 ? TILE_STREAM : 0;
      if (nr_ == NR) {
        uk(kc, Ap + ir * kc, Bk + jr * kc, c, ldc, (first ? TILE_SET : TILE_ADD) | pf);
        continue;
      }
      uk(kc, Ap + ir * kc, Bk + jr * kc, tile, NR, TILE_SET | pf);
      for (int64_t i = 0; i < mr_; ++i)
        for (int64_t j = 0; j < nr_; ++j)
          c[i * ldc + j] = first ? tile[i * NR + j] : c[i * ldc + j] + tile[i * NR + j];
    }
  }
}

// Y (M, ldy) (+)= X (M, K; rows ldx apart) times the first N rows of the blocks at W: gemm_core's
// loop over already packed B blocks, A packed once per (k block, row block) for all of them.
// Xp: X already packed by fpanel_pack (pack_a_rows' layout), or null to pack here.
template <class PB>
void fpanel_gemm_t(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx,
                   const float* Xp, const PB* W, float* Y, int64_t ldy, bool accumulate,
                   float* ws) {
  float* Ap = align64(ws);
  float* tile = align64(Ap + MC * KC);
  float* wide = align64(tile + MR<float> * nr<float>());
  const int64_t mp = (M + MR<float> - 1) / MR<float> * MR<float>;
  constexpr bool half = !std::is_same<PB, float>::value;
  // Three or more micro-tile rows will read a half block: widen it once (exact, the values ldp
  // gives) and run the float32 kernel on it: the same multiply-adds, without a conversion per
  // load (8% of a 512-token f16 prefill on Zen 4). For one or two rows of tiles (a batched
  // decode step) the widened copy, twice the bytes and past L1, costs more than the conversions:
  // a 16-row f16 step 12% faster without it. With X packed whole, every row block of a k block
  // takes the same widened copy (jb outside ic), so a half block is widened once, not once per
  // MC rows (widening was 8% of a 128-token f16 prefill's profile on Zen 4; with the epilogue
  // above, its 128- and 512-token prefill on one thread 2-4% faster).
  if (half && Xp && M > 2 * MR<float>) {
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = K - pc < KC ? K - pc : KC;
      const bool first = pc == 0 && !accumulate;
      for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
        const PB* Bk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS + pc * PANEL_ROWS;
        const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
        for (int64_t i = 0; i < kc * PANEL_ROWS; i += lanes<float>())
          storeu(wide + i, ldp<vf>(Bk + i));
        for (int64_t ic = 0; ic < M; ic += MC) {
          const int64_t mc = M - ic < MC ? M - ic : MC;
          fpanel_tiles<float>(mc, nb, kc, Xp + pc * mp + ic * kc, wide, Y + ic * ldy + jb, ldy,
                              first, tile, false);
        }
      }
    }
    return;
  }
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    const bool first = pc == 0 && !accumulate;  // the cell takes its first block's sum as is
    for (int64_t ic = 0; ic < M; ic += MC) {
      const int64_t mc = M - ic < MC ? M - ic : MC;
      const float* Ak = Xp ? Xp + pc * mp + ic * kc : Ap;
      if (!Xp) pack_a<float, float>(mc, kc, X + ic * ldx + pc, ldx, 1, Ap);
      for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
        const PB* Bk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS + pc * PANEL_ROWS;
        const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
        if (half && mc > 2 * MR<float>) {
          for (int64_t i = 0; i < kc * PANEL_ROWS; i += lanes<float>())
            storeu(wide + i, ldp<vf>(Bk + i));
          fpanel_tiles<float>(mc, nb, kc, Ak, wide, Y + ic * ldy + jb, ldy, first, tile, false);
        } else {
          fpanel_tiles<PB>(mc, nb, kc, Ak, Bk, Y + ic * ldy + jb, ldy, first, tile, true);
        }
      }
    }
  }
}

// y (N) (+)= x (K) times the first N rows of the blocks at W: fpanel_tiles' sequence for one row
// (ukernel_rows<float, 1>'s chain per k block, the block sums added in order). A k block's chain
// starts from 0 whichever block precedes it, so several blocks' chains run side by side and their
// sums join the cell in order afterwards: the same bits for any GEMV_PANELS x GEMV_KBLOCKS.
// What the pass shape buys is memory-level parallelism: each k block of a panel is its own
// stream (blocks lie KC * PANEL_ROWS values apart), and one core keeps more lines in flight over
// several streams than over one. Zen 3 (AVX2), one thread, a 537 MB bf16 matrix: 2 panels x 2
// blocks 21.6-22.5 GB/s, 1 panel x 4 blocks 24.8-26.0 (f16 +12%, f32 +6%); a one-thread decode
// step of the Qwen3-0.6B shape, medians: bf16 62-70 -> 59-64 ms, f16 62-69 -> 58-62 (two threads
// and f32 within the VM's noise). Zen 4 (AVX-512), the shapes alternated step by step in one
// process (bits checked equal), medians of 32-48 steps at the same shape: one thread f16 52.8 ->
// 49.6 ms and f32 93.0-100.4 -> 89.9-91.1 ms from 2 x 2 to 1 x 4 (2 x 4 as 1 x 4 in f16,
// 9-14% slower in f32; 1 x 2 8% slower than 2 x 2); two threads f16 39.5-40.4 -> 38.8-39.8 ms.
// The SSE2 build keeps 2 x 2 (not timed).
constexpr int GEMV_PANELS = VBYTES >= 32 ? 1 : 2;
constexpr int GEMV_KBLOCKS = VBYTES >= 32 ? 4 : 2;

// One pass: P panels from column jr of a row block times NB k blocks from pc into tot. Only the
// matrix's last k block may be short, so blocks 0..NB-2 of a pass hold KC values.
template <class PB, int P, int NB>
inline void fpanel_gemv_pass(const PB* blk, int64_t K, int64_t pc, int64_t jr, const float* x,
                             vf (&tot)[GEMV_PANELS][NV<float>], bool first) {
  constexpr int L = lanes<float>();
  constexpr int64_t NR = nr<float>();
  constexpr int NVF = NV<float>;
  const int64_t klast = pc + (NB - 1) * KC;
  const int64_t kcl = K - klast < KC ? K - klast : KC;  // the last block's length
  const PB* b[NB];
  const float* xk[NB];
  for (int h = 0; h < NB; ++h) {
    const int64_t kh = pc + h * KC, kc = h == NB - 1 ? kcl : KC;
    b[h] = blk + kh * PANEL_ROWS + jr * kc;  // panel p at + p * NR * kc
    xk[h] = x + kh;
  }
  vf acc[NB][P][NVF];
  for (int h = 0; h < NB; ++h)
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < NVF; ++j) acc[h][p][j] = vf{};
  int64_t k = 0;
  for (; k < kcl; ++k)
    for (int h = 0; h < NB; ++h) {
      const float xv = xk[h][k];
      const int64_t kc = h == NB - 1 ? kcl : KC;
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < NVF; ++j)
          acc[h][p][j] += ldp<vf>(b[h] + p * NR * kc + k * NR + j * L) * xv;
    }
  for (; k < KC; ++k)  // the full blocks past a short last one
    for (int h = 0; h < NB - 1; ++h) {
      const float xv = xk[h][k];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < NVF; ++j)
          acc[h][p][j] += ldp<vf>(b[h] + p * NR * KC + k * NR + j * L) * xv;
    }
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < NVF; ++j) {
      tot[p][j] = first ? acc[0][p][j] : tot[p][j] + acc[0][p][j];
      for (int h = 1; h < NB; ++h) tot[p][j] = tot[p][j] + acc[h][p][j];
    }
}

template <class PB, int P>
void fpanel_gemv_col(const PB* blk, int64_t K, int64_t jr, const float* x,
                     vf (&tot)[GEMV_PANELS][NV<float>], bool accumulate) {
  static_assert(GEMV_KBLOCKS >= 1 && GEMV_KBLOCKS <= 4, "passes of 1 to 4 k blocks");
  for (int64_t pc = 0; pc < K; pc += GEMV_KBLOCKS * KC) {
    const int64_t left = (K - pc + KC - 1) / KC;
    const bool first = pc == 0 && !accumulate;
    switch (left < GEMV_KBLOCKS ? left : GEMV_KBLOCKS) {
      case 4: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 4 ? 1 : 4>(blk, K, pc, jr, x, tot, first); break;
      case 3: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 3 ? 1 : 3>(blk, K, pc, jr, x, tot, first); break;
      case 2: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 2 ? 1 : 2>(blk, K, pc, jr, x, tot, first); break;
      default: fpanel_gemv_pass<PB, P, 1>(blk, K, pc, jr, x, tot, first); break;
    }
  }
}

template <class PB>
void fpanel_gemv_t(int64_t N, int64_t K, const float* x, const PB* W, float* y, bool accumulate) {
  constexpr int L = lanes<float>();
  constexpr int64_t NR = nr<float>();
  constexpr int NVF = NV<float>;
  constexpr int64_t CW = GEMV_PANELS * NR;  // columns a pass
  static_assert(GEMV_PANELS == 1 || GEMV_PANELS == 2, "passes of one or two panels");
  static_assert(PANEL_ROWS % CW == 0, "a row block holds whole passes");
  for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
    const PB* blk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS;
    const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
    for (int64_t jr = 0; jr < nb; jr += CW) {
      const int64_t w = nb - jr < CW ? nb - jr : CW;
      const int np = int((w + NR - 1) / NR);  // panels this pass
      vf tot[GEMV_PANELS][NVF];
      float edge[CW];
      for (int64_t i = 0; i < CW; ++i) edge[i] = accumulate && i < w ? y[jb + jr + i] : 0.f;
      for (int p = 0; p < GEMV_PANELS; ++p)
        for (int j = 0; j < NVF; ++j) tot[p][j] = loadu<vf>(edge + p * NR + j * L);
      if (GEMV_PANELS > 1 && np == 2)
        fpanel_gemv_col<PB, GEMV_PANELS < 2 ? 1 : 2>(blk, K, jr, x, tot, accumulate);
      else
        fpanel_gemv_col<PB, 1>(blk, K, jr, x, tot, accumulate);
      for (int p = 0; p < np; ++p)
        for (int j = 0; j < NVF; ++j) storeu(edge + p * NR + j * L, tot[p][j]);
      for (int64_t i = 0; i < w; ++i) y[jb + jr + i] = edge[i];
    }
  }
}

void fpanel_gemm(int kind, int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx,
                 const float* Xp, const void* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws) {
  if (M <= 0 || N <= 0) return;
  if (M == 1) {  // the same cells' chains, without packing the row
    if (kind == PANEL_F32)
      return fpanel_gemv_t(N, K, X, static_cast<const float*>(W), Y, accumulate);
    if (kind == PANEL_BF16)
      return fpanel_gemv_t(N, K, X, static_cast<const BF16*>(W), Y, accumulate);
    return fpanel_gemv_t(N, K, X, static_cast<const F16*>(W), Y, accumulate);
  }
  if (kind == PANEL_F32)
    return fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const float*>(W), Y, ldy, accumulate,
                         ws);
  if (kind == PANEL_BF16)
    return fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const BF16*>(W), Y, ldy, accumulate,
                         ws);
  fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const F16*>(W), Y, ldy, accumulate, ws);
}

// X (M x K) packed once as fpanel_gemm_t packs each (k block, row block) of it: a prefill
// projection's tasks then share one copy (each packing its own cost 5% of a 512-token f32
// prefill on Zen 3: a copy of X per 256 weight rows).
int64_t fpanel_packed_elems(int64_t M, int64_t K) { return packed_a_elems<float>(M, K); }
void fpanel_pack(int64_t M, int64_t K, const float* X, int64_t ldx, float* dst) {
  pack_a_rows<float, float>(M, K, 0, M, X, ldx, 1, dst);
}

// packed A (MC x KC), one edge tile and a widened half block, 64-byte aligned: the blocks are B,
// already packed
int64_t fpanel_ws_elems() {
  return MC * KC + MR<float> * nr<float>() + KC * PANEL_ROWS + 4 * 64;
}

#if defined(__AMX_BF16__)
// The amx instruction set multiplies lossk's bf16 on tiles (kernels_amx.cpp); the vdpbf16ps
// kernels below serve its session's weight panels (see dpanel_gemm).
int64_t amx_packed_a_elems(int64_t M, int64_t K);
void amx_pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                     int64_t csa, uint32_t* Afull);
int64_t amx_packed_b_elems(int64_t K, int64_t N);
int64_t amx_packed_b_max_cols();
void amx_pack_b_full(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                     uint32_t* Bfull);
void amx_gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K,
                   const uint32_t* Afull, const uint32_t* Bfull, float* C, int64_t ldc,
                   bool accumulate, float* ws);
void amx_gemm_bb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                 const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc,
                 bool accumulate, float* ws);
void amx_gemm_bpb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                  const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate, float* ws);
int64_t amx_row_quantum();
#endif

#if defined(__AVX512BF16__)
// ---- bfloat16 dot products (AVX512-BF16: vdpbf16ps) --------------------------------------------
// Operands are packed as k-pairs: one uint32 holds the bf16 values of k = 2p (low half) and
// 2p + 1 (high half), the unit vdpbf16ps multiplies: per float32 lane, acc += a[2p] b[2p] +
// a[2p+1] b[2p+1], the products exact (8-bit significands), the sum in float32. Pairs always
// start at k = 0 of the whole product (K blocks hold DP_KC values, an even count), so a cell's
// chain, and with it its bits, never depends on where the caller split K; an odd K pads its last
// pair with a zero. Every operand is bf16: the caller rounds float32 d_logits to bf16 first (with
// the one rounding both backends use, half::f32_to_bf16). The instruction treats subnormal
// inputs and results as zero (below 1.2e-38, far under anything a loss or its gradient carries).
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
// the float32 panels above. Also on amx hosts: a
// decode step cannot reproduce a tile's internal order, so the session's bf16 stays on vdpbf16ps
// there and lossk alone takes the tiles.
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
// block) of it (dp_pack_a_rows' layout), so a prefill projection's tasks share one copy:
// repacking in every task of 256 weight rows was 5% of a 128-token bf16 prefill's profile on
// Zen 4 (with the epilogue above, its 16- to 512-token prefill on one thread 5-6% faster).
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

#if defined(__AMX_BF16__)
constexpr Bf16DotOps kBf16Dot = {amx_packed_a_elems, amx_pack_a_rows, amx_packed_b_elems,
                                 amx_packed_b_max_cols, amx_pack_b_full, amx_gemm_papb,
                                 amx_gemm_bb, amx_gemm_bpb, amx_row_quantum, 32, "amx"};
#elif defined(__AVX512BF16__)
constexpr Bf16DotOps kBf16Dot = {dp_packed_a_elems, dp_pack_a_rows, dp_packed_b_elems,
                                 dp_packed_b_max_cols, dp_pack_b_full, dp_gemm_papb,
                                 dp_gemm_bb, dp_gemm_bpb, dp_row_quantum, 2, "vdpbf16ps"};
#else
constexpr Bf16DotOps kBf16Dot = {};  // this instruction set has no bf16 dot product
#endif

// ---- vectorized exp ------------------------------------------------------------------------
// exp(x) = 2^n * p(r), n = round(x / ln2), r = x - n*ln2 (two-constant Cody-Waite split, so r is
// exact to well below an ulp), p a Taylor polynomial: degree 13 for double (truncation < 1e-17
// on |r| <= ln2/2), degree 7 for float (< 6e-9). exp(0) is exactly 1. Arguments below the
// smallest normal result flush to 0; callers only pass x <= 0 (logit minus a max or an lse).
inline vd vexp(vd x) {
  const vd shifter = vd{} + 0x1.8p52;
  const vd t = x * 1.4426950408889634 + shifter;
  const vd n = t - shifter;
  vd r = x - n * 0.693147180559890330187;  // ln2 hi: 41 significant bits, so n * hi is exact
  r = r - n * 5.4979230187083711552e-14;   // ln2 lo
  vd p = vd{} + 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  vi64 tb, sb;
  std::memcpy(&tb, &t, sizeof tb);
  std::memcpy(&sb, &shifter, sizeof sb);
  const vi64 e = ((tb - sb) + 1023) << 52;
  vd scale;
  std::memcpy(&scale, &e, sizeof scale);
  vd y = p * scale;
  const vi64 tiny = x < -708.0;  // lane mask: all ones where true
  vi64 yb;
  std::memcpy(&yb, &y, sizeof yb);
  yb = yb & ~tiny;
  std::memcpy(&y, &yb, sizeof y);
  return y;
}

inline vf vexp(vf x) {
  const vf shifter = vf{} + 0x1.8p23f;
  const vf t = x * 1.44269504f + shifter;
  const vf n = t - shifter;
  vf r = x - n * 0.693145751953125f;  // ln2 hi: 14 significant bits, n * hi exact
  r = r - n * 1.428606765330187045e-06f;  // ln2 lo
  vf p = vf{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi32 tb, sb;
  std::memcpy(&tb, &t, sizeof tb);
  std::memcpy(&sb, &shifter, sizeof sb);
  const vi32 e = ((tb - sb) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  vf y = p * scale;
  const vi32 tiny = x < -87.0f;
  vi32 yb;
  std::memcpy(&yb, &y, sizeof yb);
  yb = yb & ~tiny;
  std::memcpy(&y, &yb, sizeof y);
  return y;
}

// exp of a scalar through the vector routine, so tails and bodies round identically.
template <class T>
inline T sexp(T x) {
  typedef typename V<T>::type VT;
  VT v = VT{} + x;
  return vexp(v)[0];
}

// ---- vectorized tanh (the soft cap) ------------------------------------------------------------
// |x| < 0.625: x + x z P(z), z = x^2 (Cephes' tanhf polynomial for float; its rational P(z)/Q(z)
// for double), where 1 - e below would cancel; else (1 - e) / (1 + e) with e = exp(-2|x|) <=
// exp(-1.25), no cancellation, and e flushing to 0 far out gives exactly +-1. Both branches are
// computed and selected per lane. About 2 ulp in either precision.
template <class VT, class IT>
inline VT vselect(IT mask, VT a, VT b) {
  IT ia, ib;
  std::memcpy(&ia, &a, sizeof ia);
  std::memcpy(&ib, &b, sizeof ib);
  const IT r = (ia & mask) | (ib & ~mask);
  VT out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

inline vf vtanh(vf x) {
  const vf ax = vselect<vf, vi32>(x < 0.0f, -x, x);
  const vf z = x * x;
  vf p = vf{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vf small = x + x * z * p;
  const vf e = vexp(-2.0f * ax);
  vf big = (1.0f - e) / (1.0f + e);
  big = vselect<vf, vi32>(x < 0.0f, -big, big);
  return vselect<vf, vi32>(ax < 0.625f, small, big);
}

inline vd vtanh(vd x) {
  const vd ax = vselect<vd, vi64>(x < 0.0, -x, x);
  const vd z = x * x;
  vd p = vd{} - 9.64399179425052238628e-1;
  p = p * z - 9.92877231001918586564e1;
  p = p * z - 1.61468768441708447952e3;
  vd q = z + 1.12811678491632931402e2;
  q = q * z + 2.23548839060100448583e3;
  q = q * z + 4.84406305325125486048e3;
  const vd small = x + x * (z * p / q);
  const vd e = vexp(-2.0 * ax);
  vd big = (1.0 - e) / (1.0 + e);
  big = vselect<vd, vi64>(x < 0.0, -big, big);
  return vselect<vd, vi64>(ax < 0.625, small, big);
}

template <class T>
inline T stanh(T x) {
  typedef typename V<T>::type VT;
  VT v = VT{} + x;
  return vtanh(v)[0];
}

template <class T>
BlockStats block_stats(const T* z, int64_t n, const T* w, bool entropy) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  BlockStats s{-std::numeric_limits<double>::infinity(), 0.0, 0.0, 0.0};
  if (n <= 0) return s;
  // m = the first z[v] (in index order) equal to the block's largest value, NaNs other than a
  // leading one ignored: what `m = z[v] > m ? z[v] : m` over v gives, which as a scalar chain
  // was a third of the forward's time. Lanes keep their own first strict maximum; only the sign
  // of a zero maximum depends on which lane saw it first, so that case scans for it.
  T m = z[0];
  if (m == m) {
    int64_t v = 0;
    if (n >= L) {
      VT mv = m - VT{};  // every lane z[0] (not NaN): a NaN lane would never compare again
      for (; v + L <= n; v += L) {
        const VT x = loadu<VT>(z + v);
        mv = x > mv ? x : mv;
      }
      for (int l = 0; l < L; ++l) m = mv[l] > m ? mv[l] : m;
    }
    for (; v < n; ++v) m = z[v] > m ? z[v] : m;
    if (m == T(0))
      for (v = 0; v < n; ++v)
        if (z[v] == m) {
          m = z[v];
          break;
        }
  }
  // Lane-wise double accumulators, folded in lane order at the end: a fixed order for a
  // given n, independent of where the block sits in the vocabulary.
  double se[L], sz[L], sd[L];
  for (int l = 0; l < L; ++l) se[l] = sz[l] = sd[l] = 0.0;
  const double md = double(m);
  int64_t v = 0;
  for (; v + L <= n; v += L) {
    VT x = loadu<VT>(z + v);
    VT e = vexp(x - m);
    for (int l = 0; l < L; ++l) se[l] += double(e[l]);
    // max - z in double: exact for float32 logits; each term >= 0
    if (entropy)
      for (int l = 0; l < L; ++l) sd[l] += double(e[l]) * (md - double(x[l]));
    if (w) {
      const VT wv = loadu<VT>(w + v);
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]) * double(wv[l]);
    } else {
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]);
    }
  }
  for (int l = 0; v < n; ++v, ++l) {
    const double e = double(sexp<T>(z[v] - m));
    se[l] += e;
    sz[l] += w ? double(z[v]) * double(w[v]) : double(z[v]);
    if (entropy) sd[l] += e * (md - double(z[v]));
  }
  double a = 0.0, b = 0.0, d = 0.0;
  for (int l = 0; l < L; ++l) {
    a += se[l];
    b += sz[l];
    d += sd[l];
  }
  s.max = md;
  s.sumexp = a;
  s.sumz = b;
  s.sument = d;
  return s;
}

template <class T>
void logit_epilogue(T* z, int64_t n, const T* bias, double cap, double temperature) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  if (bias)
    for (int64_t v = 0; v < n; ++v) z[v] += bias[v];
  int64_t v = 0;
  if (!(cap > 0.0)) {
    if (temperature == 1.0) return;
    // A true division, as PyTorch's `logits / T` rounds (lossk_math.hpp, tempered_cap).
    const T tt = T(temperature);
    for (; v + L <= n; v += L) storeu(z + v, loadu<VT>(z + v) / tt);
    for (; v < n; ++v) z[v] = z[v] / tt;
    return;
  }
  // z / cap as z * (1 / cap): one rounding fewer per element than a division, and the same
  // spelling everywhere, so every chunk and thread count caps a logit to the same bits. The
  // amplitude is cap / T (exactly cap at T = 1).
  const T c = T(cap / temperature), ic = T(1.0 / cap);
  for (; v + L <= n; v += L) storeu(z + v, vtanh(loadu<VT>(z + v) * ic) * c);
  for (; v < n; ++v) z[v] = stanh<T>(z[v] * ic) * c;
}

template <class T>
void softmax_grad(T* z, int64_t n, double lse, double a, double b, const T* w, double cap,
                  double e, double m) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  const T l = T(lse), ta = T(a), tb = T(b), te = T(e), tm = T(m);
  const bool capped = cap > 0.0;
  const T ic = capped ? T(1.0 / cap) : T(0);
  if (e != 0.0) {
    // The entropy's share: p_v (a + e (z_v - m)), z_v - m formed first (exact near the max,
    // where p_v is large), then the same cap slope and background as below.
    int64_t v = 0;
    for (; v + L <= n; v += L) {
      const VT x = loadu<VT>(z + v);
      VT g = vexp(x - l) * (ta + te * (x - tm)) - (w ? loadu<VT>(w + v) : VT{} + T(1)) * tb;
      if (capped) {
        const VT t = x * ic;
        g *= (T(1) - t) * (T(1) + t);
      }
      storeu(z + v, g);
    }
    for (; v < n; ++v) {
      const T x = z[v];
      T g = sexp<T>(x - l) * (ta + te * (x - tm)) - tb * (w ? w[v] : T(1));
      if (capped) {
        const T t = x * ic;
        g *= (T(1) - t) * (T(1) + t);
      }
      z[v] = g;
    }
    return;
  }
  auto one = [&](T x, T wv) {
    T g = sexp<T>(x - l) * ta - tb * wv;
    if (capped) {
      const T t = x * ic;
      g *= (T(1) - t) * (T(1) + t);  // 1 - tanh^2 without cancelling near |t| = 1
    }
    return g;
  };
  int64_t v = 0;
  for (; v + L <= n; v += L) {
    const VT x = loadu<VT>(z + v);
    VT g = vexp(x - l) * ta - (w ? loadu<VT>(w + v) : VT{} + T(1)) * tb;
    if (capped) {
      const VT t = x * ic;
      g *= (T(1) - t) * (T(1) + t);
    }
    storeu(z + v, g);
  }
  for (; v < n; ++v) z[v] = one(z[v], w ? w[v] : T(1));
}

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

}  // namespace ALGENTA_ISA_NS

#define ALGENTA_CAT2(a, b) a##b
#define ALGENTA_CAT(a, b) ALGENTA_CAT2(a, b)

namespace ALGENTA_ISA_NS {
extern const SessionOps session_ops;  // session_kernels.cpp
}

// One table per compiled instruction set; cpu_dispatch.cpp declares and picks among them.
extern const IsaTable ALGENTA_CAT(ALGENTA_ISA_NS, _table);
const IsaTable ALGENTA_CAT(ALGENTA_ISA_NS, _table) = {
    ALGENTA_ISA_NAME,
    {ALGENTA_ISA_NS::gemm<float>, ALGENTA_ISA_NS::gemm_ws_elems<float>,
     ALGENTA_ISA_NS::pack_b_full<float>, ALGENTA_ISA_NS::packed_b_elems<float>,
     ALGENTA_ISA_NS::packed_b_max_cols<float>, ALGENTA_ISA_NS::gemm_pb<float>,
     ALGENTA_ISA_NS::packed_a_elems<float>, ALGENTA_ISA_NS::pack_a_rows<float>,
     ALGENTA_ISA_NS::gemm_papb<float>, ALGENTA_ISA_NS::row_quantum<float>,
     ALGENTA_ISA_NS::block_stats<float>, ALGENTA_ISA_NS::logit_epilogue<float>,
     ALGENTA_ISA_NS::softmax_grad<float>,
     {ALGENTA_ISA_NS::pack_b_full_h<ALGENTA_ISA_NS::BF16>,
      ALGENTA_ISA_NS::pack_b_full_h<ALGENTA_ISA_NS::F16>},
     {ALGENTA_ISA_NS::pack_a_rows_h<ALGENTA_ISA_NS::BF16>,
      ALGENTA_ISA_NS::pack_a_rows_h<ALGENTA_ISA_NS::F16>},
     {ALGENTA_ISA_NS::gemm_bh<ALGENTA_ISA_NS::BF16>, ALGENTA_ISA_NS::gemm_bh<ALGENTA_ISA_NS::F16>},
     {ALGENTA_ISA_NS::narrow_h<HALF_BF16>, ALGENTA_ISA_NS::narrow_h<HALF_F16>},
     {ALGENTA_ISA_NS::widen_h<HALF_BF16>, ALGENTA_ISA_NS::widen_h<HALF_F16>},
     ALGENTA_ISA_NS::kBf16Dot},
    {ALGENTA_ISA_NS::gemm<double>, ALGENTA_ISA_NS::gemm_ws_elems<double>,
     ALGENTA_ISA_NS::pack_b_full<double>, ALGENTA_ISA_NS::packed_b_elems<double>,
     ALGENTA_ISA_NS::packed_b_max_cols<double>, ALGENTA_ISA_NS::gemm_pb<double>,
     ALGENTA_ISA_NS::packed_a_elems<double>, ALGENTA_ISA_NS::pack_a_rows<double>,
     ALGENTA_ISA_NS::gemm_papb<double>, ALGENTA_ISA_NS::row_quantum<double>,
     ALGENTA_ISA_NS::block_stats<double>, ALGENTA_ISA_NS::logit_epilogue<double>,
     ALGENTA_ISA_NS::softmax_grad<double>,
     {nullptr, nullptr}, {nullptr, nullptr}, {nullptr, nullptr}, {nullptr, nullptr},
     {nullptr, nullptr}, {}},
    &ALGENTA_ISA_NS::session_ops,
};

}  // namespace kern
}  // namespace algenta

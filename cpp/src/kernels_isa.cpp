// Hot CPU kernels, compiled once per instruction set (see CMakeLists.txt): a packed,
// register-blocked GEMM micro-kernel (packing widens bfloat16 / float16 sources on the way), and
// the vectorized exp and tanh behind the log-sum-exp, the soft cap and the softmax gradient.
// Written with GCC/Clang vector extensions so one source serves SSE2, AVX2/FMA and AVX-512;
// -ffp-contract (GCC's default) fuses the multiply-adds where FMA exists.
//
// Fuses: nothing across calls; each call packs its own A and B panels (zero-padded to MR x NR),
// so callers may hand it any strided view. Never allocates: scratch comes from the caller.
// Limits: dimensions must fit int64 products (the lossk ceilings guarantee it).
#include <array>
#include <cmath>
#include <utility>
#include <cstring>
#include <limits>

#include "algenta/kernels.hpp"

#if defined(__F16C__)
#include <immintrin.h>
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
// bfloat16 is the top half of a float32: exact.
inline float widen(BF16 x) {
  const uint32_t b = uint32_t(x.u) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// IEEE binary16 -> float32, exact (every half is a float).
inline float widen(F16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.u);
#else
  const uint32_t sign = uint32_t(x.u & 0x8000u) << 16;
  const uint32_t e = (x.u >> 10) & 0x1fu, m = x.u & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    float f = float(m) * 5.9604644775390625e-8f;  // subnormal or zero: m * 2^-24
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// float32 -> bfloat16 / binary16 bits, round to nearest even; NaN stays a (quiet) NaN and a
// value past the half format's range becomes infinity, as a hardware conversion does.
inline uint16_t narrow_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline uint16_t narrow_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {                                  // below 2^-14: a subnormal half
    float a;
    std::memcpy(&a, &x, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f)));  // a * 2^24, RNE
  }
  x += 0x0fffu + ((x >> 13) & 1u);
  return uint16_t(sign | ((x - 0x38000000u) >> 13));
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

template <class T>
int64_t gemm_ws_elems() {
  // packed A (MC x KC), packed B (KC x NC), one edge tile; padded for 64-byte alignment.
  return MC * KC + KC * NC<T>() + MR<T> * nr<T>() + 3 * 64;
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

// R x NR tile (R <= MR rows of an MR-row panel): C = (load ? C : 0) + sum_k a[k][:] b[k][:],
// one chain per cell in k order. Every R runs the same per-cell multiply-add sequence, so a row's
// bits do not depend on how many rows share its tile; edge rows just skip the padded work.
template <class T, int R>
void ukernel_rows(int64_t kc, const T* __restrict a, const T* __restrict b, T* c, int64_t ldc,
                  bool load) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  constexpr int NR = NV<T> * L;
  VT acc[R][NV<T>];
  if (load) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV<T>; ++j) acc[i][j] = loadu<VT>(c + i * ldc + j * L);
  } else {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV<T>; ++j) acc[i][j] = VT{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    VT bv[NV<T>];
    for (int j = 0; j < NV<T>; ++j) bv[j] = loadu<VT>(b + k * NR + j * L);
    for (int i = 0; i < R; ++i) {
      const T ai = a[k * MR<T> + i];
      for (int j = 0; j < NV<T>; ++j) acc[i][j] += bv[j] * ai;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV<T>; ++j) storeu(c + i * ldc + j * L, acc[i][j]);
}

template <class T>
using UkernelFn = void (*)(int64_t, const T*, const T*, T*, int64_t, bool);

template <class T, int... Rs>
constexpr std::array<UkernelFn<T>, sizeof...(Rs)> ukernel_table(std::integer_sequence<int, Rs...>) {
  return {{&ukernel_rows<T, Rs + 1>...}};
}

// ukernels<T>()[r - 1] computes r rows.
template <class T>
const std::array<UkernelFn<T>, MR<T>>& ukernels() {
  static constexpr std::array<UkernelFn<T>, MR<T>> table =
      ukernel_table<T>(std::make_integer_sequence<int, MR<T>>{});
  return table;
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
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const int64_t nr_ = nc - jr < NR ? nc - jr : NR;
          for (int64_t ir = 0; ir < mc; ir += MR<T>) {
            const int64_t mr_ = mc - ir < MR<T> ? mc - ir : MR<T>;
            T* c = C + (ic + ir) * ldc + jc + jr;
            const UkernelFn<T> uk = ukernels<T>()[size_t(mr_ - 1)];
            if (nr_ == NR) {
              uk(kc, Ak + ir * kc, Bk + jr * kc, c, ldc, load);
            } else {
              // Column edge: the same micro-kernel on a full-width tile copy (zero-padded B
              // columns), so edge cells take the same instruction sequence as interior ones.
              if (load)
                for (int64_t i = 0; i < mr_; ++i)
                  for (int64_t j = 0; j < nr_; ++j) tile[i * NR + j] = c[i * ldc + j];
              uk(kc, Ak + ir * kc, Bk + jr * kc, tile, NR, load);
              for (int64_t i = 0; i < mr_; ++i)
                for (int64_t j = 0; j < nr_; ++j) c[i * ldc + j] = tile[i * NR + j];
            }
          }
        }
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
BlockStats block_stats(const T* z, int64_t n, const T* w) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  BlockStats s{-std::numeric_limits<double>::infinity(), 0.0, 0.0};
  if (n <= 0) return s;
  T m = z[0];
  for (int64_t v = 1; v < n; ++v) m = z[v] > m ? z[v] : m;
  // Lane-wise double accumulators, folded in lane order at the end: a fixed order for a
  // given n, independent of where the block sits in the vocabulary.
  double se[L], sz[L];
  for (int l = 0; l < L; ++l) se[l] = sz[l] = 0.0;
  int64_t v = 0;
  for (; v + L <= n; v += L) {
    VT x = loadu<VT>(z + v);
    VT e = vexp(x - m);
    for (int l = 0; l < L; ++l) se[l] += double(e[l]);
    if (w) {
      const VT wv = loadu<VT>(w + v);
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]) * double(wv[l]);
    } else {
      for (int l = 0; l < L; ++l) sz[l] += double(x[l]);
    }
  }
  for (int l = 0; v < n; ++v, ++l) {
    se[l] += double(sexp<T>(z[v] - m));
    sz[l] += w ? double(z[v]) * double(w[v]) : double(z[v]);
  }
  double a = 0.0, b = 0.0;
  for (int l = 0; l < L; ++l) {
    a += se[l];
    b += sz[l];
  }
  s.max = double(m);
  s.sumexp = a;
  s.sumz = b;
  return s;
}

template <class T>
void logit_epilogue(T* z, int64_t n, const T* bias, double cap) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  if (bias)
    for (int64_t v = 0; v < n; ++v) z[v] += bias[v];
  if (!(cap > 0.0)) return;
  // z / cap as z * (1 / cap): one rounding fewer per element than a division, and the same
  // spelling everywhere, so every chunk and thread count caps a logit to the same bits.
  const T c = T(cap), ic = T(1.0 / cap);
  int64_t v = 0;
  for (; v + L <= n; v += L) storeu(z + v, vtanh(loadu<VT>(z + v) * ic) * c);
  for (; v < n; ++v) z[v] = stanh<T>(z[v] * ic) * c;
}

template <class T>
void softmax_grad(T* z, int64_t n, double lse, double a, double b, const T* w, double cap) {
  typedef typename V<T>::type VT;
  constexpr int L = lanes<T>();
  const T l = T(lse), ta = T(a), tb = T(b);
  const bool capped = cap > 0.0;
  const T ic = capped ? T(1.0 / cap) : T(0);
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
     {ALGENTA_ISA_NS::widen_h<HALF_BF16>, ALGENTA_ISA_NS::widen_h<HALF_F16>}},
    {ALGENTA_ISA_NS::gemm<double>, ALGENTA_ISA_NS::gemm_ws_elems<double>,
     ALGENTA_ISA_NS::pack_b_full<double>, ALGENTA_ISA_NS::packed_b_elems<double>,
     ALGENTA_ISA_NS::packed_b_max_cols<double>, ALGENTA_ISA_NS::gemm_pb<double>,
     ALGENTA_ISA_NS::packed_a_elems<double>, ALGENTA_ISA_NS::pack_a_rows<double>,
     ALGENTA_ISA_NS::gemm_papb<double>, ALGENTA_ISA_NS::row_quantum<double>,
     ALGENTA_ISA_NS::block_stats<double>, ALGENTA_ISA_NS::logit_epilogue<double>,
     ALGENTA_ISA_NS::softmax_grad<double>,
     {nullptr, nullptr}, {nullptr, nullptr}, {nullptr, nullptr}, {nullptr, nullptr},
     {nullptr, nullptr}},
};

}  // namespace kern
}  // namespace algenta

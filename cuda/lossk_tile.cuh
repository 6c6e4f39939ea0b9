// lossk's tile GEMM on a CUDA device: one (BM x BN) output tile per block, operands staged
// through shared memory, SIMT fma chains (float32, float64) or tensor cores through nvcuda::wmma
// (bfloat16, float16; TF32 for the float16 backward; interior tiles staged with 16-byte loads a
// k-step ahead into a second buffer), and an epilogue that either reduces the
// tile to the forward's per-(row, vocab block) statistics or stores it (see lossk_cuda.cu for
// where each product runs and why the chains are chunk-invariant).
#pragma once

#include <mma.h>

#include <type_traits>

#include "lossk_common.cuh"

namespace algenta {
namespace lossk {
namespace {

namespace wmma = nvcuda::wmma;

// ---- the tile ----------------------------------------------------------------------------------

enum Mma { SIMT = 0, WMMA_BF16 = 1, WMMA_F16 = 2, WMMA_TF32 = 3 };
enum Epi { EPI_STATS = 0, EPI_STORE = 1 };

constexpr int NT = 256;  // threads of a tile block: 8 warps
constexpr int BM = 64;   // tile rows
constexpr int BN = 256;  // tile columns: one vocab block, so the forward's statistics are per tile
constexpr int LDE = BN + 4;  // row stride of the epilogue's shared tile (floats: 16-byte rows)
static_assert(BN == LOSS_VOCAB_BLOCK, "a forward tile is one vocab block");

// What a tile stages in shared memory and accumulates in.
template <int MMA, class T>
struct TileTypes {
  typedef T S;    // staged operand element
  typedef T Acc;  // accumulator
  static constexpr int BK = 16;  // SIMT stages [BK][BM] and [BK][BN]
};
// 16-bit operands H (bfloat16 or float16) on 16x16x16 tensor-core steps, float accumulators.
template <class H>
struct TileTypes16 {
  typedef H S;
  typedef float Acc;
  static constexpr int BK = 32;
  static constexpr int KS = 16;
  template <class LA, class LB>
  struct Frags {
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, H, LA> FA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, H, LB> FB;
  };
  typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FC;
};
template <class T>
struct TileTypes<WMMA_BF16, T> : TileTypes16<__nv_bfloat16> {};
template <class T>
struct TileTypes<WMMA_F16, T> : TileTypes16<__half> {};
template <class T>
struct TileTypes<WMMA_TF32, T> {
  typedef float S;
  typedef float Acc;
  static constexpr int BK = 16;
  static constexpr int KS = 8;
  template <class LA, class LB>
  struct Frags {
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LA> FA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LB> FB;
  };
  typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> FC;
};

// One global element into the staged type.
template <int MMA, class T, class X>
__device__ __forceinline__ typename TileTypes<MMA, T>::S stage(X x) {
  if constexpr (MMA == SIMT) {
    return T(widen(x));
  } else if constexpr (MMA == WMMA_BF16) {
    if constexpr (std::is_same<X, __nv_bfloat16>::value) return x;
    else return to_bf16(widen(x));
  } else if constexpr (MMA == WMMA_F16) {
    if constexpr (std::is_same<X, __half>::value) return x;
    else return __float2half_rn(widen(x));
  } else {
    return wmma::__float_to_tf32(widen(x));
  }
}

// How a tile product's operands lie in global memory: A (M x K) as rows of K (MK) or as rows of M
// (KM, i.e. A^T is stored); B (K x N) as rows of K per output column (NK, i.e. B^T is stored, as
// a weight matrix's rows) or as rows of N (KN).
enum class ALayout { MK, KM };
enum class BLayout { NK, KN };

// One tensor-core operand tile in shared memory, kept in its global layout so that a 16-byte
// global load lands as one 16-byte shared store: ROWS rows of the global contiguous axis, COLS
// elements each (K_OUTER: BK rows of the BM or BN outputs, read by wmma as the transposed layout;
// else BM or BN rows of BK), rows padded by 16 bytes so a fragment load's row reads and the
// stores of consecutive rows fall on different banks.
template <int OUT, bool K_OUTER, int BK, class S>
struct Staged {
  static constexpr int ROWS = K_OUTER ? BK : OUT, COLS = K_OUTER ? OUT : BK;
  static constexpr int LD = COLS + 16 / int(sizeof(S));
  static constexpr int ELEMS = ROWS * LD;
};

template <int MMA, class T, bool A_KM, bool B_KN>
struct WmmaStage {
  typedef TileTypes<MMA, T> TT;
  typedef Staged<BM, A_KM, TT::BK, typename TT::S> SA;
  typedef Staged<BN, B_KN, TT::BK, typename TT::S> SB;
  static constexpr int ELEMS = SA::ELEMS + SB::ELEMS;  // one buffer: A then B
};

template <int MMA, class T, bool A_KM = false, bool B_KN = false>
constexpr int tile_smem_bytes() {
  typedef TileTypes<MMA, T> TT;
  constexpr int BK = TT::BK;
  // SIMT: one staged k-step; tensor cores: two (the next k-step is stored while this one runs)
  constexpr int stage_b = MMA == SIMT ? int(sizeof(typename TT::S)) * BK * (BM + BN)
                                      : 2 * int(sizeof(typename TT::S)) *
                                            WmmaStage<MMA, T, A_KM, B_KN>::ELEMS;
  constexpr int es = 128 / int(sizeof(typename TT::Acc));  // epilogue slice rows
  constexpr int epi_b = int(sizeof(typename TT::Acc)) * es * LDE;
  return stage_b > epi_b ? stage_b : epi_b;
}

// N elements of one type as one aligned value: a 16-byte global load is reinterpreted as its
// elements, and a staged vector leaves registers as one shared store.
template <class E, int N>
struct alignas(N * sizeof(E) >= 16 ? 16 : N * sizeof(E)) Pack {
  E v[N];
};

// One 16-byte global vector of X elements, staged: converted element by element as stage()
// converts one (the same values as the checked path), stored at dst in one piece.
template <int MMA, class T, class X>
__device__ __forceinline__ void stage_vec(typename TileTypes<MMA, T>::S* dst, int4 raw) {
  typedef typename TileTypes<MMA, T>::S S;
  constexpr int N = 16 / int(sizeof(X));
  if constexpr (std::is_same<X, S>::value && MMA != WMMA_TF32) {
    *reinterpret_cast<int4*>(dst) = raw;
  } else {
    Pack<X, N> in;
    memcpy(&in, &raw, 16);
    Pack<S, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = stage<MMA, T>(in.v[j]);
    *reinterpret_cast<Pack<S, N>*>(dst) = out;
  }
}

// One operand's k-step [k0, k0 + BK) element by element, zeros outside the matrix: OUT output
// rows (A) or columns (B) from o0, O of them in the matrix, staged at dst[o SO + k SK];
// consecutive threads along the operand's contiguous global axis (o when K_OUTER, else k).
template <int MMA, class T, int OUT, int BK, bool K_OUTER, int SO, int SK, class X>
__device__ __forceinline__ void stage_checked(typename TileTypes<MMA, T>::S* dst, const X* src,
                                              int64_t ld, int64_t o0, int64_t O, int64_t k0,
                                              int64_t K) {
  for (int i = threadIdx.x; i < OUT * BK; i += NT) {
    const int o = K_OUTER ? i % OUT : i / BK, k = K_OUTER ? i / OUT : i % BK;
    const int64_t go = o0 + o, gk = k0 + k;
    const X* at = K_OUTER ? src + gk * ld + go : src + go * ld + gk;
    dst[o * SO + k * SK] = go < O && gk < K ? stage<MMA, T>(gpu::ld_guarded(at))
                                            : stage<MMA, T>(0.0f);
  }
}

// One operand tile's 16-byte vectors of an interior k-step: thread tid takes vectors tid + NT i,
// consecutive threads along a row (coalesced). fetch issues the loads into registers (kept in
// flight while the previous k-step multiplies), put stages them.
template <int MMA, class T, class X, class SL>
struct VecStage {
  static constexpr int VX = 16 / int(sizeof(X));  // elements a vector
  static constexpr int PER_ROW = SL::COLS / VX;
  static constexpr int N = SL::ROWS * PER_ROW / NT;
  static_assert(SL::COLS * int(sizeof(X)) % 16 == 0 && SL::ROWS * PER_ROW % NT == 0,
                "a tile operand is a whole number of 16-byte vectors a thread");
  int4 r[N];
  // src points at the tile's element (row 0, col 0) in global memory, ld elements a row.
  __device__ __forceinline__ void fetch(const X* src, int64_t ld) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int v = int(threadIdx.x) + NT * i, row = v / PER_ROW, col = (v % PER_ROW) * VX;
      r[i] = __ldg(reinterpret_cast<const int4*>(src + row * ld + col));
    }
  }
  __device__ __forceinline__ void put(typename TileTypes<MMA, T>::S* dst) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int v = int(threadIdx.x) + NT * i, row = v / PER_ROW, col = (v % PER_ROW) * VX;
      stage_vec<MMA, T, X>(dst + row * SL::LD + col, r[i]);
    }
  }
};

// The register tile of a SIMT block: thread (tx, ty) owns rows ty + 8i and columns tx + 32j
// (i, j < 8), so a warp reads one broadcast A value and 32 consecutive B values per k.
template <class Acc>
struct CoreSimt {
  Acc r[8][8];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) r[i][j] = Acc(0);
  }
  // As: [BK][BM], Bs: [BK][BN]; one fma per cell per k, in k order.
  __device__ __forceinline__ void step(const Acc* As, const Acc* Bs, int kmax) {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (int k = 0; k < kmax; ++k) {
      Acc a[8], b[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = As[k * BM + ty + 8 * i];
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = Bs[k * BN + tx + 32 * j];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) r[i][j] = dfma(a[i], b[j], r[i][j]);
    }
  }
  // Rows [s * es, (s + 1) * es) of the tile <-> Ep (es x LDE).
  __device__ __forceinline__ void to_smem(Acc* Ep, int s, int es) const {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int row = ty + 8 * i - s * es;
      if (row < 0 || row >= es) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) Ep[row * LDE + tx + 32 * j] = r[i][j];
    }
  }
  __device__ __forceinline__ void from_smem(const Acc* Ep, int s, int es) {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int row = ty + 8 * i - s * es;
      if (row < 0 || row >= es) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) r[i][j] = Ep[row * LDE + tx + 32 * j];
    }
  }
};

// The fragments of a WMMA block: warp w owns rows (w / 4) * 32 + [0, 32) and columns
// (w % 4) * 64 + [0, 64), as 2 x 4 accumulators of 16 x 16. A 32-row epilogue slice s is
// exactly the warps with w / 4 == s. Each accumulator takes its k-steps in increasing k whatever
// the staged layouts, so a cell's chain is the same in every tile it falls in.
template <int MMA, class T, bool A_KM, bool B_KN>
struct CoreWmma {
  typedef TileTypes<MMA, T> TT;
  typedef WmmaStage<MMA, T, A_KM, B_KN> WS;
  // A staged k-outer is A^T row-major, i.e. A column-major; B staged k-inner is B column-major.
  typedef typename std::conditional<A_KM, wmma::col_major, wmma::row_major>::type LA;
  typedef typename std::conditional<B_KN, wmma::row_major, wmma::col_major>::type LB;
  typedef typename TT::template Frags<LA, LB> F;
  typename TT::FC c[2][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::fill_fragment(c[i][j], 0.0f);
  }
  // As, Bs: one staged buffer (WmmaStage's layouts).
  __device__ __forceinline__ void step(const typename TT::S* As, const typename TT::S* Bs, int) {
    constexpr int la = WS::SA::LD, lb = WS::SB::LD;
    const int w = threadIdx.x >> 5, wm = w >> 2, wn = w & 3;
#pragma unroll
    for (int ks = 0; ks < TT::BK; ks += TT::KS) {
      typename F::FA a[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = wm * 32 + i * 16;
        wmma::load_matrix_sync(a[i], A_KM ? As + ks * la + m : As + m * la + ks, la);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = wn * 64 + j * 16;
        typename F::FB b;
        wmma::load_matrix_sync(b, B_KN ? Bs + ks * lb + n : Bs + n * lb + ks, lb);
#pragma unroll
        for (int i = 0; i < 2; ++i) wmma::mma_sync(c[i][j], a[i], b, c[i][j]);
      }
    }
  }
  __device__ __forceinline__ void to_smem(float* Ep, int s, int) const {
    const int w = threadIdx.x >> 5, wm = w >> 2, wn = w & 3;
    if (wm != s) return;  // warp-uniform
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wmma::store_matrix_sync(Ep + i * 16 * LDE + wn * 64 + j * 16, c[i][j], LDE,
                                wmma::mem_row_major);
  }
  __device__ __forceinline__ void from_smem(const float* Ep, int s, int) {
    const int w = threadIdx.x >> 5, wm = w >> 2, wn = w & 3;
    if (wm != s) return;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wmma::load_matrix_sync(c[i][j], Ep + i * 16 * LDE + wn * 64 + j * 16, LDE,
                               wmma::mem_row_major);
  }
};

// Per (row, vocab block) statistics of the forward, merged by k_merge in block order.
struct BlockStatD {
  double max, sumexp, sumz;
  double sument;  // sum exp(z - max) (max - z), with entropy (kernels.hpp's BlockStats)
  int32_t arg, pad;
};

template <class T>
struct TileArgs {
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;  // (M, K) at A[m * lda + k], or with A_KM at A[k * lda + m]
  int64_t lda = 0;
  const void* B = nullptr;  // (K, N) at B[n * ldb + k], or with B_KN at B[k * ldb + n]
  int64_t ldb = 0;
  // EPI_STORE: C (M, N) row-major, ldc; accumulate: each cell's chain starts at its old value
  void* C = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;
  // EPI_STATS (N = V): the forward's epilogue
  BlockStatD* stats = nullptr;  // (M, nvb)
  int64_t nvb = 0;
  T* logits = nullptr;          // (M, V) chunk of (capped) logits, or null
  const void* bias = nullptr;   // (V) in the inputs' element type, or null
  double cap = 0.0;             // > 0: soft cap
  double temperature = 1.0;     // divides the capped logits (lossk_math.hpp, tempered_cap)
  bool entropy = false;         // also BlockStatD::sument
  const T* stats_w = nullptr;   // (V) class weights of the weighted logit sum, or null
  const int64_t* targets = nullptr;
  const uint8_t* valid = nullptr;  // (N tokens) counted or not
  int64_t t0 = 0, shift = 0;
  double* ztarget = nullptr;    // (M) the target's (capped) logit of each chunk row
  bool vec = false;  // set by launch_tile: both operands' rows are 16-byte aligned
};

// One warp's statistics of one row of the epilogue tile (cols <= BN valid columns, the row's
// bias and cap applied in place first). Each lane folds columns lane + 32j in j order, then the
// warp combines lanes in a fixed butterfly: every lane ends with the same bits.
template <class T, class XE, class Acc>
__device__ void row_stats(const TileArgs<T>& p, Acc* row, int64_t gm, int64_t n0, int cols) {
  const int lane = threadIdx.x & 31;
  const XE* bias = static_cast<const XE*>(p.bias);
  const T ic = p.cap > 0.0 ? T(1.0 / p.cap) : T(0), cap = T(p.cap / p.temperature);
  const T temp = T(p.temperature);
  const bool tempered = p.temperature != 1.0;
  T z[8];
  T m = T(-INFINITY);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = lane + 32 * j;
    z[j] = T(0);
    if (c >= cols) continue;
    T x = T(row[c]);
    if (bias) x += T(widen(gpu::ld_guarded(bias + n0 + c)));
    if (p.cap > 0.0) x = dtanh(x * ic) * cap;  // z * (1/cap), as the CPU backend spells it
    else if (tempered) x = x / temp;            // a true division, as the CPU backend's
    z[j] = x;
    row[c] = Acc(x);
    m = x > m ? x : m;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T y = __shfl_xor_sync(0xffffffffu, m, o);
    m = y > m ? y : m;
  }
  int arg = BN;  // the first column holding the maximum (logits that overflowed to NaN: none)
  double se = 0.0, sz = 0.0, sd = 0.0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = lane + 32 * j;
    if (c >= cols) continue;
    if (z[j] == m && c < arg) arg = c;
    const double e = double(dexp(z[j] - m));
    se += e;
    sz += p.stats_w ? double(z[j]) * double(gpu::ld_guarded(p.stats_w + n0 + c)) : double(z[j]);
    if (p.entropy) sd += e * (double(m) - double(z[j]));  // terms >= 0, as the CPU backend's
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int a2 = __shfl_xor_sync(0xffffffffu, arg, o);
    arg = a2 < arg ? a2 : arg;
    se += __shfl_xor_sync(0xffffffffu, se, o);
    sz += __shfl_xor_sync(0xffffffffu, sz, o);
    if (p.entropy) sd += __shfl_xor_sync(0xffffffffu, sd, o);
  }
  if (lane == 0) {
    BlockStatD s;
    s.max = double(m);
    s.sumexp = se;
    s.sumz = sz;
    s.sument = sd;
    s.arg = arg < cols ? arg : 0;
    s.pad = 0;
    p.stats[gm * p.nvb + n0 / BN] = s;  // a 40-byte record: a plain store, not counted
  }
  const int64_t t = p.t0 + gm;
  if (gpu::ld_guarded(p.valid + t)) {
    const int64_t y = gpu::ld_guarded(p.targets + t + p.shift) - n0;
    if (y >= 0 && y < cols && (y & 31) == lane) st(p.ztarget + gm, double(z[y >> 5]));
  }
  if (p.logits) {
    T* dst = p.logits + gm * p.N + n0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (lane + 32 * j < cols) st(dst + lane + 32 * j, z[j]);
  }
}

// One tile product, named: the multiply path, the compute type T, the operands' global element
// types and layouts, the epilogue and (EPI_STORE) the output's element type. With accumulate,
// XC is the accumulator type and each cell's chain continues from C's value.
template <int MMA_, class T_, class XA_, ALayout LA, class XB_, BLayout LB, int EPI_, class XC_>
struct TileProduct {
  static constexpr int MMA = MMA_, EPI = EPI_;
  static constexpr bool A_KM = LA == ALayout::KM, B_KN = LB == BLayout::KN;
  typedef T_ T;
  typedef XA_ XA;
  typedef XB_ XB;
  typedef XC_ XC;
};

// The three products of the fused loss:
// logits (c x V) = H (c x D) . W (V x D)^T, reduced to per-(row, vocab block) statistics;
template <int MMA, class T, class X>
using LogitsTile = TileProduct<MMA, T, X, ALayout::MK, X, BLayout::NK, EPI_STATS, T>;
// d_hidden (c x D) = G (c x V) . W (V x D), stored in XC;
template <int MMA, class T, class XW, class XC>
using DHiddenTile = TileProduct<MMA, T, T, ALayout::MK, XW, BLayout::KN, EPI_STORE, XC>;
// d_weight (V x D) += G^T (V x c) . H (c x D), continuing the T accumulator.
template <int MMA, class T, class XH>
using DWeightTile = TileProduct<MMA, T, T, ALayout::KM, XH, BLayout::KN, EPI_STORE, T>;

// C (+)= op(A) op(B) for one (BM x BN) tile of product P, then the epilogue.
template <class P>
__global__ void __launch_bounds__(NT) k_tile(TileArgs<typename P::T> p) {
  constexpr int MMA = P::MMA, EPI = P::EPI;
  constexpr bool A_KM = P::A_KM, B_KN = P::B_KN;
  typedef typename P::T T;
  typedef typename P::XA XA;
  typedef typename P::XB XB;
  typedef typename P::XC XC;
  typedef TileTypes<MMA, T> TT;
  typedef typename TT::S S;
  typedef typename TT::Acc Acc;
  constexpr int BK = TT::BK;
  constexpr bool simt = MMA == SIMT;
  constexpr int ES = 128 / int(sizeof(Acc));  // epilogue slice rows: 32 float, 16 double
  typedef typename std::conditional<simt, CoreSimt<Acc>, CoreWmma<MMA, T, A_KM, B_KN>>::type Core;

  extern __shared__ __align__(32) unsigned char smem[];
  S* As = reinterpret_cast<S*>(smem);
  S* Bs = As + BK * BM;  // SIMT's staged B
  Acc* Ep = reinterpret_cast<Acc*>(smem);  // the epilogue's slice: aliases the staged operands

  const int tid = threadIdx.x;
  const int64_t m0 = int64_t(blockIdx.x) * BM, n0 = int64_t(blockIdx.y) * BN;
  const XA* A = static_cast<const XA*>(p.A);
  const XB* B = static_cast<const XB*>(p.B);
  Core core;

  if constexpr (EPI == EPI_STORE) {
    if (p.accumulate) {
      const XC* C = static_cast<const XC*>(p.C);
      for (int s = 0; s < BM / ES; ++s) {
        for (int i = tid; i < ES * BN; i += NT) {
          const int r = i / BN, n = i % BN;
          const int64_t gm = m0 + s * ES + r, gn = n0 + n;
          Ep[r * LDE + n] = gm < p.M && gn < p.N ? Acc(widen(ld(C + gm * p.ldc + gn))) : Acc(0);
        }
        __syncthreads();
        core.from_smem(Ep, s, ES);
        __syncthreads();
      }
    } else {
      core.zero();
    }
  } else {
    core.zero();
  }

  if constexpr (simt) {
    for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
      stage_checked<MMA, T, BM, BK, A_KM, 1, BM>(As, A, p.lda, m0, p.M, k0, p.K);
      stage_checked<MMA, T, BN, BK, B_KN, 1, BN>(Bs, B, p.ldb, n0, p.N, k0, p.K);
      __syncthreads();
      core.step(As, Bs, int(p.K - k0 < BK ? p.K - k0 : BK));
      __syncthreads();
    }
  } else {
    typedef WmmaStage<MMA, T, A_KM, B_KN> WS;
    typedef typename WS::SA SA;
    typedef typename WS::SB SB;
    S* const S0 = As;  // buffer b at S0 + b * WS::ELEMS: its A, then its B at + SA::ELEMS
    // The tile's (row 0, col 0) element at k-step k0 of each operand, in its global layout.
    auto a_at = [&](int64_t k0) { return A_KM ? A + k0 * p.lda + m0 : A + m0 * p.lda + k0; };
    auto b_at = [&](int64_t k0) { return B_KN ? B + k0 * p.ldb + n0 : B + n0 * p.ldb + k0; };
    int64_t k0 = 0;
    // Interior tiles of 16-byte-aligned operands: every full k-step with unchecked 16-byte
    // loads, fetched into registers one k-step ahead and stored into the other buffer while
    // this one multiplies, so one barrier a k-step orders both (a buffer is rewritten only after
    // the barrier that follows its last read). Edge tiles and the last partial k-step take the
    // checked path below; both feed each accumulator the same k-steps in the same order.
    const bool fast = p.vec && m0 + BM <= p.M && n0 + BN <= p.N;
    const int64_t nk = fast ? p.K / BK : 0;
    if (nk > 0) {
      VecStage<MMA, T, XA, SA> va;
      VecStage<MMA, T, XB, SB> vb;
      va.fetch(a_at(0), p.lda);
      vb.fetch(b_at(0), p.ldb);
      va.put(S0);
      vb.put(S0 + SA::ELEMS);
      __syncthreads();
      for (int64_t kt = 0; kt < nk; ++kt) {
        S* const cur = S0 + (kt & 1) * WS::ELEMS;
        S* const nxt = S0 + ((kt + 1) & 1) * WS::ELEMS;
        const bool more = kt + 1 < nk;
        // Safe as __ldg under `more` (cuda/common.cuh): the address moves with kt, so the loads
        // cannot leave the loop, and inside it they are branched around or predicated. Fetching
        // unconditionally instead costs the bf16 prefill tile 8.7 -> 11 instructions an MMA.
        if (more) {
          va.fetch(a_at((kt + 1) * BK), p.lda);
          vb.fetch(b_at((kt + 1) * BK), p.ldb);
        }
        core.step(cur, cur + SA::ELEMS, BK);
        if (more) {
          va.put(nxt);
          vb.put(nxt + SA::ELEMS);
        }
        __syncthreads();
      }
      k0 = nk * BK;
    }
    for (; k0 < p.K; k0 += BK) {
      // Staged (r, c): (k, o) when K_OUTER, else (o, k)
      stage_checked<MMA, T, BM, BK, A_KM, A_KM ? 1 : SA::LD, A_KM ? SA::LD : 1>(
          S0, A, p.lda, m0, p.M, k0, p.K);
      stage_checked<MMA, T, BN, BK, B_KN, B_KN ? 1 : SB::LD, B_KN ? SB::LD : 1>(
          S0 + SA::ELEMS, B, p.ldb, n0, p.N, k0, p.K);
      __syncthreads();
      core.step(S0, S0 + SA::ELEMS, BK);
      __syncthreads();
    }
  }

  const int cols = int(p.N - n0 < BN ? p.N - n0 : BN);
  for (int s = 0; s < BM / ES; ++s) {
    core.to_smem(Ep, s, ES);
    __syncthreads();
    if constexpr (EPI == EPI_STORE) {
      XC* C = static_cast<XC*>(p.C);
      for (int i = tid; i < ES * BN; i += NT) {
        const int r = i / BN, n = i % BN;
        const int64_t gm = m0 + s * ES + r, gn = n0 + n;
        if (gm < p.M && gn < p.N) put(C + gm * p.ldc + gn, Ep[r * LDE + n]);
      }
    } else {
      for (int r = tid >> 5; r < ES; r += NT / 32) {
        const int64_t gm = m0 + s * ES + r;
        if (gm < p.M) row_stats<T, XA>(p, Ep + r * LDE, gm, n0, cols);  // warp-uniform
      }
    }
    __syncthreads();
  }
}

// The dynamic shared memory a tile of product P is launched with. Above 48 KiB a kernel runs only
// after opting in (cudaFuncSetAttribute); every architecture the build targets (sm_80 and later)
// allows at least 99 KiB a block.
template <class P>
constexpr int tile_bytes() {
  return tile_smem_bytes<P::MMA, typename P::T, P::A_KM, P::B_KN>();
}

// p as k_tile takes it: vec says whether both operands' rows are 16-byte aligned (the unchecked
// 16-byte path of interior tiles).
template <class P>
TileArgs<typename P::T> tile_args(const TileArgs<typename P::T>& p) {
  auto rows16 = [](const void* q, int64_t ld, size_t esz) {
    return reinterpret_cast<uintptr_t>(q) % 16 == 0 && (ld * int64_t(esz)) % 16 == 0;
  };
  TileArgs<typename P::T> q = p;
  q.vec = P::MMA != SIMT && rows16(p.A, p.lda, sizeof(typename P::XA)) &&
          rows16(p.B, p.ldb, sizeof(typename P::XB));
  return q;
}

template <class P>
void launch_tile(const TileArgs<typename P::T>& p, cudaStream_t s) {
  constexpr int bytes = tile_bytes<P>();
  static_assert(bytes <= 99 * 1024, "a tile fits every targeted device's shared memory");
  if constexpr (bytes > 48 * 1024)
    CK(cudaFuncSetAttribute(k_tile<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const dim3 grid(unsigned(ceil_div(p.M, BM)), unsigned(ceil_div(p.N, BN)));
  gpu::launch_label(P::EPI == EPI_STATS ? "logits" : P::A_KM ? "d_weight" : "d_hidden");
  k_tile<P><<<grid, NT, bytes, s>>>(tile_args<P>(p));
  gpu::launch_label(nullptr);
  CK(cudaGetLastError());
}

}  // namespace
}  // namespace lossk
}  // namespace algenta

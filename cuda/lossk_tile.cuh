// lossk's tile GEMM on a CUDA device: one (BM x BN) output tile per block, operands staged
// through shared memory, SIMT fma chains (float32, float64) or tensor cores through nvcuda::wmma
// (bfloat16, float16; TF32 for the float16 backward), and an epilogue that either reduces the
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
  static constexpr int BK = 16;
  static constexpr int LDS = BK + 8;  // unused: SIMT stages [BK][BM] and [BK][BN]
};
// 16-bit operands H (bfloat16 or float16) on 16x16x16 tensor-core steps, float accumulators.
template <class H>
struct TileTypes16 {
  typedef H S;
  typedef float Acc;
  static constexpr int BK = 32;
  static constexpr int LDS = BK + 8;  // staged row stride: a 16-byte multiple, off the bank period
  static constexpr int KS = 16;
  typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, H, wmma::row_major> FA;
  typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, H, wmma::col_major> FB;
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
  static constexpr int LDS = BK + 8;
  static constexpr int KS = 8;
  typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FA;
  typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FB;
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

template <int MMA, class T>
constexpr int tile_smem_bytes() {
  typedef TileTypes<MMA, T> TT;
  constexpr int BK = TT::BK;
  constexpr int stage_b = MMA == SIMT ? int(sizeof(typename TT::S)) * BK * (BM + BN)
                                      : int(sizeof(typename TT::S)) * (BM + BN) * TT::LDS;
  constexpr int es = 128 / int(sizeof(typename TT::Acc));  // epilogue slice rows
  constexpr int epi_b = int(sizeof(typename TT::Acc)) * es * LDE;
  return stage_b > epi_b ? stage_b : epi_b;
}

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
// exactly the warps with w / 4 == s.
template <int MMA, class T>
struct CoreWmma {
  typedef TileTypes<MMA, T> TT;
  typename TT::FC c[2][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::fill_fragment(c[i][j], 0.0f);
  }
  // As: [BM][lds] row-major (m, k); Bs: [BN][lds], read as col-major (k, n).
  __device__ __forceinline__ void step(const typename TT::S* As, const typename TT::S* Bs, int) {
    constexpr int L = TT::LDS;
    const int w = threadIdx.x >> 5, wm = w >> 2, wn = w & 3;
#pragma unroll
    for (int ks = 0; ks < TT::BK; ks += TT::KS) {
      typename TT::FA a[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * L + ks, L);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        typename TT::FB b;
        wmma::load_matrix_sync(b, Bs + (wn * 64 + j * 16) * L + ks, L);
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
    if (bias) x += T(widen(__ldg(bias + n0 + c)));
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
    sz += p.stats_w ? double(z[j]) * double(__ldg(p.stats_w + n0 + c)) : double(z[j]);
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
  if (__ldg(p.valid + t)) {
    const int64_t y = __ldg(p.targets + t + p.shift) - n0;
    if (y >= 0 && y < cols && (y & 31) == lane) st(p.ztarget + gm, double(z[y >> 5]));
  }
  if (p.logits) {
    T* dst = p.logits + gm * p.N + n0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (lane + 32 * j < cols) st(dst + lane + 32 * j, z[j]);
  }
}

// How a tile product's operands lie in global memory: A (M x K) as rows of K (MK) or as rows of M
// (KM, i.e. A^T is stored); B (K x N) as rows of K per output column (NK, i.e. B^T is stored, as
// a weight matrix's rows) or as rows of N (KN).
enum class ALayout { MK, KM };
enum class BLayout { NK, KN };

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
  constexpr int L = TT::LDS;
  constexpr int ES = 128 / int(sizeof(Acc));  // epilogue slice rows: 32 float, 16 double
  typedef typename std::conditional<simt, CoreSimt<Acc>, CoreWmma<MMA, T>>::type Core;

  extern __shared__ __align__(32) unsigned char smem[];
  S* As = reinterpret_cast<S*>(smem);
  S* Bs = As + (simt ? BK * BM : BM * L);
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

  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    // Consecutive threads take consecutive addresses of whichever operand layout this is.
    for (int i = tid; i < BM * BK; i += NT) {
      const int m = A_KM ? i % BM : i / BK, k = A_KM ? i / BM : i % BK;
      const int64_t gm = m0 + m, gk = k0 + k;
      const S v = gm < p.M && gk < p.K
                      ? stage<MMA, T>(__ldg(A + (A_KM ? gk * p.lda + gm : gm * p.lda + gk)))
                      : stage<MMA, T>(0.0f);
      As[simt ? k * BM + m : m * L + k] = v;
    }
    for (int i = tid; i < BN * BK; i += NT) {
      const int n = B_KN ? i % BN : i / BK, k = B_KN ? i / BN : i % BK;
      const int64_t gn = n0 + n, gk = k0 + k;
      const S v = gn < p.N && gk < p.K
                      ? stage<MMA, T>(__ldg(B + (B_KN ? gk * p.ldb + gn : gn * p.ldb + gk)))
                      : stage<MMA, T>(0.0f);
      Bs[simt ? k * BN + n : n * L + k] = v;
    }
    __syncthreads();
    core.step(As, Bs, int(p.K - k0 < BK ? p.K - k0 : BK));
    __syncthreads();
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

template <class P>
void launch_tile(const TileArgs<typename P::T>& p, cudaStream_t s) {
  constexpr int bytes = tile_smem_bytes<P::MMA, typename P::T>();
  static_assert(bytes <= 48 * 1024, "a tile fits the default shared-memory limit");
  const dim3 grid(unsigned(ceil_div(p.M, BM)), unsigned(ceil_div(p.N, BN)));
  gpu::launch_label(P::EPI == EPI_STATS ? "logits" : P::A_KM ? "d_weight" : "d_hidden");
  k_tile<P><<<grid, NT, bytes, s>>>(p);
  gpu::launch_label(nullptr);
  CK(cudaGetLastError());
}

}  // namespace
}  // namespace lossk
}  // namespace algenta

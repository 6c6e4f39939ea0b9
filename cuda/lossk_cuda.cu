// lossk on a CUDA device: the fused linear + cross-entropy of lossk.hpp, a chunk of tokens at a
// time, with the same options and the same exactness contract as the CPU backend
// (cpp/src/lossk_cross_entropy.cpp), and the seed's materialized kernels (ce_from_logits, its
// gradient, a device-side running sum).
//
// Dimension legend: N tokens, D d_model, V vocab, C chunk, VB = LOSS_VOCAB_BLOCK = BN.
//
// Per call: k_check_* (the data's refusals, into a flag the host waits for: the one
// synchronization), k_prepare (which tokens count, their weight sum), then per chunk
//   1 k_tile<.., EPI_STATS>  logits of a (BM x VB) tile, bias and soft cap applied, reduced in
//                            shared memory to per-(row, vocab block) statistics (max, sum of
//                            exp, weighted logit sum, first argmax) and the target's logit; with
//                            gradients the tile is also stored into the chunk's (C, V) logits
//   2 k_merge                one thread per token: the blocks merged in block order -> lse, the
//                            loss terms, argmax, and the gradient's per-token coefficients
//   with gradients:
//   3 k_softmax_grad         the chunk's logits overwritten in place by d loss / d z
//   4 k_tile<.., EPI_STORE>  d_hidden rows = G @ W
//   5 k_tile<.., EPI_STORE>  d_weight += G^T @ H, each cell continuing its chain (accumulator
//                            loaded, never added to afterwards)
//   6 k_bias_grad            d_bias += column sums of G, one chain per cell in token order
// and k_finish (one block: token-order reductions in a fixed tree), k_narrow for half gradients.
// Never materialized: the (N, V) logits; without gradients not even a chunk of them.
//
// Exactness: no atomics in any reduction (the only atomics are the refusal flags, whose values
// are order-free: "some element is bad", "the first bad token"). Every logit cell is one chain
// over d_model in k order whatever tile row it lands in; a token's lse merges its vocab blocks in
// block order; d_weight cells continue one chain over tokens chunk after chunk; per-token sums
// reduce over a partition of [0, N) that depends on N only. So results are bit-identical across
// runs and chunk sizes. cuBLAS is not used: it may choose a different algorithm (another
// summation order) for every row count, i.e. for every chunk size, which this contract forbids.
//
// Precision: float32 and float64 inputs run the SIMT tile (fma chains in the input precision).
// bfloat16/float16 inputs run the forward on tensor cores through nvcuda::wmma (16x16x16, float
// accumulators). Their backward GEMMs take d_logits (float) as one operand: bfloat16 inputs round
// it to bfloat16 (the same exponent range, so the 1/N-scaled softmax gradient cannot underflow),
// float16 inputs run the backward in TF32 (16x16x8), which holds float16 operands exactly and the
// gradient without float16's underflow below 6e-8. The tensor cores' internal summation order
// within one k-step is the hardware's, fixed for given inputs; the chains between k-steps are
// ours, as above.
//
// Errors: every CUDA call is checked; a failure throws StatusError 591 naming the call. A build
// whose CUDA backend finds no usable device throws 590 before any allocation. Nothing here aborts.
// The emulator (cuda/emu) runs all of this in CI; speed is a device's to measure (README).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "algenta/half.hpp"
#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"
#include "algenta/session.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace lossk {

namespace {

namespace wmma = nvcuda::wmma;

[[noreturn]] void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Loss, code, msg);
}

// Any CUDA error -> 591, the pending error cleared so a later unrelated call does not report it.
void ck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  refuse(LOSS_ERR_DEVICE_FAILED, std::string("CUDA call failed: ") + what + ": " +
                                     cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define CK(call) ck((call), #call)

void require_device(const char* fn) {
  const residentk::CudaBackend& b = residentk::cuda_backend();
  if (!b.usable)
    refuse(LOSS_ERR_NO_DEVICE, std::string(fn) + ": device='cuda' needs a usable CUDA device: " +
                                   b.why);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---- element types ------------------------------------------------------------------------------

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

__device__ __forceinline__ float dexp(float x) { return expf(x); }
__device__ __forceinline__ double dexp(double x) { return exp(x); }
__device__ __forceinline__ float dtanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dtanh(double x) { return tanh(x); }
__device__ __forceinline__ float dfma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double dfma(double a, double b, double c) { return fma(a, b, c); }

// float -> bfloat16 with the rounding the CPU backend uses too (algenta/half.hpp): a bf16
// gradient, and the bf16 d_logits the backward products take, are the same bits on both.
__device__ __forceinline__ __nv_bfloat16 to_bf16(float v) {
  const uint16_t b = half::f32_to_bf16(v);
  __nv_bfloat16 h;
  memcpy(&h, &b, 2);
  return h;
}

// A result cell in its output type: float/double as they are, halves rounded to nearest even
// (as the CPU backend narrows).
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(double* p, double v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = to_bf16(v); }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half_rn(v); }

template <class X>
__device__ __forceinline__ bool finite_el(X x) {
  return isfinite(widen(x));
}

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
template <class T>
struct TileTypes<WMMA_BF16, T> {
  typedef __nv_bfloat16 S;
  typedef float Acc;
  static constexpr int BK = 32;
  static constexpr int LDS = BK + 8;  // staged row stride: a 16-byte multiple, off the bank period
  static constexpr int KS = 16;
  typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FA;
  typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FB;
  typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FC;
};
template <class T>
struct TileTypes<WMMA_F16, T> {
  typedef __half S;
  typedef float Acc;
  static constexpr int BK = 32;
  static constexpr int LDS = BK + 8;  // staged row stride: a 16-byte multiple, off the bank period
  static constexpr int KS = 16;
  typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> FA;
  typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> FB;
  typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FC;
};
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
  const T ic = p.cap > 0.0 ? T(1.0 / p.cap) : T(0), cap = T(p.cap);
  T z[8];
  T m = T(-INFINITY);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = lane + 32 * j;
    z[j] = T(0);
    if (c >= cols) continue;
    T x = T(row[c]);
    if (bias) x += T(widen(bias[n0 + c]));
    if (p.cap > 0.0) x = dtanh(x * ic) * cap;  // z * (1/cap), as the CPU backend spells it
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
  double se = 0.0, sz = 0.0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = lane + 32 * j;
    if (c >= cols) continue;
    if (z[j] == m && c < arg) arg = c;
    se += double(dexp(z[j] - m));
    sz += p.stats_w ? double(z[j]) * double(p.stats_w[n0 + c]) : double(z[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int a2 = __shfl_xor_sync(0xffffffffu, arg, o);
    arg = a2 < arg ? a2 : arg;
    se += __shfl_xor_sync(0xffffffffu, se, o);
    sz += __shfl_xor_sync(0xffffffffu, sz, o);
  }
  if (lane == 0) {
    BlockStatD s;
    s.max = double(m);
    s.sumexp = se;
    s.sumz = sz;
    s.arg = arg < cols ? arg : 0;
    s.pad = 0;
    p.stats[gm * p.nvb + n0 / BN] = s;
  }
  const int64_t t = p.t0 + gm;
  if (p.valid[t]) {
    const int64_t y = p.targets[t + p.shift] - n0;
    if (y >= 0 && y < cols && (y & 31) == lane) p.ztarget[gm] = double(z[y >> 5]);
  }
  if (p.logits) {
    T* dst = p.logits + gm * p.N + n0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (lane + 32 * j < cols) dst[lane + 32 * j] = z[j];
  }
}

// C (+)= op(A) op(B) for one (BM x BN) tile, then the epilogue. XA, XB: the operands' global
// element types; XC: the output's (EPI_STORE). With accumulate, XC is the accumulator type and
// each cell's chain continues from C's value.
template <int MMA, class T, class XA, bool A_KM, class XB, bool B_KN, int EPI, class XC>
__global__ void __launch_bounds__(NT) k_tile(TileArgs<T> p) {
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
          Ep[r * LDE + n] = gm < p.M && gn < p.N ? Acc(widen(C[gm * p.ldc + gn])) : Acc(0);
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
      const S v = gm < p.M && gk < p.K ? stage<MMA, T>(A[A_KM ? gk * p.lda + gm : gm * p.lda + gk])
                                       : stage<MMA, T>(0.0f);
      As[simt ? k * BM + m : m * L + k] = v;
    }
    for (int i = tid; i < BN * BK; i += NT) {
      const int n = B_KN ? i % BN : i / BK, k = B_KN ? i / BN : i % BK;
      const int64_t gn = n0 + n, gk = k0 + k;
      const S v = gn < p.N && gk < p.K ? stage<MMA, T>(B[B_KN ? gk * p.ldb + gn : gn * p.ldb + gk])
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

template <int MMA, class T, class XA, bool A_KM, class XB, bool B_KN, int EPI, class XC>
void launch_tile(const TileArgs<T>& p, cudaStream_t s) {
  constexpr int bytes = tile_smem_bytes<MMA, T>();
  static_assert(bytes <= 48 * 1024, "a tile fits the default shared-memory limit");
  const dim3 grid(unsigned(ceil_div(p.M, BM)), unsigned(ceil_div(p.N, BN)));
  k_tile<MMA, T, XA, A_KM, XB, B_KN, EPI, XC><<<grid, NT, bytes, s>>>(p);
  CK(cudaGetLastError());
}

// ---- per-token kernels -----------------------------------------------------------------------

// Data checks: each sets its flag when any element is bad (the flag's value does not depend on
// which thread saw it first).
template <class X>
__global__ void k_check_finite(const X* p, int64_t n, int* flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    if (!finite_el(p[i])) {
      atomicExch(flag, 1);
      return;
    }
}

// The first scored token (the lowest index: atomicMin) whose target is outside [0, V).
__global__ void k_check_targets(const int64_t* targets, int64_t n, int64_t shift, int64_t seq,
                                bool has_ignore, int64_t ignore, int64_t V,
                                unsigned long long* first_bad) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    if (shift > 0 && t % seq >= seq - shift) continue;
    const int64_t y = targets[t + shift];
    if (has_ignore && y == ignore) continue;
    if (y < 0 || y >= V) atomicMin(first_bad, (unsigned long long)t);
  }
}

constexpr int RT = 1024;  // threads of the one-block reductions

// Sum over the block in a fixed tree (lane pairs by index): the same bits on every run.
__device__ double block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = RT / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();
  return r;
}
__device__ double block_min(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = RT / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) red[threadIdx.x] = fmin(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();
  return r;
}

// Thread i's contiguous share of [0, n): a partition that depends on n only.
__device__ __forceinline__ void share(int64_t n, int64_t* lo, int64_t* hi) {
  *lo = n * int64_t(threadIdx.x) / RT;
  *hi = n * int64_t(threadIdx.x + 1) / RT;
}

// prep: (0) counted tokens, (1) their targets' weight sum, (2) sum of all class weights (V
// without). valid: per token, counted or not.
template <class T>
__global__ void __launch_bounds__(RT) k_prepare(const int64_t* targets, int64_t N, int64_t V,
                                                int64_t shift, int64_t seq, bool has_ignore,
                                                int64_t ignore, const T* cw, uint8_t* valid,
                                                double* prep) {
  __shared__ double red[RT];
  int64_t lo, hi;
  share(N, &lo, &hi);
  double cnt = 0.0, ws = 0.0;
  for (int64_t t = lo; t < hi; ++t) {
    const bool v = math::counted(targets, t, shift, seq, has_ignore, ignore);
    valid[t] = v;
    if (v) {
      cnt += 1.0;
      ws += cw ? double(cw[targets[t + shift]]) : 1.0;
    }
  }
  cnt = block_sum(cnt, red);
  ws = block_sum(ws, red);
  double wa = double(V);
  if (cw) {
    share(V, &lo, &hi);
    double a = 0.0;
    for (int64_t v = lo; v < hi; ++v) a += double(cw[v]);
    wa = block_sum(a, red);
  }
  if (threadIdx.x == 0) {
    prep[0] = cnt;
    prep[1] = ws;
    prep[2] = wa;
  }
}

template <class T>
struct MergeArgs {
  const BlockStatD* stats = nullptr;  // (c, nvb)
  int64_t nvb = 0, c = 0, t0 = 0, V = 0, shift = 0;
  const uint8_t* valid = nullptr;
  const int64_t* targets = nullptr;
  const T* cw = nullptr;
  const double* ztarget = nullptr;  // (c)
  const double* prep = nullptr;
  double eps = 0.0, zs = 0.0, cap = 0.0;
  Reduction reduction = Reduction::Mean;
  double grad_scale = 1.0;
  const T* grad_output = nullptr;
  const T* grad_lse = nullptr;
  const T* grad_coef = nullptr;
  bool with_grad = false;
  double* ce = nullptr;   // (N)
  double* zl = nullptr;   // (N)
  T* lse = nullptr;       // (N) or null
  T* loss_tok = nullptr;  // (N) or null
  T* z_tok = nullptr;     // (N) or null
  T* target_logit = nullptr;
  T* logit_sum = nullptr;
  int64_t* pred = nullptr;
  double* lse_c = nullptr;  // (c) the chunk rows' lse, for k_softmax_grad
  double* coef = nullptr;   // (c, 4): a, b, the target's term (cap's derivative applied), target
};

// One thread per token of the chunk: the same arithmetic as the CPU backend's step 2.
template <class T>
__global__ void k_merge(MergeArgs<T> a) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.c) return;
  const int64_t t = a.t0 + r, V = a.V;
  const math::Merged mg = math::merge_blocks(a.stats + r * a.nvb, a.nvb);
  const double m = mg.max, sz = mg.sumz;
  if (a.pred) a.pred[t] = mg.block * BN + a.stats[r * a.nvb + mg.block].arg;
  const bool valid = a.valid[t] != 0;
  const double zt = a.ztarget[r];
  if (a.logit_sum) a.logit_sum[t] = T(sz);
  if (a.target_logit) a.target_logit[t] = T(valid ? zt : NAN);
  const double logse = log(mg.sumexp);
  const double l = m + logse;
  const double w_all = a.prep[2], eps = a.eps;
  double ct = 0.0, zl = 0.0, wy = 1.0;
  int64_t y = -1;
  if (valid) {
    y = a.targets[t + a.shift];
    wy = a.cw ? double(a.cw[y]) : 1.0;
    ct = math::token_ce(m, logse, zt, sz, wy, w_all, eps, V, a.cw != nullptr);
    zl = a.zs * l * l;
  }
  a.ce[t] = ct;
  a.zl[t] = zl;
  if (a.lse) a.lse[t] = T(l);
  if (a.loss_tok) a.loss_tok[t] = T(ct + zl);
  if (a.z_tok) a.z_tok[t] = T(zl);
  if (!a.with_grad) return;
  a.lse_c[r] = l;
  math::Coef g;
  if (a.grad_coef) {
    const T* k3 = a.grad_coef + 3 * t;
    g = {double(k3[0]), double(k3[1]), valid ? double(k3[2]) : 0.0};
  } else {
    const math::Scales sc = math::reduction_scales(a.reduction, valid, a.grad_scale, a.prep[0],
                                                   a.prep[1],
                                                   a.grad_output ? double(a.grad_output[t]) : 1.0);
    g = math::grad_coef(sc, eps, V, wy, w_all, a.zs, l, a.grad_lse ? double(a.grad_lse[t]) : 0.0);
  }
  const double f = g.c != 0.0 ? math::cap_slope<T>(zt, a.cap) : 1.0;
  double* k = a.coef + 4 * r;
  k[0] = g.a;
  k[1] = g.b;
  k[2] = g.c * f;
  k[3] = double(y);
}

// The chunk's logits (c, V) overwritten by their gradient, as the CPU backend's softmax_grad.
template <class T>
__global__ void k_softmax_grad(T* g, int64_t c, int64_t V, const double* lse_c, const double* coef,
                               const T* w, double cap) {
  const T ic = cap > 0.0 ? T(1.0 / cap) : T(0);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < c * V;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / V, v = i % V;
    const double* k = coef + 4 * r;
    if (k[0] == 0.0 && k[1] == 0.0 && k[2] == 0.0) {
      g[i] = T(0);
      continue;
    }
    const T x = g[i];
    T d = dexp(x - T(lse_c[r])) * T(k[0]) - T(k[1]) * (w ? w[v] : T(1));
    if (cap > 0.0) {
      const T tz = x * ic;
      d *= (T(1) - tz) * (T(1) + tz);
    }
    if (double(v) == k[3]) d -= T(k[2]);
    g[i] = d;
  }
}

// d_bias (V) += column sums of the chunk's gradient: one chain per cell, in token order.
template <class T>
__global__ void k_bias_grad(const T* g, int64_t c, int64_t V, T* db) {
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= V) return;
  T acc = db[v];
  for (int64_t r = 0; r < c; ++r) acc += g[r * V + v];
  db[v] = acc;
}

template <class T, class XO>
__global__ void k_narrow(const T* src, XO* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    put(dst + i, float(src[i]));
}

// Token-order results in one block over a fixed partition of [0, N): LossSum's (total, first,
// shifted, count) of ce and z, the weight sum, correct argmaxes; and the reduced loss.
template <class T>
__global__ void __launch_bounds__(RT) k_finish(const double* ce, const double* zl,
                                               const uint8_t* valid, const int64_t* pred,
                                               const int64_t* targets, int64_t shift, int64_t N,
                                               const double* prep, bool weighted, Reduction red_kind,
                                               double* sums, T* loss, T* zout, float* accuracy) {
  __shared__ double red[RT];
  int64_t lo, hi;
  share(N, &lo, &hi);
  double first_t = INFINITY;
  for (int64_t t = lo; t < hi; ++t)
    if (valid[t]) {
      first_t = double(t);
      break;
    }
  first_t = block_min(first_t, red);
  const bool any = first_t < double(N);
  const double fce = any ? ce[int64_t(first_t)] : 0.0, fz = any ? zl[int64_t(first_t)] : 0.0;
  double tce = 0.0, sce = 0.0, tz = 0.0, sz = 0.0, cnt = 0.0, correct = 0.0;
  for (int64_t t = lo; t < hi; ++t) {
    if (!valid[t]) continue;
    tce += ce[t];
    sce += ce[t] - fce;
    tz += zl[t];
    sz += zl[t] - fz;
    cnt += 1.0;
    if (pred && pred[t] == targets[t + shift]) correct += 1.0;
  }
  tce = block_sum(tce, red);
  sce = block_sum(sce, red);
  tz = block_sum(tz, red);
  sz = block_sum(sz, red);
  cnt = block_sum(cnt, red);
  correct = block_sum(correct, red);
  if (threadIdx.x != 0) return;
  const double wsum = prep[1];
  double* o = sums;
  o[0] = tce, o[1] = fce, o[2] = sce, o[3] = cnt;
  o[4] = tz, o[5] = fz, o[6] = sz, o[7] = cnt;
  o[8] = wsum, o[9] = correct;
  // FusedOut::reduced, on the device
  const double ce_mean = math::sum_mean(fce, sce, cnt), z_mean = math::sum_mean(fz, sz, cnt);
  if (loss) loss[0] = T(math::reduced_loss(red_kind, weighted, tce, ce_mean, wsum, tz, z_mean));
  if (zout) zout[0] = T(red_kind == Reduction::Sum ? tz : z_mean);
  if (accuracy) accuracy[0] = cnt > 0.0 ? float(correct / cnt) : NAN;
}

// ---- the seed's materialized kernels ---------------------------------------------------------

constexpr int CT = 256;  // threads per row of k_ce_rows

__device__ double row_reduce(double v, double* red, bool is_max) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = CT / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s)
      red[threadIdx.x] = is_max ? fmax(red[threadIdx.x], red[threadIdx.x + s])
                                : red[threadIdx.x] + red[threadIdx.x + s];
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();
  return r;
}

// One block per row: max, then the sum of exp(z - max) (strided per thread, fixed tree).
__global__ void __launch_bounds__(CT) k_ce_rows(const double* logits, const int64_t* targets,
                                                int64_t V, double* loss, double* lse) {
  __shared__ double red[CT];
  const int64_t t = blockIdx.x;
  const double* z = logits + t * V;
  double m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += CT) m = fmax(m, z[v]);
  m = row_reduce(m, red, true);
  double se = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += CT) se += exp(z[v] - m);
  se = row_reduce(se, red, false);
  if (threadIdx.x == 0) {
    const double logse = log(se);
    if (loss) loss[t] = (m - z[targets[t]]) + logse;  // exact log(V) for equal logits
    if (lse) lse[t] = m + logse;
  }
}

__global__ void k_ce_grad(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                          const double* lse, double scale, double* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * V;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / V, v = i % V;
    double g = exp(logits[i] - lse[r]) * scale;
    if (v == targets[r]) g -= scale;
    out[i] = g;
  }
}

// LossSum::add over the tokens in order: one thread, the only order that matches the host's.
__global__ void k_loss_sum_add(const double* loss, int64_t n, double* st) {
  double total = st[0], first = st[1], shifted = st[2], count = st[3];
  for (int64_t t = 0; t < n; ++t) {
    if (count == 0.0) first = loss[t];
    total += loss[t];
    shifted += loss[t] - first;
    count += 1.0;
  }
  st[0] = total, st[1] = first, st[2] = shifted, st[3] = count;
}

// ---- host side ---------------------------------------------------------------------------------

unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), 8192)));
}

// Carves one caller-provided block into 256-byte aligned pieces; also sizes it (base null).
struct Carver {
  unsigned char* base;
  int64_t off = 0;
  explicit Carver(void* b) : base(static_cast<unsigned char*>(b)) {}
  template <class X>
  X* take(int64_t count) {
    X* p = base ? reinterpret_cast<X*>(base + off) : nullptr;
    off += round_up(std::max<int64_t>(count, 1) * int64_t(sizeof(X)), 256);
    return p;
  }
};

// The chunk the device runs: the caller's, and for half inputs rounded down to a multiple of 16
// (at least 16) so d_weight's tensor-core k-steps group the same tokens for every chunk size.
template <class T>
int64_t device_chunk(const FusedArgs<T>& a) {
  int64_t c = std::min(a.chunk, a.n_tok);
  if (a.elem == Elem::BF16 || a.elem == Elem::F16) c = std::min(a.n_tok, std::max<int64_t>(16, c - c % 16));
  return c;
}

bool is_half(Elem e) { return e == Elem::BF16 || e == Elem::F16; }

template <class T>
struct Scratch {
  int* flags;                  // 8 flags, then first_bad
  unsigned long long* first_bad;
  double* prep;                // 4
  uint8_t* valid;              // N
  double *ce, *zl;             // N
  double *ztarget, *lse_c, *coef;  // C, C, 4C
  BlockStatD* stats;           // C * nvb
  T* logits;                   // C * V, with gradients
  T* dw_acc;                   // V * D, for half d_weight
  T* db_acc;                   // V, for half d_bias
  double* sums;                // 10, when the caller passes none
  int64_t bytes;
};

template <class T>
Scratch<T> carve(const FusedArgs<T>& a, const FusedCudaOut<T>& out, void* base) {
  const int64_t N = a.n_tok, V = a.vocab, D = a.d_model, C = device_chunk(a);
  const int64_t nvb = ceil_div(V, BN);
  const bool grad = out.d_hidden || out.d_weight || out.d_bias;
  const bool half_g = is_half(out.grad_elem);
  Carver cv(base);
  Scratch<T> s;
  s.flags = cv.take<int>(8);
  s.first_bad = cv.take<unsigned long long>(1);
  s.prep = cv.take<double>(4);
  s.valid = cv.take<uint8_t>(N);
  s.ce = cv.take<double>(N);
  s.zl = cv.take<double>(N);
  s.ztarget = cv.take<double>(C);
  s.lse_c = cv.take<double>(C);
  s.coef = cv.take<double>(4 * C);
  s.stats = cv.take<BlockStatD>(C * nvb);
  s.sums = cv.take<double>(10);
  s.logits = grad ? cv.take<T>(C * V) : nullptr;
  s.dw_acc = out.d_weight && half_g ? cv.take<T>(V * D) : nullptr;
  s.db_acc = out.d_bias && half_g ? cv.take<T>(V) : nullptr;
  s.bytes = cv.off;
  return s;
}

// The data's refusals, in the CPU backend's order, from the device's flags.
template <class T>
void check_data(const FusedArgs<T>& a, const Scratch<T>& s, cudaStream_t st) {
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  CK(cudaMemsetAsync(s.flags, 0, 8 * sizeof(int), st));
  CK(cudaMemsetAsync(s.first_bad, 0xff, sizeof(unsigned long long), st));
  auto finite = [&](const void* p, int64_t n, Elem e, int flag) {
    if (!p) return;
    const unsigned g = grid_for(n, 256);
    switch (e) {
      case Elem::F32: k_check_finite<float><<<g, 256, 0, st>>>(static_cast<const float*>(p), n, s.flags + flag); break;
      case Elem::F64: k_check_finite<double><<<g, 256, 0, st>>>(static_cast<const double*>(p), n, s.flags + flag); break;
      case Elem::BF16: k_check_finite<__nv_bfloat16><<<g, 256, 0, st>>>(static_cast<const __nv_bfloat16*>(p), n, s.flags + flag); break;
      case Elem::F16: k_check_finite<__half><<<g, 256, 0, st>>>(static_cast<const __half*>(p), n, s.flags + flag); break;
    }
    CK(cudaGetLastError());
  };
  const Elem te = sizeof(T) == 8 ? Elem::F64 : Elem::F32;
  finite(a.grad_output, N, te, 0);
  finite(a.grad_lse, N, te, 1);
  finite(a.grad_coef, 3 * N, te, 2);
  finite(a.hidden, N * D, a.elem, 3);
  finite(a.weight, V * D, a.elem, 4);
  finite(a.bias, V, a.elem, 5);
  finite(a.class_weight, V, te, 6);
  k_check_targets<<<grid_for(N, 256), 256, 0, st>>>(a.targets, N, a.shift, a.seq_len,
                                                    a.has_ignore, a.ignore_index, V, s.first_bad);
  CK(cudaGetLastError());
  int flags[8];
  unsigned long long first = 0;
  CK(cudaMemcpyAsync(flags, s.flags, sizeof flags, cudaMemcpyDeviceToHost, st));
  CK(cudaMemcpyAsync(&first, s.first_bad, sizeof first, cudaMemcpyDeviceToHost, st));
  CK(cudaStreamSynchronize(st));
  static const char* const what[7] = {
      "grad_output contains NaN or infinity", "the gradient of lse contains NaN or infinity",
      "grad_coef contains NaN or infinity", "hidden contains NaN or infinity",
      "weight contains NaN or infinity", "linear_bias contains NaN or infinity",
      "the class weights contain NaN or infinity"};
  for (int i = 0; i < 7; ++i)
    if (flags[i]) refuse(LOSS_ERR_NON_FINITE, what[i]);
  if (first != ~0ull) {
    int64_t y = 0;
    CK(cudaMemcpyAsync(&y, a.targets + int64_t(first) + a.shift, sizeof y, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    refuse(LOSS_ERR_TARGET_OUT_OF_RANGE,
           "target " + std::to_string(y) + " at token " + std::to_string(int64_t(first) + a.shift) +
               " is outside [0, " + std::to_string(V) + ")" +
               (a.has_ignore ? "" : " (no ignore_index was given)"));
  }
}

// The forward tile for the inputs' element type.
template <class T>
void launch_forward(const FusedArgs<T>& a, const TileArgs<T>& p, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<SIMT, double, double, false, double, false, EPI_STATS, double>(p, s);
  } else {
    switch (a.elem) {
      case Elem::BF16:
        launch_tile<WMMA_BF16, float, __nv_bfloat16, false, __nv_bfloat16, false, EPI_STATS, float>(p, s);
        break;
      case Elem::F16:
        launch_tile<WMMA_F16, float, __half, false, __half, false, EPI_STATS, float>(p, s);
        break;
      default:
        launch_tile<SIMT, float, float, false, float, false, EPI_STATS, float>(p, s);
    }
  }
}

// d_hidden rows = G (c, V) @ W (V, D), written in grad_elem.
template <class T>
void launch_dhidden(const FusedArgs<T>& a, const TileArgs<T>& p, Elem ge, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<SIMT, double, double, false, double, true, EPI_STORE, double>(p, s);
  } else {
    switch (a.elem) {
      case Elem::BF16:
        if (ge == Elem::BF16)
          launch_tile<WMMA_BF16, float, float, false, __nv_bfloat16, true, EPI_STORE, __nv_bfloat16>(p, s);
        else
          launch_tile<WMMA_BF16, float, float, false, __nv_bfloat16, true, EPI_STORE, float>(p, s);
        break;
      case Elem::F16:
        if (ge == Elem::F16)
          launch_tile<WMMA_TF32, float, float, false, __half, true, EPI_STORE, __half>(p, s);
        else
          launch_tile<WMMA_TF32, float, float, false, __half, true, EPI_STORE, float>(p, s);
        break;
      default:
        launch_tile<SIMT, float, float, false, float, true, EPI_STORE, float>(p, s);
    }
  }
}

// d_weight (V, D) += G^T (V, c) @ H (c, D), into the T accumulator.
template <class T>
void launch_dweight(const FusedArgs<T>& a, const TileArgs<T>& p, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<SIMT, double, double, true, double, true, EPI_STORE, double>(p, s);
  } else {
    switch (a.elem) {
      case Elem::BF16:
        launch_tile<WMMA_BF16, float, float, true, __nv_bfloat16, true, EPI_STORE, float>(p, s);
        break;
      case Elem::F16:
        launch_tile<WMMA_TF32, float, float, true, __half, true, EPI_STORE, float>(p, s);
        break;
      default:
        launch_tile<SIMT, float, float, true, float, true, EPI_STORE, float>(p, s);
    }
  }
}

template <class T>
void narrow(const T* src, void* dst, int64_t n, Elem e, cudaStream_t s) {
  const unsigned g = grid_for(n, 256);
  if (e == Elem::BF16) k_narrow<T, __nv_bfloat16><<<g, 256, 0, s>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  else k_narrow<T, __half><<<g, 256, 0, s>>>(src, static_cast<__half*>(dst), n);
  CK(cudaGetLastError());
}

size_t elem_bytes(Elem e) { return e == Elem::F64 ? 8 : e == Elem::F32 ? 4 : 2; }

// Device memory that frees itself (the host entry points' copies).
struct DevBuf {
  void* p = nullptr;
  DevBuf() = default;
  explicit DevBuf(size_t bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  DevBuf(const void* host, size_t bytes) : DevBuf(bytes) {
    if (host) CK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p) { o.p = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  template <class X>
  X* as() const {
    return static_cast<X*>(p);
  }
};

void to_host(void* dst, const void* src, size_t bytes) {
  if (dst && src) CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace

template <class T>
int64_t fused_linear_ce_cuda_workspace(const FusedArgs<T>& a, const FusedCudaOut<T>& out) {
  return carve(a, out, nullptr).bytes;
}

template <class T>
void fused_linear_ce_cuda(const FusedArgs<T>& a, FusedCudaOut<T>& out, void* workspace,
                          int64_t workspace_bytes, void* stream) {
  std::string why;
  const int st = fused_linear_ce_check_shape(a, &why);
  if (st != LOSS_OK) refuse(st, why);
  require_device("fused_linear_ce");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab, C = device_chunk(a);
  const int64_t nvb = ceil_div(V, BN);
  const Scratch<T> sc = carve(a, out, workspace);
  if (!workspace || workspace_bytes < sc.bytes)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the workspace has " + std::to_string(workspace_bytes) +
                                         " bytes, this call needs " + std::to_string(sc.bytes));
  const bool want_dh = out.d_hidden, want_dw = out.d_weight, want_db = out.d_bias;
  const bool grad = want_dh || want_dw || want_db;
  const bool half_g = is_half(out.grad_elem);
  if (half_g && !is_half(a.elem))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
  if (out.accuracy && !out.pred)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the accuracy needs the per-token argmax (pred)");
  if ((out.loss || out.z) && a.reduction == Reduction::None)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "reduction none has per-token losses only (loss_tok)");
  check_data(a, sc, s);

  const double cap = a.has_softcap ? a.softcap : 0.0;
  const T* cw = a.class_weight;
  k_prepare<T><<<1, RT, 0, s>>>(a.targets, N, V, a.shift, a.seq_len, a.has_ignore, a.ignore_index,
                                cw, sc.valid, sc.prep);
  CK(cudaGetLastError());
  T* dw = want_dw ? (half_g ? sc.dw_acc : static_cast<T*>(out.d_weight)) : nullptr;
  T* db = want_db ? (half_g ? sc.db_acc : static_cast<T*>(out.d_bias)) : nullptr;
  if (db) CK(cudaMemsetAsync(db, 0, sizeof(T) * size_t(V), s));
  const size_t esz = elem_bytes(a.elem);
  const unsigned char* H = static_cast<const unsigned char*>(a.hidden);

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = std::min(C, N - t0);
    TileArgs<T> f;
    f.M = c, f.N = V, f.K = D;
    f.A = H + size_t(t0 * D) * esz, f.lda = D;
    f.B = a.weight, f.ldb = D;
    f.stats = sc.stats, f.nvb = nvb;
    f.logits = grad ? sc.logits : nullptr;
    f.bias = a.bias, f.cap = cap;
    f.stats_w = a.label_smoothing > 0.0 || out.logit_sum ? cw : nullptr;
    f.targets = a.targets, f.valid = sc.valid, f.t0 = t0, f.shift = a.shift;
    f.ztarget = sc.ztarget;
    CK(cudaMemsetAsync(sc.ztarget, 0xff, sizeof(double) * size_t(c), s));  // NaN: no target
    launch_forward(a, f, s);

    MergeArgs<T> m;
    m.stats = sc.stats, m.nvb = nvb, m.c = c, m.t0 = t0, m.V = V, m.shift = a.shift;
    m.valid = sc.valid, m.targets = a.targets, m.cw = cw, m.ztarget = sc.ztarget, m.prep = sc.prep;
    m.eps = a.label_smoothing, m.zs = a.z_loss, m.cap = cap, m.reduction = a.reduction;
    m.grad_scale = a.grad_scale, m.grad_output = a.grad_output, m.grad_lse = a.grad_lse;
    m.grad_coef = a.grad_coef, m.with_grad = grad;
    m.ce = sc.ce, m.zl = sc.zl, m.lse = out.lse, m.loss_tok = out.loss_tok, m.z_tok = out.z_tok;
    m.target_logit = out.target_logit, m.logit_sum = out.logit_sum, m.pred = out.pred;
    m.lse_c = sc.lse_c, m.coef = sc.coef;
    k_merge<T><<<unsigned(ceil_div(c, 128)), 128, 0, s>>>(m);
    CK(cudaGetLastError());
    if (!grad) continue;

    k_softmax_grad<T><<<grid_for(c * V, 256), 256, 0, s>>>(sc.logits, c, V, sc.lse_c, sc.coef, cw, cap);
    CK(cudaGetLastError());
    if (want_dh) {
      TileArgs<T> g;
      g.M = c, g.N = D, g.K = V;
      g.A = sc.logits, g.lda = V;
      g.B = a.weight, g.ldb = D;
      g.C = static_cast<unsigned char*>(out.d_hidden) + size_t(t0 * D) * elem_bytes(out.grad_elem);
      g.ldc = D;
      launch_dhidden(a, g, out.grad_elem, s);
    }
    if (want_dw) {
      TileArgs<T> g;
      g.M = V, g.N = D, g.K = c;
      g.A = sc.logits, g.lda = V;
      g.B = H + size_t(t0 * D) * esz, g.ldb = D;
      g.C = dw, g.ldc = D, g.accumulate = t0 > 0;
      launch_dweight(a, g, s);
    }
    if (want_db) {
      k_bias_grad<T><<<unsigned(ceil_div(V, 256)), 256, 0, s>>>(sc.logits, c, V, db);
      CK(cudaGetLastError());
    }
  }

  k_finish<T><<<1, RT, 0, s>>>(sc.ce, sc.zl, sc.valid, out.pred, a.targets, a.shift, N, sc.prep,
                               cw != nullptr, a.reduction, out.sums ? out.sums : sc.sums, out.loss,
                               out.z, out.accuracy);
  CK(cudaGetLastError());
  if (half_g) {
    if (want_dw) narrow(sc.dw_acc, out.d_weight, V * D, out.grad_elem, s);
    if (want_db) narrow(sc.db_acc, out.d_bias, V, out.grad_elem, s);
  }
}

template <class T>
void fused_linear_ce_cuda_host(const FusedArgs<T>& a, FusedOut<T>& out) {
  require_device("fused_linear_ce");
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const size_t esz = elem_bytes(a.elem), tsz = sizeof(T);
  FusedArgs<T> d = a;
  DevBuf hidden(a.hidden, size_t(N * D) * esz), weight(a.weight, size_t(V * D) * esz);
  DevBuf bias, targets, cw, go, gl, gc;
  d.hidden = hidden.p;
  d.weight = weight.p;
  if (a.bias) bias = DevBuf(a.bias, size_t(V) * esz), d.bias = bias.p;
  // targets: the scored rows read targets[t + shift] for t < N - shift, all inside the N given
  targets = DevBuf(a.targets, size_t(N) * sizeof(int64_t));
  d.targets = targets.as<int64_t>();
  if (a.class_weight) cw = DevBuf(a.class_weight, size_t(V) * tsz), d.class_weight = cw.as<T>();
  if (a.grad_output) go = DevBuf(a.grad_output, size_t(N) * tsz), d.grad_output = go.as<T>();
  if (a.grad_lse) gl = DevBuf(a.grad_lse, size_t(N) * tsz), d.grad_lse = gl.as<T>();
  if (a.grad_coef) gc = DevBuf(a.grad_coef, size_t(3 * N) * tsz), d.grad_coef = gc.as<T>();

  FusedCudaOut<T> o;
  o.grad_elem = out.grad_elem;
  const size_t gsz = elem_bytes(out.grad_elem);
  DevBuf lse(size_t(N) * tsz), sums(10 * sizeof(double)), loss_tok, z_tok, pred, tl, ls, dh, dw, db;
  o.lse = lse.as<T>();
  o.sums = sums.as<double>();
  if (out.loss_tok) loss_tok = DevBuf(size_t(N) * tsz), o.loss_tok = loss_tok.as<T>();
  if (out.z_tok) z_tok = DevBuf(size_t(N) * tsz), o.z_tok = z_tok.as<T>();
  if (out.pred) pred = DevBuf(size_t(N) * sizeof(int64_t)), o.pred = pred.as<int64_t>();
  if (out.target_logit) tl = DevBuf(size_t(N) * tsz), o.target_logit = tl.as<T>();
  if (out.logit_sum) ls = DevBuf(size_t(N) * tsz), o.logit_sum = ls.as<T>();
  if (out.d_hidden) dh = DevBuf(size_t(N * D) * gsz), o.d_hidden = dh.p;
  if (out.d_weight) dw = DevBuf(size_t(V * D) * gsz), o.d_weight = dw.p;
  if (out.d_bias) db = DevBuf(size_t(V) * gsz), o.d_bias = db.p;
  DevBuf ws(size_t(fused_linear_ce_cuda_workspace(d, o)));
  fused_linear_ce_cuda(d, o, ws.p, fused_linear_ce_cuda_workspace(d, o), nullptr);

  to_host(out.lse, o.lse, size_t(N) * tsz);
  to_host(out.loss_tok, o.loss_tok, size_t(N) * tsz);
  to_host(out.z_tok, o.z_tok, size_t(N) * tsz);
  to_host(out.pred, o.pred, size_t(N) * sizeof(int64_t));
  to_host(out.target_logit, o.target_logit, size_t(N) * tsz);
  to_host(out.logit_sum, o.logit_sum, size_t(N) * tsz);
  to_host(out.d_hidden, o.d_hidden, size_t(N * D) * gsz);
  // A half d_weight/d_bias lands in the first V*D (V) uint16 of the host accumulators, as the
  // CPU backend leaves it.
  to_host(out.d_weight, o.d_weight, size_t(V * D) * gsz);
  to_host(out.d_bias, o.d_bias, size_t(V) * gsz);
  double s[10];
  to_host(s, o.sums, sizeof s);
  out.ce.total = s[0], out.ce.first = s[1], out.ce.shifted = s[2], out.ce.count = int64_t(s[3]);
  out.z.total = s[4], out.z.first = s[5], out.z.shifted = s[6], out.z.count = int64_t(s[7]);
  out.weight_sum = s[8];
  out.n_correct = int64_t(s[9]);
  out.weighted = a.class_weight != nullptr;
}

template int64_t fused_linear_ce_cuda_workspace<float>(const FusedArgs<float>&, const FusedCudaOut<float>&);
template int64_t fused_linear_ce_cuda_workspace<double>(const FusedArgs<double>&, const FusedCudaOut<double>&);
template void fused_linear_ce_cuda<float>(const FusedArgs<float>&, FusedCudaOut<float>&, void*, int64_t, void*);
template void fused_linear_ce_cuda<double>(const FusedArgs<double>&, FusedCudaOut<double>&, void*, int64_t, void*);
template void fused_linear_ce_cuda_host<float>(const FusedArgs<float>&, FusedOut<float>&);
template void fused_linear_ce_cuda_host<double>(const FusedArgs<double>&, FusedOut<double>&);

// ---- the seed's kernels ------------------------------------------------------------------------

namespace {

// Dims and data of materialized logits, checked on the device (585 then 586, as the host check).
void check_logits(const double* logits, const int64_t* targets, int64_t n, int64_t V, cudaStream_t s) {
  std::string why;
  if (n < 1 || V < 1 || n > LOSS_MAX_TOKENS || V > LOSS_MAX_VOCAB) {
    const int st = ce_from_logits_check(nullptr, nullptr, n, V, &why);
    refuse(st, why);
  }
  require_device("ce_from_logits");
  DevBuf flags(sizeof(int) + sizeof(unsigned long long) * 2);
  int* f = flags.as<int>();
  unsigned long long* first = reinterpret_cast<unsigned long long*>(flags.as<unsigned char>() + 8);
  CK(cudaMemsetAsync(f, 0, sizeof(int), s));
  CK(cudaMemsetAsync(first, 0xff, sizeof *first, s));
  k_check_finite<double><<<grid_for(n * V, 256), 256, 0, s>>>(logits, n * V, f);
  CK(cudaGetLastError());
  k_check_targets<<<grid_for(n, 256), 256, 0, s>>>(targets, n, 0, 1, false, 0, V, first);
  CK(cudaGetLastError());
  int bad = 0;
  unsigned long long fb = 0;
  CK(cudaMemcpyAsync(&bad, f, sizeof bad, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&fb, first, sizeof fb, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  if (bad) refuse(LOSS_ERR_NON_FINITE, "logits contain NaN or infinity");
  if (fb != ~0ull) {
    int64_t y = 0;
    CK(cudaMemcpy(&y, targets + fb, sizeof y, cudaMemcpyDeviceToHost));
    refuse(LOSS_ERR_TARGET_OUT_OF_RANGE, "target " + std::to_string(y) + " at token " +
                                             std::to_string(fb) + " is outside [0, " +
                                             std::to_string(V) + ")");
  }
}

}  // namespace

void ce_from_logits_cuda(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                         double* loss_tok, double* lse, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  check_logits(logits, targets, n, V, s);
  k_ce_rows<<<unsigned(n), CT, 0, s>>>(logits, targets, V, loss_tok, lse);
  CK(cudaGetLastError());
}

void ce_grad_logits_cuda(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                         double scale, double* out, void* stream) {
  if (!loss_scalars_ok(scale)) refuse(LOSS_ERR_NON_FINITE, "scale must be finite");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  check_logits(logits, targets, n, V, s);
  DevBuf lse(size_t(n) * sizeof(double));
  k_ce_rows<<<unsigned(n), CT, 0, s>>>(logits, targets, V, nullptr, lse.as<double>());
  CK(cudaGetLastError());
  k_ce_grad<<<grid_for(n * V, 256), 256, 0, s>>>(logits, targets, n, V, lse.as<double>(), scale, out);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));  // lse is freed on return
}

void loss_sum_add_cuda(const double* loss_tok, int64_t n, double* state, void* stream) {
  if (n < 0) refuse(LOSS_ERR_EMPTY_DIMENSION, "n_tok must be >= 0");
  if (n == 0) return;
  require_device("CEAccumulator");
  k_loss_sum_add<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(loss_tok, n, state);
  CK(cudaGetLastError());
}

void ce_from_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                              LossSum& sum, double* lse, double* loss_tok) {
  require_device("ce_from_logits");
  DevBuf z(logits, size_t(n * V) * sizeof(double)), t(targets, size_t(n) * sizeof(int64_t));
  DevBuf l(size_t(n) * sizeof(double)), e(size_t(n) * sizeof(double));
  double st[4] = {sum.total, sum.first, sum.shifted, double(sum.count)};
  DevBuf state(st, sizeof st);
  ce_from_logits_cuda(z.as<double>(), t.as<int64_t>(), n, V, l.as<double>(), e.as<double>(), nullptr);
  loss_sum_add_cuda(l.as<double>(), n, state.as<double>(), nullptr);
  to_host(lse, e.p, size_t(n) * sizeof(double));
  to_host(loss_tok, l.p, size_t(n) * sizeof(double));
  to_host(st, state.p, sizeof st);
  sum.total = st[0], sum.first = st[1], sum.shifted = st[2], sum.count = int64_t(st[3]);
}

void cuda_set_device(int device) {
  require_device("cuda_set_device");
  CK(cudaSetDevice(device));
}

void ce_grad_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                              double scale, double* out) {
  require_device("ce_grad_logits");
  DevBuf z(logits, size_t(n * V) * sizeof(double)), t(targets, size_t(n) * sizeof(int64_t));
  DevBuf g(size_t(n * V) * sizeof(double));
  ce_grad_logits_cuda(z.as<double>(), t.as<int64_t>(), n, V, scale, g.as<double>(), nullptr);
  to_host(out, g.p, size_t(n * V) * sizeof(double));
}

}  // namespace lossk
}  // namespace algenta

// Internal: the hot CPU kernels, compiled once per instruction set (kernels_isa.cpp with
// ALGENTA_ISA_NS = isa_generic / isa_avx2 / isa_avx512) and chosen at run time by
// cpu_dispatch.cpp. Not part of any family's contract.
//
// Exactness: every GEMM output cell is ONE multiply-add chain over k in increasing order,
// started from 0 (accumulate=false) or from the cell's current value (accumulate=true). Partial
// tiles are computed by the same micro-kernel on zero-padded panels, so a cell's bits never
// depend on where it sits in a tile, how the caller split M or N among threads, or how K was
// split across calls (a split K continues the same chain through accumulate=true).
#pragma once
#include <cstddef>
#include <cstdint>

namespace algenta {
namespace kern {

// Per-row statistics of one vocab block of logits, the unit the log-sum-exp merges in order.
struct BlockStats {
  double max;     // max_v z_v (exact: a max never rounds)
  double sumexp;  // sum_v exp(z_v - max), summed in a fixed lane order
  double sumz;    // sum_v z_v (label smoothing needs the mean logit)
};

template <class T>
struct IsaOps {
  // C (M x N, row stride ldc) (+)= A (M x K) * B (K x N); element (i,k) of A is A[i*rsa + k*csa]
  // and (k,j) of B is B[k*rsb + j*csb]. ws: gemm_ws_elems() elements of scratch, per thread.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa, const T* B,
               int64_t rsb, int64_t csb, T* C, int64_t ldc, bool accumulate, T* ws);
  int64_t (*gemm_ws_elems)();
  // B (K x N, N <= packed_b_max_cols()) packed once into packed_b_elems(K, N) elements, for
  // callers that multiply many row blocks by the same B. gemm_pb then gives exactly the bits
  // gemm gives for the same A, B and C.
  void (*pack_b_full)(int64_t K, int64_t N, const T* B, int64_t rsb, int64_t csb, T* Bp);
  int64_t (*packed_b_elems)(int64_t K, int64_t N);
  int64_t (*packed_b_max_cols)();
  void (*gemm_pb)(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa,
                  const T* Bp, T* C, int64_t ldc, bool accumulate, T* ws);
  // A (M x K) packed once into packed_a_elems(M, K) elements, by disjoint row ranges [r0, r1)
  // with r0 a multiple of row_quantum() (so threads may share the work). gemm_papb multiplies
  // rows [row0, row0 + m) of it (row0 a multiple of row_quantum()) by a pack_b_full B.
  int64_t (*packed_a_elems)(int64_t M, int64_t K);
  void (*pack_a_rows)(int64_t M, int64_t K, int64_t r0, int64_t r1, const T* A, int64_t rsa,
                      int64_t csa, T* Ap);
  void (*gemm_papb)(int64_t M, int64_t row0, int64_t m, int64_t N, int64_t K, const T* Ap,
                    const T* Bp, T* C, int64_t ldc, bool accumulate, T* ws);
  int64_t (*row_quantum)();
  // Statistics of z[0..n).
  BlockStats (*block_stats)(const T* z, int64_t n);
  // z[v] <- (exp(z[v] - lse) - off) * scale for v in [0, n): softmax minus a uniform offset,
  // the label-smoothed one-hot's background; the caller subtracts the target's own share.
  void (*softmax_shift)(T* z, int64_t n, double lse, double off, double scale);
};

struct IsaTable {
  const char* name;
  IsaOps<float> f32;
  IsaOps<double> f64;
};

// The table for the best instruction set this host supports, or the one named by the
// environment variable ALGENTA_ISA (generic, avx2, avx512) when set; an unknown or unsupported
// name there is refused with a clear message the first time kernels are needed.
const IsaTable& isa();
// Name of the active instruction set ("avx2", ...), or the refusal message if ALGENTA_ISA is bad.
const char* isa_name();

template <class T>
inline const IsaOps<T>& ops();
template <>
inline const IsaOps<float>& ops<float>() { return isa().f32; }
template <>
inline const IsaOps<double>& ops<double>() { return isa().f64; }

}  // namespace kern
}  // namespace algenta

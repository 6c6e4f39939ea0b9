// Internal: the hot CPU kernels of both families, compiled once per instruction set (one file a
// job under cpp/src/kernels/, parts.hpp lists them, each with ALGENTA_ISA_NS = isa_generic /
// isa_avx2 / isa_avx512 / isa_avx512bf16 / isa_amx; kernels/tables.cpp fills this header's tables)
// and chosen at run time by cpu_dispatch.cpp: one dispatch, so a new instruction set is added in
// one place. Not part of any family's contract.
//
// Exactness: every GEMM output cell is ONE multiply-add chain over k in increasing order,
// started from 0 (accumulate=false) or from the cell's current value (accumulate=true). Partial
// tiles are computed by the same micro-kernel on zero-padded panels, so a cell's bits never
// depend on where it sits in a tile, how the caller split M or N among threads, or how K was
// split across calls (a split K continues the same chain through accumulate=true).
#pragma once
#include <cstddef>
#include <cstdint>

#include "algenta/dtype.hpp"

namespace algenta {
namespace kern {

// Per-row statistics of one vocab block of logits, the unit the log-sum-exp merges in order.
struct BlockStats {
  double max;     // max_v z_v (exact: a max never rounds)
  double sumexp;  // sum_v exp(z_v - max), summed in a fixed lane order
  double sumz;    // sum_v z_v, or sum_v w_v z_v with class weights (label smoothing needs it)
  // sum_v exp(z_v - max) (max - z_v) when asked for (the entropy's: terms >= 0, no cancellation),
  // else 0
  double sument;
};

// Half-precision element storage (bit patterns in uint16_t): bfloat16 or IEEE binary16.
enum Half : int { HALF_BF16 = 0, HALF_F16 = 1 };

// bfloat16 dot-product GEMMs (AVX512-BF16 vdpbf16ps, or AMX tdpbf16ps tiles), the fast path of
// bfloat16 lossk inputs and the session's bf16 prefill; every pointer null in an instruction set
// without them. Operands are packed as k-pairs of bf16 (uint32 each; the packed layouts are the
// path's own: kernels/x86/bf16dot.cpp, kernels/amx/amx.cpp), accumulation is float32, and each
// output cell is one chain over groups of k_quantum values of k in increasing order (the
// instruction's k step: 2 for vdpbf16ps, 32 for an AMX tile), started from 0 or continued from
// C: the same split invariance as the float32 GEMMs, provided every split of K falls on a
// multiple of k_quantum.
struct Bf16DotOps {
  // A (M x K bf16) packed once, by disjoint row ranges [r0, r1), r0 and r1 multiples of
  // row_quantum() (r1 may be M): the last panel of a range is zero-padded, so two ranges must not
  // share one.
  int64_t (*packed_a_elems)(int64_t M, int64_t K);  // uint32 elements
  void (*pack_a_rows)(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A,
                      int64_t rsa, int64_t csa, uint32_t* Ap);
  // B (K x N bf16, N <= packed_b_max_cols()) packed once.
  int64_t (*packed_b_elems)(int64_t K, int64_t N);  // uint32 elements
  int64_t (*packed_b_max_cols)();
  void (*pack_b_full)(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                      uint32_t* Bp);
  // C (+)= rows [row0, row0 + m) of a packed A times a packed B (the logits).
  void (*gemm_papb)(int64_t M, int64_t row0, int64_t m, int64_t N, int64_t K, const uint32_t* Ap,
                    const uint32_t* Bp, float* C, int64_t ldc, bool accumulate, float* ws);
  // C (+)= A (bf16) times B (bf16), both strided views packed as they are used: d_hidden.
  void (*gemm_bb)(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                  const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc,
                  bool accumulate, float* ws);
  // C (+)= A (bf16, a strided view) times a packed B: d_weight.
  void (*gemm_bpb)(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
                   const uint32_t* Bp, float* C, int64_t ldc, bool accumulate, float* ws);
  int64_t (*row_quantum)();
  int64_t k_quantum;  // a split of K must fall on a multiple of it (see above)
  const char* path;   // "vdpbf16ps" or "amx"
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
  // with r0 and r1 multiples of row_quantum() (r1 may be M; so threads may share the work, each
  // range's last panel being zero-padded). gemm_papb multiplies
  // rows [row0, row0 + m) of it (row0 a multiple of row_quantum()) by a pack_b_full B.
  int64_t (*packed_a_elems)(int64_t M, int64_t K);
  void (*pack_a_rows)(int64_t M, int64_t K, int64_t r0, int64_t r1, const T* A, int64_t rsa,
                      int64_t csa, T* Ap);
  void (*gemm_papb)(int64_t M, int64_t row0, int64_t m, int64_t N, int64_t K, const T* Ap,
                    const T* Bp, T* C, int64_t ldc, bool accumulate, T* ws);
  int64_t (*row_quantum)();
  // Statistics of z[0..n); with w (n class weights) sumz is sum_v w[v] z[v]; sument only with
  // entropy set.
  BlockStats (*block_stats)(const T* z, int64_t n, const T* w, bool entropy);
  // The logits' epilogue, on a tile while it is hot: z[v] += bias[v] (bias may be null), then
  // with cap > 0 the soft cap over the temperature z[v] = (cap / t) * tanh(z[v] / cap), else
  // z[v] / t (t = 1: nothing).
  void (*logit_epilogue)(T* z, int64_t n, const T* bias, double cap, double temperature);
  // d_logits of one token from its (capped) logits, in place, for v in [0, n):
  //   z[v] <- (exp(z[v] - lse) * (a + e (z[v] - m)) - b * (w ? w[v] : 1))
  //           * (cap > 0 ? 1 - (z[v] / cap)^2 : 1)
  // softmax scaled by a (and, for the entropy's gradient, by e times the logit's distance from
  // the token's max m; e = 0: the term is not formed), minus the label-smoothed target's
  // (class-weighted) background, through
  // the soft cap's derivative (cap: the capped logits' amplitude, cap / t when tempered; the
  // caller folds 1 / t into a and b); the caller subtracts the target's own share.
  void (*softmax_grad)(T* z, int64_t n, double lse, double a, double b, const T* w, double cap,
                       double e, double m);

  // Half-precision sources (T = float only; null entries for double), indexed by Half: the same
  // packing and GEMM with each source element widened exactly as it is packed, so a half input
  // is never widened into a copy of itself.
  void (*pack_b_full_h[2])(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                           T* Bp);
  void (*pack_a_rows_h[2])(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A,
                           int64_t rsa, int64_t csa, T* Ap);
  void (*gemm_bh[2])(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa,
                     const uint16_t* B, int64_t rsb, int64_t csb, T* C, int64_t ldc,
                     bool accumulate, T* ws);
  // dst[i] = src[i] rounded to the half format (to nearest even; past its range, infinity).
  // src and dst may overlap only when dst <= src in bytes (the caller narrows front to back).
  void (*narrow_h[2])(const T* src, uint16_t* dst, int64_t n);
  // dst[i] = src[i] widened exactly.
  void (*widen_h[2])(const uint16_t* src, T* dst, int64_t n);
  // bfloat16 dot products (T = float only), where the instruction set has them; ws is
  // gemm_ws_elems() of this table.
  Bf16DotOps bf16dot;
};

// ---- the resident session's weight panels -----------------------------------------------------
// A session weight matrix (N rows of K) is resident as ceil(N / PANEL_ROWS) blocks of
// block_bytes(K) bytes each, rows past N zero, in the layout the instruction set's GEMM
// micro-kernel reads without packing (PanelOps says whose), so prefill never packs a weight. One
// gemm serves prefill (M rows) and a decode step (M = 1) with ONE sequence of roundings per output
// cell for every M, every N and every first block: a prompt's logits are bit-identical whether it
// is prefilled at once, in pieces, or stepped, and so would a sequence's be in any batch.
constexpr int64_t PANEL_ROWS = 64;

// The activation rows a format's panels multiply (act says which field): float32 values (f32,
// f16, and bf16 where the panels widen: values already rounded to bf16), bf16 bits (bf16 on
// vdpbf16ps; rows zero-padded to an even count), or int8 codes and block scales (quantize_q8's;
// rows zero-padded to a whole block). ld: elements between rows, lds: scales between rows.
enum : int { ACT_F32 = 0, ACT_BF16_BITS = 1, ACT_Q8 = 2 };
struct PanelAct {
  const float* f = nullptr;
  const uint16_t* b = nullptr;
  const int8_t* q = nullptr;
  const float* s = nullptr;
  int64_t ld = 0, lds = 0;
  // the rows already packed by PanelOps::pack (the same M and K), or null: prefill packs them
  // once for all its tasks instead of once a task
  const void* packed = nullptr;
};

struct PanelOps {
  int64_t (*block_bytes)(int64_t K);
  // One row into its block (blk: the block's first byte; c = the row's index within it): K
  // values in the format (float32, bf16/f16 bits, or int8 codes with their block scales).
  void (*put_row)(void* blk, int64_t K, int64_t c, const void* row, const float* scales);
  // Row c of a block widened exactly to float32 (int8: codes times their scales).
  void (*get_row)(const void* blk, int64_t K, int64_t c, float* dst);
  // Y (M rows, ldy apart) (+)= X times the first N rows of the blocks at W (transposed). A
  // cell's sum: f32, f16, bf16: one multiply-add chain per k block of the layout, the block sums
  // added in order (to Y's value when accumulating); int8: one FMA per 32-value block, then
  // added to Y. The same sequence for every M. ws: ws_bytes(K) bytes, 64-byte aligned.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
               int64_t ldy, bool accumulate, void* ws);
  int64_t (*ws_bytes)(int64_t K);
  int act;           // ACT_*: what X must hold
  const char* path;  // what multiplies, for reports: "fp32", "vdpbf16ps", "vpdpbusd", ...
  // Float32 and vdpbf16ps panels (null elsewhere): the M rows X holds (as `act` says) packed as
  // gemm packs them, into packed_elems(M, K) 4-byte elements, for PanelAct::packed. Copies
  // only: a cell's bits are the same either way.
  int64_t (*packed_elems)(int64_t M, int64_t K);
  void (*pack)(int64_t M, int64_t K, const PanelAct& X, void* dst);
};

constexpr int64_t Q8_ACT_PAD = 64;  // elements a prepared activation row is padded to
// the elements a prepared row of n values takes: n rounded up to Q8_ACT_PAD
constexpr int64_t act_padded(int64_t n) { return (n + Q8_ACT_PAD - 1) / Q8_ACT_PAD * Q8_ACT_PAD; }

// The resident session's primitives besides its panels: the KV cache's dot products and
// updates (float32 queries against float32, bf16 or f16 keys and values), the activation
// preparation each weight format multiplies, and the read-bandwidth probe. A dot product's
// result depends only on its data and n (fixed accumulator layout and combination order).
struct SessionOps {
  // the read-bandwidth probe: a's sum read in `streams` (1, 2 or 4) parts side by side
  float (*sum)(const float* a, int64_t n, int streams, bool prefetch);
  // Queries (several in prefill, one in decode) against one head's KV rows (n values each, in
  // cache format f: float32, or bf16 / f16 bits widened exactly): s[t * lds + j - j0] = q[t] .
  // row j, j in [j0, j1); out[t] (n) += p[t * ldp + j - j0] * row j, one multiply-add an element
  // for j = j0, ..., j1 - 1 in order (kernels/attention.cpp gives the score's order). A query's
  // bits depend on nothing but its own data: not on nq, its place in the group, or j0.
  void (*kv_dots)(Dtype f, const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
                  int64_t j1, float* s, int64_t lds);
  void (*kv_axpys)(Dtype f, const float* p, int64_t ldp, int nq, const void* V, int64_t n,
                   int64_t j0, int64_t j1, float* const* out);
  // x (n) rounded to bf16 once (xb the bits, xr their float32 values, or null for the bits
  // only), each zero-padded to a multiple of Q8_ACT_PAD: what bf16 panels multiply (act says
  // which of the two).
  void (*round_bf16)(const float* x, int64_t n, uint16_t* xb, float* xr);
  // x (n) quantized in blocks of RESIDENT_INT8_BLOCK by the weights' rule (quant::q8_block):
  // codes xq zero-padded to a multiple of Q8_ACT_PAD, one scale a block in xs.
  void (*quantize_q8)(const float* x, int64_t n, int8_t* xq, float* xs);
  // The families' elementwise stages, vectorized, each element by the same instructions
  // wherever it sits (so decode and prefill agree bit for bit): z (n) soft-capped in place
  // (session_math::softcap); out (n) = silu(g + gb) * (u + ub) and gelu_tanh(g + gb) * (u + ub),
  // biases may be null, out may be g (session_math::silu_mul, gelu_tanh_mul).
  void (*softcap)(float* z, int64_t n, float cap);
  // s (n) <- softmax(s) in place: attention's weights (kernels/attention.cpp says how it rounds)
  void (*softmax)(float* s, int64_t n);
  // x (n)'s squares summed in double, RMSNorm's (the same bits on every instruction set)
  double (*sum_sq)(const float* x, int64_t n);
  void (*silu_mul)(const float* g, const float* u, const float* gb, const float* ub, float* out,
                   int64_t n);
  void (*gelu_mul)(const float* g, const float* u, const float* gb, const float* ub, float* out,
                   int64_t n);
  // indexed by panel_index(weight format)
  PanelOps panels[5];
};
// The index of a session weight format (f32, bf16, f16, int8, q4_0) in SessionOps::panels.
constexpr int panel_index(Dtype f) {
  return f == Dtype::F32 ? 0 : f == Dtype::BF16 ? 1 : f == Dtype::F16 ? 2 : f == Dtype::Int8 ? 3 : 4;
}
// Whether a weight format's panels multiply int8 activation blocks (quantize_q8's): int8, q4_0.
constexpr bool act_q8(Dtype f) { return f == Dtype::Int8 || f == Dtype::Q4_0; }

struct IsaTable {
  const char* name;
  IsaOps<float> f32;
  IsaOps<double> f64;
  const SessionOps* session;  // the session's kernels of the same instruction set
};

// The table for the best instruction set this host supports, or the one named by the
// environment variable ALGENTA_ISA (one of isa_names()) when set; an unknown or unsupported name
// there is refused with a clear message the first time kernels are needed.
const IsaTable& isa();
// Name of the active instruction set ("avx2", ...), or the refusal message if ALGENTA_ISA is bad.
const char* isa_name();
// The instruction sets compiled into this build, best first, comma-separated ("amx,avx512bf16,
// ...,generic"): the names ALGENTA_ISA takes.
const char* isa_names();
// Why a better instruction set the CPU reports was passed over (the kernel refused AMX's tile
// state, say), or "" when none was.
const char* isa_note();

template <class T>
inline const IsaOps<T>& ops();
template <>
inline const IsaOps<float>& ops<float>() { return isa().f32; }
template <>
inline const IsaOps<double>& ops<double>() { return isa().f64; }

}  // namespace kern
}  // namespace algenta

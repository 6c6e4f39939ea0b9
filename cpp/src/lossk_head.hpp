// One linear head on the CPU, a chunk of tokens at a time: the projection logits = hidden @
// weight^T + bias (then a soft cap and the temperature) and, from a chunk's d_logits, the
// gradient products d_hidden, d_weight and d_bias. The GEMM orchestration every fused lossk loss
// shares (cross-entropy in lossk_cross_entropy.cpp, distillation's student and teacher heads in
// lossk_distill.cpp); each loss keeps only its own per-token arithmetic.
//
// Dimension legend: D d_model, V vocab, C chunk, VB = LOSS_VOCAB_BLOCK.
// Memory: every buffer is allocated by the constructor, before any work. A materialized head
// holds one (C, V) chunk of logits (overwritten in place by d_logits; the block is kept for the
// next call, see ChunkScratch); otherwise per thread one (ROWS, VB) tile. Half-precision inputs
// (bf16, f16) are widened to float32 as they are packed, never copied; on an instruction set with
// a bf16 dot product bf16 inputs are packed as bf16 pairs and d_logits is rounded to bf16 in
// place before the gradient products (kernels.hpp, Bf16DotOps).
// Exactness: every logit is one chain over D in k order, independent of the chunk and the
// threads; every d_hidden cell one chain over v; every d_weight and d_bias cell one chain over
// tokens in token order, continued chunk after chunk (the first chunk starts it at 0).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "algenta/buffer.hpp"
#include "algenta/kernels.hpp"
#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"

namespace algenta {
namespace lossk {
namespace head {

// ---- the data checks every loss runs on its inputs ----

// True when no element is NaN or infinite. Tests the exponent bits with an integer OR, which
// (unlike a floating-point sum) the compiler may vectorize and reassociate freely.
template <class U>
inline bool exponent_never_all_ones(const U* p, int64_t n, U mask) {
  U bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static) if (n > (int64_t(1) << 18))
  for (int64_t i = 0; i < n; ++i) {
    U b;
    std::memcpy(&b, p + i, sizeof b);
    bad |= U((b & mask) == mask);
  }
  return bad == 0;
}

template <class T>
inline bool all_finite(const T* p, int64_t n) {
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  return exponent_never_all_ones(reinterpret_cast<const U*>(p), n,
                                 sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull));
}

inline bool all_finite(const void* p, int64_t n, Dtype e) {
  switch (e) {
    case Dtype::F32: return all_finite(static_cast<const float*>(p), n);
    case Dtype::F64: return all_finite(static_cast<const double*>(p), n);
    case Dtype::BF16: return exponent_never_all_ones(static_cast<const uint16_t*>(p), n, uint16_t(0x7f80));
    case Dtype::F16: return exponent_never_all_ones(static_cast<const uint16_t*>(p), n, uint16_t(0x7c00));
    case Dtype::Int8: break;  // not an element type lossk takes (the bindings refuse it)
  }
  return false;
}

// The words of a refusal in *why (when asked for), and its status.
inline int refusal(std::string* why, int code, const std::string& msg) {
  if (why) *why = msg;
  return code;
}

// The first of a loss's finite_inputs (lossk.hpp) that holds NaN or infinity, refused (585).
inline int refuse_non_finite(const std::vector<FiniteInput>& inputs, std::string* why) {
  for (const FiniteInput& f : inputs)
    if (f.p && !all_finite(f.p, f.n, f.elem)) return refusal(why, LOSS_ERR_NON_FINITE, f.what);
  return LOSS_OK;
}

// The first counted target (math::counted: rows [0, n) scored against targets[t + shift] within
// sequences of seq_len rows, ignore_index skipped when has_ignore) outside [0, vocab), refused
// (586).
inline int refuse_bad_target(const int64_t* targets, int64_t n, int64_t shift, int64_t seq_len,
                             bool has_ignore, int64_t ignore_index, int64_t vocab,
                             std::string* why) {
  for (int64_t t = 0; t < n; ++t) {
    if (!math::counted(targets, t, shift, seq_len, has_ignore, ignore_index)) continue;
    const int64_t y = targets[t + shift];
    if (y < 0 || y >= vocab)
      return refusal(why, LOSS_ERR_TARGET_OUT_OF_RANGE,
                     target_refusal(y, t + shift, vocab, has_ignore));
  }
  return LOSS_OK;
}

// The refusals of LossOptions' shared scalars (each loss makes them in its own order).
template <class T>
int check_temperature(double t, std::string* why) {
  if (math::temperature_ok<T>(t)) return LOSS_OK;
  return refusal(why, LOSS_ERR_NON_FINITE,
                 "temperature must be a finite number > 0 (at least " +
                     std::string(sizeof(T) == 8 ? "2.2e-308" : "1.2e-38") +
                     " in this precision), got " + std::to_string(t));
}
inline int check_grad_scale(double g, std::string* why) {
  if (loss_scalars_ok(g)) return LOSS_OK;
  return refusal(why, LOSS_ERR_NON_FINITE, "grad_output must be finite");
}

// ---- the head ----

inline int half_kind(Dtype e) { return e == Dtype::F16 ? kern::HALF_F16 : kern::HALF_BF16; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits [0, extent) into tiles of a multiple of `quantum`, at least `min_tiles` of them when
// the extent allows. Only the work split depends on this, never the bits.
inline int64_t tile_size(int64_t extent, int64_t quantum, int64_t min_tiles, int64_t max_tile) {
  int64_t t = ceil_div(extent, min_tiles < 1 ? 1 : min_tiles);
  t = ceil_div(t, quantum) * quantum;
  if (t > max_tile) t = max_tile;
  if (t < quantum) t = quantum;
  return t;
}

constexpr int64_t ROWS = 96;     // token rows per work item: a multiple of every MR and row_quantum
constexpr int64_t DW_ROWS = 96;  // vocab rows per d_weight item narrowed straight to half bits

// Narrows n float32 values to halves in place: element i's bits end at byte 2i of the same
// buffer. Batches of B elements: a batch starting at a >= B writes only bytes below 4a, all read
// by earlier batches, so its threads narrow straight into place; the first batch reads its own
// destination, so it goes through a temporary.
inline void narrow_in_place(float* buf, int64_t n, int kind, const kern::IsaOps<float>& K) {
  constexpr int64_t B = int64_t(1) << 20;
  uint16_t* dst = reinterpret_cast<uint16_t*>(buf);
  const int64_t first = std::min(n, B);
  Buffer<uint16_t> tmp(static_cast<size_t>(first));
  for (int64_t a = 0; a < n; a += B) {
    const int64_t m = std::min(B, n - a);
    uint16_t* out = a == 0 ? tmp.data() : dst + a;
    const int64_t per = 16384;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i += per) K.narrow_h[kind](buf + a + i, out + i, std::min(per, m - i));
    if (a == 0) std::memcpy(dst, tmp.data(), size_t(m) * sizeof(uint16_t));
  }
}

// bfloat16 inputs on an instruction set with a bf16 dot product multiply bf16 by bf16 (the
// logits exactly as stored; d_logits rounded to bf16 once, half::f32_to_bf16, as the CUDA
// backend rounds them). Its products take k in groups of k_quantum (a pair for vdpbf16ps, 32
// for an AMX tile), and the d_weight product's k is the tokens, chained chunk after chunk:
// every chunk but the last holds a multiple of k_quantum tokens, so the groups, and the bits,
// are the same for every chunk size (a chunk below k_quantum tokens is raised to it).
template <class T>
bool dot_path(Dtype elem) {
  return elem == Dtype::BF16 && kern::ops<T>().bf16dot.gemm_papb != nullptr;
}

// The chunk a head of `elem` runs `chunk` in for n_tok tokens (see dot_path).
template <class T>
int64_t run_chunk(Dtype elem, int64_t chunk, int64_t n_tok) {
  int64_t C = chunk < n_tok ? chunk : n_tok;
  if (dot_path<T>(elem) && C < n_tok) {
    const int64_t q = kern::ops<T>().bf16dot.k_quantum;
    C = C < q ? std::min(q, n_tok) : C / q * q;
  }
  return C;
}

template <class T>
class Head {
 public:
  // hidden (N, D) rows and weight (V, D), bias (V) or null, all of `elem`; C the chunk
  // (run_chunk's); materialize: keep each chunk's (C, V) logits (always, with gradients).
  Head(const void* hidden, const void* weight, const void* bias, Dtype elem, int64_t N, int64_t D,
       int64_t V, int64_t C, bool materialize, const GradOut<T>& g)
      : K(kern::ops<T>()), DP(K.bf16dot), g_(g), N_(N), D_(D), V_(V), C_(C),
        half_in_(is_half(elem)), hk_(half_kind(elem)), dp_(dot_path<T>(elem)),
        esz_(half_in_ ? 2 : sizeof(T)),
        hidden_(static_cast<const unsigned char*>(hidden)),
        weight_(static_cast<const unsigned char*>(weight)), bias_in_(bias),
        want_dh_(g.d_hidden != nullptr),
        want_dw_(g.d_weight != nullptr || g.d_weight_half != nullptr),
        want_db_(g.d_bias != nullptr), dw_direct_(g.d_weight_half != nullptr),
        half_dh_(want_dh_ && is_half(g.grad_elem)),
        materialize_(materialize || want_dh_ || want_dw_ || want_db_),
        nthreads_(omp_get_max_threads()),
        dtile_w_(dp_ ? DP.packed_b_max_cols() : K.packed_b_max_cols()),
        n_dtiles_(ceil_div(D, dtile_w_)), ws_elems_(K.gemm_ws_elems()),
        wpack_elems_(dp_ ? DP.packed_b_elems(D, std::min(LOSS_VOCAB_BLOCK, V))
                         : K.packed_b_elems(D, std::min(LOSS_VOCAB_BLOCK, V))),
        ws_(size_t(nthreads_) * size_t(ws_elems_)),
        wpack_(dp_ ? 0 : size_t(nthreads_) * size_t(wpack_elems_)),
        wpack_dp_(dp_ ? size_t(nthreads_) * size_t(wpack_elems_) : 0),
        tiles_(materialize_ ? 0 : size_t(nthreads_) * size_t(ROWS * LOSS_VOCAB_BLOCK)),
        logits_mem_(materialize_ ? sizeof(T) * size_t(C * V) : 0),
        hpack_off_(size_t(n_dtiles_) + 1, 0) {
    if (dw_direct_ && (C < N || g.d_weight || !is_half(g.grad_elem) || sizeof(T) != 4))
      throw std::invalid_argument("d_weight_half needs a half grad_elem, one chunk, no d_weight");
    for (int64_t j = 0; j < n_dtiles_; ++j) {
      const int64_t cols = std::min(dtile_w_, D - j * dtile_w_);
      hpack_off_[size_t(j) + 1] =
          hpack_off_[size_t(j)] + (dp_ ? DP.packed_b_elems(C, cols) : K.packed_b_elems(C, cols));
    }
    // (C, D) packed for the d_weight product, and the chunk's hidden rows packed for the
    // logits: float32 panels, or bf16 pairs on the dot-product path.
    const size_t hpack_n = want_dw_ ? size_t(hpack_off_[size_t(n_dtiles_)]) : 0;
    const size_t apack_n = size_t(dp_ ? DP.packed_a_elems(C, D) : K.packed_a_elems(C, D));
    hpack_ = Buffer<T>(dp_ ? 0 : hpack_n);
    apack_ = Buffer<T>(dp_ ? 0 : apack_n);
    hpack_dp_ = Buffer<uint32_t>(dp_ ? hpack_n : 0);
    apack_dp_ = Buffer<uint32_t>(dp_ ? apack_n : 0);
    bias_w_ = Buffer<T>(half_in_ && bias ? size_t(V) : 0);   // a half bias, widened
    dh_rows_ = Buffer<T>(half_dh_ ? size_t(C * D) : 0);       // d_hidden before narrowing
    // d_weight_half: per thread one (DW_ROWS, d tile) block of cells before narrowing
    dw_cols_ = std::min(D, dtile_w_);
    dw_tile_ = Buffer<T>(dw_direct_ ? size_t(nthreads_) * size_t(DW_ROWS * dw_cols_) : 0);
  }

  // The first work, once every allocation of the call has succeeded: a half bias widened, the
  // bias gradient's chains started at 0.
  void begin() {
    if (bias_in_) {
      if (half_in_) {
        K.widen_h[hk_](static_cast<const uint16_t*>(bias_in_), bias_w_.data(), V_);
        bias_ = bias_w_.data();
      } else {
        bias_ = static_cast<const T*>(bias_in_);
      }
    }
    if (want_db_) std::memset(g_.d_bias, 0, sizeof(T) * size_t(V_));
  }

  bool with_grad() const { return want_dh_ || want_dw_ || want_db_; }
  // (C, V) row-major: the chunk's logits after project(), d_logits for backward()
  T* logits() { return logits_mem_.template as<T>(); }

  // Logits of tokens [t0, t0 + c), their epilogue (bias, then cap and temperature as
  // logit_epilogue takes them), then row(r, vb, cols, z) for each row r of each (ROWS, VB) tile
  // while it is hot (z: its cols logits of vocab block vb; in logits() when materialized). An
  // item is one vocab block against a range of rows: its (D, VB) slice of W^T is packed once and
  // reused by every ROWS-row tile. Row ranges split only when there are too few vocab blocks to
  // keep every thread busy.
  template <class RowFn>
  void project(int64_t t0, int64_t c, double cap, double temp, RowFn&& row) {
    const int64_t D = D_, V = V_, VB = LOSS_VOCAB_BLOCK, nVB = ceil_div(V, VB);
    const unsigned char* Hc = hidden_ + size_t(t0 * D) * esz_;  // (c, D)
    hc_ = Hc;
    const int64_t n_rg = ceil_div(c, ROWS);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n_rg; ++g) {
      const int64_t r0 = g * ROWS, r1 = std::min(c, (g + 1) * ROWS);
      if (dp_)
        DP.pack_a_rows(c, D, r0, r1, reinterpret_cast<const uint16_t*>(Hc), D, 1,
                       apack_dp_.data());
      else if (half_in_)
        K.pack_a_rows_h[hk_](c, D, r0, r1, reinterpret_cast<const uint16_t*>(Hc), D, 1,
                             apack_.data());
      else
        K.pack_a_rows(c, D, r0, r1, reinterpret_cast<const T*>(Hc), D, 1, apack_.data());
    }
    const int64_t n_rs =
        std::min<int64_t>(n_rg, std::max<int64_t>(1, ceil_div(2 * nthreads_, nVB)));
    const int64_t rs_rows = ceil_div(n_rg, n_rs) * ROWS;
    T* const logits = this->logits();
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < n_rs * nVB; ++item) {
      const int tid = omp_get_thread_num();
      const int64_t vb = item % nVB, rs0 = (item / nVB) * rs_rows;
      const int64_t rs1 = std::min(c, rs0 + rs_rows);
      const int64_t v0 = vb * VB, cols = V - v0 < VB ? V - v0 : VB;
      T* wp = wpack_.data() + size_t(tid) * size_t(wpack_elems_);
      uint32_t* wpd = wpack_dp_.data() + size_t(tid) * size_t(wpack_elems_);
      T* wsp = ws_.data() + size_t(tid) * size_t(ws_elems_);
      if (dp_)
        DP.pack_b_full(D, cols, reinterpret_cast<const uint16_t*>(weight_ + size_t(v0 * D) * esz_),
                       1, D, wpd);
      else if (half_in_)
        K.pack_b_full_h[hk_](D, cols,
                             reinterpret_cast<const uint16_t*>(weight_ + size_t(v0 * D) * esz_),
                             1, D, wp);
      else
        K.pack_b_full(D, cols, reinterpret_cast<const T*>(weight_) + v0 * D, 1, D, wp);
      for (int64_t r0 = rs0; r0 < rs1; r0 += ROWS) {
        const int64_t rows = rs1 - r0 < ROWS ? rs1 - r0 : ROWS;
        T* dst;
        int64_t ldd;
        if (materialize_) {
          dst = logits + r0 * V + v0;
          ldd = V;
        } else {
          dst = tiles_.data() + size_t(tid) * size_t(ROWS * VB);
          ldd = VB;
        }
        bool done = false;
        if constexpr (std::is_same<T, float>::value) {
          if (dp_) {
            DP.gemm_papb(c, r0, rows, cols, D, apack_dp_.data(), wpd, dst, ldd, false, wsp);
            done = true;
          }
        }
        if (!done) K.gemm_papb(c, r0, rows, cols, D, apack_.data(), wp, dst, ldd, false, wsp);
        for (int64_t r = 0; r < rows; ++r) {
          T* z = dst + r * ldd;
          if (bias_ || cap > 0.0 || temp != 1.0)
            K.logit_epilogue(z, cols, bias_ ? bias_ + v0 : nullptr, cap, temp);
          row(r0 + r, vb, cols, z);
        }
      }
    }
  }

  // The gradient products of the chunk [t0, t0 + c) that project() last ran, from d_logits in
  // logits() (c, V), which the bf16 dot path rounds to bf16 in place first.
  void backward(int64_t t0, int64_t c) {
    const int64_t D = D_, V = V_;
    const T* G = logits();  // (c, V) d_logits of this chunk
    const unsigned char* Hc = hc_;
    // d_bias (V) += column sums of G, each cell one chain over tokens in token order.
    if (want_db_) {
      const int64_t VC = 1024;
      T* db = g_.d_bias;
#pragma omp parallel for schedule(static)
      for (int64_t v0 = 0; v0 < V; v0 += VC) {
        const int64_t v1 = std::min(V, v0 + VC);
        for (int64_t r = 0; r < c; ++r) {
          const T* gr = G + r * V;
          for (int64_t v = v0; v < v1; ++v) db[v] += gr[v];
        }
      }
    }
    // On the bf16 dot-product path both gradient products take G in bf16: rounded once, in
    // place (row r's bf16 values end up in the first half of the buffer, row-major, ld V).
    const uint16_t* Gb = reinterpret_cast<const uint16_t*>(G);
    if constexpr (std::is_same<T, float>::value) {
      if (dp_) narrow_in_place(logits(), c * V, kern::HALF_BF16, K);
    }
    // d_hidden rows of this chunk = G (c, V) @ W (V, D): one chain over v per cell. Items split
    // D only; each call packs every W block once for all c rows.
    if (want_dh_) {
      T* dh = half_dh_ ? dh_rows_.data() : static_cast<T*>(g_.d_hidden) + t0 * D;
      // Each item packs all of G (c, V) again: on the bf16 path, whose packing is a larger share
      // of the work, one item per thread.
      const int64_t dt = tile_size(D, 16, dp_ ? nthreads_ : 2 * nthreads_,
                                   dp_ ? DP.packed_b_max_cols() : K.packed_b_max_cols());
      const int64_t n_dt = ceil_div(D, dt);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_dt; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t d0 = item * dt, cols = D - d0 < dt ? D - d0 : dt;
        T* wsp = ws_.data() + size_t(tid) * size_t(ws_elems_);
        if constexpr (std::is_same<T, float>::value) {
          if (dp_) {
            DP.gemm_bb(c, cols, V, Gb, V, 1,
                       reinterpret_cast<const uint16_t*>(weight_ + size_t(d0) * esz_), D, 1,
                       dh + d0, D, false, wsp);
            continue;
          }
        }
        if (half_in_)
          K.gemm_bh[hk_](c, cols, V, G, V, 1,
                         reinterpret_cast<const uint16_t*>(weight_ + size_t(d0) * esz_), D, 1,
                         dh + d0, D, false, wsp);
        else
          K.gemm(c, cols, V, G, V, 1, reinterpret_cast<const T*>(weight_) + d0, D, 1, dh + d0,
                 D, false, wsp);
      }
      if (half_dh_) {
        uint16_t* o = static_cast<uint16_t*>(g_.d_hidden) + t0 * D;
        const int ok = half_kind(g_.grad_elem);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < c; ++r) K.narrow_h[ok](dh + r * D, o + r * D, D);
      }
    }
    // d_weight (V, D) += G^T (V, c) @ Hc (c, D): each cell continues its chain over tokens in
    // token order, chunk after chunk. Hc is packed once per chunk and shared.
    if (want_dw_) {
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < n_dtiles_; ++j) {
        const int64_t d0 = j * dtile_w_, cols = D - d0 < dtile_w_ ? D - d0 : dtile_w_;
        if (dp_)
          DP.pack_b_full(c, cols, reinterpret_cast<const uint16_t*>(Hc + size_t(d0) * esz_), D, 1,
                         hpack_dp_.data() + hpack_off_[size_t(j)]);
        else if (half_in_)
          K.pack_b_full_h[hk_](c, cols, reinterpret_cast<const uint16_t*>(Hc + size_t(d0) * esz_),
                               D, 1, hpack_.data() + hpack_off_[size_t(j)]);
        else
          K.pack_b_full(c, cols, reinterpret_cast<const T*>(Hc) + d0, D, 1,
                        hpack_.data() + hpack_off_[size_t(j)]);
      }
      const int64_t VR = dw_direct_ ? DW_ROWS : 4 * ROWS;
      const int64_t n_vr = ceil_div(V, VR);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_vr * n_dtiles_; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t v0 = (item / n_dtiles_) * VR, j = item % n_dtiles_;
        const int64_t d0 = j * dtile_w_;
        const int64_t rows = V - v0 < VR ? V - v0 : VR;
        const int64_t cols = D - d0 < dtile_w_ ? D - d0 : dtile_w_;
        // The first chunk starts each chain at 0 (no memset pass over d_weight); later chunks
        // continue it. Either way one chain per cell, so the bits do not depend on C. With
        // d_weight_half the one chunk's chains land in the thread's tile and are narrowed.
        T* wsp = ws_.data() + size_t(tid) * size_t(ws_elems_);
        T* dst = dw_direct_ ? dw_tile_.data() + size_t(tid) * size_t(DW_ROWS * dw_cols_)
                            : g_.d_weight + v0 * D + d0;
        const int64_t ldd = dw_direct_ ? cols : D;
        bool done = false;
        if constexpr (std::is_same<T, float>::value) {
          if (dp_) {
            DP.gemm_bpb(rows, cols, c, Gb + v0, 1, V, hpack_dp_.data() + hpack_off_[size_t(j)],
                        dst, ldd, t0 > 0, wsp);
            done = true;
          }
        }
        if (!done)
          K.gemm_pb(rows, cols, c, G + v0, 1, V, hpack_.data() + hpack_off_[size_t(j)], dst, ldd,
                    t0 > 0, wsp);
        if (dw_direct_)
          for (int64_t r = 0; r < rows; ++r)
            K.narrow_h[half_kind(g_.grad_elem)](dst + r * ldd,
                                                g_.d_weight_half + (v0 + r) * D + d0, cols);
      }
    }
  }

  // After the last chunk: half accumulators of d_weight and d_bias narrowed in place.
  void finish() {
    if constexpr (std::is_same<T, float>::value) {
      if (!is_half(g_.grad_elem)) return;
      const int ok = half_kind(g_.grad_elem);
      if (g_.d_weight) narrow_in_place(g_.d_weight, V_ * D_, ok, K);
      if (want_db_) narrow_in_place(g_.d_bias, V_, ok, K);
    }
  }

 private:
  const kern::IsaOps<T>& K;
  const kern::Bf16DotOps& DP;
  GradOut<T> g_;
  int64_t N_, D_, V_, C_;
  bool half_in_;
  int hk_;
  bool dp_;
  size_t esz_;
  const unsigned char* hidden_;
  const unsigned char* weight_;
  const void* bias_in_;
  const T* bias_ = nullptr;
  bool want_dh_, want_dw_, want_db_, dw_direct_, half_dh_, materialize_;
  int nthreads_;
  int64_t dtile_w_, n_dtiles_, ws_elems_, wpack_elems_;
  Buffer<T> ws_, wpack_;
  Buffer<uint32_t> wpack_dp_;
  Buffer<T> tiles_;
  ChunkScratch logits_mem_;
  std::vector<int64_t> hpack_off_;
  Buffer<T> hpack_, apack_;
  Buffer<uint32_t> hpack_dp_, apack_dp_;
  Buffer<T> bias_w_, dh_rows_;
  int64_t dw_cols_ = 0;
  Buffer<T> dw_tile_;
  const unsigned char* hc_ = nullptr;  // the chunk project() last ran, for backward()
};

}  // namespace head
}  // namespace lossk
}  // namespace algenta

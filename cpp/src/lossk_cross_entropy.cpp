// Fused linear + cross-entropy on the CPU: logits = hidden @ weight^T a chunk of tokens at a time,
// reduced to a per-token log-sum-exp while each tile is hot, with the analytic gradients formed
// in the same pass.
//
// Dimension legend: N tokens, D d_model, V vocab, C chunk, VB = LOSS_VOCAB_BLOCK.
// Fuses: projection + log-sum-exp + target pick (+ softmax-minus-one-hot + both gradient GEMMs).
// Never materializes: the (N, V) logits. Forward alone holds (C, V/VB) block statistics, the
// chunk's hidden rows packed, and per thread one (ROWS, VB) logit tile and one packed (D, VB)
// block of W; with gradients, also one (C, V) chunk of logits, overwritten in place by d_logits
// (the block is kept for the next call, see ChunkScratch), and the chunk's hidden rows packed
// for the d_weight product.
// Exactness: every output has one owner and a fixed reduction order (see kernels.hpp and
// lossk.hpp), so results are bit-identical for every C and every thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "algenta/buffer.hpp"
#include "algenta/kernels.hpp"
#include "algenta/lossk.hpp"

namespace algenta {
namespace lossk {

namespace {

// True when no element is NaN or infinite. Tests the exponent bits with an integer OR, which
// (unlike a floating-point sum) the compiler may vectorize and reassociate freely.
template <class T>
bool all_finite(const T* p, int64_t n) {
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  const U mask = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  U bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static) if (n > (int64_t(1) << 18))
  for (int64_t i = 0; i < n; ++i) {
    U b;
    std::memcpy(&b, p + i, sizeof b);
    bad |= U((b & mask) == mask);
  }
  return bad == 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits [0, extent) into tiles of a multiple of `quantum`, at least `min_tiles` of them when
// the extent allows. Only the work split depends on this, never the bits.
int64_t tile_size(int64_t extent, int64_t quantum, int64_t min_tiles, int64_t max_tile) {
  int64_t t = ceil_div(extent, min_tiles < 1 ? 1 : min_tiles);
  t = ceil_div(t, quantum) * quantum;
  if (t > max_tile) t = max_tile;
  if (t < quantum) t = quantum;
  return t;
}

constexpr int64_t ROWS = 96;  // token rows per work item: a multiple of every MR and row_quantum

}  // namespace

template <class T>
int fused_linear_ce_check(const FusedArgs<T>& a, std::string* why) {
  auto refuse = [&](int code, const std::string& msg) {
    if (why) *why = msg;
    return code;
  };
  int st = loss_dims_check(a.n_tok, a.d_model, a.vocab);
  if (st != LOSS_OK)
    return refuse(st, "shape (n_tok=" + std::to_string(a.n_tok) + ", d_model=" +
                          std::to_string(a.d_model) + ", vocab=" + std::to_string(a.vocab) +
                          ") refused: " + loss_status_name(st));
  st = loss_chunk_check(a.chunk, a.vocab);
  if (st != LOSS_OK)
    return refuse(st, "chunk=" + std::to_string(a.chunk) + " refused for vocab=" +
                          std::to_string(a.vocab) + ": " + loss_status_name(st) +
                          (st == LOSS_ERR_BAD_CHUNK
                               ? " (chunk * vocab must be <= 2^27 = 134217728 logit cells)"
                               : ""));
  if (!loss_scalars_ok(a.label_smoothing) || a.label_smoothing < 0.0 || a.label_smoothing > 1.0)
    return refuse(LOSS_ERR_NON_FINITE, "label_smoothing must be a finite number in [0, 1], got " +
                                           std::to_string(a.label_smoothing));
  if (a.grad_output && !all_finite(a.grad_output, a.n_tok))
    return refuse(LOSS_ERR_NON_FINITE, "grad_output contains NaN or infinity");
  if (!all_finite(a.hidden, a.n_tok * a.d_model))
    return refuse(LOSS_ERR_NON_FINITE, "hidden contains NaN or infinity");
  if (!all_finite(a.weight, a.vocab * a.d_model))
    return refuse(LOSS_ERR_NON_FINITE, "weight contains NaN or infinity");
  for (int64_t t = 0; t < a.n_tok; ++t) {
    const int64_t y = a.targets[t];
    if (a.has_ignore && y == a.ignore_index) continue;
    if (y < 0 || y >= a.vocab)
      return refuse(LOSS_ERR_TARGET_OUT_OF_RANGE,
                    "target " + std::to_string(y) + " at token " + std::to_string(t) +
                        " is outside [0, " + std::to_string(a.vocab) + ")" +
                        (a.has_ignore ? "" : " (no ignore_index was given)"));
  }
  return LOSS_OK;
}

template <class T>
void fused_linear_ce(const FusedArgs<T>& a, FusedOut<T>& out) {
  const kern::IsaOps<T>& K = kern::ops<T>();
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const int64_t C = a.chunk < N ? a.chunk : N;
  const int64_t VB = LOSS_VOCAB_BLOCK;
  const int64_t nVB = ceil_div(V, VB);
  const bool want_dh = out.d_hidden != nullptr, want_dw = out.d_weight != nullptr;
  const bool with_grad = want_dh || want_dw;
  const double eps = a.label_smoothing;
  const int nthreads = omp_get_max_threads();
  // d tiles of the d_weight product: each packed once per chunk, at most packed_b_max_cols wide.
  const int64_t dtile_w = K.packed_b_max_cols();
  const int64_t n_dtiles = ceil_div(D, dtile_w);

  // ---- every allocation, before any work --------------------------------------------------
  const int64_t ws_elems = K.gemm_ws_elems();
  // one (D, VB) block of W^T, packed (a narrower vocab needs no more than its own width)
  const int64_t wpack_elems = K.packed_b_elems(D, std::min(VB, V));
  Buffer<T> ws(size_t(nthreads) * size_t(ws_elems));
  Buffer<T> wpack(size_t(nthreads) * size_t(wpack_elems));
  Buffer<T> tiles(with_grad ? 0 : size_t(nthreads) * size_t(ROWS * VB));
  ChunkScratch logits_mem(with_grad ? sizeof(T) * size_t(C * V) : 0);
  T* const logits = logits_mem.as<T>();  // (C, V): the one chunk in flight
  std::vector<int64_t> hpack_off(size_t(n_dtiles) + 1, 0);
  for (int64_t j = 0; j < n_dtiles; ++j) {
    const int64_t cols = D - j * dtile_w < dtile_w ? D - j * dtile_w : dtile_w;
    hpack_off[size_t(j) + 1] = hpack_off[size_t(j)] + K.packed_b_elems(C, cols);
  }
  Buffer<T> hpack(want_dw ? size_t(hpack_off[size_t(n_dtiles)]) : 0);  // (C, D) packed
  Buffer<T> apack(size_t(K.packed_a_elems(C, D)));  // the chunk's hidden rows, packed
  Buffer<kern::BlockStats> stats(static_cast<size_t>(C * nVB));  // (C, nVB)
  Buffer<double> ztarget(static_cast<size_t>(C)), lse(static_cast<size_t>(N)),
      loss(static_cast<size_t>(N));
  Buffer<unsigned char> valid(static_cast<size_t>(N));

  int64_t n_valid = 0;
  for (int64_t t = 0; t < N; ++t) {
    valid[t] = !(a.has_ignore && a.targets[t] == a.ignore_index);
    n_valid += valid[t];
  }

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = N - t0 < C ? N - t0 : C;
    const T* Hc = a.hidden + t0 * D;  // (c, D)

    // 1. logits and their block statistics. An item is one vocab block against a range of
    //    rows: its (D, VB) slice of W^T is packed once and reused by every ROWS-row tile, whose
    //    statistics are taken while the tile is hot. Row ranges split only when there are too
    //    few vocab blocks to keep every thread busy.
    const int64_t n_rg = ceil_div(c, ROWS);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n_rg; ++g)
      K.pack_a_rows(c, D, g * ROWS, std::min(c, (g + 1) * ROWS), Hc, D, 1, apack.data());
    const int64_t n_rs = std::min<int64_t>(n_rg, std::max<int64_t>(1, ceil_div(2 * nthreads, nVB)));
    const int64_t rs_rows = ceil_div(n_rg, n_rs) * ROWS;
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < n_rs * nVB; ++item) {
      const int tid = omp_get_thread_num();
      const int64_t vb = item % nVB, rs0 = (item / nVB) * rs_rows;
      const int64_t rs1 = std::min(c, rs0 + rs_rows);
      const int64_t v0 = vb * VB, cols = V - v0 < VB ? V - v0 : VB;
      T* wp = wpack.data() + size_t(tid) * size_t(wpack_elems);
      T* wsp = ws.data() + size_t(tid) * size_t(ws_elems);
      K.pack_b_full(D, cols, a.weight + v0 * D, 1, D, wp);
      for (int64_t r0 = rs0; r0 < rs1; r0 += ROWS) {
        const int64_t rows = rs1 - r0 < ROWS ? rs1 - r0 : ROWS;
        T* dst;
        int64_t ldd;
        if (with_grad) {
          dst = logits + r0 * V + v0;
          ldd = V;
        } else {
          dst = tiles.data() + size_t(tid) * size_t(ROWS * VB);
          ldd = VB;
        }
        K.gemm_papb(c, r0, rows, cols, D, apack.data(), wp, dst, ldd, false, wsp);
        for (int64_t r = 0; r < rows; ++r) {
          const T* z = dst + r * ldd;
          stats[size_t((r0 + r) * nVB + vb)] = K.block_stats(z, cols);
          const int64_t y = a.targets[t0 + r0 + r] - v0;
          if (y >= 0 && y < cols) ztarget[size_t(r0 + r)] = double(z[y]);
        }
      }
    }

    // 2. merge block statistics in block order -> lse, loss; with gradients, d_logits in place.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      const int64_t t = t0 + r;
      const kern::BlockStats* s = stats.data() + r * nVB;
      double m = s[0].max;
      for (int64_t b = 1; b < nVB; ++b) m = s[b].max > m ? s[b].max : m;
      double se = 0.0, sz = 0.0;
      for (int64_t b = 0; b < nVB; ++b) {
        se += s[b].sumexp * std::exp(s[b].max - m);
        sz += s[b].sumz;
      }
      // loss = (m - z_target) + log(se), not lse - z_target: the logit difference is formed
      // before the log is added, so equal logits give exactly log(V) whatever their value,
      // and a large max does not cancel against a large target logit.
      const double logse = std::log(se);
      const double l = m + logse;
      lse[t] = l;
      double lt = 0.0;
      if (valid[t]) {
        lt = (m - ztarget[r]) + logse;
        if (eps > 0.0) lt = (1.0 - eps) * lt + eps * ((m - sz / double(V)) + logse);
      }
      loss[t] = lt;
      if (with_grad) {
        T* g = logits + r * V;
        double scale = 0.0;
        if (valid[t]) {
          if (a.reduction == Reduction::Mean) scale = 1.0 / double(n_valid);
          else if (a.reduction == Reduction::Sum) scale = 1.0;
          else scale = a.grad_output ? double(a.grad_output[t]) : 1.0;
        }
        if (scale == 0.0) {
          std::memset(g, 0, sizeof(T) * size_t(V));
        } else {
          K.softmax_shift(g, V, l, eps / double(V), scale);
          g[a.targets[t]] -= T((1.0 - eps) * scale);
        }
      }
    }

    if (!with_grad) continue;
    const T* G = logits;  // (c, V) d_logits of this chunk
    // 3. d_hidden rows of this chunk = G (c, V) @ W (V, D): one chain over v per cell. Items
    //    split D only; each call packs every W block once for all c rows.
    if (want_dh) {
      const int64_t dt = tile_size(D, 16, 2 * nthreads, K.packed_b_max_cols());
      const int64_t n_dt = ceil_div(D, dt);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_dt; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t d0 = item * dt, cols = D - d0 < dt ? D - d0 : dt;
        K.gemm(c, cols, V, G, V, 1, a.weight + d0, D, 1, out.d_hidden + t0 * D + d0, D, false,
               ws.data() + size_t(tid) * size_t(ws_elems));
      }
    }
    // 4. d_weight (V, D) += G^T (V, c) @ Hc (c, D): each cell continues its chain over tokens
    //    in token order, chunk after chunk. Hc is packed once per chunk and shared.
    if (want_dw) {
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < n_dtiles; ++j) {
        const int64_t d0 = j * dtile_w, cols = D - d0 < dtile_w ? D - d0 : dtile_w;
        K.pack_b_full(c, cols, Hc + d0, D, 1, hpack.data() + hpack_off[size_t(j)]);
      }
      const int64_t VR = 4 * ROWS;
      const int64_t n_vr = ceil_div(V, VR);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_vr * n_dtiles; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t v0 = (item / n_dtiles) * VR, j = item % n_dtiles;
        const int64_t d0 = j * dtile_w;
        const int64_t rows = V - v0 < VR ? V - v0 : VR, cols = D - d0 < dtile_w ? D - d0 : dtile_w;
        // The first chunk starts each chain at 0 (no memset pass over d_weight); later chunks
        // continue it. Either way one chain per cell, so the bits do not depend on C.
        K.gemm_pb(rows, cols, c, G + v0, 1, V, hpack.data() + hpack_off[size_t(j)],
                  out.d_weight + v0 * D + d0, D, t0 > 0, ws.data() + size_t(tid) * size_t(ws_elems));
      }
    }
  }

  // Token-order reductions, serial: the only order that cannot depend on C or the threads.
  for (int64_t t = 0; t < N; ++t) {
    if (valid[t]) out.sum.add(loss[t]);
    if (out.lse) out.lse[t] = T(lse[t]);
    if (out.loss_tok) out.loss_tok[t] = T(loss[t]);
  }
}

template int fused_linear_ce_check<float>(const FusedArgs<float>&, std::string*);
template int fused_linear_ce_check<double>(const FusedArgs<double>&, std::string*);
template void fused_linear_ce<float>(const FusedArgs<float>&, FusedOut<float>&);
template void fused_linear_ce<double>(const FusedArgs<double>&, FusedOut<double>&);

// ---- the materialized reference ----------------------------------------------------------

int ce_from_logits_check(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                         std::string* why) {
  auto refuse = [&](int code, const std::string& msg) {
    if (why) *why = msg;
    return code;
  };
  if (n_tok < 1 || vocab < 1)
    return refuse(LOSS_ERR_EMPTY_DIMENSION, "n_tok and vocab must be >= 1, got n_tok=" +
                                                std::to_string(n_tok) + ", vocab=" +
                                                std::to_string(vocab));
  if (n_tok > LOSS_MAX_TOKENS || vocab > LOSS_MAX_VOCAB)
    return refuse(LOSS_ERR_DIMENSION_TOO_LARGE, "n_tok or vocab exceeds its ceiling");
  if (!all_finite(logits, n_tok * vocab))
    return refuse(LOSS_ERR_NON_FINITE, "logits contain NaN or infinity");
  for (int64_t t = 0; t < n_tok; ++t)
    if (targets[t] < 0 || targets[t] >= vocab)
      return refuse(LOSS_ERR_TARGET_OUT_OF_RANGE, "target " + std::to_string(targets[t]) +
                                                      " at token " + std::to_string(t) +
                                                      " is outside [0, " + std::to_string(vocab) +
                                                      ")");
  return LOSS_OK;
}

// Straight two-pass log-sum-exp per row with libm's exp/log, in vocab order: the independent
// reference the fused kernel is tested against.
struct RowLse {
  double max, logse;  // lse = max + logse
};
static RowLse row_lse(const double* z, int64_t V) {
  double m = z[0];
  for (int64_t v = 1; v < V; ++v) m = z[v] > m ? z[v] : m;
  double s = 0.0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
  return {m, std::log(s)};
}

void ce_from_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    LossSum& sum, double* lse_out) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* z = logits + t * vocab;
    const RowLse r = row_lse(z, vocab);
    if (lse_out) lse_out[t] = r.max + r.logse;
    sum.add((r.max - z[targets[t]]) + r.logse);  // exact log(V) for equal logits
  }
}

void ce_grad_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    double scale, double* out) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* z = logits + t * vocab;
    double* g = out + t * vocab;
    const RowLse r = row_lse(z, vocab);
    const double l = r.max + r.logse;
    for (int64_t v = 0; v < vocab; ++v) g[v] = std::exp(z[v] - l) * scale;
    g[targets[t]] -= scale;
  }
}

}  // namespace lossk
}  // namespace algenta

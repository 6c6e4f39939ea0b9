// Fused linear + cross-entropy on the CPU: logits = hidden @ weight^T (+ bias, soft-capped, over
// the temperature) a chunk of tokens at a time, reduced to a per-token log-sum-exp while each
// tile is hot, with the analytic gradients formed in the same pass.
//
// Dimension legend: N tokens, D d_model, V vocab, C chunk, VB = LOSS_VOCAB_BLOCK.
// Fuses: projection + bias + soft cap + temperature + log-sum-exp + target pick + argmax (+ the
// softmax gradient through the cap, the z-loss, class weights and label smoothing, and the gradient
// GEMMs and the bias gradient). Never materializes: the (N, V) logits. Forward alone holds (C,
// V/VB) block statistics, the chunk's hidden rows packed, and per thread one (ROWS, VB) logit tile
// and one packed (D, VB) block of W; with gradients, also one (C, V) chunk of logits, overwritten
// in place by d_logits (the block is kept for the next call, see ChunkScratch), and the chunk's
// hidden rows packed for the d_weight product. Half-precision inputs (bf16, f16) are widened to
// float32 as they are packed: never a widened copy of hidden or weight. On an instruction set with
// a bf16 dot product, bf16 inputs are packed as bf16 pairs instead and the chunk's d_logits is
// rounded to bf16 in place before the two gradient products (see kernels.hpp, Bf16DotOps).
// Exactness: every output has one owner and a fixed reduction order (see kernels.hpp and
// lossk.hpp), so results are bit-identical for every C and every thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "algenta/buffer.hpp"
#include "algenta/kernels.hpp"
#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"

namespace algenta {
namespace lossk {

namespace {

// True when no element is NaN or infinite. Tests the exponent bits with an integer OR, which
// (unlike a floating-point sum) the compiler may vectorize and reassociate freely.
template <class U>
bool exponent_never_all_ones(const U* p, int64_t n, U mask) {
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
bool all_finite(const T* p, int64_t n) {
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  return exponent_never_all_ones(reinterpret_cast<const U*>(p), n,
                                 sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull));
}

bool all_finite(const void* p, int64_t n, Dtype e) {
  switch (e) {
    case Dtype::F32: return all_finite(static_cast<const float*>(p), n);
    case Dtype::F64: return all_finite(static_cast<const double*>(p), n);
    case Dtype::BF16: return exponent_never_all_ones(static_cast<const uint16_t*>(p), n, uint16_t(0x7f80));
    case Dtype::F16: return exponent_never_all_ones(static_cast<const uint16_t*>(p), n, uint16_t(0x7c00));
    case Dtype::Int8: break;  // not an element type lossk takes (the bindings refuse it)
  }
  return false;
}

int half_kind(Dtype e) { return e == Dtype::F16 ? kern::HALF_F16 : kern::HALF_BF16; }

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
constexpr int64_t DW_ROWS = 96;  // vocab rows per d_weight item narrowed straight to half bits

// Narrows n float32 values to halves in place: element i's bits end at byte 2i of the same
// buffer. Batches of B elements: a batch starting at a >= B writes only bytes below 4a, all read
// by earlier batches, so its threads narrow straight into place; the first batch reads its own
// destination, so it goes through a temporary.
void narrow_in_place(float* buf, int64_t n, int kind, const kern::IsaOps<float>& K) {
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

}  // namespace

template <class T>
double FusedOut<T>::reduced(Reduction r) const {
  return math::reduced_loss(r, weighted, ce.total, ce.mean(), weight_sum, z.total, z_mean());
}

template <class T>
double FusedOut<T>::z_mean() const {
  return math::z_mean(token_weighted, z.total, token_weight_sum, z.first, z.shifted,
                      double(z.count));
}

template <class T>
double FusedOut<T>::entropy_mean() const {
  return math::z_mean(token_weighted, ent.total, token_weight_sum, ent.first, ent.shifted,
                      double(ent.count));
}

template <class T>
int fused_linear_ce_check_shape(const FusedArgs<T>& a, std::string* why) {
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
  if ((sizeof(T) == 8) != (a.elem == Dtype::F64))
    return refuse(LOSS_ERR_LENGTH_MISMATCH, std::string("inputs of ") + dtype_long_name(a.elem) +
                                                " cannot compute in this precision");
  if (!loss_scalars_ok(a.label_smoothing) || a.label_smoothing < 0.0 || a.label_smoothing > 1.0)
    return refuse(LOSS_ERR_NON_FINITE, "label_smoothing must be a finite number in [0, 1], got " +
                                           std::to_string(a.label_smoothing));
  if (a.has_softcap && (!loss_scalars_ok(a.softcap) || !(a.softcap > 0.0)))
    return refuse(LOSS_ERR_NON_FINITE, "softcap must be a finite number > 0 (None for no cap), "
                                       "got " + std::to_string(a.softcap));
  if (!math::temperature_ok<T>(a.temperature))
    return refuse(LOSS_ERR_NON_FINITE, "temperature must be a finite number > 0 (at least " +
                                           std::string(sizeof(T) == 8 ? "2.2e-308" : "1.2e-38") +
                                           " in this precision), got " +
                                           std::to_string(a.temperature));
  if (!loss_scalars_ok(a.z_loss) || a.z_loss < 0.0)
    return refuse(LOSS_ERR_NON_FINITE, "lse_square_scale must be a finite number >= 0, got " +
                                           std::to_string(a.z_loss));
  if (a.shift < 0 || (a.shift > 0 && (a.seq_len < 1 || a.shift >= a.seq_len ||
                                       a.n_tok % a.seq_len != 0)))
    return refuse(LOSS_ERR_LENGTH_MISMATCH,
                  "shift=" + std::to_string(a.shift) + " needs sequences of seq_len > shift "
                  "positions tiling the " + std::to_string(a.n_tok) + " tokens (seq_len=" +
                  std::to_string(a.seq_len) + ")");
  if (!loss_scalars_ok(a.grad_scale))
    return refuse(LOSS_ERR_NON_FINITE, "grad_output must be finite");
  if (!loss_scalars_ok(a.entropy_grad_scale))
    return refuse(LOSS_ERR_NON_FINITE, "the entropy's upstream gradient must be finite");
  if (!a.entropy && (a.grad_entropy || a.entropy_grad_scale != 0.0))
    return refuse(LOSS_ERR_LENGTH_MISMATCH, "an upstream gradient of the entropy needs entropy");
  if (a.grad_coef && a.entropy)
    return refuse(LOSS_ERR_LENGTH_MISMATCH,
                  "grad_coef (a vocabulary shard's pass) does not compute the entropy");
  return LOSS_OK;
}

template <class T>
int fused_linear_ce_check(const FusedArgs<T>& a, std::string* why) {
  auto refuse = [&](int code, const std::string& msg) {
    if (why) *why = msg;
    return code;
  };
  const int st = fused_linear_ce_check_shape(a, why);
  if (st != LOSS_OK) return st;
  if (a.grad_output && !all_finite(a.grad_output, a.n_tok))
    return refuse(LOSS_ERR_NON_FINITE, "grad_output contains NaN or infinity");
  if (a.grad_lse && !all_finite(a.grad_lse, a.n_tok))
    return refuse(LOSS_ERR_NON_FINITE, "the gradient of lse contains NaN or infinity");
  if (a.grad_entropy && !all_finite(a.grad_entropy, a.n_tok))
    return refuse(LOSS_ERR_NON_FINITE, "the gradient of the entropy contains NaN or infinity");
  if (a.grad_coef && !all_finite(a.grad_coef, 3 * a.n_tok))
    return refuse(LOSS_ERR_NON_FINITE, "grad_coef contains NaN or infinity");
  if (!all_finite(a.hidden, a.n_tok * a.d_model, a.elem))
    return refuse(LOSS_ERR_NON_FINITE, "hidden contains NaN or infinity");
  if (!all_finite(a.weight, a.vocab * a.d_model, a.elem))
    return refuse(LOSS_ERR_NON_FINITE, "weight contains NaN or infinity");
  if (a.bias && !all_finite(a.bias, a.vocab, a.elem))
    return refuse(LOSS_ERR_NON_FINITE, "linear_bias contains NaN or infinity");
  if (a.class_weight && !all_finite(a.class_weight, a.vocab))
    return refuse(LOSS_ERR_NON_FINITE, "the class weights contain NaN or infinity");
  if (a.token_weight)
    for (int64_t t = 0; t < a.n_tok; ++t)
      if (!math::token_weight_ok(double(a.token_weight[t])))
        return refuse(LOSS_ERR_NON_FINITE, "token_weight must be finite and >= 0, got " +
                                               std::to_string(double(a.token_weight[t])) +
                                               " at token " + std::to_string(t));
  for (int64_t t = 0; t < a.n_tok; ++t) {
    if (a.shift > 0 && t % a.seq_len >= a.seq_len - a.shift) continue;  // not scored
    const int64_t y = a.targets[t + a.shift];
    if (a.has_ignore && y == a.ignore_index) continue;
    if (y < 0 || y >= a.vocab)
      return refuse(LOSS_ERR_TARGET_OUT_OF_RANGE,
                    "target " + std::to_string(y) + " at token " + std::to_string(t + a.shift) +
                        " is outside [0, " + std::to_string(a.vocab) + ")" +
                        (a.has_ignore ? "" : " (no ignore_index was given)"));
  }
  return LOSS_OK;
}

// bfloat16 inputs on an instruction set with a bf16 dot product multiply bf16 by bf16 (the
// logits exactly as stored; d_logits rounded to bf16 once, half::f32_to_bf16, as the CUDA
// backend rounds them). Its products take k in groups of k_quantum (a pair for vdpbf16ps, 32
// for an AMX tile), and the d_weight product's k is the tokens, chained chunk after chunk:
// every chunk but the last holds a multiple of k_quantum tokens, so the groups, and the bits,
// are the same for every chunk size (a chunk below k_quantum tokens is raised to it).
template <class T>
bool bf16_dot_path(const FusedArgs<T>& a) {
  return a.elem == Dtype::BF16 && kern::ops<T>().bf16dot.gemm_papb != nullptr;
}

template <class T>
int64_t fused_linear_ce_chunk(const FusedArgs<T>& a) {
  const int64_t N = a.n_tok;
  int64_t C = a.chunk < N ? a.chunk : N;
  if (bf16_dot_path(a) && C < N) {
    const int64_t q = kern::ops<T>().bf16dot.k_quantum;
    C = C < q ? std::min(q, N) : C / q * q;
  }
  return C;
}

template <class T>
void fused_linear_ce(const FusedArgs<T>& a, FusedOut<T>& out) {
  const kern::IsaOps<T>& K = kern::ops<T>();
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const bool half_in = is_half(a.elem);
  const int hk = half_kind(a.elem);
  const kern::Bf16DotOps& DP = K.bf16dot;
  const bool dp = bf16_dot_path(a);
  const int64_t C = fused_linear_ce_chunk(a);
  // d_weight straight into half bits: only when no chain continues past this one chunk
  const bool dw_direct = out.d_weight_half != nullptr;
  if (dw_direct && (C < N || out.d_weight || !is_half(out.grad_elem) || sizeof(T) != 4))
    throw std::invalid_argument("d_weight_half needs a half grad_elem, one chunk, no d_weight");
  const int64_t VB = LOSS_VOCAB_BLOCK;
  const int64_t nVB = ceil_div(V, VB);
  const bool want_dh = out.d_hidden != nullptr;
  const bool want_dw = out.d_weight != nullptr || dw_direct;
  const bool want_db = out.d_bias != nullptr;
  const bool with_grad = want_dh || want_dw || want_db;
  const bool half_dh = want_dh && is_half(out.grad_elem);
  const bool want_pred = out.pred != nullptr;
  const double eps = a.label_smoothing, cap = a.has_softcap ? a.softcap : 0.0, zs = a.z_loss;
  // The gradient sweep sees tempered logits: the cap's slope at the tempered amplitude, 1/T in
  // the coefficients (math::tempered).
  const double temp = a.temperature, tcap = math::tempered_cap(cap, temp);
  const bool want_ent = a.entropy;
  const bool ent_grad = a.grad_entropy != nullptr || a.entropy_grad_scale != 0.0;
  const T* cw = a.class_weight;
  // Class weights enter the statistics only through the weighted logit sum (label smoothing's,
  // or the one a caller asked for).
  const T* stats_w = eps > 0.0 || out.logit_sum ? cw : nullptr;
  const int nthreads = omp_get_max_threads();
  // d tiles of the d_weight product: each packed once per chunk, at most packed_b_max_cols wide.
  const int64_t dtile_w = dp ? DP.packed_b_max_cols() : K.packed_b_max_cols();
  const int64_t n_dtiles = ceil_div(D, dtile_w);
  const size_t esz = half_in ? 2 : sizeof(T);
  const unsigned char* hidden = static_cast<const unsigned char*>(a.hidden);
  const unsigned char* weight = static_cast<const unsigned char*>(a.weight);

  // ---- every allocation, before any work --------------------------------------------------
  const int64_t ws_elems = K.gemm_ws_elems();
  // one (D, VB) block of W^T, packed (a narrower vocab needs no more than its own width)
  const int64_t wpack_elems = dp ? DP.packed_b_elems(D, std::min(VB, V))
                                 : K.packed_b_elems(D, std::min(VB, V));
  Buffer<T> ws(size_t(nthreads) * size_t(ws_elems));
  Buffer<T> wpack(dp ? 0 : size_t(nthreads) * size_t(wpack_elems));
  Buffer<uint32_t> wpack_dp(dp ? size_t(nthreads) * size_t(wpack_elems) : 0);
  Buffer<T> tiles(with_grad ? 0 : size_t(nthreads) * size_t(ROWS * VB));
  ChunkScratch logits_mem(with_grad ? sizeof(T) * size_t(C * V) : 0);
  T* const logits = logits_mem.as<T>();  // (C, V): the one chunk in flight
  std::vector<int64_t> hpack_off(size_t(n_dtiles) + 1, 0);
  for (int64_t j = 0; j < n_dtiles; ++j) {
    const int64_t cols = D - j * dtile_w < dtile_w ? D - j * dtile_w : dtile_w;
    hpack_off[size_t(j) + 1] =
        hpack_off[size_t(j)] + (dp ? DP.packed_b_elems(C, cols) : K.packed_b_elems(C, cols));
  }
  // (C, D) packed for the d_weight product, and the chunk's hidden rows packed for the logits:
  // float32 panels, or bf16 pairs on the dot-product path.
  const size_t hpack_n = want_dw ? size_t(hpack_off[size_t(n_dtiles)]) : 0;
  const size_t apack_n = size_t(dp ? DP.packed_a_elems(C, D) : K.packed_a_elems(C, D));
  Buffer<T> hpack(dp ? 0 : hpack_n), apack(dp ? 0 : apack_n);
  Buffer<uint32_t> hpack_dp(dp ? hpack_n : 0), apack_dp(dp ? apack_n : 0);
  Buffer<kern::BlockStats> stats(static_cast<size_t>(C * nVB));  // (C, nVB)
  Buffer<int32_t> blk_arg(want_pred ? static_cast<size_t>(C * nVB) : 0);  // first max per block
  Buffer<double> ztarget(static_cast<size_t>(C)), lse(static_cast<size_t>(N)),
      ce(static_cast<size_t>(N)), zl(static_cast<size_t>(N));
  Buffer<double> zy(out.target_logit ? static_cast<size_t>(N) : 0),
      zsum(out.logit_sum ? static_cast<size_t>(N) : 0),
      ent(want_ent ? static_cast<size_t>(N) : 0);
  Buffer<int64_t> pred(want_pred ? static_cast<size_t>(N) : 0);
  Buffer<unsigned char> valid(static_cast<size_t>(N));
  Buffer<T> bias_w(half_in && a.bias ? static_cast<size_t>(V) : 0);  // a half bias, widened
  Buffer<T> dh_rows(half_dh ? static_cast<size_t>(C * D) : 0);       // d_hidden before narrowing
  // d_weight_half: per thread one (DW_ROWS, d tile) block of cells before narrowing
  const int64_t dw_cols = std::min(D, dtile_w);
  Buffer<T> dw_tile(dw_direct ? size_t(nthreads) * size_t(DW_ROWS * dw_cols) : 0);

  const T* bias = nullptr;
  if (a.bias) {
    if (half_in) {
      K.widen_h[hk](static_cast<const uint16_t*>(a.bias), bias_w.data(), V);
      bias = bias_w.data();
    } else {
      bias = static_cast<const T*>(a.bias);
    }
  }
  auto target_of = [&](int64_t t) { return a.targets[t + a.shift]; };
  const T* tw = a.token_weight;
  // In token order: the sums of u w_y and of u over the counted tokens.
  double w_sum = 0.0, u_sum = 0.0;
  for (int64_t t = 0; t < N; ++t) {
    const bool v = math::counted(a.targets, t, a.shift, a.seq_len, a.has_ignore, a.ignore_index);
    valid[t] = v;
    if (v) {
      const double u = math::token_weight_of(tw, t, a.shift);
      u_sum += u;
      w_sum += u * (cw ? double(cw[target_of(t)]) : 1.0);
    }
  }
  double w_all = double(V);  // sum_v w_v, in vocab order
  if (cw) {
    w_all = 0.0;
    for (int64_t v = 0; v < V; ++v) w_all += double(cw[v]);
  }
  if (want_db) std::memset(out.d_bias, 0, sizeof(T) * size_t(V));

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = N - t0 < C ? N - t0 : C;
    const unsigned char* Hc = hidden + size_t(t0 * D) * esz;  // (c, D)
    std::fill(ztarget.data(), ztarget.data() + c, std::nan(""));

    // 1. logits, their epilogue (bias, soft cap) and block statistics. An item is one vocab
    //    block against a range of rows: its (D, VB) slice of W^T is packed once and reused by
    //    every ROWS-row tile, whose epilogue and statistics run while the tile is hot. Row ranges
    //    split only when there are too few vocab blocks to keep every thread busy.
    const int64_t n_rg = ceil_div(c, ROWS);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n_rg; ++g) {
      const int64_t r0 = g * ROWS, r1 = std::min(c, (g + 1) * ROWS);
      if (dp)
        DP.pack_a_rows(c, D, r0, r1, reinterpret_cast<const uint16_t*>(Hc), D, 1,
                       apack_dp.data());
      else if (half_in)
        K.pack_a_rows_h[hk](c, D, r0, r1, reinterpret_cast<const uint16_t*>(Hc), D, 1,
                            apack.data());
      else
        K.pack_a_rows(c, D, r0, r1, reinterpret_cast<const T*>(Hc), D, 1, apack.data());
    }
    const int64_t n_rs = std::min<int64_t>(n_rg, std::max<int64_t>(1, ceil_div(2 * nthreads, nVB)));
    const int64_t rs_rows = ceil_div(n_rg, n_rs) * ROWS;
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < n_rs * nVB; ++item) {
      const int tid = omp_get_thread_num();
      const int64_t vb = item % nVB, rs0 = (item / nVB) * rs_rows;
      const int64_t rs1 = std::min(c, rs0 + rs_rows);
      const int64_t v0 = vb * VB, cols = V - v0 < VB ? V - v0 : VB;
      T* wp = wpack.data() + size_t(tid) * size_t(wpack_elems);
      uint32_t* wpd = wpack_dp.data() + size_t(tid) * size_t(wpack_elems);
      T* wsp = ws.data() + size_t(tid) * size_t(ws_elems);
      if (dp)
        DP.pack_b_full(D, cols, reinterpret_cast<const uint16_t*>(weight + size_t(v0 * D) * esz),
                       1, D, wpd);
      else if (half_in)
        K.pack_b_full_h[hk](D, cols, reinterpret_cast<const uint16_t*>(weight + size_t(v0 * D) * esz),
                            1, D, wp);
      else
        K.pack_b_full(D, cols, reinterpret_cast<const T*>(weight) + v0 * D, 1, D, wp);
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
        if constexpr (std::is_same<T, float>::value) {
          if (dp)
            DP.gemm_papb(c, r0, rows, cols, D, apack_dp.data(), wpd, dst, ldd, false, wsp);
          else
            K.gemm_papb(c, r0, rows, cols, D, apack.data(), wp, dst, ldd, false, wsp);
        } else {
          K.gemm_papb(c, r0, rows, cols, D, apack.data(), wp, dst, ldd, false, wsp);
        }
        for (int64_t r = 0; r < rows; ++r) {
          T* z = dst + r * ldd;
          if (bias || cap > 0.0 || temp != 1.0)
            K.logit_epilogue(z, cols, bias ? bias + v0 : nullptr, cap, temp);
          const size_t si = size_t((r0 + r) * nVB + vb);
          stats[si] = K.block_stats(z, cols, stats_w ? stats_w + v0 : nullptr, want_ent);
          if (want_pred) {
            const T m = T(stats[si].max);
            int32_t k = 0;  // the first maximum (logits that overflowed to NaN have none: 0)
            while (k < cols && !(z[k] == m)) ++k;
            blk_arg[si] = k < cols ? k : 0;
          }
          // Only counted rows have a target: with a shift, the last rows of the last sequence
          // would read past the end of targets.
          if (!valid[t0 + r0 + r]) continue;
          const int64_t y = target_of(t0 + r0 + r) - v0;
          if (y >= 0 && y < cols) ztarget[size_t(r0 + r)] = double(z[y]);
        }
      }
    }

    // 2. merge block statistics in block order -> lse, the loss terms, the argmax; with
    //    gradients, d_logits in place.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      const int64_t t = t0 + r;
      const math::Merged mg = math::merge_blocks(stats.data() + r * nVB, nVB);
      const double m = mg.max, sz = mg.sumz;
      if (want_pred) pred[t] = mg.block * VB + blk_arg[size_t(r * nVB + mg.block)];
      if (out.logit_sum) zsum[t] = sz;  // weighted by the class weights when given
      if (out.target_logit) zy[t] = valid[t] ? ztarget[r] : std::nan("");
      const double logse = std::log(mg.sumexp);
      const double l = m + logse;
      lse[t] = l;
      double ct = 0.0, zt = 0.0, wy = 1.0, u = 1.0;
      int64_t y = 0;
      if (valid[t]) {
        y = target_of(t);
        wy = cw ? double(cw[y]) : 1.0;
        u = math::token_weight_of(tw, t, a.shift);
        ct = u * math::token_ce(m, logse, ztarget[r], sz, wy, w_all, eps, V, cw != nullptr);
        zt = u * (zs * l * l);
      }
      ce[t] = ct;
      zl[t] = zt;
      // the entropy and, for its gradient, max - E[z'] (math::token_entropy, with_entropy)
      const double dmax = want_ent ? mg.sument / mg.sumexp : 0.0;
      if (want_ent) ent[t] = valid[t] ? u * math::token_entropy(mg, logse) : 0.0;
      if (!with_grad) continue;
      T* g = logits + r * V;
      if (a.grad_coef) {
        const T* k3 = a.grad_coef + 3 * t;
        const math::Coef k =
            math::tempered({double(k3[0]), double(k3[1]), double(k3[2])}, temp);
        if (k.a == 0.0 && k.b == 0.0 && k.c == 0.0) {
          std::memset(g, 0, sizeof(T) * size_t(V));
          continue;
        }
        K.softmax_grad(g, V, l, k.a, k.b, cw, tcap, 0.0, m);
        if (k.c != 0.0 && valid[t])
          g[target_of(t)] -= T(k.c * math::cap_slope<T>(ztarget[r], tcap));
        continue;
      }
      const math::Scales sc = math::reduction_scales(
          a.reduction, valid[t] != 0, a.grad_scale, u_sum, w_sum,
          a.grad_output ? double(a.grad_output[t]) : 1.0, u);
      math::Coef k =
          math::grad_coef(sc, eps, V, wy, w_all, zs, l, a.grad_lse ? double(a.grad_lse[t]) : 0.0);
      if (ent_grad) {
        const double s_h =
            math::entropy_scale(a.reduction, valid[t] != 0, a.entropy_grad_scale, u_sum,
                                a.grad_entropy ? double(a.grad_entropy[t]) : 0.0, u);
        k = math::with_entropy(k, s_h, dmax);
      }
      k = math::tempered(k, temp);
      if (k.a == 0.0 && k.b == 0.0 && k.c == 0.0 && k.e == 0.0) {
        std::memset(g, 0, sizeof(T) * size_t(V));
        continue;
      }
      K.softmax_grad(g, V, l, k.a, k.b, stats_w ? cw : nullptr, tcap, k.e, m);
      if (k.c != 0.0) g[y] -= T(k.c * math::cap_slope<T>(ztarget[r], tcap));
    }

    if (!with_grad) continue;
    const T* G = logits;  // (c, V) d_logits of this chunk
    // 3. d_bias (V) += column sums of G, each cell one chain over tokens in token order.
    if (want_db) {
      const int64_t VC = 1024;
#pragma omp parallel for schedule(static)
      for (int64_t v0 = 0; v0 < V; v0 += VC) {
        const int64_t v1 = std::min(V, v0 + VC);
        T* db = out.d_bias;
        for (int64_t r = 0; r < c; ++r) {
          const T* gr = G + r * V;
          for (int64_t v = v0; v < v1; ++v) db[v] += gr[v];
        }
      }
    }
    // On the bf16 dot-product path both gradient products take G in bf16: rounded once, in
    // place (row r's bf16 values end up in the first half of the buffer, row-major, ld V).
    const uint16_t* Gb = reinterpret_cast<const uint16_t*>(logits);
    if constexpr (std::is_same<T, float>::value) {
      if (dp) narrow_in_place(logits, c * V, kern::HALF_BF16, K);
    }
    // 4. d_hidden rows of this chunk = G (c, V) @ W (V, D): one chain over v per cell. Items
    //    split D only; each call packs every W block once for all c rows.
    if (want_dh) {
      T* dh = half_dh ? dh_rows.data() : static_cast<T*>(out.d_hidden) + t0 * D;
      // Each item packs all of G (c, V) again: on the bf16 path, whose packing is a larger share
      // of the work, one item per thread.
      const int64_t dt = tile_size(D, 16, dp ? nthreads : 2 * nthreads,
                                   dp ? DP.packed_b_max_cols() : K.packed_b_max_cols());
      const int64_t n_dt = ceil_div(D, dt);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_dt; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t d0 = item * dt, cols = D - d0 < dt ? D - d0 : dt;
        T* wsp = ws.data() + size_t(tid) * size_t(ws_elems);
        if constexpr (std::is_same<T, float>::value) {
          if (dp) {
            DP.gemm_bb(c, cols, V, Gb, V, 1,
                       reinterpret_cast<const uint16_t*>(weight + size_t(d0) * esz), D, 1,
                       dh + d0, D, false, wsp);
            continue;
          }
        }
        if (half_in)
          K.gemm_bh[hk](c, cols, V, G, V, 1,
                        reinterpret_cast<const uint16_t*>(weight + size_t(d0) * esz), D, 1,
                        dh + d0, D, false, wsp);
        else
          K.gemm(c, cols, V, G, V, 1, reinterpret_cast<const T*>(weight) + d0, D, 1, dh + d0, D,
                 false, wsp);
      }
      if (half_dh) {
        uint16_t* o = static_cast<uint16_t*>(out.d_hidden) + t0 * D;
        const int ok = half_kind(out.grad_elem);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < c; ++r) K.narrow_h[ok](dh + r * D, o + r * D, D);
      }
    }
    // 5. d_weight (V, D) += G^T (V, c) @ Hc (c, D): each cell continues its chain over tokens
    //    in token order, chunk after chunk. Hc is packed once per chunk and shared.
    if (want_dw) {
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < n_dtiles; ++j) {
        const int64_t d0 = j * dtile_w, cols = D - d0 < dtile_w ? D - d0 : dtile_w;
        if (dp)
          DP.pack_b_full(c, cols, reinterpret_cast<const uint16_t*>(Hc + size_t(d0) * esz), D, 1,
                         hpack_dp.data() + hpack_off[size_t(j)]);
        else if (half_in)
          K.pack_b_full_h[hk](c, cols, reinterpret_cast<const uint16_t*>(Hc + size_t(d0) * esz),
                              D, 1, hpack.data() + hpack_off[size_t(j)]);
        else
          K.pack_b_full(c, cols, reinterpret_cast<const T*>(Hc) + d0, D, 1,
                        hpack.data() + hpack_off[size_t(j)]);
      }
      const int64_t VR = dw_direct ? DW_ROWS : 4 * ROWS;
      const int64_t n_vr = ceil_div(V, VR);
#pragma omp parallel for schedule(dynamic)
      for (int64_t item = 0; item < n_vr * n_dtiles; ++item) {
        const int tid = omp_get_thread_num();
        const int64_t v0 = (item / n_dtiles) * VR, j = item % n_dtiles;
        const int64_t d0 = j * dtile_w;
        const int64_t rows = V - v0 < VR ? V - v0 : VR, cols = D - d0 < dtile_w ? D - d0 : dtile_w;
        // The first chunk starts each chain at 0 (no memset pass over d_weight); later chunks
        // continue it. Either way one chain per cell, so the bits do not depend on C. With
        // d_weight_half the one chunk's chains land in the thread's tile and are narrowed.
        T* wsp = ws.data() + size_t(tid) * size_t(ws_elems);
        T* dst = dw_direct ? dw_tile.data() + size_t(tid) * size_t(DW_ROWS * dw_cols)
                           : out.d_weight + v0 * D + d0;
        const int64_t ldd = dw_direct ? cols : D;
        bool done = false;
        if constexpr (std::is_same<T, float>::value) {
          if (dp) {
            DP.gemm_bpb(rows, cols, c, Gb + v0, 1, V, hpack_dp.data() + hpack_off[size_t(j)],
                        dst, ldd, t0 > 0, wsp);
            done = true;
          }
        }
        if (!done)
          K.gemm_pb(rows, cols, c, G + v0, 1, V, hpack.data() + hpack_off[size_t(j)], dst, ldd,
                    t0 > 0, wsp);
        if (dw_direct)
          for (int64_t r = 0; r < rows; ++r)
            K.narrow_h[half_kind(out.grad_elem)](dst + r * ldd,
                                                 out.d_weight_half + (v0 + r) * D + d0, cols);
      }
    }
  }

  // Token-order reductions, serial: the only order that cannot depend on C or the threads.
  int64_t correct = 0;
  for (int64_t t = 0; t < N; ++t) {
    if (valid[t]) {
      out.ce.add(ce[t]);
      out.z.add(zl[t]);
      if (want_ent) out.ent.add(ent[t]);
      if (want_pred) correct += pred[t] == target_of(t);
    }
    if (out.lse) out.lse[t] = T(lse[t]);
    if (out.loss_tok) out.loss_tok[t] = T(ce[t] + zl[t]);
    if (out.z_tok) out.z_tok[t] = T(zl[t]);
    if (out.entropy_tok) out.entropy_tok[t] = want_ent ? T(ent[t]) : T(0);
    if (want_pred) out.pred[t] = pred[t];
    if (out.target_logit) out.target_logit[t] = T(zy[t]);
    if (out.logit_sum) out.logit_sum[t] = T(zsum[t]);
  }
  out.weight_sum = w_sum;
  out.token_weight_sum = u_sum;
  out.weighted = cw != nullptr || tw != nullptr;
  out.token_weighted = tw != nullptr;
  out.n_correct = correct;
  if (is_half(out.grad_elem)) {
    if constexpr (std::is_same<T, float>::value) {
      const int ok = half_kind(out.grad_elem);
      if (out.d_weight) narrow_in_place(out.d_weight, V * D, ok, K);
      if (want_db) narrow_in_place(out.d_bias, V, ok, K);
    }
  }
}

template int fused_linear_ce_check_shape<float>(const FusedArgs<float>&, std::string*);
template int fused_linear_ce_check_shape<double>(const FusedArgs<double>&, std::string*);
template int fused_linear_ce_check<float>(const FusedArgs<float>&, std::string*);
template int fused_linear_ce_check<double>(const FusedArgs<double>&, std::string*);
template void fused_linear_ce<float>(const FusedArgs<float>&, FusedOut<float>&);
template void fused_linear_ce<double>(const FusedArgs<double>&, FusedOut<double>&);
template int64_t fused_linear_ce_chunk<float>(const FusedArgs<float>&);
template int64_t fused_linear_ce_chunk<double>(const FusedArgs<double>&);
template double FusedOut<float>::reduced(Reduction) const;
template double FusedOut<double>::reduced(Reduction) const;
template double FusedOut<float>::z_mean() const;
template double FusedOut<double>::z_mean() const;
template double FusedOut<float>::entropy_mean() const;
template double FusedOut<double>::entropy_mean() const;

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
                    LossSum& sum, double* lse_out, double* loss_out) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* z = logits + t * vocab;
    const RowLse r = row_lse(z, vocab);
    if (lse_out) lse_out[t] = r.max + r.logse;
    const double l = (r.max - z[targets[t]]) + r.logse;  // exact log(V) for equal logits
    if (loss_out) loss_out[t] = l;
    sum.add(l);
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

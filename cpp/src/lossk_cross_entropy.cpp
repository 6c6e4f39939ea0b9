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
#include "lossk_head.hpp"

namespace algenta {
namespace lossk {

using head::all_finite;


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
  using head::refusal;
  const CrossEntropyOptions& o = a.opt;
  int st = loss_dims_check(a.n_tok, a.d_model, a.vocab);
  if (st != LOSS_OK)
    return refusal(why, st, "shape (n_tok=" + std::to_string(a.n_tok) + ", d_model=" +
                                std::to_string(a.d_model) + ", vocab=" + std::to_string(a.vocab) +
                                ") refused: " + loss_status_name(st));
  st = loss_chunk_check(o.chunk, a.vocab);
  if (st != LOSS_OK) return refusal(why, st, chunk_refusal(st, o.chunk, a.vocab));
  if ((sizeof(T) == 8) != (a.elem == Dtype::F64))
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH, std::string("inputs of ") +
                                                      dtype_long_name(a.elem) +
                                                      " cannot compute in this precision");
  if (!loss_scalars_ok(o.label_smoothing) || o.label_smoothing < 0.0 || o.label_smoothing > 1.0)
    return refusal(why, LOSS_ERR_NON_FINITE,
                   "label_smoothing must be a finite number in [0, 1], got " +
                       std::to_string(o.label_smoothing));
  if (o.has_softcap && (!loss_scalars_ok(o.softcap) || !(o.softcap > 0.0)))
    return refusal(why, LOSS_ERR_NON_FINITE,
                   "softcap must be a finite number > 0 (None for no cap), got " +
                       std::to_string(o.softcap));
  if ((st = head::check_temperature<T>(o.temperature, why)) != LOSS_OK) return st;
  if (!loss_scalars_ok(o.lse_square_scale) || o.lse_square_scale < 0.0)
    return refusal(why, LOSS_ERR_NON_FINITE, "lse_square_scale must be a finite number >= 0, got " +
                                                 std::to_string(o.lse_square_scale));
  if (o.shift < 0 || (o.shift > 0 && (a.seq_len < 1 || o.shift >= a.seq_len ||
                                       a.n_tok % a.seq_len != 0)))
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH,
                   "shift=" + std::to_string(o.shift) + " needs sequences of seq_len > shift "
                   "positions tiling the " + std::to_string(a.n_tok) + " tokens (seq_len=" +
                   std::to_string(a.seq_len) + ")");
  if ((st = head::check_grad_scale(o.grad_scale, why)) != LOSS_OK) return st;
  if (!loss_scalars_ok(o.entropy_grad_scale))
    return refusal(why, LOSS_ERR_NON_FINITE, "the entropy's upstream gradient must be finite");
  if (!o.entropy && (a.grad_entropy || o.entropy_grad_scale != 0.0))
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH,
                   "an upstream gradient of the entropy needs entropy");
  if (a.grad_coef && o.entropy)
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH,
                   "grad_coef (a vocabulary shard's pass) does not compute the entropy");
  return LOSS_OK;
}

template <class T>
std::vector<FiniteInput> finite_inputs(const FusedArgs<T>& a) {
  const Dtype te = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  return {{a.grad_output, N, te, "grad_output contains NaN or infinity"},
          {a.grad_lse, N, te, "the gradient of lse contains NaN or infinity"},
          {a.grad_entropy, N, te, "the gradient of the entropy contains NaN or infinity"},
          {a.grad_coef, 3 * N, te, "grad_coef contains NaN or infinity"},
          {a.hidden, N * D, a.elem, "hidden contains NaN or infinity"},
          {a.weight, V * D, a.elem, "weight contains NaN or infinity"},
          {a.bias, V, a.elem, "linear_bias contains NaN or infinity"},
          {a.class_weight, V, te, "the class weights contain NaN or infinity"}};
}

template <class T>
int fused_linear_ce_check(const FusedArgs<T>& a, std::string* why) {
  using head::refusal;
  int st = fused_linear_ce_check_shape(a, why);
  if (st != LOSS_OK) return st;
  if ((st = head::refuse_non_finite(finite_inputs(a), why)) != LOSS_OK) return st;
  if (a.token_weight)
    for (int64_t t = 0; t < a.n_tok; ++t)
      if (!math::token_weight_ok(double(a.token_weight[t])))
        return refusal(why, LOSS_ERR_NON_FINITE, "token_weight must be finite and >= 0, got " +
                                                     std::to_string(double(a.token_weight[t])) +
                                                     " at token " + std::to_string(t));
  return head::refuse_bad_target(a.targets, a.n_tok, a.opt.shift, a.seq_len, a.opt.has_ignore,
                                 a.opt.ignore_index, a.vocab, why);
}

template <class T>
int64_t fused_linear_ce_chunk(const FusedArgs<T>& a) {
  return head::run_chunk<T>(a.elem, a.opt.chunk, a.n_tok);
}

template <class T>
void fused_linear_ce(const FusedArgs<T>& a, FusedOut<T>& out) {
  const int64_t N = a.n_tok, V = a.vocab;
  const int64_t C = fused_linear_ce_chunk(a);
  const int64_t VB = LOSS_VOCAB_BLOCK;
  const int64_t nVB = head::ceil_div(V, VB);
  const bool want_pred = out.pred != nullptr;
  const CrossEntropyOptions& o = a.opt;
  const double eps = o.label_smoothing, cap = o.has_softcap ? o.softcap : 0.0;
  const double zs = o.lse_square_scale;
  // The gradient sweep sees tempered logits: the cap's slope at the tempered amplitude, 1/T in
  // the coefficients (math::tempered).
  const double temp = o.temperature, tcap = math::tempered_cap(cap, temp);
  const bool want_ent = o.entropy;
  const bool ent_grad = a.grad_entropy != nullptr || o.entropy_grad_scale != 0.0;
  const T* cw = a.class_weight;
  // Class weights enter the statistics only through the weighted logit sum (label smoothing's,
  // or the one a caller asked for).
  const T* stats_w = eps > 0.0 || out.logit_sum ? cw : nullptr;
  const kern::IsaOps<T>& K = kern::ops<T>();

  // ---- every allocation, before any work --------------------------------------------------
  head::Head<T> hd(a.hidden, a.weight, a.bias, a.elem, N, a.d_model, V, C, false,
                   out);
  const bool with_grad = hd.with_grad();
  Buffer<kern::BlockStats> stats(static_cast<size_t>(C * nVB));  // (C, nVB)
  Buffer<int32_t> blk_arg(want_pred ? static_cast<size_t>(C * nVB) : 0);  // first max per block
  Buffer<double> ztarget(static_cast<size_t>(C)), lse(static_cast<size_t>(N)),
      ce(static_cast<size_t>(N)), zl(static_cast<size_t>(N));
  Buffer<double> zy(out.target_logit ? static_cast<size_t>(N) : 0),
      zsum(out.logit_sum ? static_cast<size_t>(N) : 0),
      ent(want_ent ? static_cast<size_t>(N) : 0);
  Buffer<int64_t> pred(want_pred ? static_cast<size_t>(N) : 0);
  Buffer<unsigned char> valid(static_cast<size_t>(N));

  hd.begin();
  auto target_of = [&](int64_t t) { return a.targets[t + o.shift]; };
  const T* tw = a.token_weight;
  // In token order: the sums of u w_y and of u over the counted tokens.
  double w_sum = 0.0, u_sum = 0.0;
  for (int64_t t = 0; t < N; ++t) {
    const bool v = math::counted(a.targets, t, o.shift, a.seq_len, o.has_ignore, o.ignore_index);
    valid[t] = v;
    if (v) {
      const double u = math::token_weight_of(tw, t, o.shift);
      u_sum += u;
      w_sum += u * (cw ? double(cw[target_of(t)]) : 1.0);
    }
  }
  double w_all = double(V);  // sum_v w_v, in vocab order
  if (cw) {
    w_all = 0.0;
    for (int64_t v = 0; v < V; ++v) w_all += double(cw[v]);
  }

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = N - t0 < C ? N - t0 : C;
    std::fill(ztarget.data(), ztarget.data() + c, std::nan(""));

    // 1. logits, their epilogue (bias, soft cap, temperature) and block statistics, per tile
    //    while it is hot.
    hd.project(t0, c, cap, temp, [&](int64_t r, int64_t vb, int64_t cols, T* z) {
      const int64_t v0 = vb * VB;
      const size_t si = size_t(r * nVB + vb);
      stats[si] = K.block_stats(z, cols, stats_w ? stats_w + v0 : nullptr, want_ent);
      if (want_pred) {
        const T m = T(stats[si].max);
        int32_t k = 0;  // the first maximum (logits that overflowed to NaN have none: 0)
        while (k < cols && !(z[k] == m)) ++k;
        blk_arg[si] = k < cols ? k : 0;
      }
      // Only counted rows have a target: with a shift, the last rows of the last sequence
      // would read past the end of targets.
      if (!valid[t0 + r]) return;
      const int64_t y = target_of(t0 + r) - v0;
      if (y >= 0 && y < cols) ztarget[size_t(r)] = double(z[y]);
    });

    // 2. merge block statistics in block order -> lse, the loss terms, the argmax; with
    //    gradients, d_logits in place.
    T* const logits = hd.logits();
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
        u = math::token_weight_of(tw, t, o.shift);
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
          o.reduction, valid[t] != 0, o.grad_scale, u_sum, w_sum,
          a.grad_output ? double(a.grad_output[t]) : 1.0, u);
      math::Coef k =
          math::grad_coef(sc, eps, V, wy, w_all, zs, l, a.grad_lse ? double(a.grad_lse[t]) : 0.0);
      if (ent_grad) {
        const double s_h =
            math::entropy_scale(o.reduction, valid[t] != 0, o.entropy_grad_scale, u_sum,
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

    if (with_grad) hd.backward(t0, c);
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
  hd.finish();
}

template int fused_linear_ce_check_shape<float>(const FusedArgs<float>&, std::string*);
template int fused_linear_ce_check_shape<double>(const FusedArgs<double>&, std::string*);
template int fused_linear_ce_check<float>(const FusedArgs<float>&, std::string*);
template int fused_linear_ce_check<double>(const FusedArgs<double>&, std::string*);
template std::vector<FiniteInput> finite_inputs<float>(const FusedArgs<float>&);
template std::vector<FiniteInput> finite_inputs<double>(const FusedArgs<double>&);
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
  auto refuse = [&](int code, const std::string& msg) { return head::refusal(why, code, msg); };
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

// Fused linear distillation on the CPU: a student and a teacher head projected a chunk of tokens
// at a time (lossk_head.hpp), each token's divergence between their tempered distributions (and
// the student's hard cross-entropy) reduced from the two chunks of logits while they are hot,
// and the student's gradients formed from the same chunk (lossk.hpp: DistillArgs).
//
// Dimension legend: N tokens, D student d_model, Dt teacher d_model, V vocab, C chunk.
// Never materializes: either (N, V) logit tensor. Holds one (C, V) chunk of each head's logits
// (the student's overwritten in place by d_logits), per thread four (V) rows of doubles, and the
// gradients.
// Numerics: each token's sums run serially over v in vocab order in double from the float (or
// double) logits: max, then exp((z - max) / T) of each head, kept in a row per thread, and its
// sum, then the divergence's shares (lossk_math.hpp: div_elem, div_grad) with p and q the kept
// exponentials over their sums, so a token's outputs do not depend on the chunk, the thread count
// or the other tokens of its batch; the batch's sums run in token order. Two exponentials per
// logit pair (three with a hard term at T != 1; JSD's log m adds an exp and a log1p).
#include <omp.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "algenta/buffer.hpp"
#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"
#include "lossk_head.hpp"

namespace algenta {
namespace lossk {

template <class T>
double DistillOut<T>::reduced(Reduction r) const {
  return r == Reduction::Sum ? loss.total : loss.mean();
}
template <class T>
double DistillOut<T>::div_reduced(Reduction r) const {
  return r == Reduction::Sum ? div.total : div.mean();
}
template <class T>
double DistillOut<T>::ce_reduced(Reduction r) const {
  return r == Reduction::Sum ? ce.total : ce.mean();
}

namespace {

bool computes_in(Dtype e, bool f64) { return f64 ? e == Dtype::F64 : e != Dtype::F64; }

bool weight_ok(double w) { return loss_scalars_ok(w) && w >= 0.0; }

}  // namespace

template <class T>
int fused_linear_distill_check_shape(const DistillArgs<T>& a, std::string* why) {
  using head::refusal;
  const DistillOptions& o = a.opt;
  const char* heads[2] = {"student", "teacher"};
  const int64_t dims[2] = {a.d_model, a.t_d_model};
  int st = LOSS_OK;
  for (int h = 0; h < 2; ++h)
    if ((st = loss_dims_check(a.n_tok, dims[h], a.vocab)) != LOSS_OK)
      return refusal(why, st, std::string(heads[h]) + " shape (n_tok=" +
                                  std::to_string(a.n_tok) + ", d_model=" +
                                  std::to_string(dims[h]) + ", vocab=" + std::to_string(a.vocab) +
                                  ") refused: " + loss_status_name(st));
  if ((st = loss_chunk_check(o.chunk, a.vocab)) != LOSS_OK)
    return refusal(why, st, chunk_refusal(st, o.chunk, a.vocab));
  const bool f64 = sizeof(T) == 8;
  if (!computes_in(a.elem, f64) || !computes_in(a.t_elem, f64))
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH,
                   std::string("the student's ") + dtype_long_name(a.elem) + " and the teacher's " +
                       dtype_long_name(a.t_elem) + " do not compute in one precision (float64 "
                       "goes with float64 only)");
  if ((st = head::check_temperature<T>(o.temperature, why)) != LOSS_OK) return st;
  if (!loss_scalars_ok(o.beta) || o.beta < 0.0 || o.beta > 1.0)
    return refusal(why, LOSS_ERR_NON_FINITE,
                   "beta must be a finite number in [0, 1], got " + std::to_string(o.beta));
  if (!weight_ok(o.hard_weight) || !weight_ok(o.soft_weight))
    return refusal(why, LOSS_ERR_NON_FINITE, "hard_weight and soft_weight must be finite and >= 0, "
                                             "got " + std::to_string(o.hard_weight) + " and " +
                                                 std::to_string(o.soft_weight));
  if (o.hard_weight > 0.0 && !a.targets)
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH, "hard_weight > 0 mixes in the cross-entropy "
                                                  "against targets: pass target");
  if ((st = head::check_grad_scale(o.grad_scale, why)) != LOSS_OK) return st;
  if ((a.shard_h != nullptr) != (a.shard_coef != nullptr) || (a.shard_h && !a.shard_lse) ||
      (a.shard_lse && !a.shard))
    return refusal(why, LOSS_ERR_LENGTH_MISMATCH, "shard_lse belongs to the vocab-parallel form, "
                                                  "and its gradient pass needs shard_lse, shard_h "
                                                  "and shard_coef together");
  return LOSS_OK;
}

template <class T>
std::vector<FiniteInput> finite_inputs(const DistillArgs<T>& a) {
  const Dtype te = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
  const int64_t N = a.n_tok, V = a.vocab, D = a.d_model, Dt = a.t_d_model;
  return {{a.grad_output, N, te, "grad_output contains NaN or infinity"},
          {a.hidden, N * D, a.elem, "student_input contains NaN or infinity"},
          {a.weight, V * D, a.elem, "student_weight contains NaN or infinity"},
          {a.bias, V, a.elem, "student_bias contains NaN or infinity"},
          {a.t_hidden, N * Dt, a.t_elem, "teacher_input contains NaN or infinity"},
          {a.t_weight, V * Dt, a.t_elem, "teacher_weight contains NaN or infinity"},
          {a.t_bias, V, a.t_elem, "teacher_bias contains NaN or infinity"},
          {a.shard_lse, 3 * N, te, "shard_lse contains NaN or infinity"},
          {a.shard_h, N, te, "shard_h contains NaN or infinity"},
          {a.shard_coef, 2 * N, te, "shard_coef contains NaN or infinity"}};
}

template <class T>
int fused_linear_distill_check(const DistillArgs<T>& a, std::string* why) {
  int st = fused_linear_distill_check_shape(a, why);
  if (st != LOSS_OK) return st;
  if ((st = head::refuse_non_finite(finite_inputs(a), why)) != LOSS_OK) return st;
  // in the vocab-parallel form a target outside [0, V) lies in another shard
  if (!a.targets || a.shard) return LOSS_OK;
  return head::refuse_bad_target(a.targets, a.n_tok, 0, 0, a.opt.has_ignore, a.opt.ignore_index,
                                 a.vocab, why);
}

template <class T>
int64_t fused_linear_distill_chunk(const DistillArgs<T>& a) {
  return head::run_chunk<T>(a.elem, a.opt.chunk, a.n_tok);
}

template <class T>
void fused_linear_distill(const DistillArgs<T>& a, DistillOut<T>& out) {
  const int64_t N = a.n_tok, V = a.vocab;
  const int64_t C = fused_linear_distill_chunk(a);
  const DistillOptions& o = a.opt;
  const double temp = o.temperature, sw = o.soft_weight, hw = o.hard_weight, beta = o.beta;
  const Objective obj = math::effective_objective(o.objective, beta);
  const double lb = obj == Objective::JSD ? std::log(beta) : 0.0;
  const double l1b = obj == Objective::JSD ? std::log1p(-beta) : 0.0;
  const bool has_ce = a.targets != nullptr;  // the hard term, reported even at hard_weight 0
  const bool shard = a.shard;  // the vocab-parallel form

  // ---- every allocation, before any work --------------------------------------------------
  head::Head<T> student(a.hidden, a.weight, a.bias, a.elem, N, a.d_model, V, C, true,
                        out);
  head::Head<T> teacher(a.t_hidden, a.t_weight, a.t_bias, a.t_elem, N, a.t_d_model, V, C, true,
                        GradOut<T>());
  const bool with_grad = student.with_grad();
  if (shard && with_grad && !a.shard_coef)
    throw std::invalid_argument("the vocab-parallel form's gradients need shard_coef");
  Buffer<double> div(static_cast<size_t>(N)), ce(static_cast<size_t>(N));
  // per thread four (V) rows of a token's per-class values, each formed once (see below)
  Buffer<double> rows(size_t(omp_get_max_threads()) * size_t(4 * V));
  Buffer<unsigned char> valid(static_cast<size_t>(N));

  student.begin();
  teacher.begin();
  int64_t n_counted = 0;
  for (int64_t t = 0; t < N; ++t) {
    valid[t] = !a.targets || shard ||
               math::counted(a.targets, t, 0, 0, o.has_ignore, o.ignore_index);
    n_counted += valid[t];
  }
  const double n_sum = double(n_counted);
  auto no_row = [](int64_t, int64_t, int64_t, T*) {};

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = N - t0 < C ? N - t0 : C;
    student.project(t0, c, 0.0, 1.0, no_row);
    teacher.project(t0, c, 0.0, 1.0, no_row);
    T* const zs_all = student.logits();
    const T* const zt_all = teacher.logits();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      const int64_t t = t0 + r;
      T* zs = zs_all + r * V;
      const T* zt = zt_all + r * V;
      if (!valid[t]) {
        div[t] = ce[t] = 0.0;
        if (with_grad) std::memset(zs, 0, sizeof(T) * size_t(V));
        continue;
      }
      double* es = rows.data() + size_t(omp_get_thread_num()) * size_t(4 * V);
      double* et = es + V;  // exp((t - max) / T): q_v = et[v] / st
      double* e1 = et + V;  // exp(s - max), the untempered softmax's (the hard term at T != 1)
      double* hv = e1 + V;  // the student's score h_v (ReverseKL, JSD)
      // Maxima (exact), then each head's exp((z - max) / T) and their sums, in vocab order.
      double ms = double(zs[0]), mt = double(zt[0]);
      for (int64_t v = 1; v < V; ++v) {
        ms = double(zs[v]) > ms ? double(zs[v]) : ms;
        mt = double(zt[v]) > mt ? double(zt[v]) : mt;
      }
      double ss = 0.0, st = 0.0, s1 = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        es[v] = std::exp((double(zs[v]) - ms) / temp);
        et[v] = std::exp((double(zt[v]) - mt) / temp);
        ss += es[v];
        st += et[v];
      }
      // the hard term's softmax is the untempered one: the same sums at T = 1
      const bool own_e1 = has_ce && temp != 1.0;
      if (own_e1)
        for (int64_t v = 0; v < V; ++v) s1 += (e1[v] = std::exp(double(zs[v]) - ms));
      else
        s1 = ss;
      const double lss = std::log(ss), lst = std::log(st), ls1 = std::log(s1);
      // The normalizers: this vocabulary's own (fs = 1 / ss: p = es / ss), or in the
      // vocab-parallel form the full vocabulary's lse L, with log p = (s - ms) / T - (L - ms / T)
      // and p = es * exp(ms / T - L).
      const T* gl = a.shard_lse ? a.shard_lse + 3 * t : nullptr;
      const double ns = gl ? double(gl[0]) - ms / temp : lss;
      const double nt = gl ? double(gl[1]) - mt / temp : lst;
      const double n1 = gl ? double(gl[2]) - ms : ls1;
      const double fs = gl ? std::exp(-ns) : 1.0 / ss, ft = gl ? std::exp(-nt) : 1.0 / st;
      const double f1 = gl ? std::exp(-n1) : 1.0 / s1;
      double ct = 0.0;
      int64_t y = -1;
      if (has_ce) {
        // in the vocab-parallel form a target outside [0, V) lies in another shard
        y = a.targets[t];
        if (y < 0 || y >= V) y = -1;
        else ct = (ms - double(zs[y])) + n1;  // math::token_ce's form: log(V) for equal logits
      }
      // The divergence's shares and, for ReverseKL and JSD, H = sum_v p_v h_v. p and q are the
      // stored exponentials times their normalizers; lp and lq are formed from the logits.
      double dsum = 0.0, hsum = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        const double lp = (double(zs[v]) - ms) / temp - ns;
        const double lq = (double(zt[v]) - mt) / temp - nt;
        const double p = es[v] * fs;
        const math::DivElem e = math::div_elem(obj, beta, lb, l1b, lp, lq, p, et[v] * ft);
        dsum += e.term;
        hsum += p * e.h;
        hv[v] = e.h;
      }
      div[t] = dsum;
      ce[t] = ct;
      if (out.shard_stats) {
        T* o = out.shard_stats + 6 * t;
        o[0] = T(ms / temp + lss), o[1] = T(mt / temp + lst), o[2] = T(ms + ls1);
        o[3] = T(dsum), o[4] = T(hsum), o[5] = T(y >= 0 ? double(zs[y]) : std::nan(""));
      }
      if (!with_grad) continue;
      // d loss_t / d s_v = sw / T d div / d(s_v / T) + hw (p1_v - [v == y]), times the scale;
      // in the vocab-parallel form the caller's per-token (soft, hard) scales and full H.
      double ks, kh;
      if (shard) {
        ks = double(a.shard_coef[2 * t]), kh = double(a.shard_coef[2 * t + 1]);
        hsum = double(a.shard_h[t]);
      } else {
        const double sc = math::reduction_scales(o.reduction, true, o.grad_scale, n_sum, n_sum,
                                                 a.grad_output ? double(a.grad_output[t]) : 1.0,
                                                 1.0).ce;
        ks = sc * sw / temp, kh = sc * hw;
      }
      if (ks == 0.0 && kh == 0.0) {
        std::memset(zs, 0, sizeof(T) * size_t(V));
        continue;
      }
      const double* p1 = own_e1 ? e1 : es;
      const double g1 = own_e1 ? f1 : fs;
      for (int64_t v = 0; v < V; ++v) {
        double g = 0.0;
        if (ks != 0.0) g = ks * math::div_grad(obj, beta, es[v] * fs, et[v] * ft, hv[v], hsum);
        if (kh != 0.0) g += kh * (p1[v] * g1);
        zs[v] = T(g);
      }
      if (kh != 0.0 && y >= 0) zs[y] = T(double(zs[y]) - kh);
    }
    if (with_grad) student.backward(t0, c);
  }

  // Token-order reductions, serial: the only order that cannot depend on C or the threads.
  for (int64_t t = 0; t < N; ++t) {
    const double l = sw * div[t] + hw * ce[t];
    if (valid[t]) {
      out.loss.add(l);
      out.div.add(div[t]);
      out.ce.add(ce[t]);
    }
    if (out.loss_tok) out.loss_tok[t] = T(valid[t] ? l : 0.0);
    if (out.div_tok) out.div_tok[t] = T(div[t]);
    if (out.ce_tok) out.ce_tok[t] = T(ce[t]);
  }
  student.finish();
}

template int fused_linear_distill_check_shape<float>(const DistillArgs<float>&, std::string*);
template int fused_linear_distill_check_shape<double>(const DistillArgs<double>&, std::string*);
template int fused_linear_distill_check<float>(const DistillArgs<float>&, std::string*);
template int fused_linear_distill_check<double>(const DistillArgs<double>&, std::string*);
template std::vector<FiniteInput> finite_inputs<float>(const DistillArgs<float>&);
template std::vector<FiniteInput> finite_inputs<double>(const DistillArgs<double>&);
template int64_t fused_linear_distill_chunk<float>(const DistillArgs<float>&);
template int64_t fused_linear_distill_chunk<double>(const DistillArgs<double>&);
template void fused_linear_distill<float>(const DistillArgs<float>&, DistillOut<float>&);
template void fused_linear_distill<double>(const DistillArgs<double>&, DistillOut<double>&);
template struct DistillOut<float>;
template struct DistillOut<double>;

}  // namespace lossk
}  // namespace algenta

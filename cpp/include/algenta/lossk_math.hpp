// The per-token arithmetic of the fused loss that the CPU backend (lossk_cross_entropy.cpp) and
// the CUDA backend (cuda/lossk_*.cu, also under the emulator) both compute: which tokens count,
// the merge of a token's vocab-block statistics, its loss terms, its gradient coefficients and
// the reduced loss. Written once so the two cannot drift apart; each backend keeps its own
// parallel structure (threads, blocks) around these calls.
//
// Bits: nvcc contracts a * b + c into one fma where host C++ does not, so the same expression
// may differ in the last bit between a device and the CPU; the emulator compiles it as host C++.
// What does not differ is the formula and its evaluation order, which this file fixes.
#pragma once

#include <cmath>
#include <cstdint>

#include "algenta/hd.hpp"
#include "algenta/lossk.hpp"

namespace algenta {
namespace lossk {
namespace math {

// Is token t scored? Not the last `shift` positions of each sequence (their target lies in the
// next sequence), and not a target equal to ignore_index. Reads targets only for a token a shift
// keeps, so the last rows never read past the end of targets.
ALGENTA_HD bool counted(const int64_t* targets, int64_t t, int64_t shift, int64_t seq_len,
                        bool has_ignore, int64_t ignore_index) {
  if (shift > 0 && t % seq_len >= seq_len - shift) return false;
  return !(has_ignore && targets[t + shift] == ignore_index);
}

// A per-token loss weight the core accepts: finite and >= 0 (NaN fails both tests).
ALGENTA_HD bool token_weight_ok(double u) { return u >= 0.0 && u <= 1.7976931348623157e308; }

// Row t's loss weight: token weights are aligned with the targets, so row t (scored against
// targets[t + shift]) takes tw[t + shift]; 1 without token weights.
template <class T>
ALGENTA_HD double token_weight_of(const T* tw, int64_t t, int64_t shift) {
  return tw ? double(tw[t + shift]) : 1.0;
}

// A token's vocab blocks merged in block order: the overall max (the first block holding it),
// sum_v exp(z_v - max), sum_v (w_v) z_v and sum_v exp(z_v - max) (max - z_v). S has fields max,
// sumexp, sumz, sument (a block's own sums, relative to its own max).
struct Merged {
  double max, sumexp, sumz, sument;
  int64_t block;  // the first block whose max is the overall max
};

// Its two passes, as steps, so a device can spread the first pass and the factors over lanes
// and keep the second pass's additions in block order: the overall max (the first block holding
// it), then each block's factor exp(max_b - max) and its additions, block after block.
ALGENTA_HD double merge_factor(double block_max, double max) {
#if defined(__CUDA_ARCH__)
  return exp(block_max - max);
#else
  return std::exp(block_max - max);
#endif
}
template <class S>
ALGENTA_HD void merge_add(Merged& r, const S& b, double f) {
  r.sumexp += b.sumexp * f;
  r.sumz += b.sumz;
  // max - z_v = (max - max_b) + (max_b - z_v): both parts >= 0
  r.sument += f * ((r.max - b.max) * b.sumexp + b.sument);
}

template <class S>
ALGENTA_HD Merged merge_blocks(const S* s, int64_t nvb) {
  Merged r{s[0].max, 0.0, 0.0, 0.0, 0};
  for (int64_t b = 1; b < nvb; ++b)
    if (s[b].max > r.max) r.max = s[b].max, r.block = b;
  for (int64_t b = 0; b < nvb; ++b) merge_add(r, s[b], merge_factor(s[b].max, r.max));
  return r;
}

// The entropy of a token's softmax, H = lse - sum_v p_v z_v, as (max - E[z]) + log(sumexp): two
// sums of terms >= 0, so a peaked distribution's small entropy is not the difference of two
// large numbers. logse = log(mg.sumexp).
ALGENTA_HD double token_entropy(const Merged& mg, double logse) {
  return mg.sument / mg.sumexp + logse;
}

// The cross-entropy term of a counted token (lossk.hpp's ce_t), from the merged max m, logse =
// log(sumexp), its target's logit zt, sz = sum_v (w_v) z_v, its target's weight wy and w_all =
// sum_v w_v. Formed as (m - zt) + logse, not lse - zt: the logit difference comes before the log
// is added, so equal logits give exactly log(V) whatever their value, and a large max does not
// cancel against a large target logit.
ALGENTA_HD double token_ce(double m, double logse, double zt, double sz, double wy, double w_all,
                           double eps, int64_t V, bool weighted) {
  double ct = (m - zt) + logse;
  if (weighted) {
    ct *= wy;
    if (eps > 0.0) ct = (1.0 - eps) * ct + (eps / double(V)) * ((w_all * m - sz) + w_all * logse);
  } else if (eps > 0.0) {
    ct = (1.0 - eps) * ct + eps * ((m - sz / double(V)) + logse);
  }
  return ct;
}

// The reduction's per-token scales of d ce_t and d z_t, u the token's weight (1 without): for
// Mean u/(sum of counted u w_y) and u/(sum of counted u), for Sum u, for None u times the token's
// upstream gradient; zero for a token that is not counted, and a zero denominator gives zero
// (the loss is then NaN, PyTorch's mean over nothing). Without token weights u = 1 and u_sum is
// the count, so the products below are exact and change no bit.
struct Scales {
  double ce, z;
};

ALGENTA_HD Scales reduction_scales(Reduction red, bool valid, double grad_scale, double u_sum,
                                   double w_sum, double grad_out_t, double u) {
  if (!valid) return {0.0, 0.0};
  if (red == Reduction::Mean)
    return {w_sum != 0.0 ? grad_scale * u / w_sum : 0.0,
            u_sum != 0.0 ? grad_scale * u / u_sum : 0.0};
  if (red == Reduction::Sum) return {grad_scale * u, grad_scale * u};
  return {grad_out_t * u, grad_out_t * u};
}

// d loss / d z'_v = p_v a - b w_v - c [v == y], p = softmax(z'):
//   a = s_ce ((1 - eps) w_y + (eps / V) sum_u w_u) + s_z 2 zs lse + grad_lse,
//   b = s_ce eps / V,  c = s_ce (1 - eps) w_y;
// then times the soft cap's slope (cap_slope) where a cap is set.
struct Coef {
  double a, b, c;
  double e = 0.0;  // the entropy's: d/dz'_v also has p_v e (z'_v - max) (with_entropy)
};

ALGENTA_HD Coef grad_coef(Scales s, double eps, int64_t V, double wy, double w_all, double zs,
                          double lse, double grad_lse_t) {
  return {s.ce * ((1.0 - eps) * wy + (eps / double(V)) * w_all) + s.z * 2.0 * zs * lse + grad_lse_t,
          s.ce * eps / double(V), s.ce * (1.0 - eps) * wy};
}

// d z' / d z = 1 - (z' / cap)^2 at a capped logit z', in the compute type T (both backends form
// it in T, as the gradient sweep does for every other logit); 1 without a cap.
template <class T>
ALGENTA_HD double cap_slope(double zcapped, double cap) {
  if (!(cap > 0.0)) return 1.0;
  const T tz = T(zcapped) * T(1.0 / cap);
  return double((T(1) - tz) * (T(1) + tz));
}

// Temperature T: z' = cap tanh(z / cap) / T, which both backends form as tanh(z * (1/cap)) * a
// with a = cap / T the tempered cap's amplitude (one constant; exactly cap at T = 1), and
// z' = z / T without a cap (a division, as `logits / T` rounds in PyTorch; nothing at T = 1).
// Then dz'/dz = (1 - (z' / a)^2) / T: the cap's slope at amplitude a (cap_slope, and the
// gradient sweep's own with cap = a), and 1/T folded into the per-token coefficients, exact at
// T = 1, so an untempered loss changes no bit.
ALGENTA_HD double tempered_cap(double cap, double temperature) {
  return cap > 0.0 ? cap / temperature : 0.0;
}

ALGENTA_HD Coef tempered(Coef k, double temperature) {
  if (temperature == 1.0) return k;
  return {k.a / temperature, k.b / temperature, k.c / temperature, k.e / temperature};
}

// The entropy's gradient added to a token's coefficients: dH/dz'_v = p_v (E[z'] - z'_v)
// = -p_v (d + (z'_v - max)), d = max - E[z'] = mg.sument / mg.sumexp; s_h its scale (the
// reduction's, times the entropy's upstream gradient).
ALGENTA_HD Coef with_entropy(Coef k, double s_h, double d) {
  if (s_h == 0.0) return k;
  return {k.a - s_h * d, k.b, k.c, k.e - s_h};
}

// The entropy's per-token scale s_h: it reduces as the z-loss term does, so reduction_scales'
// z share with the entropy's upstream gradient (scale for Mean/Sum, g_t per token for None).
ALGENTA_HD double entropy_scale(Reduction red, bool valid, double scale, double u_sum,
                                double g_t, double u) {
  return reduction_scales(red, valid, scale, u_sum, 0.0, g_t, u).z;
}

// A temperature the core accepts in compute type T: finite, and at least T's smallest normal
// number (a smaller one would round to zero or lose precision as a divisor).
template <class T>
ALGENTA_HD bool temperature_ok(double t) {
  const double lo = sizeof(T) == 8 ? 2.2250738585072014e-308 : 1.1754943508222875e-38;
  const double hi = sizeof(T) == 8 ? 1.7976931348623157e308 : 3.4028234663852886e38;
  return t >= lo && t <= hi;
}

// LossSum's mean from its parts: first + sum(l - first) / n, NaN over no tokens (PyTorch's mean
// of nothing).
ALGENTA_HD double sum_mean(double first, double shifted, double count) {
  return count > 0.0 ? first + shifted / count : NAN;
}

// The z-loss term's mean: over the counted tokens (LossSum's parts), or with token weights
// sum_t u_t z_t / sum_t u_t.
ALGENTA_HD double z_mean(bool token_weighted, double z_total, double u_sum, double z_first,
                         double z_shifted, double count) {
  return token_weighted ? z_total / u_sum : sum_mean(z_first, z_shifted, count);
}

// The loss a reduction returns from the token-order sums (of u_t ce_t and u_t z_t): Sum adds both
// terms; Mean is PyTorch's weighted mean (divided by the sum of u_t w_{y_t}) with class or token
// weights, the LossSum mean without (exact log(V) for uniform logits), plus z_mean.
ALGENTA_HD double reduced_loss(Reduction red, bool weighted, double ce_total, double ce_mean,
                               double weight_sum, double z_total, double z_mean) {
  if (red == Reduction::Sum) return ce_total + z_total;
  const double m = weighted ? ce_total / weight_sum : ce_mean;
  return z_total != 0.0 ? m + z_mean : m;
}

// ---- distillation (lossk.hpp's DistillArgs) ----------------------------------------------

// The objective computed: JSD at beta 0 and 1 is KL and ReverseKL (the mixture formula is
// identically 0 there; Liger-Kernel's beta means these two limits).
ALGENTA_HD Objective effective_objective(Objective o, double beta) {
  if (o != Objective::JSD) return o;
  return beta == 0.0 ? Objective::KL : beta == 1.0 ? Objective::ReverseKL : Objective::JSD;
}

// log m = log(beta q + (1 - beta) p) from lq and lp, lb = log(beta), l1b = log(1 - beta): the
// larger exponent factored out, so it is finite wherever lq and lp are (never log 0 where both
// probabilities underflow).
ALGENTA_HD double log_mix(double lb, double l1b, double lq, double lp) {
  const double a = lb + lq, b = l1b + lp;
  const double hi = a > b ? a : b, lo = a > b ? b : a;
#if defined(__CUDA_ARCH__)
  return hi + log1p(exp(lo - hi));
#else
  return hi + std::log1p(std::exp(lo - hi));
#endif
}

// Element v's share of a token's divergence, from lp = log p_v, lq = log q_v and p, q, and the
// student's score h (ReverseKL: lp - lq; JSD: lp - log m) whose p-weighted sum H the gradient
// needs. Each share is formed from the log-probabilities (never log(p / q) of two that may
// underflow), so a share is finite and 0 wherever its weight p or q is.
struct DivElem {
  double term, h;
};

ALGENTA_HD DivElem div_elem(Objective o, double beta, double lb, double l1b, double lp, double lq,
                            double p, double q) {
  if (o == Objective::KL) return {q * (lq - lp), 0.0};
  if (o == Objective::ReverseKL) return {p * (lp - lq), lp - lq};
  const double lm = log_mix(lb, l1b, lq, lp);
  return {beta * q * (lq - lm) + (1.0 - beta) * p * (lp - lm), lp - lm};
}

// d div / d (s_v / T): KL p - q; ReverseKL p (h - H); JSD (1 - beta) p (h - H) (the mixture's
// own derivative cancels: d/dp of beta KL(q||m) + (1 - beta) KL(p||m) is (1 - beta) log(p / m)).
ALGENTA_HD double div_grad(Objective o, double beta, double p, double q, double h, double H) {
  if (o == Objective::KL) return p - q;
  if (o == Objective::ReverseKL) return p * (h - H);
  return (1.0 - beta) * p * (h - H);
}

}  // namespace math
}  // namespace lossk
}  // namespace algenta

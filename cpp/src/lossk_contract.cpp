// lossk contract: status names, ceilings and budget checks. Pure arithmetic on int64 with no
// product formed before it is known not to overflow.
#include <cfloat>
#include <cmath>

#include <string>

#include "algenta/lossk.hpp"
#include "algenta/lossk_math.hpp"

namespace algenta {
namespace lossk {

const char* loss_status_name(int64_t code) {
  switch (code) {
    case LOSS_OK: return "ok";
    case LOSS_ERR_EMPTY_DIMENSION: return "empty_dimension";
    case LOSS_ERR_LENGTH_MISMATCH: return "length_mismatch";
    case LOSS_ERR_DIMENSION_TOO_LARGE: return "dimension_too_large";
    case LOSS_ERR_WORK_BUDGET: return "work_budget_exceeded";
    case LOSS_ERR_NON_FINITE: return "non_finite_scalar";
    case LOSS_ERR_TARGET_OUT_OF_RANGE: return "target_id_out_of_range";
    case LOSS_ERR_BAD_CHUNK: return "chunk_exceeds_logit_budget";
    case LOSS_ERR_UNKNOWN_OBJECTIVE: return "unknown_objective";
    case LOSS_ERR_NO_CUDA_BACKEND: return "no_cuda_backend";
    case LOSS_ERR_NO_DEVICE: return "no_cuda_device";
    case LOSS_ERR_DEVICE_FAILED: return "cuda_call_failed";
    default: return "unknown_status";
  }
}

bool loss_work_fits(int64_t n_tok, int64_t d_model, int64_t vocab, int64_t ceiling) {
  if (n_tok < 1 || d_model < 1 || vocab < 1 || ceiling < 1) return false;
  // a*b*c <= C  <=>  a <= floor(floor(C / c) / b) for positive integers: exact, and no product
  // is ever formed.
  return n_tok <= (ceiling / vocab) / d_model;
}

int loss_dims_check(int64_t n_tok, int64_t d_model, int64_t vocab) {
  if (n_tok < 1 || d_model < 1 || vocab < 1) return LOSS_ERR_EMPTY_DIMENSION;
  if (n_tok > LOSS_MAX_TOKENS || d_model > LOSS_MAX_D_MODEL || vocab > LOSS_MAX_VOCAB)
    return LOSS_ERR_DIMENSION_TOO_LARGE;
  if (!loss_work_fits(n_tok, d_model, vocab, LOSS_MAX_WORK_CELLS)) return LOSS_ERR_WORK_BUDGET;
  return LOSS_OK;
}

std::string target_refusal(int64_t y, int64_t t, int64_t vocab, bool has_ignore) {
  return "target " + std::to_string(y) + " at token " + std::to_string(t) + " is outside [0, " +
         std::to_string(vocab) + ")" + (has_ignore ? "" : " (no ignore_index was given)");
}

std::string chunk_refusal(int st, int64_t chunk, int64_t vocab) {
  return "chunk=" + std::to_string(chunk) + " refused for vocab=" + std::to_string(vocab) + ": " +
         loss_status_name(st) +
         (st == LOSS_ERR_BAD_CHUNK ? " (chunk * vocab must be <= 2^27 = 134217728 logit cells)"
                                   : "");
}

int loss_chunk_check(int64_t chunk, int64_t vocab) {
  if (chunk < 1 || vocab < 1) return LOSS_ERR_EMPTY_DIMENSION;
  if (chunk > LOSS_MAX_TOKENS || vocab > LOSS_MAX_VOCAB) return LOSS_ERR_DIMENSION_TOO_LARGE;
  if (chunk > LOSS_MAX_LOGIT_CELLS / vocab) return LOSS_ERR_BAD_CHUNK;
  return LOSS_OK;
}

double loss_logit_cells(int64_t chunk, int64_t vocab) {
  // Malformed (empty or past a ceiling) reads as -1, never as a small positive count. Within the
  // ceilings chunk * vocab < 2^48, exact in a double.
  if (chunk < 1 || vocab < 1 || chunk > LOSS_MAX_TOKENS || vocab > LOSS_MAX_VOCAB) return -1.0;
  return double(chunk * vocab);
}

int64_t loss_max_chunk(int64_t n_tok, int64_t vocab) {
  if (n_tok < 1 || vocab < 1 || vocab > LOSS_MAX_VOCAB) return 0;
  int64_t c = LOSS_MAX_LOGIT_CELLS / vocab;
  if (c > n_tok) c = n_tok;
  if (c > LOSS_MAX_TOKENS) c = LOSS_MAX_TOKENS;  // a chunk is a token count: same ceiling
  return c < 1 ? 0 : c;
}

bool loss_targets_in_range(const int64_t* targets, int64_t len, int64_t n_tok, int64_t vocab) {
  if (n_tok < 0 || len < n_tok || vocab < 1) return false;
  for (int64_t i = 0; i < n_tok; ++i)
    if (targets[i] < 0 || targets[i] >= vocab) return false;
  return true;
}

bool loss_scalars_ok(double value) { return std::isfinite(value); }

double loss_tol_for(double magnitude, double reduction_width) {
  // A float32 reduction of width w carries a rounding error that grows like sqrt(w) ulps on
  // random data (and is bounded by w ulps); a loss of size |m| has an ulp of eps*|m|. We allow
  // 8 ulps times sqrt(w), with magnitudes below 1 treated as 1 (a loss near 0 is still computed
  // from terms of size ~1). NaN in, NaN out: a NaN tolerance fails every comparison.
  const double m = std::fabs(magnitude) > 1.0 ? std::fabs(magnitude) : 1.0;
  const double w = reduction_width > 1.0 ? reduction_width : 1.0;
  if (std::isnan(magnitude) || std::isnan(reduction_width)) return NAN;
  return 8.0 * double(FLT_EPSILON) * m * std::sqrt(w);
}

double LossSum::mean() const { return math::sum_mean(first, shifted, double(count)); }

}  // namespace lossk
}  // namespace algenta

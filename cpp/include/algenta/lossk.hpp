// lossk: the contract of the fused linear + cross-entropy family.
//
// Dimension legend: N tokens, D d_model, V vocab, C chunk (tokens whose logits exist at once).
//
// Everything a caller can ask before work runs lives here as pure arithmetic (status codes,
// ceilings, budget checks), next to the compute entry points both backends implement. The CPU
// implementation is cpp/src/lossk_*.cpp; nothing in this header pulls in CUDA or OpenMP.
//
// Numerics contract (see DESIGN.md): the loss, the per-token log-sum-exp and both gradients are
// bit-identical for every chunk size C and every OpenMP thread count. Reductions run in a fixed
// order: per-token losses in token order, log-sum-exp over fixed vocab blocks merged in block
// order, GEMM cells as one multiply-add chain in k order that never depends on how k or the
// output was partitioned.
#pragma once
#include <cstdint>
#include <string>

namespace algenta {
namespace lossk {

// ---- status codes (580-599) -------------------------------------------------------------
enum : int {
  LOSS_OK = 580,
  LOSS_ERR_EMPTY_DIMENSION = 581,
  LOSS_ERR_LENGTH_MISMATCH = 582,
  LOSS_ERR_DIMENSION_TOO_LARGE = 583,
  LOSS_ERR_WORK_BUDGET = 584,
  LOSS_ERR_NON_FINITE = 585,
  LOSS_ERR_TARGET_OUT_OF_RANGE = 586,
  LOSS_ERR_BAD_CHUNK = 587,
  LOSS_ERR_UNKNOWN_OBJECTIVE = 588,  // an objective/reduction this family does not compute
};

// ---- ceilings ---------------------------------------------------------------------------
// Total multiply-adds of one fused projection (N * D * V). Chunking is what makes a huge total
// tractable, so this bounds work, not memory.
constexpr int64_t LOSS_MAX_WORK_CELLS = int64_t(1) << 46;
// Logit cells one chunk may hold at once (C * V): 2^27 cells is 1 GiB in float64.
constexpr int64_t LOSS_MAX_LOGIT_CELLS = int64_t(1) << 27;
// Per-dimension ceilings. They admit every real LM head we know of with room to spare
// (Gemma-3's 262,144-token vocabulary, d_model 16,384 of the largest dense models) while keeping
// every product of two dimensions far below 2^63, so intermediate index arithmetic cannot wrap.
constexpr int64_t LOSS_MAX_TOKENS = int64_t(1) << 26;   // 67,108,864 tokens in one call
constexpr int64_t LOSS_MAX_D_MODEL = int64_t(1) << 17;  // 131,072
constexpr int64_t LOSS_MAX_VOCAB = int64_t(1) << 22;    // 4,194,304 classes
// Agreement floor between two spellings of a transcendental-heavy reduction (libm's exp/log
// are not correctly rounded): identities such as "d_weight summed over the vocabulary cancels"
// are tested against this, not against zero.
constexpr double LOSS_TRANSCENDENTAL_FLOOR = 1e-9;
// Vocab block the log-sum-exp is merged over. A fixed constant (never derived from C, V or the
// thread count), so the merge order of every token's log-sum-exp is fixed.
constexpr int64_t LOSS_VOCAB_BLOCK = 256;

// ---- pure checks (never throw, never allocate) -------------------------------------------
const char* loss_status_name(int64_t code);
int loss_dims_check(int64_t n_tok, int64_t d_model, int64_t vocab);
int loss_chunk_check(int64_t chunk, int64_t vocab);
double loss_logit_cells(int64_t chunk, int64_t vocab);  // < 0 on a malformed request
bool loss_work_fits(int64_t n_tok, int64_t d_model, int64_t vocab, int64_t ceiling);
bool loss_targets_in_range(const int64_t* targets, int64_t len, int64_t n_tok, int64_t vocab);
bool loss_scalars_ok(double value);
double loss_tol_for(double magnitude, double reduction_width);
// Largest chunk whose C * V logits fit LOSS_MAX_LOGIT_CELLS, never more than n_tok or
// LOSS_MAX_TOKENS, so loss_chunk_check always admits it (>= 1 for a valid vocab; 0 for a
// malformed one).
int64_t loss_max_chunk(int64_t n_tok, int64_t vocab);

// Running token-order sum of per-token losses. The mean is first + sum(l - first) / n: for
// identical losses (uniform logits) it returns that loss to the last bit, which sum / n does not,
// and it is as accurate as a plain sum otherwise. Feeding tokens in pieces gives the same bits as
// feeding them at once.
struct LossSum {
  double total = 0.0, first = 0.0, shifted = 0.0;
  int64_t count = 0;
  void add(double loss) {
    if (count == 0) first = loss;
    total += loss;
    shifted += loss - first;
    ++count;
  }
  double mean() const;  // NaN when count == 0 (PyTorch: a mean over no tokens is NaN)
};

// ---- the fused loss ---------------------------------------------------------------------
enum class Reduction { Mean, Sum, None };

template <class T>
struct FusedArgs {
  const T* hidden = nullptr;        // (N, D) row-major
  const T* weight = nullptr;        // (V, D) row-major
  const int64_t* targets = nullptr; // (N)
  int64_t n_tok = 0, d_model = 0, vocab = 0;
  int64_t chunk = 0;                // tokens per chunk; must pass loss_chunk_check
  Reduction reduction = Reduction::Mean;
  bool has_ignore = false;          // when false every target must be in [0, V)
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;     // PyTorch's F.cross_entropy semantics, in [0, 1]
  const T* grad_output = nullptr;   // (N) per-token upstream gradient, Reduction::None only
};

template <class T>
struct FusedOut {
  T* lse = nullptr;        // (N) per-token log-sum-exp, or null
  T* loss_tok = nullptr;   // (N) per-token loss (0 for ignored tokens), or null
  T* d_hidden = nullptr;   // (N, D), or null: no gradient wanted
  T* d_weight = nullptr;   // (V, D), or null
  LossSum sum;             // valid tokens' losses in token order; sum.count is n_valid
};

// Every refusal of FusedArgs, in a fixed order (581/583/584 dims, 587 chunk, 585 non-finite
// data or scalars, 586 targets), with the reason in *why. Reads the inputs, never allocates. Call before allocating
// outputs; the compute functions below assume it returned LOSS_OK.
template <class T>
int fused_linear_ce_check(const FusedArgs<T>& a, std::string* why = nullptr);

// Forward (and, when out.d_hidden / out.d_weight are set, both gradients in the same pass).
// Gradients are of the reduced loss: scaled by 1/n_valid for Mean, 1 for Sum, grad_output[t]
// for None. Peak extra memory: one chunk of logits (C * V) when gradients are wanted, a few
// numbers per (token, vocab block) otherwise. May throw std::bad_alloc (before any work).
template <class T>
void fused_linear_ce(const FusedArgs<T>& a, FusedOut<T>& out);

// The materialized reference: cross-entropy of (N, V) float64 logits, no chunking.
int ce_from_logits_check(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                         std::string* why = nullptr);
// Adds the N tokens' losses to sum (token order); lse_out (N) may be null.
void ce_from_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    LossSum& sum, double* lse_out);
// (softmax(logits) - one_hot(target)) * scale, row by row; out (N, V) may alias logits.
void ce_grad_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    double scale, double* out);

}  // namespace lossk
}  // namespace algenta

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
#include <vector>

#include "algenta/dtype.hpp"

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
  // The CUDA backend's: a capability of the build or host, or a failed device call.
  LOSS_ERR_NO_CUDA_BACKEND = 589,    // built without a CUDA backend (ALGENTA_GPU / ALGENTA_CUDA_EMU)
  LOSS_ERR_NO_DEVICE = 590,          // a CUDA backend, no usable device on this host
  LOSS_ERR_DEVICE_FAILED = 591,      // a CUDA call failed
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
// The words of a 586 refusal: target y at token t outside [0, vocab) (every backend's).
std::string target_refusal(int64_t y, int64_t t, int64_t vocab, bool has_ignore);
// The words of loss_chunk_check's refusal of chunk st for vocab (both fused losses say them).
std::string chunk_refusal(int st, int64_t chunk, int64_t vocab);
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

// ---- the options record ---------------------------------------------------------------------
enum class Reduction { Mean, Sum, None };
enum class Objective { KL, ReverseKL, JSD };  // distillation's divergence (below)

// The scalar options of a fused loss: one record from the Python faces (algenta/lossk/_args.py
// builds it under these field names, the binding reads it in one place) through either backend's
// host code to the kernels. Per-call data (the arrays, their sizes, which outputs are wanted) is
// the Args and Out structs' own. Every range below is refused by the core's checks
// (fused_linear_ce_check_shape, fused_linear_distill_check_shape), never assumed.
struct LossOptions {                 // what every fused loss takes
  int64_t chunk = 0;                 // tokens per chunk; must pass loss_chunk_check
  Reduction reduction = Reduction::Mean;
  bool has_ignore = false;           // when false every counted target must be in [0, V)
  int64_t ignore_index = -100;
  // T > 0 (finite, and a normal number of the compute type) divides the logits (both heads'
  // for distillation)
  double temperature = 1.0;
  double grad_scale = 1.0;           // the upstream gradient of a Mean/Sum loss (finite)
};

struct CrossEntropyOptions : LossOptions {
  double label_smoothing = 0.0;      // PyTorch's F.cross_entropy semantics, in [0, 1]
  bool has_softcap = false;          // cap the logits (Gemma 2) at softcap, which must be > 0
  double softcap = 0.0;
  double lse_square_scale = 0.0;     // the z-loss scale s >= 0
  // >= 0: score row r against targets[r + shift] within sequences of FusedArgs::seq_len rows
  int64_t shift = 0;
  bool entropy = false;              // compute the entropy (FusedOut::ent, entropy_tok)
  double entropy_grad_scale = 0.0;   // its upstream gradient for Mean/Sum (entropy only)
};

struct DistillOptions : LossOptions {
  Objective objective = Objective::KL;
  double beta = 0.5;                 // JSD's, in [0, 1]
  double hard_weight = 0.0, soft_weight = 1.0;  // finite, >= 0; hard_weight > 0 needs targets
};

// Where a loss's gradients go on the host (FusedOut's, DistillOut's, one head's in
// lossk_head.hpp), each null when not wanted. d_hidden: (N, D) in grad_elem. d_weight: (V, D) T
// accumulator; d_bias: (V) T accumulator; with a half grad_elem both are narrowed in place at the
// end, their first V*D (V) uint16 holding the result. d_weight_half, instead of d_weight, where
// the grad_elem is half and the whole batch is one chunk (the loss's *_chunk(a) >= n_tok): (V, D)
// half bits, each cell's one chain formed in a tile and narrowed from it, no accumulator at all.
template <class T>
struct GradOut {
  void* d_hidden = nullptr;
  T* d_weight = nullptr;
  uint16_t* d_weight_half = nullptr;
  T* d_bias = nullptr;
  Dtype grad_elem = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
};

// One input a loss requires finite: n elements of `elem` at p (null: not given) and the words of
// its 585 refusal. finite_inputs lists a call's in the order its check refuses them; both
// backends run that list (lossk_head.hpp on the host, lossk_launch.cuh on a device).
struct FiniteInput {
  const void* p;
  int64_t n;
  Dtype elem;
  const char* what;
};

// ---- the fused loss ---------------------------------------------------------------------

// Storage of hidden, weight and bias (and of gradients handed back narrowed). BF16/F16 inputs
// compute in float32: FusedArgs<float>.
// f32, f64, bf16 or f16 (dtype.hpp); names in messages are dtype_long_name's.

// The loss of one token t, with z = hidden_t W^T + bias, z' = softcap * tanh(z / softcap) / T when
// a soft cap is set (else z' = z / T), T the temperature (1 by default: z' = z exactly), lse = log
// sum_v exp(z'_v), w the class weights (1 without), y its target, eps the label smoothing and s the
// z-loss scale:
//   ce_t = (1 - eps) w_y (lse - z'_y) + (eps / V) sum_v w_v (lse - z'_v)
//   z_t  = s lse^2
// Counted tokens only (not ignore_index, and with shift, not one of the last `shift` positions of
// a sequence). With per-token weights u (token_weight; 1 without) each counted token's loss is
// u_t (ce_t + z_t), and Mean = sum_t u_t ce_t / sum_t u_t w_{y_t} + sum_t u_t z_t / sum_t u_t
// (PyTorch's weighted mean, the token's weight times its class's; without either weight
// sum_t ce_t / n_counted, the z-loss averaged over counted tokens, as Liger-Kernel);
// Sum = sum_t u_t (ce_t + z_t); None = the per-token u_t (ce_t + z_t).
// With entropy, also H_t = lse - sum_v p_v z'_v (p = softmax(z')), reduced as the z-loss term is:
// Mean = sum_t u_t H_t / sum_t u_t (the count without token weights), Sum = sum_t u_t H_t, None
// the per-token u_t H_t; tokens not counted contribute 0.
template <class T>
struct FusedArgs {
  const void* hidden = nullptr;        // (N, D) row-major, `elem`
  const void* weight = nullptr;        // (V, D) row-major, `elem`
  const void* bias = nullptr;          // (V), `elem`, or null
  Dtype elem = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;  // F64 with T = double; F32/BF16/F16 else
  const int64_t* targets = nullptr;    // (N): row r's target is targets[r + opt.shift]
  const T* class_weight = nullptr;     // (V) PyTorch's `weight`, or null
  // (N) per-token loss weights u, finite and >= 0, aligned with targets (row r's is
  // token_weight[r + opt.shift]), or null (every u = 1)
  const T* token_weight = nullptr;
  int64_t n_tok = 0, d_model = 0, vocab = 0;
  int64_t seq_len = 0;                 // with opt.shift: rows a sequence (shift < seq_len)
  CrossEntropyOptions opt;
  const T* grad_output = nullptr;      // (N) per-token upstream gradient, Reduction::None only
  const T* grad_lse = nullptr;         // (N) upstream gradient of the per-token lse, or null
  // (N) the entropy's upstream gradient per token for None (opt.entropy only), or null
  const T* grad_entropy = nullptr;
  // (N, 3) per-token (a, b, c), or null: the gradient is d/dz'_v = a softmax_v - b w_v - c [v == y]
  // (times d z' / d z: the cap's derivative over T) instead of the reduction's, for callers
  // that combine passes over shards of the vocabulary (a then carries exp(lse_shard -
  // lse_global)).
  const T* grad_coef = nullptr;
};

// The per-token results and sums of fused_linear_ce, with its gradients (GradOut).
template <class T>
struct FusedOut : GradOut<T> {
  T* lse = nullptr;        // (N) per-token log-sum-exp of the (capped) logits, or null
  T* loss_tok = nullptr;   // (N) per-token ce_t + z_t (0 for tokens not counted), or null
  T* z_tok = nullptr;      // (N) per-token z-loss, or null
  int64_t* pred = nullptr; // (N) per-token argmax of the (capped) logits (first maximum), or null
  T* target_logit = nullptr;  // (N) z'_y of counted tokens (NaN for the others), or null
  T* logit_sum = nullptr;     // (N) sum_v w_v z'_v (w the class weights, or ones), or null
  T* entropy_tok = nullptr;   // (N) per-token u_t H_t (0 for tokens not counted), or null
  // Results, summed in token order over the counted tokens.
  LossSum ce, z;           // ce_t and z_t; ce.count is the number of counted tokens
  LossSum ent;             // u_t H_t (with entropy)
  double weight_sum = 0.0; // sum over counted tokens of u_t w_{y_t} (the count without weights)
  double token_weight_sum = 0.0;  // sum over counted tokens of u_t (the count without them)
  int64_t n_correct = 0;   // counted tokens whose argmax is their target (when pred is set)
  bool weighted = false;        // class or token weights: Mean divides by weight_sum
  bool token_weighted = false;  // token weights: the z-loss mean divides by token_weight_sum
  double reduced(Reduction r) const;  // the loss the reduction asks for (NaN: mean of nothing)
  double z_mean() const;              // the z-loss term of the Mean reduction
  double entropy_mean() const;        // the entropy's Mean reduction
};

// Every refusal of FusedArgs, in a fixed order (581/583/584 dims, 587 chunk, 585 non-finite
// data or scalars, a softcap or temperature not > 0, a negative z-loss scale, 582 shift/seq_len,
// 586 targets), with the reason in *why. Reads the inputs, never allocates. Call before
// allocating outputs; the compute functions below assume it returned LOSS_OK.
template <class T>
int fused_linear_ce_check(const FusedArgs<T>& a, std::string* why = nullptr);

// Forward (and, when out.d_hidden / d_weight / d_bias are set, the gradients in the same pass).
// Gradients are of the reduced loss: per token scaled by 1 / sum w_y (z-loss 1 / n_counted) for
// Mean, 1 for Sum (both times grad_scale), grad_output[t] for None; plus grad_lse[t] times the
// softmax, plus the entropy's (its reduction's scales times entropy_grad_scale or
// grad_entropy[t]). Peak extra memory: one chunk of logits (C * V) when gradients are wanted, a
// few numbers per (token, vocab block) otherwise. May throw std::bad_alloc (before any work).
template <class T>
void fused_linear_ce(const FusedArgs<T>& a, FusedOut<T>& out);

// The chunk fused_linear_ce runs a (passing fused_linear_ce_check_shape) in: a.opt.chunk, at
// most n_tok, rounded to the bf16 dot product's k step on that path (see the .cpp).
template <class T>
int64_t fused_linear_ce_chunk(const FusedArgs<T>& a);

// Every refusal of fused_linear_ce_check that needs no look at the data (dims, chunk, scalars,
// shift, element type): what the CUDA backend checks on the host before any device allocation;
// the data's own checks (finite values, targets) then run on the device.
template <class T>
int fused_linear_ce_check_shape(const FusedArgs<T>& a, std::string* why = nullptr);

// The inputs fused_linear_ce_check requires finite, in its order (token weights, finite and
// >= 0, and the targets are checked after them).
template <class T>
std::vector<FiniteInput> finite_inputs(const FusedArgs<T>& a);

// ---- fused linear distillation ------------------------------------------------------------
// A student head (hidden (N, D), weight (V, D), bias) against a teacher head (teacher hidden (N,
// Dt), weight (V, Dt), bias) over one vocabulary: both projected a chunk of tokens at a time, the
// divergence of their tempered distributions reduced while the chunk is hot, gradients for the
// student only. With s = student logits, t = teacher logits, T the temperature, lp = log
// softmax(s / T), lq = log softmax(t / T), p = exp(lp), q = exp(lq) (q is the teacher's):
//   KL         div_t = sum_v q_v (lq_v - lp_v)                        KL(teacher || student)
//   ReverseKL  div_t = sum_v p_v (lp_v - lq_v)                        KL(student || teacher)
//   JSD        div_t = beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p
// JSD at beta = 0 is KL and at beta = 1 ReverseKL (where the mixture formula is identically 0),
// as Liger-Kernel's fused linear JSD defines its beta. No T^2 factor. The hard term is the
// cross-entropy of the untempered student logits against the target, ce_t = lse(s) - s_y.
// Per counted token (a target other than ignore_index; every token without targets):
//   loss_t = soft_weight div_t + hard_weight ce_t
// Mean = sum_t loss_t / n_counted (LossSum's mean; NaN over none), Sum = sum_t loss_t, None the
// per-token loss_t (0 where not counted). Exactness as the cross-entropy's: every output and
// gradient bit-identical for every chunk size and thread count, each token's div_t and ce_t
// independent of the other tokens of its batch.
template <class T>
struct DistillArgs {
  const void* hidden = nullptr;    // student (N, D) row-major, `elem`
  const void* weight = nullptr;    // student (V, D)
  const void* bias = nullptr;      // student (V), or null
  Dtype elem = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
  const void* t_hidden = nullptr;  // teacher (N, Dt), `t_elem`
  const void* t_weight = nullptr;  // teacher (V, Dt)
  const void* t_bias = nullptr;    // teacher (V), or null
  Dtype t_elem = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
  const int64_t* targets = nullptr;  // (N), or null: every token counts, no hard term
  int64_t n_tok = 0, d_model = 0, t_d_model = 0, vocab = 0;
  DistillOptions opt;
  const T* grad_output = nullptr;    // (N) per-token upstream gradient, Reduction::None only
  // The vocab-parallel form (shard): both heads are the same rows of a larger vocabulary,
  // targets are local (outside [0, V): in another shard, never refused) and every token is
  // scored (the caller zeroes the scales of tokens it does not count). shard_lse (N, 3): per
  // token the full vocabulary's log-sum-exp of s / T, t / T and s, which then normalize p, q and
  // the hard term's softmax (null: this call's own). For gradients also shard_h (N), the full
  // vocabulary's H = sum_v p_v h_v, and shard_coef (N, 2), each token's scales of d/ds (soft:
  // soft_weight / T times the reduction's; hard: hard_weight times it), replacing the
  // reduction's.
  bool shard = false;
  const T* shard_lse = nullptr;
  const T* shard_h = nullptr;
  const T* shard_coef = nullptr;
};

// The per-token results and sums of fused_linear_distill, with the student's gradients of the
// reduced loss (GradOut).
template <class T>
struct DistillOut : GradOut<T> {
  T* loss_tok = nullptr;   // (N) per-token loss_t (0 where not counted), or null
  T* div_tok = nullptr;    // (N) per-token div_t (0 where not counted), or null
  T* ce_tok = nullptr;     // (N) per-token ce_t (0 where not counted; 0 without targets)
  // (N, 6) or null: per token this vocabulary's own lse of s / T, t / T and s, its shares of
  // div_t and of H (under shard_lse's normalizers when given), and the target's logit s_y (NaN
  // where the target is not in [0, V)): what the vocab-parallel form combines across shards.
  T* shard_stats = nullptr;
  LossSum loss, div, ce;   // token-order sums over the counted tokens
  double reduced(Reduction r) const;      // of loss_t (NaN: mean of nothing)
  double div_reduced(Reduction r) const;  // of div_t, as reduced
  double ce_reduced(Reduction r) const;   // of ce_t, as reduced
};

// Every refusal that needs no look at the data, in a fixed order: 581/583/584 either head's
// dims, 587 chunk, 582 element types that do not compute in T, 585 a temperature, beta, or
// weight out of range, 582 hard_weight > 0 without targets; then (fused_linear_distill_check)
// 585 non-finite inputs or grad_output, 586 targets out of range.
template <class T>
int fused_linear_distill_check_shape(const DistillArgs<T>& a, std::string* why = nullptr);
template <class T>
int fused_linear_distill_check(const DistillArgs<T>& a, std::string* why = nullptr);
// The inputs fused_linear_distill_check requires finite, in its order.
template <class T>
std::vector<FiniteInput> finite_inputs(const DistillArgs<T>& a);
// The chunk fused_linear_distill runs (as fused_linear_ce_chunk, for the student's dtype).
template <class T>
int64_t fused_linear_distill_chunk(const DistillArgs<T>& a);
// Forward and, with out's gradient pointers set, the student's gradients in the same pass. Peak
// extra memory: one (C, V) chunk of each head's logits plus the gradients. May throw
// std::bad_alloc (before any work).
template <class T>
void fused_linear_distill(const DistillArgs<T>& a, DistillOut<T>& out);

// ---- the CUDA backend (cuda/lossk_*.cu; cpp/src/cuda_absent.cpp refuses 589 without one) ----
// The same loss on a CUDA device, the same options, the same guarantees: no atomics in any
// reduction, every output cell one fixed-order chain, so the same inputs give the same bits on
// every run and for every chunk size. With half inputs the chunk is rounded down to a multiple
// of 16 tokens (16 at least), the tensor cores' k-step, so the weight gradient's chains group
// tokens the same way whatever chunk the caller asked for. Bits differ from the CPU backend's
// (another reduction order, device libm), within the tolerances the tests hold.
// Where a loss's gradients go on a device, each null when not wanted: d_hidden (N, D),
// d_weight (V, D) and d_bias (V), all in grad_elem.
template <class T>
struct DeviceGradOut {
  void* d_hidden = nullptr;
  void* d_weight = nullptr;
  void* d_bias = nullptr;
  Dtype grad_elem = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
};

template <class T>
struct FusedCudaOut : DeviceGradOut<T> {  // device memory, each pointer null when not wanted
  T* loss = nullptr;           // () the reduced loss, Mean or Sum (not for None)
  T* z = nullptr;              // () the reduced z-loss term, as loss
  T* loss_tok = nullptr;       // (N) per-token ce_t + z_t, 0 for tokens not counted
  T* z_tok = nullptr;          // (N) per-token z_t
  T* lse = nullptr;            // (N)
  int64_t* pred = nullptr;     // (N) argmax of the (capped) logits, first maximum
  float* accuracy = nullptr;   // () correct argmaxes / counted tokens (NaN for none); needs pred
  T* target_logit = nullptr;   // (N) as FusedOut
  T* logit_sum = nullptr;      // (N) as FusedOut
  T* entropy = nullptr;        // () the reduced entropy, as loss (needs opt.entropy)
  T* entropy_tok = nullptr;    // (N) per-token u_t H_t (needs opt.entropy)
  // (14) FusedOut's sums: ce (total, first, shifted, count), z (the same), weight_sum, n_correct,
  // token_weight_sum, ent (total, first, shifted)
  double* sums = nullptr;
};
// Device scratch one call needs, in bytes: per token a few numbers, per chunk its block
// statistics and, with gradients, its (C, V) logits; a float32 accumulator of d_weight/d_bias
// when they are handed back in half precision. a must pass fused_linear_ce_check_shape.
template <class T>
int64_t fused_linear_ce_cuda_workspace(const FusedArgs<T>& a, const FusedCudaOut<T>& out);
// a: device pointers (hidden, weight, bias, targets, class weights, grad_output/grad_lse/
// grad_coef), passing fused_linear_ce_check_shape. The data checks (585 non-finite, 586 targets)
// run on the device into a flag the host waits for: the one synchronization, before any other
// work. workspace: workspace_bytes (at least fused_linear_ce_cuda_workspace) of device memory the
// caller owns (PyTorch's allocator). stream: a cudaStream_t; every launch is enqueued there and
// the call returns without waiting for them. Throws StatusError 589/590/591 (and 585/586).
template <class T>
void fused_linear_ce_cuda(const FusedArgs<T>& a, FusedCudaOut<T>& out, void* workspace,
                          int64_t workspace_bytes, void* stream);
// The same from and to host memory (the NumPy API's device="cuda"): a and out as for
// fused_linear_ce (host pointers, fused_linear_ce_check passed); inputs are copied to the device,
// the results back, out filled as the CPU backend fills it.
template <class T>
void fused_linear_ce_cuda_host(const FusedArgs<T>& a, FusedOut<T>& out);

// Distillation on a CUDA device: DistillArgs' options (not the vocab-parallel form), the same
// guarantees as the cross-entropy's there (no atomics in a reduction, bit-identical across runs
// and chunk sizes; half students' chunks rounded down to a multiple of 16 tokens).
template <class T>
struct DistillCudaOut : DeviceGradOut<T> {  // device memory, each pointer null when not wanted
  T* loss = nullptr;           // () the reduced loss, Mean or Sum (not for None)
  T* div = nullptr;            // () the reduced divergence term
  T* ce = nullptr;             // () the reduced hard term
  T* loss_tok = nullptr;       // (N) as DistillOut
  T* div_tok = nullptr;        // (N)
  T* ce_tok = nullptr;         // (N)
  double* sums = nullptr;      // (10) DistillOut's loss, div, ce (total, first, shifted), count
};
// Device scratch of one call in bytes: per token a few numbers, one (C, V) chunk of each head's
// logits, float32 accumulators of half gradients. a must pass fused_linear_distill_check_shape.
template <class T>
int64_t fused_linear_distill_cuda_workspace(const DistillArgs<T>& a, const DistillCudaOut<T>& out);
// a: device pointers; the data checks (585, 586) run on the device first (one synchronization);
// the rest is enqueued on stream. Throws StatusError 589/590/591 (and 585/586).
template <class T>
void fused_linear_distill_cuda(const DistillArgs<T>& a, DistillCudaOut<T>& out, void* workspace,
                               int64_t workspace_bytes, void* stream);
// Host memory in and out (the NumPy API's device="cuda"), out filled as the CPU backend fills it.
template <class T>
void fused_linear_distill_cuda_host(const DistillArgs<T>& a, DistillOut<T>& out);

// The seed's materialized kernels on the device: per-token loss and lse of (N, V) float64
// logits, their gradient (softmax - one_hot) * scale, and a running token-order sum kept on the
// device (state: 4 doubles, LossSum's total, first, shifted and count). Device pointers, work
// enqueued on stream; each checks its data on the device first (585/586, one synchronization).
void ce_from_logits_cuda(const double* logits, const int64_t* targets, int64_t n_tok,
                         int64_t vocab, double* loss_tok, double* lse, void* stream);
void ce_grad_logits_cuda(const double* logits, const int64_t* targets, int64_t n_tok,
                         int64_t vocab, double scale, double* out, void* stream);
void loss_sum_add_cuda(const double* loss_tok, int64_t n_tok, double* state, void* stream);
// Makes `device` this thread's current device for the backend's runtime (which is not PyTorch's:
// the extension links the CUDA runtime statically), before any of the device-pointer calls.
void cuda_set_device(int device);
// Host memory in and out (the NumPy API's device="cuda"); sum continues on the device from its
// host value and comes back, as ce_from_logits continues it on the host.
void ce_from_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n_tok,
                              int64_t vocab, LossSum& sum, double* lse, double* loss_tok);
void ce_grad_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n_tok,
                              int64_t vocab, double scale, double* out);

// The materialized reference: cross-entropy of (N, V) float64 logits, no chunking.
int ce_from_logits_check(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                         std::string* why = nullptr);
// Adds the N tokens' losses to sum (token order); lse_out and loss_out (N) may be null.
void ce_from_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    LossSum& sum, double* lse_out, double* loss_out = nullptr);
// (softmax(logits) - one_hot(target)) * scale, row by row; out (N, V) may alias logits.
void ce_grad_logits(const double* logits, const int64_t* targets, int64_t n_tok, int64_t vocab,
                    double scale, double* out);

}  // namespace lossk
}  // namespace algenta

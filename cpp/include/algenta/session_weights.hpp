// What every resident session engine shares, written once: the family table and the tensor
// table it makes for a config, the weight
// registry (name and shape checks, a ready counter, the checked conversions to float32), the
// checks a session opens with, the RoPE table and greedy argmax. The CPU engine binds each table
// entry to one of its buffers, the CUDA engine to an offset in its device arena; neither knows
// how the other stores anything. No CUDA, no OpenMP.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, Dh d_head, F d_ff, L layers,
// V vocab, T capacity.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "algenta/session.hpp"

namespace algenta {
namespace residentk {

// Which tensor of the model a table entry is; the per-layer ones carry their layer. AttnNorm
// and MlpNorm are the norms before attention and before the MLP; AttnOutNorm and MlpOutNorm the
// ones Gemma 2/3 put after them (on the sublayer's output, before the residual add).
enum class Field : int {
  Embed, InNorm, QProj, KProj, VProj, QNorm, KNorm, OProj, PostNorm, Gate, Up, Down, FinalNorm,
  LmHead, QBias, KBias, VBias, OBias, GateBias, UpBias, DownBias, AttnOutNorm, MlpOutNorm,
};
const char* field_name(Field f);

enum class Act : int { Silu, GeluTanh };

// One model family as data: what its layers hold and compute beyond the config's sizes. The
// tensor table, the config readers (through the bindings) and both engines read this; no
// engine compares architectures.
struct ArchSpec {
  Arch arch;
  const char* name;        // "qwen3", "llama", ...: transformers' model_type
  const char* hf_class;    // config.json's architectures entry
  bool qk_norm;            // per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
  bool qkv_bias;           // q/k/v biases whatever the config says (Qwen2)
  bool norm_plus_one;      // RMSNorm scales by (1 + w): stored as 1 + w at load (Gemma)
  bool embed_scaled;       // embeddings multiplied by float(sqrt(d_model)) (Gemma)
  bool sandwich;           // AttnOutNorm / MlpOutNorm on each sublayer's output (Gemma 2/3)
  Act act;                 // the MLP gate: silu, or gelu with the tanh approximation
  const char* mlp_norm;    // the HF name of the norm before the MLP (PostNorm's tensor)
};
const ArchSpec& arch_spec(Arch a);
// Every family, in Arch order (for lookups by name and the refusal naming them).
const std::vector<ArchSpec>& arch_specs();

// Decode stages a step of this config runs (what dispatches_per_token measures): embed, final
// norm and head, and per layer norm+QKV, q/k norm+RoPE+KV write, attention, o_proj, norm+gate/up,
// down, plus the two output norms of a sandwich family: residentk_dispatch_budget (the seed's
// Qwen3 count, n_layers * 6 + 3) plus 2 * n_layers for those; 0 where the budget refuses
// n_layers.
int64_t decode_stages(const SessionConfig& c);

struct TensorSpec {
  std::string name;            // the HuggingFace name
  std::vector<int64_t> shape;  // (rows, cols) for a matrix, (n) for a norm's weight or a bias
  int64_t layer = -1;          // -1 for model-level tensors
  Field field = Field::Embed;
  bool plus_one = false;       // a (1 + w) norm: stored as 1 + w (rounded once, in float32)
  int64_t rows() const { return shape.size() == 2 ? shape[0] : 1; }
  int64_t cols() const { return shape.back(); }
  int64_t elems() const { return rows() * cols(); }
};

// Every tensor a session with this config holds, in a HuggingFace checkpoint's order: the
// embedding; per layer input norm, q, k, v (each with its bias when the family or config has
// one), q_norm, k_norm (qk_norm families), o (+ bias), the norm after attention (Gemma), the
// norm before the MLP, gate, up, down (+ biases), the norm after the MLP (Gemma); the final norm;
// lm_head when the head is not tied to the embedding.
//   embed (V, D)  q (Hq*Dh, D)  k, v (Hkv*Dh, D)  q_norm, k_norm (Dh)  o (D, Hq*Dh)
//   gate, up (F, D)  down (D, F)  norms (D)  lm_head (V, D)  biases (their matrix's rows)
std::vector<TensorSpec> model_tensors(const SessionConfig& c);

// The checks a session runs before it allocates anything, in order: the model shape (601-603,
// residentk_shape_check), rms_eps and rope_theta finite and > 0 (609), max_ctx in
// [1, RESIDENT_MAX_CONTEXT] (601/602). RESIDENT_OK with *capacity = resident_bucket_ctx(max_ctx),
// or the refusal with its reason in *why.
int session_open_status(const SessionConfig& c, int64_t max_ctx, int64_t* capacity,
                        std::string* why);
// The same, throwing StatusError(Resident) on a refusal; returns the capacity.
int64_t session_open_check(const SessionConfig& c, int64_t max_ctx);

// The RoPE tables both engines use: cos (T, hw) then sin (T, hw), hw = max(Dh/2, 1), for the
// rotate-half pairing (i, i + Dh/2) at positions 0..T-1. Angles p * inv_freq(i) are formed in
// double and rounded to float once (transformers forms them in float32: a difference far below
// the tests' logit tolerance). The global table serves full-attention layers: theta^(-2i/Dh)
// scaled by rope_type (linear divides by the factor; llama3 divides wavelengths past
// original_ctx / low_freq_factor by the factor, keeps those under original_ctx /
// high_freq_factor, and blends between, as transformers' _compute_llama3_parameters). The local
// table (local=true) is plain RoPE at rope_local_theta, for sliding layers when it is set.
std::vector<float> rope_table(const SessionConfig& c, int64_t T, bool local = false);
// Whether layer l reads the local table.
inline bool layer_rope_local(const SessionConfig& c, int64_t l) {
  return c.rope_local_theta > 0.0 && c.layer_slides(l);
}

// numpy.argmax of logits[0..n): the first maximum, with a NaN counting as larger than any number
// (so the first NaN wins). n >= 1.
int64_t greedy_argmax(const float* logits, int64_t n);

// Widens src elements [i0, i0 + n) of type t (read bytewise: src need not be aligned) to float32
// in dst (n floats). Returns the flat index of the first non-finite value (dst then holds an
// unspecified prefix), or -1 when every value was finite.
int64_t widen_checked(const void* src, Dtype t, int64_t i0, int64_t n, float* dst);

// One float32 row x (cols) in a resident weight format, the conversion both engines store with
// (so the same checkpoint is the same bits on either): f32 copied; bf16 and f16 rounded to
// nearest even (half.hpp) into dst as uint16_t bits; int8 quantized per block of
// RESIDENT_INT8_BLOCK (quant.hpp) into dst as int8_t values and `scales` (ceil(cols / 32)
// floats); q4_0 likewise by llama.cpp's rule (quant::q4_0_block) into uint8_t codes 0..15 and
// their float16 scales widened. Returns the index of the first value the format cannot hold (it
// rounds to infinity: float16 past 65504, bfloat16 past its largest finite; for q4_0 the largest
// value of a block whose scale passes float16's range), or -1. x is finite (widen_checked).
int64_t narrow_row(Dtype f, const float* x, int64_t cols, void* dst, float* scales);
// The 609 refusal of a weight value past its format's range (narrow_row's index), naming the
// tensor, the value, its flat index and the format to load it with instead.
[[noreturn]] void refuse_past_range(const std::string& tensor, Dtype f, float value,
                                    int64_t flat_index);

// The registry of one session's tensors: which are set, checked against the table by name and
// shape. Not thread-safe on its own: the session serializes its writers.
class WeightRegistry {
 public:
  explicit WeightRegistry(const SessionConfig& c);

  const std::vector<TensorSpec>& table() const { return table_; }
  // The table entry of `name`, whose shape must equal `shape`; throws 607 otherwise.
  const TensorSpec& find(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<int64_t> shape(const std::string& name) const;  // empty for an unknown name
  std::vector<std::string> missing() const;
  bool ready() const { return n_set_ == table_.size(); }
  // Throws 607 naming the first tensor never set. A counter, not a scan, once every one is.
  void check_ready() const;

  // Converts one tensor (`type` elements, row-major) to float32 and stores it, whole rows at a
  // time, at most `chunk_elems` elements (and at least one row) per run: stage(spec, r0, r1)
  // returns the float32 host memory rows [r0, r1) land in (the resident buffer itself, or a
  // staging buffer), commit(spec, r0, r1) is called once they are there. The tensor is unset
  // from the first row to the last: a refusal halfway (609 for a non-finite value, naming the
  // tensor and index, or whatever commit throws) leaves it unset, never half old.
  template <class Stage, class Commit>
  void set(const std::string& name, const std::vector<int64_t>& shape, const void* data,
           Dtype type, int64_t chunk_elems, Stage&& stage, Commit&& commit) {
    const TensorSpec& t = find(name, shape);
    const size_t i = index_.at(name);
    if (set_[i]) {
      set_[i] = 0;
      --n_set_;
    }
    const int64_t cols = t.cols(), rows = t.rows();
    const int64_t step = chunk_elems / cols > 0 ? chunk_elems / cols : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t r1 = r0 + step < rows ? r0 + step : rows;
      float* dst = stage(t, r0, r1);
      const int64_t bad = widen_checked(data, type, r0 * cols, (r1 - r0) * cols, dst);
      if (bad >= 0) non_finite(name, bad);
      if (t.plus_one)  // exact as transformers' float32 (1.0 + weight.float())
        for (int64_t i = 0; i < (r1 - r0) * cols; ++i) dst[i] = 1.0f + dst[i];
      commit(t, r0, r1);
    }
    set_[i] = 1;
    ++n_set_;
  }

 private:
  [[noreturn]] static void non_finite(const std::string& name, int64_t index);
  std::vector<TensorSpec> table_;
  std::map<std::string, size_t> index_;
  std::vector<char> set_;
  size_t n_set_ = 0;
};

}  // namespace residentk
}  // namespace algenta

// What every resident session engine shares, written once: the Qwen3 tensor table, the weight
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

// Which tensor of the model a table entry is; the per-layer ones carry their layer.
enum class Field : int {
  Embed, InNorm, QProj, KProj, VProj, QNorm, KNorm, OProj, PostNorm, Gate, Up, Down, FinalNorm,
  LmHead,
};
const char* field_name(Field f);

struct TensorSpec {
  std::string name;            // the HuggingFace name
  std::vector<int64_t> shape;  // (rows, cols) for a matrix, (n) for a norm's weight
  int64_t layer = -1;          // -1 for model-level tensors
  Field field = Field::Embed;
  int64_t rows() const { return shape.size() == 2 ? shape[0] : 1; }
  int64_t cols() const { return shape.back(); }
  int64_t elems() const { return rows() * cols(); }
};

// Every tensor a Qwen3 session with this config holds, in a HuggingFace checkpoint's order:
// the embedding; per layer input norm, q, k, v, q_norm, k_norm, o, post-attention norm, gate, up,
// down; the final norm; lm_head when the head is not tied to the embedding.
//   embed (V, D)  q (Hq*Dh, D)  k, v (Hkv*Dh, D)  q_norm, k_norm (Dh)  o (D, Hq*Dh)
//   gate, up (F, D)  down (D, F)  norms (D)  lm_head (V, D)
std::vector<TensorSpec> qwen3_tensors(const SessionConfig& c);

// The checks a session runs before it allocates anything, in order: the model shape (601-603,
// residentk_shape_check), rms_eps and rope_theta finite and > 0 (609), max_ctx in
// [1, RESIDENT_MAX_CONTEXT] (601/602). RESIDENT_OK with *capacity = resident_bucket_ctx(max_ctx),
// or the refusal with its reason in *why.
int session_open_status(const SessionConfig& c, int64_t max_ctx, int64_t* capacity,
                        std::string* why);
// The same, throwing StatusError(Resident) on a refusal; returns the capacity.
int64_t session_open_check(const SessionConfig& c, int64_t max_ctx);

// The RoPE table both engines use: cos (T, hw) then sin (T, hw), hw = max(Dh/2, 1), for the
// rotate-half pairing (i, i + Dh/2) at positions 0..T-1. Angles p * theta^(-2i/Dh) are formed in
// double and rounded to float once (transformers forms them in float32: a difference far below
// the tests' logit tolerance).
std::vector<float> rope_table(const SessionConfig& c, int64_t T);

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
// floats). Returns the index of the first value the format cannot hold (it rounds to infinity:
// float16 past 65504, bfloat16 past its largest finite), or -1. x is finite (widen_checked).
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

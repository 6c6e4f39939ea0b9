// The session core shared by every engine: the family table, the tensor table, registry,
// conversions, open check, RoPE tables, greedy argmax (see session_weights.hpp).
#include "algenta/session_weights.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "algenta/ggml_blocks.hpp"
#include "algenta/half.hpp"
#include "algenta/quant.hpp"
#include "algenta/residentk.hpp"
#include "algenta/session_math.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

namespace {

[[noreturn]] void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Resident, code, msg);
}

std::string fmt(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}


}  // namespace

const char* field_name(Field f) {
  switch (f) {
    case Field::Embed: return "embed";
    case Field::InNorm: return "input_norm";
    case Field::QProj: return "q_proj";
    case Field::KProj: return "k_proj";
    case Field::VProj: return "v_proj";
    case Field::QNorm: return "q_norm";
    case Field::KNorm: return "k_norm";
    case Field::OProj: return "o_proj";
    case Field::PostNorm: return "post_attention_norm";
    case Field::Gate: return "gate_proj";
    case Field::Up: return "up_proj";
    case Field::Down: return "down_proj";
    case Field::FinalNorm: return "final_norm";
    case Field::LmHead: return "lm_head";
    case Field::QBias: return "q_bias";
    case Field::KBias: return "k_bias";
    case Field::VBias: return "v_bias";
    case Field::OBias: return "o_bias";
    case Field::GateBias: return "gate_bias";
    case Field::UpBias: return "up_bias";
    case Field::DownBias: return "down_bias";
    case Field::AttnOutNorm: return "attention_output_norm";
    case Field::MlpOutNorm: return "mlp_output_norm";
  }
  return "?";
}

const std::vector<ArchSpec>& arch_specs() {
  // name, HF class, qk_norm, qkv_bias, norm_plus_one, embed_scaled, sandwich, act, mlp_norm
  static const std::vector<ArchSpec> t = {
      {Arch::Qwen3, "qwen3", "Qwen3ForCausalLM", true, false, false, false, false, Act::Silu,
       "post_attention_layernorm"},
      {Arch::Llama, "llama", "LlamaForCausalLM", false, false, false, false, false, Act::Silu,
       "post_attention_layernorm"},
      {Arch::Qwen2, "qwen2", "Qwen2ForCausalLM", false, true, false, false, false, Act::Silu,
       "post_attention_layernorm"},
      {Arch::Mistral, "mistral", "MistralForCausalLM", false, false, false, false, false,
       Act::Silu, "post_attention_layernorm"},
      // Gemma's "post_attention_layernorm" normalizes the attention output; the MLP's input
      // norm is "pre_feedforward_layernorm".
      {Arch::Gemma2, "gemma2", "Gemma2ForCausalLM", false, false, true, true, true,
       Act::GeluTanh, "pre_feedforward_layernorm"},
      {Arch::Gemma3, "gemma3_text", "Gemma3ForCausalLM", true, false, true, true, true,
       Act::GeluTanh, "pre_feedforward_layernorm"},
  };
  return t;
}

const ArchSpec& arch_spec(Arch a) {
  const auto& t = arch_specs();
  const size_t i = size_t(a);
  if (i >= t.size()) throw std::logic_error("arch_spec: not an Arch");  // a bug, not input
  return t[i];
}

int64_t decode_stages(const SessionConfig& c) {
  const int64_t budget = residentk_dispatch_budget(c.n_layers);  // the seed's Qwen3 count
  if (budget == 0) return 0;
  return budget + (arch_spec(c.arch).sandwich ? 2 * c.n_layers : 0);
}

std::vector<TensorSpec> model_tensors(const SessionConfig& c) {
  const ArchSpec& A = arch_spec(c.arch);
  const int64_t D = c.d_model, Hq = c.h_q, Hkv = c.h_kv, Dh = c.d_head, F = c.d_ff, V = c.vocab;
  const bool qkv_b = A.qkv_bias || c.qkv_bias, pl = A.norm_plus_one;
  std::vector<TensorSpec> t;
  t.reserve(size_t(3 + 20 * c.n_layers));
  t.push_back({"model.embed_tokens.weight", {V, D}, -1, Field::Embed});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const std::string a = p + "self_attn.", m = p + "mlp.";
    t.push_back({p + "input_layernorm.weight", {D}, i, Field::InNorm, pl});
    t.push_back({a + "q_proj.weight", {Hq * Dh, D}, i, Field::QProj});
    if (qkv_b) t.push_back({a + "q_proj.bias", {Hq * Dh}, i, Field::QBias});
    t.push_back({a + "k_proj.weight", {Hkv * Dh, D}, i, Field::KProj});
    if (qkv_b) t.push_back({a + "k_proj.bias", {Hkv * Dh}, i, Field::KBias});
    t.push_back({a + "v_proj.weight", {Hkv * Dh, D}, i, Field::VProj});
    if (qkv_b) t.push_back({a + "v_proj.bias", {Hkv * Dh}, i, Field::VBias});
    if (A.qk_norm) {
      t.push_back({a + "q_norm.weight", {Dh}, i, Field::QNorm, pl});
      t.push_back({a + "k_norm.weight", {Dh}, i, Field::KNorm, pl});
    }
    t.push_back({a + "o_proj.weight", {D, Hq * Dh}, i, Field::OProj});
    if (c.o_bias) t.push_back({a + "o_proj.bias", {D}, i, Field::OBias});
    if (A.sandwich)
      t.push_back({p + "post_attention_layernorm.weight", {D}, i, Field::AttnOutNorm, pl});
    t.push_back({p + A.mlp_norm + ".weight", {D}, i, Field::PostNorm, pl});
    t.push_back({m + "gate_proj.weight", {F, D}, i, Field::Gate});
    if (c.mlp_bias) t.push_back({m + "gate_proj.bias", {F}, i, Field::GateBias});
    t.push_back({m + "up_proj.weight", {F, D}, i, Field::Up});
    if (c.mlp_bias) t.push_back({m + "up_proj.bias", {F}, i, Field::UpBias});
    t.push_back({m + "down_proj.weight", {D, F}, i, Field::Down});
    if (c.mlp_bias) t.push_back({m + "down_proj.bias", {D}, i, Field::DownBias});
    if (A.sandwich)
      t.push_back({p + "post_feedforward_layernorm.weight", {D}, i, Field::MlpOutNorm, pl});
  }
  t.push_back({"model.norm.weight", {D}, -1, Field::FinalNorm, pl});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {V, D}, -1, Field::LmHead});
  return t;
}

namespace {
bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0.0; }
bool finite_pos(double x) { return std::isfinite(x) && x > 0.0; }

// The family fields' own checks (session_open_status), "" when they pass.
std::string family_refusal(const SessionConfig& c, int* code) {
  *code = RESIDENT_ERR_NON_FINITE;
  if (int(c.arch) < 0 || size_t(c.arch) >= arch_specs().size()) {
    *code = RESIDENT_ERR_EMPTY_DIMENSION;
    return "arch " + std::to_string(int(c.arch)) + " is not a family the session computes";
  }
  if (!finite_nonneg(c.attn_scale) || !finite_nonneg(c.attn_softcap) ||
      !finite_nonneg(c.final_softcap) || !finite_nonneg(c.rope_local_theta))
    return "attn_scale, attn_softcap, final_softcap and rope_local_theta must be finite and "
           ">= 0 (0: the default)";
  if (c.sliding_window < 0) {
    *code = RESIDENT_ERR_EMPTY_DIMENSION;
    return "sliding_window must be >= 0 (0: none), got " + std::to_string(c.sliding_window);
  }
  if (!c.sliding_layers.empty() && int64_t(c.sliding_layers.size()) != c.n_layers) {
    *code = RESIDENT_ERR_WEIGHT_LENGTH;
    return "sliding_layers names " + std::to_string(c.sliding_layers.size()) +
           " layers, the model has " + std::to_string(c.n_layers);
  }
  if (c.rope_type != RopeType::Default) {
    if (!finite_pos(c.rope_factor)) return "rope factor must be finite and > 0";
    if (c.rope_type == RopeType::Llama3 &&
        (!finite_pos(c.rope_low_freq_factor) || !finite_pos(c.rope_high_freq_factor) ||
         !(c.rope_high_freq_factor > c.rope_low_freq_factor) || c.rope_original_ctx < 1))
      return "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and "
             "original_max_position_embeddings >= 1";
  }
  return "";
}
}  // namespace

int session_open_status(const SessionConfig& c, int64_t max_ctx, int64_t* capacity,
                        std::string* why) {
  std::string w;
  int st = residentk_shape_check(c, &w);
  if (st != RESIDENT_OK) {
    if (why) *why = "model shape refused: " + w;
    return st;
  }
  if (!residentk_scalars_ok(c.rms_eps, 1.0 / std::sqrt(double(c.d_head))) ||
      !std::isfinite(c.rope_theta) || !(c.rope_theta > 0.0)) {
    if (why) *why = "rms_eps and rope_theta must be finite and > 0";
    return RESIDENT_ERR_NON_FINITE;
  }
  int fcode = RESIDENT_OK;
  const std::string fam = family_refusal(c, &fcode);
  if (!fam.empty()) {
    if (why) *why = fam;
    return fcode;
  }
  if (std::string(residentk_weight_format_name(c.weights)) == "?") {
    if (why) *why = std::string("weights='") + dtype_name(c.weights) + "' is not a weight format";
    return RESIDENT_ERR_EMPTY_DIMENSION;  // 601, as the bindings' refusal of an unknown name
  }
  if (std::string(residentk_kv_format_name(c.kv)) == "?") {
    if (why) *why = std::string("kv='") + dtype_name(c.kv) + "' is not a KV cache format";
    return RESIDENT_ERR_EMPTY_DIMENSION;
  }
  st = residentk_context_check(1, 0, max_ctx);
  if (st != RESIDENT_OK) {
    if (why)
      *why = "max_ctx " + std::to_string(max_ctx) + " outside [1, " +
             std::to_string(RESIDENT_MAX_CONTEXT) + "]";
    return st;
  }
  if (capacity) *capacity = resident_bucket_ctx(max_ctx);
  return RESIDENT_OK;
}

int64_t session_open_check(const SessionConfig& c, int64_t max_ctx) {
  int64_t cap = 0;
  std::string why;
  const int st = session_open_status(c, max_ctx, &cap, &why);
  if (st != RESIDENT_OK) refuse(st, why);
  return cap;
}

std::vector<float> rope_table(const SessionConfig& c, int64_t T, bool local) {
  const int64_t Dh = c.d_head, half = Dh / 2, hw = half > 0 ? half : 1;
  const double theta = local ? c.rope_local_theta : c.rope_theta;
  const RopeType type = local ? RopeType::Default : c.rope_type;
  const double pi = 3.14159265358979323846;
  std::vector<float> r(size_t(2 * T * hw), 0.f);
  for (int64_t i = 0; i < half; ++i) {
    double inv_freq = std::pow(theta, -double(2 * i) / double(Dh));
    if (type == RopeType::Linear) {
      inv_freq /= c.rope_factor;
    } else if (type == RopeType::Llama3) {
      const double old_ctx = double(c.rope_original_ctx), lo = c.rope_low_freq_factor,
                   hi = c.rope_high_freq_factor, wavelen = 2.0 * pi / inv_freq;
      if (wavelen > old_ctx / lo) {
        inv_freq /= c.rope_factor;
      } else if (!(wavelen < old_ctx / hi)) {  // between the bands: a linear blend
        const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
        inv_freq = (1.0 - smooth) * inv_freq / c.rope_factor + smooth * inv_freq;
      }
    }
    for (int64_t p = 0; p < T; ++p) {
      const double a = double(p) * inv_freq;
      r[size_t(p * hw + i)] = float(std::cos(a));
      r[size_t(T * hw + p * hw + i)] = float(std::sin(a));
    }
  }
  return r;
}

int64_t greedy_argmax(const float* z, int64_t n) {
  int64_t best = 0;
  for (int64_t v = 1; v < n; ++v)
    if (session_math::argmax_beats(z[v], v, z[best], best)) best = v;
  return best;
}

// Widens n 16-bit elements (bf16 or f16 bits) from s + 2 * i0, read bytewise.
template <float (*widen)(uint16_t)>
static void widen16(const unsigned char* s, int64_t i0, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, s + 2 * (i0 + i), 2);
    dst[i] = widen(h);
  }
}

int64_t widen_checked(const void* src, Dtype t, int64_t i0, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  switch (t) {
    case Dtype::F32:
      std::memcpy(dst, s + 4 * i0, size_t(n) * 4);
      break;
    case Dtype::BF16:  // widening is exact (half.hpp)
      widen16<half::bf16_to_f32>(s, i0, n, dst);
      break;
    case Dtype::F16:
      widen16<half::f16_to_f32>(s, i0, n, dst);
      break;
    case Dtype::Q8_0:
    case Dtype::Q4_0:
    case Dtype::Q4_K:
    case Dtype::Q6_K: {
      // Whole blocks only: the registry hands whole rows, and set_weight refuses a row length
      // that is not a multiple of the block.
      const DtypeInfo& d = dtype_info(t);
      void (*deq)(const unsigned char*, float*) =
          t == Dtype::Q8_0 ? ggml::dequant_q8_0
          : t == Dtype::Q4_0 ? ggml::dequant_q4_0
          : t == Dtype::Q4_K ? ggml::dequant_q4_k : ggml::dequant_q6_k;
      for (int64_t b = 0; b < n / d.block; ++b)
        deq(s + (i0 / d.block + b) * d.bytes, dst + b * d.block);
      break;
    }
    case Dtype::F64:
    case Dtype::Int8:  // not source types (the set_weight binding refuses them)
      for (int64_t i = 0; i < n; ++i) dst[i] = NAN;
      return i0;
  }
  // One NaN or infinite weight would turn every later logit into NaN without a word.
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(dst[i])) return i0 + i;
  return -1;
}

int64_t narrow_row(Dtype f, const float* x, int64_t cols, void* dst, float* scales) {
  switch (f) {
    case Dtype::F32:
      std::memcpy(dst, x, size_t(cols) * sizeof(float));
      return -1;
    case Dtype::BF16:
    case Dtype::F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      const bool bf = f == Dtype::BF16;
      const uint16_t exp_mask = bf ? 0x7f80u : 0x7c00u;  // all ones: infinity (x is finite)
      int64_t bad = -1;
      for (int64_t i = 0; i < cols; ++i) {
        d[i] = bf ? half::f32_to_bf16(x[i]) : half::f32_to_f16(x[i]);
        if (bad < 0 && (d[i] & exp_mask) == exp_mask) bad = i;
      }
      return bad;
    }
    case Dtype::Int8: {
      int8_t* d = static_cast<int8_t*>(dst);
      for (int64_t i0 = 0, b = 0; i0 < cols; i0 += RESIDENT_INT8_BLOCK, ++b) {
        const int64_t n = cols - i0 < RESIDENT_INT8_BLOCK ? cols - i0 : RESIDENT_INT8_BLOCK;
        scales[b] = quant::q8_block(x + i0, n, d + i0);
      }
      return -1;
    }
    case Dtype::Q4_0: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (int64_t i0 = 0, b = 0; i0 < cols; i0 += RESIDENT_INT8_BLOCK, ++b) {
        const int64_t n = cols - i0 < RESIDENT_INT8_BLOCK ? cols - i0 : RESIDENT_INT8_BLOCK;
        scales[b] = quant::q4_0_block(x + i0, n, d + i0);
        if (!std::isfinite(scales[b])) {  // the block's scale past float16: its largest value
          int64_t at = i0;
          for (int64_t i = i0; i < i0 + n; ++i)
            if (std::fabs(x[i]) > std::fabs(x[at])) at = i;
          return at;
        }
      }
      return -1;
    }
    default: break;  // f64 and the ggml block types are not formats a session holds (601)
  }
  return -1;
}

void refuse_past_range(const std::string& tensor, Dtype f, float value, int64_t flat_index) {
  const bool f16 = f == Dtype::F16, q4 = f == Dtype::Q4_0;
  refuse(RESIDENT_ERR_NON_FINITE,
         "weight '" + tensor + "' holds " + std::to_string(value) + " at index " +
             std::to_string(flat_index) + ", past " + residentk_weight_format_name(f) +
             "'s range (" +
             (f16   ? "float16 holds |x| <= 65504): load it with weights='bf16' or 'f32'"
              : q4  ? "its float16 scale holds |x| <= 8 * 65504): load it with weights='int8'"
                    : "it rounds to infinity): load it with weights='f32'"));
}

WeightRegistry::WeightRegistry(const SessionConfig& c) : table_(model_tensors(c)) {
  set_.assign(table_.size(), 0);
  for (size_t i = 0; i < table_.size(); ++i) index_[table_[i].name] = i;
}

const TensorSpec& WeightRegistry::find(const std::string& name,
                                       const std::vector<int64_t>& shape) const {
  auto it = index_.find(name);
  if (it == index_.end())
    refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + name + "' is not part of this model");
  const TensorSpec& t = table_[it->second];
  if (shape != t.shape)
    refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + name + "' has shape " + fmt(shape) +
                                           ", the config declares " + fmt(t.shape));
  return t;
}

std::vector<int64_t> WeightRegistry::shape(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? std::vector<int64_t>{} : table_[it->second].shape;
}

std::vector<std::string> WeightRegistry::missing() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < table_.size(); ++i)
    if (!set_[i]) out.push_back(table_[i].name);
  return out;
}

void WeightRegistry::check_ready() const {
  if (ready()) return;
  for (size_t i = 0; i < table_.size(); ++i)
    if (!set_[i]) refuse(RESIDENT_ERR_WEIGHT_LENGTH, "tensor '" + table_[i].name + "' was never set");
}

void WeightRegistry::non_finite(const std::string& name, int64_t index) {
  refuse(RESIDENT_ERR_NON_FINITE,
         "tensor '" + name + "' holds a non-finite value at flat index " + std::to_string(index));
}

}  // namespace residentk
}  // namespace algenta

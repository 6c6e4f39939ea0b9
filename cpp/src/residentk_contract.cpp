// residentk contract and probe: status names, shape/context checks, resident sizing, the split-K
// and prefill-tile policies. Pure int64 arithmetic; every product goes through mul() so a value
// that slipped past a ceiling is refused instead of wrapping into a small, plausible count.
#include <cmath>
#include <string>

#include "algenta/residentk.hpp"

namespace algenta {
namespace residentk {

namespace {

// a * b into *out; false (and *out untouched) on int64 overflow.
bool mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool add(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

void say(std::string* why, const std::string& msg) {
  if (why) *why = msg;
}

std::string num(int64_t v) { return std::to_string(v); }

struct Dim {
  const char* name;
  int64_t value, ceiling;
};

}  // namespace

int64_t residentk_smem_tier_bytes() { return RESIDENT_SMEM_TIER_BYTES; }

const char* residentk_status_name(int64_t code) {
  switch (code) {
    case RESIDENT_OK: return "resident_ok";
    case RESIDENT_ERR_EMPTY_DIMENSION: return "resident_empty_dimension";
    case RESIDENT_ERR_DIMENSION_TOO_LARGE: return "resident_dimension_too_large";
    case RESIDENT_ERR_HEAD_GEOMETRY: return "resident_head_geometry_unsupported";
    case RESIDENT_ERR_NO_KERNELS: return "resident_shader_toolchain_absent";
    case RESIDENT_ERR_NO_ACCELERATOR: return "resident_no_accelerator_present";
    case RESIDENT_ERR_CONTEXT_FULL: return "resident_kv_context_full";
    case RESIDENT_ERR_WEIGHT_LENGTH: return "resident_weight_length_mismatch";
    case RESIDENT_ERR_LAUNCH_FAILED: return "resident_launch_failed";
    case RESIDENT_ERR_NON_FINITE: return "resident_non_finite_scalar";
    default: return "resident_code_out_of_range";  // 610 itself included: it names "not a code"
  }
}

// The checks of residentk_shape_check over the first n_dims of the shape's dimensions, in the
// record's order: 5 (the layer's, residentk_dims_check) or 7 (the whole model).
static int shape_check_impl(const ModelShape& m, int n_dims, std::string* why, bool check_tier) {
  const Dim dims[] = {{"d_model", m.d_model, RESIDENT_MAX_D_MODEL},
                      {"h_q", m.h_q, RESIDENT_MAX_HEADS},
                      {"h_kv", m.h_kv, RESIDENT_MAX_HEADS},
                      {"d_head", m.d_head, RESIDENT_MAX_D_HEAD},
                      {"d_ff", m.d_ff, RESIDENT_MAX_D_FF},
                      {"n_layers", m.n_layers, RESIDENT_MAX_LAYERS},
                      {"vocab", m.vocab, RESIDENT_MAX_VOCAB}};
  // Every emptiness before any ceiling, so the code does not depend on argument order.
  for (int i = 0; i < n_dims; ++i)
    if (dims[i].value < 1) {
      say(why, std::string(dims[i].name) + " is " + num(dims[i].value) + "; it must be >= 1");
      return RESIDENT_ERR_EMPTY_DIMENSION;
    }
  for (int i = 0; i < n_dims; ++i)
    if (dims[i].value > dims[i].ceiling) {
      say(why, std::string(dims[i].name) + " " + num(dims[i].value) + " exceeds its ceiling " +
                   num(dims[i].ceiling));
      return RESIDENT_ERR_DIMENSION_TOO_LARGE;
    }
  if (m.h_q % m.h_kv != 0) {
    say(why, "h_q " + num(m.h_q) + " is not a multiple of h_kv " + num(m.h_kv) +
                 " (grouped-query attention needs an integer group size)");
    return RESIDENT_ERR_HEAD_GEOMETRY;
  }
  if (!is_pow2(m.d_head)) {
    say(why, "d_head " + num(m.d_head) +
                 " is not a power of two (the RoPE/SDPA reduction halves its stride)");
    return RESIDENT_ERR_HEAD_GEOMETRY;
  }
  // Within the ceilings h_q * d_head <= 2^20: no overflow.
  const int64_t qdim = m.h_q * m.d_head;
  int64_t staged = m.d_model;
  const char* which = "d_model";
  if (m.d_ff > staged) staged = m.d_ff, which = "d_ff";
  if (qdim > staged) staged = qdim, which = "h_q*d_head";
  if (check_tier && staged > RESIDENT_MAX_STAGED_FLOATS) {
    // Name the tier that would hold it, rounded up to a KiB, unless no device has that much.
    const int64_t need = ((staged * 4 + 1023) / 1024) * 1024;
    const std::string fix = need <= 227 * 1024
                                ? "rebuild with -Ccmake.define.ALGENTA_SMEM_TIER_BYTES=" + num(need)
                                : "no tier holds it: 227 KiB is the most any CUDA device grants a block";
    say(why, std::string("largest staged vector (") + which + " = " + num(staged) +
                 " float32, " + num(staged * 4) + " bytes) exceeds the compiled shared-memory tier of " +
                 num(RESIDENT_SMEM_TIER_BYTES) + " bytes (" + num(RESIDENT_MAX_STAGED_FLOATS) +
                 " floats; " + fix + ")");
    return RESIDENT_ERR_DIMENSION_TOO_LARGE;
  }
  say(why, "");
  return RESIDENT_OK;
}

int residentk_dims_check(const ModelShape& m) { return shape_check_impl(m, 5, nullptr, true); }

int residentk_shape_check(const ModelShape& m, std::string* why) {
  return shape_check_impl(m, 7, why, true);
}

int residentk_context_check(int64_t n_prompt, int64_t n_new, int64_t max_ctx) {
  if (n_prompt < 1 || n_new < 0 || max_ctx < 1) return RESIDENT_ERR_EMPTY_DIMENSION;
  if (max_ctx > RESIDENT_MAX_CONTEXT) return RESIDENT_ERR_DIMENSION_TOO_LARGE;
  // n_prompt + n_new > max_ctx without forming a sum that could overflow.
  if (n_prompt > max_ctx || n_new > max_ctx - n_prompt) return RESIDENT_ERR_CONTEXT_FULL;
  return RESIDENT_OK;
}

int64_t residentk_cache_elements(int64_t n_layers, int64_t h_kv, int64_t d_head, int64_t max_ctx) {
  if (n_layers < 1 || h_kv < 1 || d_head < 1 || max_ctx < 1) return 0;
  if (n_layers > RESIDENT_MAX_LAYERS || h_kv > RESIDENT_MAX_HEADS || d_head > RESIDENT_MAX_D_HEAD ||
      max_ctx > RESIDENT_MAX_CONTEXT)
    return 0;
  int64_t r = 0;
  if (!mul(n_layers, 2, &r) || !mul(r, max_ctx, &r) || !mul(r, h_kv, &r) || !mul(r, d_head, &r))
    return 0;
  return r;
}

int64_t residentk_dispatch_budget(int64_t n_layers) {
  if (n_layers < 1 || n_layers > RESIDENT_MAX_LAYERS) return 0;
  // Per layer: rmsnorm+qkv, rope+kv-append, sdpa, o-proj+residual, rmsnorm+gate/up, down+residual;
  // per token: embedding lookup, final norm, lm_head.
  return n_layers * 6 + 3;
}

int64_t residentk_dispatch_budget_deep(int64_t n_layers) {
  if (n_layers < 1 || n_layers > RESIDENT_MAX_LAYERS) return 0;
  // Split-K turns each layer's sdpa into partial + merge; the embedding stays 1 in front and
  // the final norm + lm_head 2 behind, written that way to match the seed's formula.
  return 1 + n_layers * 7 + 2;
}

// The name of f within one of the format lists (weights, KV), "?" when it is not in it.
template <size_t N>
static const char* name_in(Dtype f, const Dtype (&set)[N]) {
  for (Dtype g : set)
    if (f == g) return dtype_name(f);
  return "?";
}

const char* residentk_weight_format_name(Dtype f) { return name_in(f, kWeightFormats); }
const char* residentk_kv_format_name(Dtype f) { return name_in(f, kKvFormats); }

int64_t residentk_matrix_bytes(int64_t rows, int64_t cols, Dtype f) {
  if (rows < 1 || cols < 1) return 0;
  int64_t n = 0, t = 0;
  if (!mul(rows, cols, &n)) return 0;
  switch (f) {
    case Dtype::F32: return mul(n, 4, &t) ? t : 0;
    case Dtype::BF16:
    case Dtype::F16: return mul(n, 2, &t) ? t : 0;
    case Dtype::Int8: {
      const int64_t blocks = cols / RESIDENT_INT8_BLOCK + (cols % RESIDENT_INT8_BLOCK != 0);
      return mul(rows, blocks, &t) && mul(t, 4, &t) && add(n, t, &t) ? t : 0;
    }
    case Dtype::Q4_0: {
      const int64_t blocks = cols / RESIDENT_INT8_BLOCK + (cols % RESIDENT_INT8_BLOCK != 0);
      return mul(rows, blocks, &t) && mul(t, 18, &t) ? t : 0;
    }
    default: return 0;  // f64, ggml block types: not formats a session holds
  }
  return 0;
}

ResidentFootprint residentk_footprint(const ModelShape& m, int64_t max_ctx, const FootprintOpts& o,
                                      std::string* why) {
  ResidentFootprint f;
  f.status = shape_check_impl(m, 7, why, o.check_tier);
  if (f.status != RESIDENT_OK) return f;
  if (max_ctx < 1 || max_ctx > RESIDENT_MAX_CONTEXT) {
    f.status = max_ctx < 1 ? RESIDENT_ERR_EMPTY_DIMENSION : RESIDENT_ERR_DIMENSION_TOO_LARGE;
    say(why, "max_ctx " + num(max_ctx) + " is outside [1, " + num(RESIDENT_MAX_CONTEXT) + "]");
    return f;
  }
  const int64_t tp = o.tp, d_model = m.d_model, d_head = m.d_head, n_layers = m.n_layers;
  if (tp < 1 || m.h_q % tp != 0 || m.h_kv % tp != 0 || m.d_ff % tp != 0) {
    f.status = RESIDENT_ERR_HEAD_GEOMETRY;
    say(why, "tensor-parallel degree " + num(tp) + " must divide h_q " + num(m.h_q) + ", h_kv " +
                 num(m.h_kv) + " and d_ff " + num(m.d_ff));
    return f;
  }
  const int64_t hq = m.h_q / tp, hkv = m.h_kv / tp, ff = m.d_ff / tp;
  // Within the ceilings no term exceeds 2^50; the checked products are the belt to those braces.
  int64_t q = 0, kv = 0, per_layer = 0, t = 0;
  bool ok = mul(d_model, hq, &q) && mul(q, d_head, &q)             // q and o: D x Hq*Dh each
            && mul(d_model, hkv, &kv) && mul(kv, d_head, &kv)      // k and v: D x Hkv*Dh each
            && mul(q, 2, &t) && mul(kv, 2, &per_layer) && add(t, per_layer, &per_layer) &&
            mul(n_layers, per_layer, &f.attn);
  ok = ok && mul(d_model, ff, &t) && mul(t, 3, &t) && mul(n_layers, t, &f.mlp);
  ok = ok && add(2 * d_model, 2 * d_head, &t) && mul(n_layers, t, &t) && add(t, d_model, &f.norms);
  ok = ok && mul(m.vocab, d_model, &f.embed);
  f.lm_head = o.tied ? 0 : f.embed;
  ok = ok && add(f.attn, f.mlp, &t) && add(t, f.norms, &t) && add(t, f.embed, &t) &&
       add(t, f.lm_head, &f.weights);
  ok = ok && mul(n_layers, 2, &t) && mul(t, hkv, &t) && mul(t, d_head, &f.kv_per_pos) &&
       mul(f.kv_per_pos, max_ctx, &f.kv_cache) && add(f.weights, f.kv_cache, &f.total);
  // Bytes, matrix by matrix (int8's scales depend on each matrix's row length).
  const auto mb = [&](int64_t rows, int64_t cols) {
    return residentk_matrix_bytes(rows, cols, o.format);
  };
  const int64_t layer_bytes = mb(hq * d_head, d_model) + 2 * mb(hkv * d_head, d_model) +
                              mb(d_model, hq * d_head) + 2 * mb(ff, d_model) + mb(d_model, ff);
  ok = ok && mul(n_layers, layer_bytes, &t) &&
       add(t, mb(m.vocab, d_model) * (o.tied ? 1 : 2), &t) &&
       mul(f.norms, 4, &per_layer) && add(t, per_layer, &f.weight_bytes) &&
       mul(f.kv_cache, dtype_info(o.kv_format).bytes, &f.kv_bytes) &&
       add(f.weight_bytes, f.kv_bytes, &f.total_bytes);
  if (!ok) {  // unreachable within the ceilings; refuse rather than report a wrapped size
    f = ResidentFootprint();
    f.status = RESIDENT_ERR_DIMENSION_TOO_LARGE;
    say(why, "resident element count overflows int64");
  }
  return f;
}

int64_t residentk_weight_elems(const ModelShape& m, int64_t max_ctx, bool tied) {
  FootprintOpts o;
  o.tied = tied;
  const ResidentFootprint f = residentk_footprint(m, max_ctx, o);
  return f.status == RESIDENT_OK ? f.total : 0;
}

int64_t residentk_max_ctx_fitting(const ModelShape& m, int64_t budget_bytes,
                                  const FootprintOpts& o) {
  if (budget_bytes < 1) return 0;
  for (int64_t cap = RESIDENT_MAX_CONTEXT; cap >= RESIDENT_DEFAULT_CONTEXT; cap /= 2) {
    const ResidentFootprint f = residentk_footprint(m, cap, o);
    if (f.status != RESIDENT_OK) return 0;
    if (f.total_bytes <= budget_bytes) return cap;
  }
  return 0;
}

bool residentk_scalars_ok(double eps, double scale) {
  return std::isfinite(eps) && std::isfinite(scale) && eps > 0.0 && scale > 0.0;
}

bool residentk_splitk_should_split(int64_t n_keys) { return n_keys >= RESIDENT_SPLITK_MIN_KEYS; }

int64_t residentk_splitk_max_n_splits(int64_t n_cores, int64_t h_q) {
  if (h_q < 1) return 1;  // no heads, nothing to split: a scratch of one split is always safe
  if (n_cores <= 0) return RESIDENT_SPLITK_FALLBACK_SPLITS;
  // Past 2^20 cores the cap below binds anyway; clamping first keeps 32 * n_cores in range.
  const int64_t cores = n_cores > (int64_t(1) << 20) ? (int64_t(1) << 20) : n_cores;
  const int64_t slots = RESIDENT_SPLITK_BLOCKS_PER_CORE * cores;
  int64_t m = slots / h_q + (slots % h_q != 0);  // ceil(slots / h_q)
  if (m > RESIDENT_SPLITK_MAX_SPLITS) m = RESIDENT_SPLITK_MAX_SPLITS;
  return m < 1 ? 1 : m;
}

int64_t residentk_splitk_policy(int64_t n_keys, int64_t n_cores, int64_t h_q) {
  if (!residentk_splitk_should_split(n_keys)) return 1;
  const int64_t m = residentk_splitk_max_n_splits(n_cores, h_q);
  // Fraction of the occupancy ceiling, log-linear in depth: 1/2 at 128 keys, 1 at 1000 keys.
  // Both anchors are exact in floating point: log(1) is 0, and at 1000 keys the numerator and
  // denominator are the same computed double, so their ratio is exactly 1. Every step (log,
  // divide, multiply and add by positive constants, floor) is monotone, so the policy never
  // decreases as n_keys grows.
  const double span = std::log(double(RESIDENT_SPLITK_ANCHOR_HI_KEYS) / double(RESIDENT_SPLITK_ANCHOR_LO_KEYS));
  const double depth = std::log(double(n_keys) / double(RESIDENT_SPLITK_ANCHOR_LO_KEYS)) / span;
  const double half = 0.5 * double(m);
  const double x = std::floor(half + half * depth + 0.5);
  if (!(x >= 1.0)) return 1;
  if (x >= double(m)) return m;
  return int64_t(x);
}

bool residentk_prefill_gemm_use_narrow_tile(int64_t m_rows) {
  return m_rows < RESIDENT_PREFILL_NARROW_BELOW_ROWS;
}

int64_t resident_bucket_ctx(int64_t max_ctx) {
  if (max_ctx <= RESIDENT_DEFAULT_CONTEXT) return RESIDENT_DEFAULT_CONTEXT;
  if (max_ctx >= RESIDENT_MAX_CONTEXT) return RESIDENT_MAX_CONTEXT;
  int64_t b = RESIDENT_DEFAULT_CONTEXT;
  while (b < max_ctx) b *= 2;
  return b;
}

}  // namespace residentk
}  // namespace algenta

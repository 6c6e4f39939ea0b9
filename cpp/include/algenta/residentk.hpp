// residentk: the contract of a resident decode session (weights and a fixed-capacity KV cache
// held on the GPU for a whole generation), as pure host arithmetic.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, Dh head_dim, F d_ff (MLP
// intermediate), L layers, V vocab, T max_ctx (KV positions the session is opened at).
//
// Everything here answers "would a session hold this shape, and what would it cost" without a
// device: the CPU session, the CUDA session and the `algenta plan` tool all size themselves with
// these functions, so each formula exists once. Nothing in this header knows a backend exists:
// the probe's device facts (resident_gpu_kernels_compiled / resident_available below,
// cpp/src/residentk_probe.cpp) are the CUDA backend's answer to cuda_backend() (session.hpp).
//
// Arithmetic: every count is int64. The per-dimension ceilings keep every product the contract
// forms below 2^50 (see RESIDENT_MAX_*), and the products are still formed with overflow checks,
// so a caller passing INT64_MAX gets a refusal, never a wrapped small number.
#pragma once
#include <cstdint>
#include <string>

#include "algenta/dtype.hpp"

namespace algenta {
namespace residentk {

// ---- status codes (600-619) -------------------------------------------------------------
enum : int {
  RESIDENT_OK = 600,
  RESIDENT_ERR_EMPTY_DIMENSION = 601,
  RESIDENT_ERR_DIMENSION_TOO_LARGE = 602,
  RESIDENT_ERR_HEAD_GEOMETRY = 603,
  RESIDENT_ERR_NO_KERNELS = 604,       // built without a CUDA backend
  RESIDENT_ERR_NO_ACCELERATOR = 605,   // kernels compiled, no usable CUDA device
  RESIDENT_ERR_CONTEXT_FULL = 606,
  RESIDENT_ERR_WEIGHT_LENGTH = 607,
  RESIDENT_ERR_LAUNCH_FAILED = 608,
  RESIDENT_ERR_NON_FINITE = 609,
  RESIDENT_CODE_OUT_OF_RANGE = 610,
};

// ---- ceilings ---------------------------------------------------------------------------
// KV positions a session may be opened at. A refusal ceiling, not an allocation size: a
// session pays only for the max_ctx it opens at (Qwen3-0.6B at 65536 would hold 15 GB of KV).
constexpr int64_t RESIDENT_MAX_CONTEXT = 65536;
// Sequences one session may hold (slots), each its own KV region of the session's capacity.
constexpr int64_t RESIDENT_MAX_SLOTS = 1024;
// The default capacity, and the floor of resident_bucket_ctx.
constexpr int64_t RESIDENT_DEFAULT_CONTEXT = 512;
// Per-dimension ceilings: several times the largest published dense models (d_model 16,384,
// 128 heads, d_ff 53,248, 126 layers, vocab 262,144) and small enough that the biggest product
// the contract forms, the KV cache L * 2 * T * Hkv * Dh, stays below 2^10 * 2 * 2^16 * 2^10 *
// 2^10 = 2^47, and the weights below 2^50.
constexpr int64_t RESIDENT_MAX_D_MODEL = int64_t(1) << 16;  // 65,536
constexpr int64_t RESIDENT_MAX_HEADS = 1024;                // query and key/value heads each
constexpr int64_t RESIDENT_MAX_D_HEAD = 1024;
constexpr int64_t RESIDENT_MAX_D_FF = int64_t(1) << 18;     // 262,144
constexpr int64_t RESIDENT_MAX_LAYERS = 1024;
constexpr int64_t RESIDENT_MAX_VOCAB = int64_t(1) << 22;    // 4,194,304 (as lossk)

// The largest vector a resident kernel stages in shared memory is one row of the widest
// activation: max(D, F, Hq * Dh) float32 values. It must fit the shared-memory tier the kernels
// were compiled for (CMake cache variable ALGENTA_SMEM_TIER_BYTES, default 49152 = 48 KiB, the
// per-block amount every CUDA device grants without an opt-in; Ampere/Hopper allow up to 227 KiB
// with cudaFuncSetAttribute).
#ifndef ALGENTA_SMEM_TIER_BYTES
#define ALGENTA_SMEM_TIER_BYTES 49152
#endif
constexpr int64_t RESIDENT_SMEM_TIER_BYTES = ALGENTA_SMEM_TIER_BYTES;
static_assert(RESIDENT_SMEM_TIER_BYTES >= 1024 && RESIDENT_SMEM_TIER_BYTES <= 227 * 1024,
              "ALGENTA_SMEM_TIER_BYTES must lie in [1 KiB, 227 KiB] (Hopper's per-block maximum)");
constexpr int64_t RESIDENT_MAX_STAGED_FLOATS = RESIDENT_SMEM_TIER_BYTES / 4;
// The tier this binary was compiled with (reported, so a refusal can name it).
int64_t residentk_smem_tier_bytes();

// ---- split-K attention policy -------------------------------------------------------------
// Keys below which splitting the SDPA dispatch does not pay for its extra merge launch (measured).
constexpr int64_t RESIDENT_SPLITK_MIN_KEYS = 32;
// Resident blocks one SM can hold on Ampere (sm_80) and Hopper (sm_90): the occupancy ceiling
// is the split count at which Hq * splits blocks exactly fill every SM's block slots.
constexpr int64_t RESIDENT_SPLITK_BLOCKS_PER_CORE = 32;
// What an unprobeable core count (n_cores <= 0) falls back to: the fixed split count an earlier
// release shipped (_ATTN_SPLITK_N_SPLITS_NATIVE), i.e. max_n_splits(40, 16).
constexpr int64_t RESIDENT_SPLITK_FALLBACK_SPLITS = 80;
// Hard cap on any split count, so scratch stays bounded on a huge GPU running one head: at the
// context ceiling every split still covers >= 256 keys.
constexpr int64_t RESIDENT_SPLITK_MAX_SPLITS = 256;
// Calibrated anchors on the reference GPU (40 SMs, Hq = 16): half the occupancy ceiling at 128
// keys, all of it at 1000 keys.
constexpr int64_t RESIDENT_SPLITK_ANCHOR_LO_KEYS = 128;
constexpr int64_t RESIDENT_SPLITK_ANCHOR_HI_KEYS = 1000;

// Prefill GEMMs with fewer rows than this use the narrow-tile kernel (measured: narrow wins at
// 5 rows, 110.1 vs 91.6 tok/s; wide wins at 256 rows, 1165 vs 783.3 tok/s).
constexpr int64_t RESIDENT_PREFILL_NARROW_BELOW_ROWS = 32;

// ---- the model shape ---------------------------------------------------------------------
// The seven sizes every check, sizing and plan below reads, as one record (a session's
// SessionConfig is one, session.hpp). The seed's flat Python API spells them as seven arguments
// in this order; the bindings build the record from them in one place (session_args.hpp).
struct ModelShape {
  int64_t d_model = 0;   // D
  int64_t h_q = 0;       // Hq
  int64_t h_kv = 0;      // Hkv, divides Hq
  int64_t d_head = 0;    // Dh, a power of two; Hq*Dh need not equal D
  int64_t d_ff = 0;      // F
  int64_t n_layers = 0;  // L
  int64_t vocab = 0;     // V
};

// ---- pure checks (never throw, never allocate) -------------------------------------------
const char* residentk_status_name(int64_t code);

// 601 a dimension < 1; 602 past its ceiling; 603 Hq % Hkv != 0 or Dh not a power of two; 602 the
// largest staged vector max(D, F, Hq*Dh) over RESIDENT_MAX_STAGED_FLOATS; else 600. Over the
// layer's five dimensions only: n_layers and vocab are not looked at.
// Hq * Dh == D is not assumed (Qwen3-0.6B has 2048 vs 1024).
int residentk_dims_check(const ModelShape& m);
// The same checks over a whole model (L and V too, in the same order: every emptiness before
// any ceiling, ceilings before geometry, geometry before the shared-memory tier). The reason
// goes to *why when given.
int residentk_shape_check(const ModelShape& m, std::string* why = nullptr);
// 601 n_prompt < 1, n_new < 0 or max_ctx < 1; 602 max_ctx > RESIDENT_MAX_CONTEXT; 606 when
// n_prompt + n_new > max_ctx; else 600.
int residentk_context_check(int64_t n_prompt, int64_t n_new, int64_t max_ctx);
// L * 2 * T * Hkv * Dh (one K and one V buffer per layer); 0 when an argument is < 1 or past
// its ceiling (T past RESIDENT_MAX_CONTEXT included).
int64_t residentk_cache_elements(int64_t n_layers, int64_t h_kv, int64_t d_head, int64_t max_ctx);
// Dispatches per decode token: L * 6 + 3 (standard) and 1 + L * 7 + 2 (split-K, where SDPA is a
// partial + merge pair). 0 for L < 1 or L > RESIDENT_MAX_LAYERS.
int64_t residentk_dispatch_budget(int64_t n_layers);
int64_t residentk_dispatch_budget_deep(int64_t n_layers);
// Total resident float32 elements: weights (see ResidentFootprint) plus the KV cache at max_ctx.
// 0 for a shape residentk_shape_check refuses or a max_ctx outside [1, RESIDENT_MAX_CONTEXT].
int64_t residentk_weight_elems(const ModelShape& m, int64_t max_ctx = RESIDENT_DEFAULT_CONTEXT,
                               bool tied = true);
// eps and the attention scale both finite and > 0.
bool residentk_scalars_ok(double eps, double scale);

bool residentk_splitk_should_split(int64_t n_keys);
// Occupancy ceiling: ceil(32 * n_cores / Hq) clamped to [1, 256] (Hq * splits blocks fill all
// 32 block slots of every SM). n_cores <= 0 (unprobeable) gives 80; Hq < 1 gives 1.
int64_t residentk_splitk_max_n_splits(int64_t n_cores, int64_t h_q);
// 1 below 32 keys; else round(M/2 * (1 + ln(n_keys/128) / ln(1000/128))) clamped to [1, M],
// M = residentk_splitk_max_n_splits(n_cores, Hq). Half the ceiling at 128 keys, all of it at
// 1000, log-linear between and beyond; non-decreasing in n_keys.
int64_t residentk_splitk_policy(int64_t n_keys, int64_t n_cores, int64_t h_q);
bool residentk_prefill_gemm_use_narrow_tile(int64_t m_rows);

// Next power of two >= max_ctx, floored at RESIDENT_DEFAULT_CONTEXT and capped at
// RESIDENT_MAX_CONTEXT: the capacity a session actually allocates, so requests within one
// power-of-two band share resident buffers.
int64_t resident_bucket_ctx(int64_t max_ctx);

// ---- resident weight formats ------------------------------------------------------------------
// How a session holds its weight matrices (q, k, v, o, gate, up, down, the embedding and the
// head); norms, activations, RoPE and the KV cache are float32 in every format. Int8 is
// symmetric per-block quantization of each row: blocks of RESIDENT_INT8_BLOCK along the row, one
// float32 scale per block (amax / 127), values rounded to nearest even (llama.cpp's Q8_0 with a
// float32 instead of a float16 scale). q4_0 is llama.cpp's Q4_0 as it is (blocks of 32 four-bit
// codes with one float16 scale, quant::q4_0_block's rule): CPU engine only for now.
// The formats are Dtype's f32, bf16, f16, int8 and q4_0 (dtype.hpp); f64 is none.
constexpr Dtype kWeightFormats[] = {Dtype::F32, Dtype::BF16, Dtype::F16, Dtype::Int8,
                                    Dtype::Q4_0};
constexpr int64_t RESIDENT_INT8_BLOCK = 32;
// "f32", "bf16", "f16", "int8", "q4_0"; "?" for any other
const char* residentk_weight_format_name(Dtype f);

// ---- KV cache formats --------------------------------------------------------------------------
// How a session holds its KV cache: float32, or each key and value rounded to bfloat16 or float16
// (nearest even, half.hpp) when it is written; attention widens them exactly and accumulates in
// float32. The element counts (residentk_cache_elements) are the same in every format.
constexpr Dtype kKvFormats[] = {Dtype::F32, Dtype::BF16, Dtype::F16};
const char* residentk_kv_format_name(Dtype f);  // "f32", "bf16", "f16"; "?" for any other
// Bytes of one (rows, cols) matrix held in format f: 4, 2, 2 bytes an element, or for int8 one
// byte an element plus 4 per block (rows * ceil(cols / 32) blocks), for q4_0 18 bytes a block
// (16 of codes, a float16 scale). 0 for rows or cols < 1.
int64_t residentk_matrix_bytes(int64_t rows, int64_t cols, Dtype f);

// ---- sizing, term by term ------------------------------------------------------------------
// Float32 elements of one model's resident state, per GPU when the heads and the MLP are split
// tp ways (tensor parallel: Hq, Hkv and F divided by tp; norms and embeddings replicated).
struct ResidentFootprint {
  int status = RESIDENT_ERR_EMPTY_DIMENSION;  // 600, or why the sizes below are 0
  int64_t attn = 0;        // L * (D*Hq*Dh [q] + 2 * D*Hkv*Dh [k, v] + Hq*Dh*D [o])
  int64_t mlp = 0;         // L * 3 * D * F [gate, up, down]
  int64_t norms = 0;       // L * (2 * D [input, post-attention] + 2 * Dh [q_norm, k_norm]) + D [final]
  int64_t embed = 0;       // V * D, counted once when tied to the lm_head
  int64_t lm_head = 0;     // V * D when untied, else 0
  int64_t weights = 0;     // the five above
  int64_t kv_cache = 0;    // residentk_cache_elements(L, Hkv/tp, Dh, T)
  int64_t kv_per_pos = 0;  // KV elements one context position adds (L * 2 * Hkv/tp * Dh)
  int64_t total = 0;       // weights + kv_cache
  // Bytes in the footprint's weight format (the elements above are the format's own counts):
  // every matrix by residentk_matrix_bytes, the norms in float32.
  int64_t weight_bytes = 0;
  int64_t kv_bytes = 0;     // kv_cache times the KV format's element size (4 or 2)
  int64_t total_bytes = 0;  // weight_bytes + kv_bytes
};
// How a footprint is asked for, beyond the shape and the capacity.
struct FootprintOpts {
  bool tied = true;              // the head reuses the embedding (counted once)
  int64_t tp = 1;                // tensor-parallel degree: Hq, Hkv and F divided by it
  bool check_tier = true;        // false skips only the shared-memory tier check
  Dtype format = Dtype::F32;     // the weight format the bytes are counted in
  Dtype kv_format = Dtype::F32;  // the KV cache format
};
// status: residentk_shape_check's; then 602 for max_ctx past the ceiling (601 below 1); 603 for
// tp < 1 or a tp that does not divide Hq, Hkv and F. check_tier = false sizes a shape for a
// rebuild with a larger tier.
ResidentFootprint residentk_footprint(const ModelShape& m, int64_t max_ctx,
                                      const FootprintOpts& o = {}, std::string* why = nullptr);
// Largest power-of-two capacity (a resident_bucket_ctx value, 512..65536) whose per-GPU
// footprint (total_bytes in o.format) fits budget_bytes; 0 when not even 512 positions fit or
// the shape is refused.
int64_t residentk_max_ctx_fitting(const ModelShape& m, int64_t budget_bytes,
                                  const FootprintOpts& o = {});

// ---- probe ----------------------------------------------------------------------------------
// A build fact: true in a build with a CUDA backend (ALGENTA_GPU, or ALGENTA_CUDA_EMU whose
// kernels run on the CPU emulator).
bool resident_gpu_kernels_compiled();
// A host fact: the current CUDA device exists and can run this binary's kernels (always true on
// the emulator). Any CUDA error (no driver, no device, no compatible kernel image) reads as
// false. Always false without a CUDA backend. Asked once per process: the CUDA runtime's
// initialization result is itself fixed for the life of the process.
bool resident_available();

struct ResidentProbe {
  bool kernels_compiled = false;
  bool device_present = false;
  bool session_possible = false;
  int64_t dispatch_budget = 0;
  int64_t resident_f32_elems = 0;
  int status = RESIDENT_ERR_EMPTY_DIMENSION;
};
// Shape refusals (601-603) first, on every build and host, and without asking the device
// (device_present reads false: no hardware could have helped); then 604 (no kernels), 605
// (kernels, no usable device), else 600. dispatch_budget depends on n_layers alone and is
// reported whenever n_layers is valid; resident_f32_elems (at RESIDENT_DEFAULT_CONTEXT, tied
// embeddings) is 0 for a refused shape.
ResidentProbe resident_session_probe(const ModelShape& m);

}  // namespace residentk
}  // namespace algenta

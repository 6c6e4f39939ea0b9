// The CUDA resident session's host-side launch plan: every grid size, split count, buffer size
// and offset the backend (cuda/session_cuda.cu) uses, as plain C++ compiled in every build so
// the CPU test suite (tests/test_residentk_cuda_plan.py) checks it on a host with no GPU.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, G = Hq/Hkv, Dh d_head,
// Q = (Hq + 2*Hkv)*Dh fused q/k/v rows, A = Hq*Dh attention width, F d_ff, L layers, V vocab,
// T capacity (KV positions allocated), P position, M prefill block rows, S split-K splits,
// SM multiprocessors of the device.
//
// Nothing here includes CUDA. The few formulas the kernels themselves evaluate on the device
// (a split's key range, reading the position from device memory) are ALGENTA_HD functions: the
// same source line runs in the kernel and in the CPU tests.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "algenta/hd.hpp"
#include "algenta/residentk.hpp"
#include "algenta/session.hpp"

namespace algenta {
namespace residentk {
namespace cudaplan {

// ---- fixed launch shapes ------------------------------------------------------------------
constexpr int WARP = 32;
// Matvec-style kernels: 8 warps per block, one weight row per warp at a time (a decode matvec's
// short matrices: one row per 2, 4 or 8 warps, decode_matvec_launch).
constexpr int MATVEC_THREADS = 256;
constexpr int MATVEC_WARPS = MATVEC_THREADS / WARP;
// Blocks per SM a matvec grid aims at: enough independent rows in flight to cover HBM latency
// on a memory-bound stage, few enough that each block's staged input vector (re-read from L2
// by every block) stays a small fraction of the weight bytes it streams.
constexpr int64_t MATVEC_BLOCKS_PER_SM = 4;
// 16-byte weight loads a lane of a matvec keeps in flight (warp_dot's unrolled main loop).
constexpr int MATVEC_LOADS = 4;
// Attention: 4 warps per (query head, split, row) block; each warp walks every 4th key.
constexpr int ATTN_THREADS = 128;
constexpr int ATTN_WARPS = ATTN_THREADS / WARP;
// Row-parallel small kernels (embed, norms, merge, elementwise).
constexpr int ROW_THREADS = 256;
// Wide prefill GEMM tile: BM x BN outputs per 256-thread block (4 x 4 per thread), BK-deep.
constexpr int GEMM_BM = 64, GEMM_BN = 64, GEMM_BK = 16, GEMM_THREADS = 256;
// Narrow prefill GEMM: activation rows handled per pass over a weight row (the accumulators
// are a compile-time-indexed register array of this length).
constexpr int NARROW_ROWS = 8;
// Prefill processes at most this many tokens per block (the CPU engine's block too).
constexpr int64_t PREFILL_BLOCK = 256;
// A session of several slots: one launch sequence carries at most STEP_ROWS tokens (rows) of
// any slots and positions through decode's stages (the CPU engine's decode_rows carries 16);
// a matvec block multiplies each weight load by up to PASS_ROWS of them (the template width of
// the row kernels' accumulators; fewer where the staged vectors would not fit shared memory,
// matvec_pass_rows), so a step of B rows reads the weights ceil(B / pass rows) times.
constexpr int64_t STEP_ROWS = 16;
constexpr int PASS_ROWS = 8;
// Every buffer offset is a multiple of this many floats (256 bytes): float4 loads of a row whose
// length is a multiple of 4 never straddle, and every tensor starts on its own cache lines. The
// weight arena, whose matrices may be 2- or 1-byte elements, aligns byte offsets the same way.
constexpr int64_t ALIGN_FLOATS = 64;
constexpr int64_t ALIGN_BYTES = 4 * ALIGN_FLOATS;
// A core count to plan with when the device cannot be asked (CPU tests, the 605 path).
constexpr int64_t FALLBACK_SMS = 40;

ALGENTA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
ALGENTA_HD int64_t align_up(int64_t n) { return ceil_div(n, ALIGN_FLOATS) * ALIGN_FLOATS; }
ALGENTA_HD int64_t align_up_bytes(int64_t n) { return ceil_div(n, ALIGN_BYTES) * ALIGN_BYTES; }

// Keys [k0, k1) of split s of S over n keys: ceil(n/S) keys each, in key order, so the splits
// partition [0, n) exactly; trailing splits may be empty (k0 == k1) when ceil rounding runs out
// of keys first, and the kernels write an empty partial (m = -inf, l = 0) for them.
ALGENTA_HD void splitk_range(int64_t n, int64_t S, int64_t s, int64_t* k0, int64_t* k1) {
  const int64_t per = ceil_div(n, S);
  int64_t a = s * per;
  if (a > n) a = n;
  int64_t b = a + per;
  if (b > n) b = n;
  *k0 = a;
  *k1 = b;
}

// One token a launch sequence carries (a row), as the host writes it into device memory
// before the launches that read it: decode's one row, a batched step's B, prefill's M. The
// kernels take a row's token, position and KV region from here, never from their launch
// shape, so one graph serves every position and rows of different slots share a launch.
// n_splits: 0 for the standard path (one split, finalized in place), else the split-K count
// S >= 1 of splitk_plan (partials, then k_attn_merge).
struct StepRow {
  int64_t tok = 0;
  int64_t pos = 0;   // P: the slot's tokens before this row (the KV position it writes)
  int64_t slot = 0;
  int64_t n_splits = 0;
};

// ---- one matvec-style launch ---------------------------------------------------------------
// With split 1 each warp of a block takes every MATVEC_WARPS-th of its rows; with split s > 1
// (decode_matvec_launch) a block has MATVEC_WARPS / s rows, one for each group of s warps, warp
// j on the j-th of s equal slices of K, the slices' sums joined in warp order: a row's sum
// depends on s (fixed by the plan) and nothing else.
struct MatvecLaunch {
  int64_t rows = 0;            // N
  int64_t rows_per_block = 0;  // a multiple of MATVEC_WARPS, or MATVEC_WARPS / split
  int64_t grid = 0;            // ceil(N / rows_per_block)
  int64_t split = 1;           // warps a row: 1, 2, 4 or 8
};
// About MATVEC_BLOCKS_PER_SM blocks per SM, never a block without a row; one warp a row.
MatvecLaunch matvec_launch(int64_t rows, int64_t sms);
// Smallest slice of K a warp takes in a split row: one 16-byte load a lane, in elements of a
// matrix of this format (f32 128, bf16 and f16 256, int8 512).
int64_t matvec_min_slice(Dtype weights);
// A decode matvec over (rows, K) weights, for HBM: a memory-bound launch streams at the rate of
// the bytes it holds in flight, so each row is split over the 1, 2, 4 or 8 warps that hold the
// most, counted as blocks an SM (its grid over the SMs, at most MATVEC_BLOCKS_PER_SM) times a
// lane's bytes in flight (MATVEC_LOADS 16-byte loads, at most its slice of the row), the fewest
// on a tie; a slice is at least matvec_min_slice elements, whole 16-byte units (int8: blocks).
// At a 0.6B shape on 132 SMs o_proj and down (1,024 rows: 128 blocks unsplit, one on an SM)
// split (bf16: over 2 and 4 warps); qkv and gate/up have rows enough (f32: 2 warps a row).
MatvecLaunch decode_matvec_launch(int64_t rows, int64_t K, Dtype weights, int64_t sms);

// ---- split-K attention for one decode step ---------------------------------------------------
struct SplitPlan {
  bool split = false;      // residentk_splitk_should_split(n_keys)
  int64_t n_splits = 1;    // S: policy clamped to [1, n_keys]; 1 when not split
  int64_t launches = 1;    // 1 (fused partial+finalize) or 2 (partial, merge)
};
SplitPlan splitk_plan(int64_t n_keys, int64_t sms, int64_t h_q);

// ---- buffers -------------------------------------------------------------------------------
// A weight matrix (rows, cols) in the weight arena, byte offsets: its elements in the session's
// format (row r at data + r * cols * elem_bytes), and for int8 its block scales (rows,
// ceil(cols / RESIDENT_INT8_BLOCK) float32, the CPU engine's layout); scales is -1 otherwise.
struct MatOffsets {
  int64_t data = 0;
  int64_t scales = -1;
};
// One layer's tensors inside the weight arena (byte offsets; norms and biases are float32).
// What a family does not hold (model_tensors) is -1.
struct LayerOffsets {
  int64_t in_norm = 0;    // (D)
  MatOffsets wqkv;        // (Q, D): q_proj rows, then k_proj, then v_proj
  int64_t q_norm = -1;    // (Dh)
  int64_t k_norm = -1;    // (Dh)
  MatOffsets wo;          // (D, A)
  int64_t post_norm = 0;  // (D) the norm before the MLP
  MatOffsets wg, wu;      // (F, D)
  MatOffsets wd;          // (D, F)
  int64_t qkv_b = -1, o_b = -1, g_b = -1, u_b = -1, d_b = -1;  // (Q), (D), (F), (F), (D)
  int64_t attn_out_norm = -1, mlp_out_norm = -1;              // (D) sandwich norms
  bool slides = false;    // attention sees the last sliding_window keys
  int64_t rope = 0;       // offset (floats) of this layer's RoPE table in the rope buffer
};

struct Plan {
  int status = RESIDENT_ERR_EMPTY_DIMENSION;  // 600, or the contract's refusal (plan is empty)
  std::string why;
  int64_t sms = 0;
  int64_t capacity = 0;   // T = resident_bucket_ctx(max_ctx)
  int64_t q_rows = 0;     // Q
  int64_t attn_width = 0; // A

  // Weight arena: one allocation, every tensor and scale array aligned (ALIGN_BYTES); the
  // matrices in the session's weight format (elem_bytes each), norms float32.
  int64_t elem_bytes = 4;   // 4 (f32), 2 (bf16, f16), 1 (int8)
  MatOffsets embed;         // (V, D)
  MatOffsets head;          // (V, D); == embed when tied
  int64_t final_norm = 0;   // (D)
  std::vector<LayerOffsets> layers;
  int64_t weight_bytes = 0;

  // KV cache: one region of residentk_cache_elements(L, Hkv, Dh, T) elements of the KV format
  // (kv_elem_bytes each) a slot, slot s at element s * kv_slot_stride; within a region layer
  // l's K at element l*2*Hkv*T*Dh, its V one Hkv*T*Dh further, each laid out (Hkv, T, Dh) as
  // in the CPU engine.
  int64_t slots = 1;
  int64_t kv_elems = 0;         // slots * kv_slot_stride
  int64_t kv_slot_stride = 0;   // L * kv_layer_stride
  int64_t kv_elem_bytes = 4;    // 4 (f32), 2 (bf16, f16)
  int64_t kv_layer_stride = 0;  // 2 * Hkv * T * Dh, elements
  // RoPE tables: cos (T, Dh/2) then sin (T, Dh/2); the global one at 0, the local one (sliding
  // layers of a family with a base of their own) after it.
  int64_t rope_floats = 0;

  // Decode activations (one arena) for R = step_rows rows: offsets in floats.
  int64_t step_rows = 1;  // min(slots, STEP_ROWS): rows one decode launch sequence carries
  int64_t x = 0;        // (R, D) residual stream
  int64_t y = 0;        // (R, D) a sublayer's output on its way through a bias or sandwich norm
  int64_t xf = 0;       // (R, D) final-normed
  int64_t qkv = 0;      // (R, Q)
  int64_t attn = 0;     // (R, A)
  int64_t act = 0;      // (R, F)
  int64_t logits = 0;   // (R, V)
  int64_t part_acc = 0; // (R, Hq, S_max, Dh) split-K unnormalized partial outputs
  int64_t part_ml = 0;  // (R, Hq, S_max, 2) split-K running max and sum
  int64_t argmax_val = 0;  // (grid of the head launch) per-block best logit
  int64_t act_floats = 0;
  int64_t max_splits = 0;  // S_max = residentk_splitk_max_n_splits(SM, Hq), sized once
  // StepRow entries in device memory: max(prefill_rows, step_rows), the most one launch
  // sequence reads.
  int64_t row_entries = 0;

  // Prefill activations (one arena, M_max = min(PREFILL_BLOCK, T) rows): offsets in floats.
  int64_t prefill_rows = 0;  // M_max
  int64_t p_x = 0;     // (M, D)
  int64_t p_y = 0;     // (M, D) as y
  int64_t p_xn = 0;    // (M, D)
  int64_t p_qkv = 0;   // (M, Q)
  int64_t p_attn = 0;  // (M, A)
  int64_t p_gate = 0;  // (M, F)
  int64_t p_up = 0;    // (M, F)
  // int8 weights only (else 0 and 0): one activation matrix quantized for the integer GEMM,
  // codes (M, q8_ld) bytes (q8_ld = max(D, A, F) rounded up to 32) and block scales
  // (M, q8_ld / 32) floats
  int64_t q8_ld = 0;
  int64_t p_q8_codes = 0;
  int64_t p_q8_scales = 0;
  int64_t prefill_floats = 0;

  // Decode launches.
  MatvecLaunch qkv_mv, o_mv, gateup_mv, down_mv, head_mv;
  int64_t staged_floats = 0;  // max(D, F, A): the longest vector a matvec kernel stages
  // Dynamic shared memory of a matvec kernel staging a K-vector (stage_bytes(K)); the largest,
  // at K = staged_floats, is what the device's per-block limit is checked against at open.
  int64_t staged_bytes = 0;
  int64_t attn_smem_bytes = 0;
  int64_t norm_rope_threads = 0;  // min(Dh, 1024) rounded up to a warp
};

// Everything the session allocates and launches, or the contract's refusal in status/why.
// Refusals are the contract's own: shape (601-603), scalars (609), max_ctx (601/602); slots
// outside [1, RESIDENT_MAX_SLOTS] 601 / 602.
Plan make_plan(const SessionConfig& cfg, int64_t max_ctx, int64_t sms, int64_t slots = 1);

// Dynamic shared memory (bytes) of a matvec kernel whose input vector has K values, in weight
// format f: the vector in float32 (K floats), and for int8 also its quantized blocks (K bytes,
// rounded up to 16) and their scales (ceil(K / 32) floats), as the kernels lay them out.
ALGENTA_HD int64_t stage_bytes(int64_t K, Dtype f) {
  const int64_t xf = 16 * ceil_div(K, 4);  // K floats, padded to whole float4
  if (f != Dtype::Int8) return xf;
  return xf + 16 * ceil_div(K, 16) + 4 * ceil_div(K, RESIDENT_INT8_BLOCK);
}

// A row kernel's staged vectors lie this many bytes apart (stage_bytes rounded up to 16, so each
// starts on a float4).
ALGENTA_HD int64_t stage_stride(int64_t K, Dtype f) { return 16 * ceil_div(stage_bytes(K, f), 16); }

// Rows a matvec block of the row kernels multiplies per weight load: PASS_ROWS, or as many
// staged vectors of stride bytes as fit a block's opt-in shared memory beside 1 KiB of the
// kernels' own arrays (at least 1: the session's open checks that one fits).
int64_t matvec_pass_rows(int64_t stride, int64_t optin_bytes);

// Dispatches one decode step launches at position P (n_keys = P + 1): 3 + 6L, plus one per
// layer when split-K is in play (residentk_dispatch_budget / _deep for Qwen3), plus two per
// layer for a family with sandwich norms (decode_stages).
int64_t decode_launches(const Plan& p, const SessionConfig& cfg, int64_t n_keys);

// Wide GEMM grid for Y (M, N): (ceil(N / BN), ceil(M / BM)).
struct GemmGrid {
  bool narrow = false;
  int64_t gx = 0, gy = 0;  // wide: tile columns, tile rows; narrow: matvec grid (gy = 1)
  int64_t rows_per_block = 0;  // narrow only
};
GemmGrid prefill_gemm_grid(int64_t m_rows, int64_t n_cols, int64_t sms);

}  // namespace cudaplan
}  // namespace residentk
}  // namespace algenta

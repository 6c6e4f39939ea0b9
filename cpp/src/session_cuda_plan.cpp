// Host-side launch planning of the CUDA resident session (see session_cuda_plan.hpp): plain C++
// compiled in every build, so grid sizes, split counts, buffer sizes and offsets are tested
// without a GPU.
//
// Sizes are int64 throughout. The contract's ceilings (residentk.hpp) bound every product formed
// here below 2^50 floats, and make_plan runs the contract's checks before forming any of them.
#include "algenta/session_cuda_plan.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "algenta/residentk.hpp"
#include "algenta/session_weights.hpp"

namespace algenta {
namespace residentk {
namespace cudaplan {

MatvecLaunch matvec_launch(int64_t rows, int64_t sms) {
  MatvecLaunch m;
  if (rows < 1) return m;
  if (sms < 1) sms = FALLBACK_SMS;
  const int64_t target_blocks = sms * MATVEC_BLOCKS_PER_SM;
  // Rows per block: a whole number of rows per warp, at least one row per warp.
  const int64_t per_warp = std::max<int64_t>(1, ceil_div(rows, target_blocks * MATVEC_WARPS));
  m.rows = rows;
  m.rows_per_block = per_warp * MATVEC_WARPS;
  m.grid = ceil_div(rows, m.rows_per_block);
  return m;
}

// A slice starts on its format's 16-byte load unit (int8: a whole 32-code block, so a lane pair
// shares a block as in an unsplit row).
static int64_t slice_unit(Dtype weights) {
  return weights == Dtype::Int8 ? RESIDENT_INT8_BLOCK : 16 / dtype_info(weights).bytes;
}

int64_t matvec_min_slice(Dtype weights) { return 16 * WARP / dtype_info(weights).bytes; }

// What decode_matvec_launch maximizes: blocks an SM (at most MATVEC_BLOCKS_PER_SM) times a
// lane's weight bytes in flight (MATVEC_LOADS 16-byte loads, at most its slice of a row).
static double matvec_flight_bytes(const MatvecLaunch& m, int64_t K, Dtype weights, int64_t sms) {
  if (sms < 1) sms = FALLBACK_SMS;
  const double blocks = std::min(double(m.grid) / double(sms), double(MATVEC_BLOCKS_PER_SM));
  const double slice_lane = double(K / m.split) * dtype_info(weights).bytes / WARP;
  return blocks * std::min(double(16 * MATVEC_LOADS), slice_lane);
}

MatvecLaunch decode_matvec_launch(int64_t rows, int64_t K, Dtype weights, int64_t sms) {
  const MatvecLaunch base = matvec_launch(rows, sms);
  if (base.grid == 0 || base.rows_per_block > MATVEC_WARPS) return base;  // rows for every SM
  MatvecLaunch best = base;
  double best_bytes = matvec_flight_bytes(base, K, weights, sms);
  for (int64_t s = 2; s <= MATVEC_WARPS; s *= 2) {
    if (K % s != 0 || K / s < matvec_min_slice(weights) || (K / s) % slice_unit(weights) != 0)
      break;
    MatvecLaunch m = base;
    m.split = s;
    m.rows_per_block = MATVEC_WARPS / s;
    m.grid = ceil_div(rows, m.rows_per_block);
    const double b = matvec_flight_bytes(m, K, weights, sms);
    if (b > best_bytes) best = m, best_bytes = b;
  }
  return best;
}

SplitPlan splitk_plan(int64_t n_keys, int64_t sms, int64_t h_q) {
  SplitPlan s;
  if (!residentk_splitk_should_split(n_keys)) return s;
  s.split = true;
  // More splits than keys would only add empty blocks and a longer merge.
  s.n_splits = std::min(residentk_splitk_policy(n_keys, sms, h_q), n_keys);
  s.n_splits = std::max<int64_t>(1, s.n_splits);
  s.launches = 2;
  return s;
}

Plan make_plan(const SessionConfig& c, int64_t max_ctx, int64_t sms, int64_t slots) {
  Plan p;
  int64_t T = 0;
  p.status = session_open_status(c, max_ctx, &T, &p.why);
  if (p.status != RESIDENT_OK) return p;
  if (c.weights == Dtype::Q4_0) {  // CPU panels only (kernels/q4panels.cpp), so far
    p.status = RESIDENT_ERR_NO_KERNELS;
    p.why = "device='cuda' has no q4_0 kernels yet: hold the weights as 'int8' on the GPU, or "
            "use device='cpu'";
    return p;
  }
  if (slots < 1 || slots > RESIDENT_MAX_SLOTS) {
    p.status = slots < 1 ? RESIDENT_ERR_EMPTY_DIMENSION : RESIDENT_ERR_DIMENSION_TOO_LARGE;
    p.why = "slots " + std::to_string(slots) + " outside [1, " +
            std::to_string(RESIDENT_MAX_SLOTS) + "]";
    return p;
  }
  if (sms < 1) sms = FALLBACK_SMS;
  const int64_t D = c.d_model, Hq = c.h_q, Hkv = c.h_kv, Dh = c.d_head, F = c.d_ff;
  const int64_t L = c.n_layers, V = c.vocab;
  p.sms = sms;
  p.capacity = T;
  p.q_rows = (Hq + 2 * Hkv) * Dh;
  p.attn_width = Hq * Dh;
  const int64_t Q = p.q_rows, A = p.attn_width;

  // ---- weight arena (bytes), in the order of the HF names ----
  p.elem_bytes = dtype_info(c.weights).bytes;
  int64_t at = 0;
  auto take_bytes = [&at](int64_t n) {
    const int64_t o = at;
    at += align_up_bytes(n);
    return o;
  };
  auto vec = [&](int64_t n) { return take_bytes(4 * n); };
  auto mat = [&](int64_t rows, int64_t cols) {
    MatOffsets m;
    m.data = take_bytes(rows * cols * p.elem_bytes);
    if (c.weights == Dtype::Int8) m.scales = take_bytes(4 * rows * ceil_div(cols, RESIDENT_INT8_BLOCK));
    return m;
  };
  // Each tensor of the family's table (model_tensors, the one list of what a layer holds) in
  // its order; k and v join q's rows in the fused wqkv, their biases q's in the fused qkv_b.
  p.layers.resize(size_t(L));
  for (const TensorSpec& t : model_tensors(c)) {
    LayerOffsets* l = t.layer >= 0 ? &p.layers[size_t(t.layer)] : nullptr;
    switch (t.field) {
      case Field::Embed: p.embed = mat(V, D); break;
      case Field::LmHead: p.head = mat(V, D); break;
      case Field::FinalNorm: p.final_norm = vec(D); break;
      case Field::InNorm: l->in_norm = vec(D); break;
      case Field::QProj: l->wqkv = mat(Q, D); break;
      case Field::QBias: l->qkv_b = vec(Q); break;
      case Field::KProj: case Field::VProj: case Field::KBias: case Field::VBias: break;
      case Field::QNorm: l->q_norm = vec(Dh); break;
      case Field::KNorm: l->k_norm = vec(Dh); break;
      case Field::OProj: l->wo = mat(D, A); break;
      case Field::OBias: l->o_b = vec(D); break;
      case Field::AttnOutNorm: l->attn_out_norm = vec(D); break;
      case Field::PostNorm: l->post_norm = vec(D); break;
      case Field::Gate: l->wg = mat(F, D); break;
      case Field::GateBias: l->g_b = vec(F); break;
      case Field::Up: l->wu = mat(F, D); break;
      case Field::UpBias: l->u_b = vec(F); break;
      case Field::Down: l->wd = mat(D, F); break;
      case Field::DownBias: l->d_b = vec(D); break;
      case Field::MlpOutNorm: l->mlp_out_norm = vec(D); break;
    }
  }
  if (c.tie_word_embeddings) p.head = p.embed;
  p.weight_bytes = at;

  p.slots = slots;
  p.kv_slot_stride = residentk_cache_elements(L, Hkv, Dh, T);
  p.kv_elems = slots * p.kv_slot_stride;  // SessionBase refused a 64-bit overflow of the bytes
  p.kv_elem_bytes = dtype_info(c.kv).bytes;
  p.kv_layer_stride = 2 * Hkv * T * Dh;
  const int64_t table = 2 * T * (Dh / 2 > 0 ? Dh / 2 : 1);
  p.rope_floats = c.rope_local_theta > 0.0 ? 2 * table : table;
  for (int64_t li = 0; li < L; ++li) {
    p.layers[size_t(li)].slides = c.layer_slides(li);
    p.layers[size_t(li)].rope = layer_rope_local(c, li) ? table : 0;
  }

  // ---- decode launches (the head's grid sizes the argmax scratch) ----
  p.qkv_mv = decode_matvec_launch(Q, D, c.weights, sms);
  p.o_mv = decode_matvec_launch(D, A, c.weights, sms);
  p.gateup_mv = decode_matvec_launch(F, D, c.weights, sms);
  p.down_mv = decode_matvec_launch(D, F, c.weights, sms);
  p.head_mv = matvec_launch(V, sms);  // k_head_argmax keeps one warp a row (its argmax is per warp)
  p.staged_floats = std::max({D, F, A});
  // q staged (Dh) + per-warp accumulators (ATTN_WARPS, Dh) + per-warp (m, l).
  p.attn_smem_bytes = int64_t(sizeof(float)) * (Dh + ATTN_WARPS * Dh + 2 * ATTN_WARPS);
  // One thread per rotation pair (i, i + Dh/2), whole warps, at most a block's 1024.
  p.norm_rope_threads =
      std::min<int64_t>(1024, ceil_div(std::max<int64_t>(Dh / 2, 1), WARP) * WARP);

  p.staged_bytes = stage_bytes(p.staged_floats, c.weights);

  // ---- decode activation arena (floats) ----
  auto take = [&at](int64_t n) {
    const int64_t o = at;
    at += align_up(n);
    return o;
  };
  // Buffers of `rows` rows each, in the order given: (where its offset goes, its row's floats).
  using RowBuffer = std::pair<int64_t*, int64_t>;
  auto take_rows = [&take](int64_t rows, std::initializer_list<RowBuffer> buffers) {
    for (const RowBuffer& b : buffers) *b.first = take(rows * b.second);
  };
  p.max_splits = residentk_splitk_max_n_splits(sms, Hq);
  p.step_rows = std::min(slots, STEP_ROWS);
  at = 0;
  take_rows(p.step_rows, {{&p.x, D}, {&p.y, D}, {&p.xf, D}, {&p.qkv, Q}, {&p.attn, A},
                          {&p.act, F}, {&p.logits, V}, {&p.part_acc, Hq * p.max_splits * Dh},
                          {&p.part_ml, Hq * p.max_splits * 2}});
  p.argmax_val = take(p.head_mv.grid);
  p.act_floats = at;

  // ---- prefill activation arena ----
  p.prefill_rows = std::min(PREFILL_BLOCK, T);
  const int64_t M = p.prefill_rows;
  at = 0;
  take_rows(M, {{&p.p_x, D}, {&p.p_y, D}, {&p.p_xn, D}, {&p.p_qkv, Q}, {&p.p_attn, A},
                {&p.p_gate, F}, {&p.p_up, F}});
  if (c.weights == Dtype::Int8) {
    p.q8_ld = ceil_div(std::max({D, A, F}), RESIDENT_INT8_BLOCK) * RESIDENT_INT8_BLOCK;
    p.p_q8_codes = take(ceil_div(M * p.q8_ld, 4));
    p.p_q8_scales = take(M * (p.q8_ld / RESIDENT_INT8_BLOCK));
  }
  p.prefill_floats = at;
  p.row_entries = std::max(p.prefill_rows, p.step_rows);

  p.status = RESIDENT_OK;
  return p;
}

int64_t matvec_pass_rows(int64_t stride, int64_t optin_bytes) {
  if (stride < 1) return PASS_ROWS;
  return std::max<int64_t>(1, std::min<int64_t>(PASS_ROWS, (optin_bytes - 1024) / stride));
}

int64_t decode_launches(const Plan& p, const SessionConfig& c, int64_t n_keys) {
  const SplitPlan s = splitk_plan(n_keys, p.sms, c.h_q);
  // Fixed: embed, final norm, head (+argmax). Per layer: norm+QKV, q/k norm+RoPE+KV write,
  // attention (partial, + merge when split), o_proj+residual, norm+gate/up, down+residual.
  return decode_stages(c) + c.n_layers * (s.launches - 1);  // split-K: + a merge a layer
}

GemmGrid prefill_gemm_grid(int64_t m_rows, int64_t n_cols, int64_t sms) {
  GemmGrid g;
  if (m_rows < 1 || n_cols < 1) return g;
  g.narrow = residentk_prefill_gemm_use_narrow_tile(m_rows);
  if (g.narrow) {
    const MatvecLaunch mv = matvec_launch(n_cols, sms);
    g.gx = mv.grid;
    g.gy = 1;
    g.rows_per_block = mv.rows_per_block;
  } else {
    g.gx = ceil_div(n_cols, GEMM_BN);
    g.gy = ceil_div(m_rows, GEMM_BM);
  }
  return g;
}

}  // namespace cudaplan
}  // namespace residentk
}  // namespace algenta

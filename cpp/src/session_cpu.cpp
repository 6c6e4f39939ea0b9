// The CPU resident decode engine: the session's model families with float32 activations,
// OpenMP across cores, SIMD within one; weight matrices resident in float32, bfloat16, float16,
// int8 or q4_0 (SessionConfig::weights) as the instruction set's weight panels (kernels.hpp:
// PanelOps), widened to float32 in registers as they stream or multiplied on bf16 / int8 dot
// products (q4_0's 4-bit codes too); the KV cache in float32, bfloat16 or float16 (SessionConfig::kv, see KvCache).
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, G = Hq/Hkv group size,
// Dh d_head, Q = (Hq + 2*Hkv)*Dh fused q/k/v rows, F d_ff, L layers, V vocab, T capacity,
// P position, M prefill block rows.
//
// Decode fuses, per token, exactly the stages residentk_dispatch_budget counts, each ONE
// `omp parallel` region (the count is measured, see dispatches_per_token; a stage under 256 KiB
// of data runs as a team of one, since a fork/join would cost more than it saves):
//   fixed:     embed (x = E[id])  ...  final norm (xf = rmsnorm(x))  ...  head (logits = H xf)
//   per layer: 1 norm + QKV      qkv = Wqkv rmsnorm(x)             (Q rows split over threads)
//              2 q/k norm + RoPE + KV write, per head              (K, V slots P written in place)
//              3 attention, per query head: softmax(q K[0..P]^T / sqrt(Dh)) V[0..P]
//              4 o_proj + residual  x += Wo attn
//              5 norm + gate/up     act = silu(Wg rmsnorm(x)) * (Wu rmsnorm(x))
//              6 down + residual    x += Wd act
// That is Qwen3's list; the other families (session_weights.hpp's ArchSpec table) change it in
// place: biases added where their products land (q/k/v before the head norm, o and down in
// the projection's task, gate/up in the gate), no q/k norm where the family has none, the GELU
// gate, scaled embeddings, sliding windows and soft caps inside attend and the head, a local
// RoPE table per sliding layer; a sandwich family (Gemma 2/3) writes o and down to sub_ and
// norms them onto x in one more stage each (decode_stages counts them).
// Never materialized: the normed x (each thread rebuilds its own private copy of it, D values,
// instead of paying a barrier), gate and up separately (the row that computes gate j also
// computes up j and writes only act j), any [T]-sized per-layer state beyond one score row.
// Every weight element is read exactly once per step, by the thread that owns its row. A step
// of several sequences (slots, each its own KV region) runs the same stages on up to 16 rows
// at once (decode_rows): each panel block multiplies every row while it is hot.
//
// Prefill runs blocks of M <= PREFILL_BLOCK tokens through each layer as matrix-matrix
// products on the same panels (PanelOps::gemm, which never packs a weight: the panels are the
// GEMM's packed layout, written once at load). Only the last row's logits are formed.
//
// Numerics: every output cell has one owning thread and a fixed reduction order, so logits are
// bit-identical for every thread count, in every weight format. And a product's cell is computed
// by one multiply-add sequence whether one token is multiplied or M (a decode step runs the
// panels' GEMM for one row), every other stage runs the same code per token, and prefill rounds
// its activation rows as a step does, so a prompt's logits are bit-identical whether it is
// prefilled at once, in any split, or stepped (tests/test_residentk_split.py), on each
// instruction set. RMSNorm sums squares in double. The RoPE table is the shared one
// (session_weights.hpp: double angles rounded once). Conversion happens once, at load: bf16 and
// f16 round to nearest even (a value past float16's range is refused, 609); int8 stores
// round(w / s) per block of 32 with s = amax / 127 (quant.hpp). What each format multiplies:
//   f16   float32 activations; weight vectors widened in registers right after their load.
//   bf16  bf16 activations (each vector entering a matrix rounded once, half.hpp), as
//         transformers' and llama.cpp's bf16 matmuls: vdpbf16ps where the host has it, else the
//         widening kernels on the rounded values (products of two bf16 are exact in float32).
//   int8  int8 activations (Q8_0 x Q8_0, as llama.cpp): each vector quantized once per product
//         by the weights' rule, block products summed exactly in int32 (vpdpbusd / vpmaddubsw),
//         each block's sum entering float32 once.
//   q4_0  as int8, on llama.cpp's Q4_0 blocks (Q4_0 x Q8_0, ggml's quantizer at load): the
//         4-bit codes unpacked in registers, each cell int8's for the codes q - 8.
//
// The registry, the refusals and the position are SessionBase's; this engine is the compute and
// the layout of the resident buffers (stage_weight says where each tensor's rows go).
//
// Limits: shapes residentk_shape_check accepts; capacity resident_bucket_ctx(max_ctx) <= 65536.
// OpenMP barriers spin by default: on a machine whose cores are busy with other processes a
// spinning thread holds a core its descheduled partner needs, and each stage can cost a
// scheduler tick. Decode therefore tunes its team size at run time (see tuned_decode), and
// OMP_WAIT_POLICY=passive helps further on such machines.
//
// Files: session_cpu.hpp declares the engine (its buffers, layers and class); this file holds
// its opening (every buffer sized once), weight placement and task sizes; the decode step,
// prefill, attention and the test hooks have a file each (session_cpu_*.cpp, listed there).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "session_cpu.hpp"

namespace algenta {
namespace residentk {
namespace cpu_engine {

namespace {

// float32 rows (n, cols) -> rows [row0, row0 + n) of m, in m's format (narrow_row, the
// conversion the CUDA engine stores with too), each put into its panel. tmp: per thread, room
// for one converted row and its int8 scales (row_tmp_bytes). Returns the flat index (within
// src) of the first value the format cannot hold (it would round to infinity), or -1.
int64_t row_tmp_bytes(int64_t cols) {
  return Arena::span(size_t(cols) * 4) + Arena::span(size_t(cols / RESIDENT_INT8_BLOCK + 1) * 4);
}
int64_t store_rows(WMat& m, int64_t row0, const float* src, int64_t n, char* tmp, int nt) {
  const int64_t cols = m.cols, tb = row_tmp_bytes(cols);
  int64_t first = -1;  // the smallest row's offender: the same index for every thread count
#pragma omp parallel for num_threads(nt) schedule(static) if (n * cols > (int64_t(1) << 16))
  for (int64_t r = 0; r < n; ++r) {
    const float* x = src + r * cols;
    if (m.f == Dtype::F32) {
      m.put_row(row0 + r, x, nullptr);
      continue;
    }
    char* row = tmp + omp_get_thread_num() * tb;
    float* scales = reinterpret_cast<float*>(row + Arena::span(size_t(cols) * 4));
    const int64_t bad = narrow_row(m.f, x, cols, row, scales);
    if (bad >= 0) {
#pragma omp critical(algenta_store_rows)
      if (first < 0 || r * cols + bad < first) first = r * cols + bad;
      continue;
    }
    m.put_row(row0 + r, row, scales);
  }
  return first;
}

}  // namespace

CpuSession::CpuSession(const SessionConfig& c, int64_t max_ctx, int64_t slots)
    : SessionBase(c, max_ctx, slots) {
  nt_ = std::max(1, omp_get_max_threads());
  const int64_t D = c.d_model, Dh = c.d_head, F = c.d_ff;
  const Dtype wf = c.weights;
  q_rows_ = (c.h_q + 2 * c.h_kv) * Dh;
  // every matrix, in one order: sized first (need), then carved out of the arena
  auto matrices = [&](size_t* need) {
    embed_ = WMat(wf, c.vocab, D, &arena_, need);
    if (!c.tie_word_embeddings) head_ = WMat(wf, c.vocab, D, &arena_, need);
    for (Layer& l : layers_) {
      l.wqkv = WMat(wf, q_rows_, D, &arena_, need);
      l.wo = WMat(wf, D, c.h_q * Dh, &arena_, need);
      l.wg = WMat(wf, F, D, &arena_, need);
      l.wu = WMat(wf, F, D, &arena_, need);
      l.wd = WMat(wf, D, F, &arena_, need);
    }
  };
  layers_.resize(size_t(c.n_layers));
  size_t need = 0;
  matrices(&need);
  arena_.open(need);
  matrices(nullptr);
  final_norm_ = Buf(D);
  const ArchSpec& A = arch_spec(c.arch);
  act_ = A.act;
  sandwich_ = A.sandwich;
  qk_norm_ = A.qk_norm;
  embed_scale_ = A.embed_scaled ? float(std::sqrt(double(D))) : 0.f;
  attn_scale_ = float(c.attn_scale > 0.0 ? c.attn_scale : 1.0 / std::sqrt(double(Dh)));
  for (Layer& l : layers_) {
    l.in_norm = Buf(D);
    l.q_norm = Buf(Dh);
    l.k_norm = Buf(Dh);
    l.post_norm = Buf(D);
  }
  // the family's extra vectors, allocated where its table has them
  for (const TensorSpec& t : weights_.table()) {
    if (t.layer < 0) continue;
    Layer& l = layers_[size_t(t.layer)];
    switch (t.field) {
      case Field::QBias: l.qkv_b = Buf(q_rows_); break;
      case Field::OBias: l.o_b = Buf(D); break;
      case Field::GateBias: l.g_b = Buf(F); break;
      case Field::UpBias: l.u_b = Buf(F); break;
      case Field::DownBias: l.d_b = Buf(D); break;
      case Field::AttnOutNorm: l.attn_out_norm = Buf(D); break;
      case Field::MlpOutNorm: l.mlp_out_norm = Buf(D); break;
      default: break;
    }
  }
  const int64_t widest = std::max({D, F, c.h_q * Dh});
  step_rows_ = std::min<int64_t>(slots_, kMaxStepRows);
  act_scratch_ = ActScratch(wf, nt_, widest, step_rows_);
  // prefill's activation rows as the panels multiply them (act_rows)
  ldx_ = kern::act_padded(widest);
  const kern::PanelOps& P = simd().panels[kern::panel_index(wf)];
  if (P.act == kern::ACT_BF16_BITS) xb_ = ABuf<uint16_t>(PREFILL_BLOCK * ldx_);
  if (P.act == kern::ACT_Q8) {
    xq_ = ABuf<int8_t>(PREFILL_BLOCK * ldx_);
    xs_ = Buf(PREFILL_BLOCK * (ldx_ / RESIDENT_INT8_BLOCK));
  }
  ws_bytes_ = (P.ws_bytes(widest) + 63) / 64 * 64;
  ws_ = ABuf<char>(ws_bytes_ * nt_);
  staging_ = Buf(std::max(STAGE_ELEMS, widest));
  row_tmp_ = ABuf<char>(row_tmp_bytes(widest) * nt_);
  slot_elems_ = residentk_cache_elements(c.n_layers, c.h_kv, Dh, cap_);
  kv_ = KvCache(c.kv, slot_elems_ * slots_);

  // RoPE tables: cos (T, hw) then sin (T, hw), rotate-half pairing (i, i + Dh/2); the local
  // one only where sliding layers have a base of their own.
  const auto table = [&](bool local) {
    const std::vector<float> r = rope_table(c, cap_, local);
    Buf b(int64_t(r.size()));
    std::memcpy(b.p, r.data(), r.size() * sizeof(float));
    return b;
  };
  rope_ = table(false);
  if (c.rope_local_theta > 0.0) rope_local_ = table(true);
  rope_hw_ = std::max<int64_t>(Dh / 2, 1);
  for (int64_t li = 0; li < c.n_layers; ++li) {
    Layer& l = layers_[size_t(li)];
    l.slides = c.layer_slides(li);
    l.rope = layer_rope_local(c, li) ? rope_local_.p : rope_.p;
  }

  // a decode step's rows (step_rows_ of them at most)
  x_ = Buf(step_rows_ * D);
  xf_ = Buf(step_rows_ * D);
  qkv_ = Buf(step_rows_ * q_rows_);
  attn_ = Buf(step_rows_ * c.h_q * Dh);
  sub_ = Buf(step_rows_ * D);
  act_buf_ = Buf(step_rows_ * F);
  logits_ = Buf(c.vocab);
  scratch_ = Buf(int64_t(nt_) * step_rows_ * std::max(D, F));
  gate_up_ = Buf(int64_t(nt_) * 2 * step_rows_ * kMaxTaskRows);
  // a thread's attention scores: a KV head's query heads (up to kMaxAttendQueries at once)
  score_rows_ = std::min<int64_t>(c.h_q / c.h_kv, kMaxAttendQueries);
  scores_ = Buf(int64_t(nt_) * score_rows_ * cap_);
}

// Norms: straight into their resident buffer. Matrices: rows staged as float32 a bounded run
// at a time, then converted and put into their panels.
float* CpuSession::stage_weight(const TensorSpec& t, int64_t, int64_t) {
  if (float* v = vec_dest(t)) return v;
  return staging_.p;
}
void CpuSession::commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) {
  if (vec_dest(t)) return;
  const MatDest d = mat_dest(t);
  const int64_t bad = store_rows(*d.m, d.row0 + r0, staging_.p, r1 - r0, row_tmp_.p, nt_);
  if (bad >= 0) refuse_past_range(t.name, d.m->f, staging_.p[bad], r0 * t.cols() + bad);
}

// The float32 buffer a norm's weight lives in; null for a matrix.
float* CpuSession::vec_dest(const TensorSpec& t) {
  Layer* l = t.layer >= 0 ? &layers_[size_t(t.layer)] : nullptr;
  const int64_t Dh = c_.d_head;
  switch (t.field) {
    case Field::FinalNorm: return final_norm_.p;
    case Field::InNorm: return l->in_norm.p;
    case Field::QNorm: return l->q_norm.p;
    case Field::KNorm: return l->k_norm.p;
    case Field::PostNorm: return l->post_norm.p;
    case Field::QBias: return l->qkv_b.p;
    case Field::KBias: return l->qkv_b.p + c_.h_q * Dh;
    case Field::VBias: return l->qkv_b.p + (c_.h_q + c_.h_kv) * Dh;
    case Field::OBias: return l->o_b.p;
    case Field::GateBias: return l->g_b.p;
    case Field::UpBias: return l->u_b.p;
    case Field::DownBias: return l->d_b.p;
    case Field::AttnOutNorm: return l->attn_out_norm.p;
    case Field::MlpOutNorm: return l->mlp_out_norm.p;
    default: return nullptr;
  }
}
CpuSession::MatDest CpuSession::mat_dest(const TensorSpec& t) {
  const int64_t Dh = c_.d_head;
  Layer* l = t.layer >= 0 ? &layers_[size_t(t.layer)] : nullptr;
  switch (t.field) {
    case Field::Embed: return {&embed_, 0};
    case Field::LmHead: return {&head_, 0};
    case Field::QProj: return {&l->wqkv, 0};
    case Field::KProj: return {&l->wqkv, c_.h_q * Dh};
    case Field::VProj: return {&l->wqkv, (c_.h_q + c_.h_kv) * Dh};
    case Field::OProj: return {&l->wo, 0};
    case Field::Gate: return {&l->wg, 0};
    case Field::Up: return {&l->wu, 0};
    case Field::Down: return {&l->wd, 0};
    default: return {nullptr, 0};
  }
}

// Positions [0, n) of slot src's KV region to dst's, every (layer, head) a run, bits as stored.
void CpuSession::run_copy_prefix(int64_t src, int64_t dst, int64_t n) {
  const int64_t Dh = c_.d_head;
#pragma omp parallel for collapse(2) num_threads(team(n * Dh * c_.n_layers * c_.h_kv * 2))
  for (int64_t l = 0; l < c_.n_layers; ++l)
    for (int64_t h = 0; h < c_.h_kv; ++h) {
      const int64_t off = h * cap_ * Dh;
      kv_.copy(kcache(dst, l) + off, kcache(src, l) + off, n * Dh);
      kv_.copy(vcache(dst, l) + off, vcache(src, l) + off, n * Dh);
    }
}

// Weight rows per task of one decode row's product over N rows: two panel blocks where that
// still leaves every thread four tasks (so a descheduled thread's share is taken over), one
// otherwise. Two blocks let AVX-512's int8 tile read eight panels, eight streams, at once
// (kernels' Q8_DECODE_PANELS); for the other formats the task size made no difference beyond
// noise (perf/RESULTS.md). Task bounds never change a cell's bits.
int64_t CpuSession::step_task_rows(int64_t N) const {
  const int64_t two = 2 * kern::PANEL_ROWS;
  return N >= 4 * int64_t(nt_) * two ? two : kern::PANEL_ROWS;
}

// Weight rows per task of a prefill projection over N rows, whole panel blocks: packing the
// activation rows costs <1% of the FLOPs at 256, but a narrow matrix needs about four tasks a
// thread or one thread finishes a task behind the other. Task bounds never change a cell's
// bits.
int64_t CpuSession::task_rows(int64_t N) const {
  const int64_t q = kern::PANEL_ROWS;
  const int64_t per_task = ((N + 4 * nt_ - 1) / (4 * nt_) + q - 1) / q * q;
  return std::clamp<int64_t>(per_task, q, kMaxTaskRows);
}

}  // namespace cpu_engine

std::unique_ptr<Session> make_cpu_session(const SessionConfig& cfg, int64_t max_ctx,
                                          int64_t slots) {
  return std::unique_ptr<Session>(new cpu_engine::CpuSession(cfg, max_ctx, slots));
}

}  // namespace residentk
}  // namespace algenta

// The CPU resident-session engine's declarations (session_cpu.cpp says what the engine
// computes, stage by stage, and its numerics): the resident buffers (ABuf, the weight Arena in
// huge pages, WMat a weight matrix as the instruction set's panels, KvCache, ActScratch the
// per-thread activation vectors prepared for the panels), the layer record, the engine's
// constants, and the CpuSession class, whose members are defined by job:
//   session_cpu.cpp            opening, weight placement, the KV prefix copy, task sizes
//   session_cpu_decode.cpp     a decode step (one row, or several slots' rows at once)
//   session_cpu_prefill.cpp    prefill blocks as GEMMs on the same panels
//   session_cpu_attention.cpp  q/k norm + RoPE + KV write, causal attention over the cache
//   session_cpu_hooks.cpp      the test hooks and the read-bandwidth probe
// The small helpers every stage calls stay here, inline. Internal to the engine: included only
// by those files.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "algenta/buffer.hpp"
#include "algenta/half.hpp"
#include "algenta/kernels.hpp"
#include "algenta/quant.hpp"
#include "algenta/residentk.hpp"
#include "algenta/session_base.hpp"
#include "algenta/session_math.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {
namespace cpu_engine {

// The decode primitives of the instruction set the GEMM kernels use (host support, or
// ALGENTA_ISA), from the same dispatch table, so one variable pins both.
using Simd = kern::SessionOps;
inline const Simd& simd() { return *kern::isa().session; }

// 64-byte aligned buffer of n T: weight rows of a multiple-of-64-byte length then never
// straddle a cache line at their start, and SIMD loads of them never split.
template <class T>
struct ABuf {
  T* p = nullptr;
  int64_t n = 0;
  ABuf() = default;
  explicit ABuf(int64_t count) : n(count) {
    const size_t bytes = ((size_t(count) * sizeof(T)) + 63) / 64 * 64;
    p = static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64));
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
  }
  // n T at p, owned by someone else (the weight arena)
  static ABuf view(T* at, int64_t count) {
    ABuf b;
    b.p = at, b.n = count, b.own = false;
    return b;
  }
  ABuf(const ABuf&) = delete;
  ABuf& operator=(const ABuf&) = delete;
  ABuf(ABuf&& o) noexcept : p(o.p), n(o.n), own(o.own) { o.p = nullptr; o.n = 0; }
  ABuf& operator=(ABuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    std::swap(own, o.own);
    return *this;
  }
  ~ABuf() {
    if (own) std::free(p);
  }

 private:
  bool own = true;
};
using Buf = ABuf<float>;

// Every resident weight matrix in one allocation, 2 MiB aligned and advised into transparent
// huge pages (huge_malloc): a decode step streams every weight once, and in 4 KiB pages each
// page edge stops the hardware prefetcher and costs a TLB walk (perf/RESULTS.md has what huge
// pages gave decode). One allocation rounds up to a whole huge page once, not once per matrix.
// Matrices start at 64-byte offsets.
struct Arena {
  char* base = nullptr;
  size_t cap = 0, used = 0;
  static size_t span(size_t bytes) { return (bytes + 63) / 64 * 64; }
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { std::free(base); }
  void open(size_t bytes) {
    base = static_cast<char*>(huge_malloc(bytes ? bytes : 64));
    cap = bytes;
    std::memset(base, 0, bytes);
  }
  template <class T>
  ABuf<T> take(int64_t n) {
    T* at = reinterpret_cast<T*>(base + used);
    used += span(size_t(n) * sizeof(T));
    if (used > cap) throw std::logic_error("weight arena sized too small");  // a bug, not input
    return ABuf<T>::view(at, n);
  }
};

// Per-thread room for up to `rows` activation vectors prepared as the weight format's panels
// multiply them (SessionOps::round_bf16 / quantize_q8), each up to `widest` values.
struct ActScratch {
  Dtype f = Dtype::F32;
  int64_t stride = 0;  // elements a row takes (act_padded(widest))
  int64_t per = 0;     // elements a thread's rows take
  ABuf<int8_t> q;
  ABuf<uint16_t> b;
  Buf s, r;
  ActScratch() = default;
  ActScratch(Dtype fmt, int nt, int64_t widest, int64_t rows)
      : f(fmt),
        stride(kern::act_padded(widest)),
        per(rows * stride) {
    if (kern::act_q8(f)) {
      q = ABuf<int8_t>(nt * per);
      s = Buf(nt * (per / RESIDENT_INT8_BLOCK));
    } else if (f == Dtype::BF16) {
      b = ABuf<uint16_t>(nt * per);
      r = Buf(nt * per);
    }
  }
  // The M rows of X (n values each, ldx apart), prepared by thread t for its own products.
  kern::PanelAct prepare(const Simd& S, const float* X, int64_t M, int64_t n, int64_t ldx,
                         int t) const {
    kern::PanelAct a;
    const int64_t lds = stride / RESIDENT_INT8_BLOCK;
    a.ld = stride, a.lds = lds;
    if (f == Dtype::BF16) {
      uint16_t* bt = b.p + t * per;
      float* rt = r.p + t * per;
      for (int64_t m = 0; m < M; ++m)
        S.round_bf16(X + m * ldx, n, bt + m * stride, rt + m * stride);
      a.f = rt, a.b = bt;
    } else if (kern::act_q8(f)) {
      int8_t* qt = q.p + t * per;
      float* st = s.p + t * (per / RESIDENT_INT8_BLOCK);
      for (int64_t m = 0; m < M; ++m) S.quantize_q8(X + m * ldx, n, qt + m * stride, st + m * lds);
      a.q = qt, a.s = st;
    } else {
      a.f = X, a.ld = ldx;
    }
    return a;
  }
};

// One resident weight matrix (rows, cols) in the session's format, as the instruction set's
// panels (kernels.hpp): ceil(rows / PANEL_ROWS) blocks carved out of the weight arena, each
// row put into its place once at load, and every product of it, prefill's and decode's, run
// by the same PanelOps::gemm, so a cell's bits never depend on how many tokens are multiplied.
struct WMat {
  Dtype f = Dtype::F32;
  int64_t rows = 0, cols = 0, block_bytes = 0;
  char* p = nullptr;
  WMat() = default;
  // (arena null: only count its bytes into *need)
  WMat(Dtype fmt, int64_t r, int64_t c, Arena* arena, size_t* need = nullptr)
      : f(fmt), rows(r), cols(c), block_bytes(ops().block_bytes(c)) {
    const int64_t bytes = (r + kern::PANEL_ROWS - 1) / kern::PANEL_ROWS * block_bytes;
    if (need) {
      *need += Arena::span(size_t(bytes));
      return;
    }
    p = arena->take<char>(bytes).p;
  }
  const kern::PanelOps& ops() const { return simd().panels[kern::panel_index(f)]; }
  char* block(int64_t o) const { return p + (o / kern::PANEL_ROWS) * block_bytes; }
  // row o from its format's storage (float32, half bits, or int8 codes with block scales)
  void put_row(int64_t o, const void* row, const float* scales) {
    ops().put_row(block(o), cols, o % kern::PANEL_ROWS, row, scales);
  }
  // row o widened to float32 in d (cols)
  void get_row(int64_t o, float* d) const {
    ops().get_row(block(o), cols, o % kern::PANEL_ROWS, d);
  }
  // Y[m, o - r0] (+)= row o . X[m] for M activation rows and o in [r0, r1), r0 a multiple of
  // PANEL_ROWS; Y rows ldy apart. ws: the thread's ws_bytes(cols) bytes.
  void gemm(int64_t M, const kern::PanelAct& X, int64_t r0, int64_t r1, float* Y, int64_t ldy,
            bool accumulate, void* ws) const {
    ops().gemm(M, r1 - r0, cols, X, block(r0), Y, ldy, accumulate, ws);
  }
};

// The KV cache, one allocation in the session's KV format: layer l's K at element l * 2S, its V
// S further (S = Hkv * T * Dh), each laid out (Hkv, T, Dh) so one head's keys stream
// contiguously; float32 values, or bf16/f16 bits rounded once when a position is written
// (session_math::kv_narrow) and widened exactly as attention reads them.
struct KvCache {
  Dtype f = Dtype::F32;
  Buf f32;
  ABuf<uint16_t> h16;
  KvCache() = default;
  KvCache(Dtype fmt, int64_t elems) : f(fmt) {
    if (f == Dtype::F32)
      f32 = Buf(elems);
    else
      h16 = ABuf<uint16_t>(elems);
  }
  // the row of n values at element o <- v
  void store(int64_t o, const float* v, int64_t n) {
    if (f == Dtype::F32) {
      std::memcpy(f32.p + o, v, size_t(n) * sizeof(float));
      return;
    }
    for (int64_t i = 0; i < n; ++i) h16.p[o + i] = session_math::kv_narrow(f, v[i]);
  }
  // the n values at element dst <- the n at src (the bits as stored)
  void copy(int64_t dst, int64_t src, int64_t n) {
    if (f == Dtype::F32)
      std::memcpy(f32.p + dst, f32.p + src, size_t(n) * sizeof(float));
    else
      std::memcpy(h16.p + dst, h16.p + src, size_t(n) * sizeof(uint16_t));
  }
  // Queries against the rows [j0, j1) of one head whose row 0 is at o (SessionOps::kv_dots /
  // kv_axpys): each query's bits the same alone or in any group.
  void dots(const Simd& S, const float* const* q, int nq, int64_t o, int64_t n, int64_t j0,
            int64_t j1, float* s, int64_t lds) const {
    S.kv_dots(f, q, nq, at(o), n, j0, j1, s, lds);
  }
  void axpys(const Simd& S, const float* p, int64_t ldp, int nq, int64_t o, int64_t n,
             int64_t j0, int64_t j1, float* const* out) const {
    S.kv_axpys(f, p, ldp, nq, at(o), n, j0, j1, out);
  }
  const void* at(int64_t o) const {
    return f == Dtype::F32 ? static_cast<const void*>(f32.p + o) : h16.p + o;
  }
};

// [r0, r1) of `rows` for thread t of nt, contiguous.
inline void split(int64_t rows, int t, int nt, int64_t& r0, int64_t& r1) {
  const int64_t base = rows / nt, extra = rows % nt;
  r0 = t * base + std::min<int64_t>(t, extra);
  r1 = r0 + base + (t < extra ? 1 : 0);
}

// Inside a parallel region: fn(r0, r1) over [0, rows) in chunks of `chunk` rows (whole panel
// blocks; one or two for a single decode row, CpuSession::step_task_rows) handed out
// dynamically. Each row still has exactly one owner and one reduction order (bits never depend
// on the schedule), but a thread that the OS deschedules on a shared machine no longer holds a
// fixed half of every matvec hostage: the running ones take its chunks.
template <class Fn>
inline void rows_dynamic(int64_t rows, int64_t chunk, Fn&& fn) {
  const int64_t tasks = (rows + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) fn(t * chunk, std::min(rows, (t + 1) * chunk));
}

// out (n) = w (n) * (x (n) * 1/sqrt(mean(x^2) + eps)), as transformers' Qwen3RMSNorm.
inline void rmsnorm(const float* x, const float* w, int64_t n, double eps, float* out) {
  const double ss = simd().sum_sq(x, n);
  const float inv = session_math::rms_inv(ss, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = session_math::rms_apply(x[i], w[i], inv);
}

struct Layer {
  Buf in_norm;     // (D)
  WMat wqkv;       // (Q, D): q_proj rows, then k_proj, then v_proj
  Buf q_norm;      // (Dh)
  Buf k_norm;      // (Dh)
  WMat wo;         // (D, Hq*Dh)
  Buf post_norm;   // (D) the norm before the MLP
  WMat wg, wu;     // (F, D)
  WMat wd;         // (D, F)
  // What a family adds (model_tensors), each null when the model has none: biases (float32,
  // as norms), the sandwich norms on the attention and MLP outputs.
  Buf qkv_b, o_b, g_b, u_b, d_b;  // (Q), (D), (F), (F), (D)
  Buf attn_out_norm, mlp_out_norm;  // (D)
  bool slides = false;        // attention sees the last sliding_window keys
  const float* rope = nullptr;  // this layer's RoPE table (global or local)
};

constexpr int64_t PREFILL_BLOCK = 256;
// Sequences one decode pass multiplies at once: past 16 rows a batched step is compute-bound
// on every format here, and the per-thread buffers grow with it; more sequences step in groups.
constexpr int64_t kMaxStepRows = 16;
// Queries one prefill attention pass takes against a KV head's rows (attend_rows): the G heads
// of RB = 8 / G rows, or 8 of one row's heads at a time where G > 8.
constexpr int kMaxAttendQueries = 8;
// The most weight rows one task of a GEMM takes (task_rows).
constexpr int64_t kMaxTaskRows = 256;
// float32 elements of the staging buffer a tensor's rows arrive in at load (at least one row)
constexpr int64_t STAGE_ELEMS = int64_t(1) << 20;
// 256 KiB of float32: what one core streams in the few microseconds a fork/join costs.
constexpr int64_t PARALLEL_MIN_FLOATS = int64_t(1) << 16;

class CpuSession final : public SessionBase {
 public:
  CpuSession(const SessionConfig& c, int64_t max_ctx, int64_t slots);

  const char* device() const override { return "cpu"; }

 protected:
  // Loading and the KV prefix copy (session_cpu.cpp)
  float* stage_weight(const TensorSpec& t, int64_t, int64_t) override;
  void commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) override;
  int64_t weight_chunk_elems() const override { return STAGE_ELEMS; }
  void run_copy_prefix(int64_t src, int64_t dst, int64_t n) override;
  // Prefill (session_cpu_prefill.cpp)
  void run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) override;
  // Decode (session_cpu_decode.cpp)
  void run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                      float* logits) override;
  void run_step(int64_t id, float* logits) override { tuned_decode(0, id, logits); }
  void tuned_decode(int64_t slot, int64_t id, float* logits);
  int64_t run_step_greedy(int64_t id) override;

 private:
  // ---- weight placement (session_cpu.cpp) ----
  float* vec_dest(const TensorSpec& t);
  // The matrix a table entry's rows land in and its first row there (q, k and v share the
  // fused wqkv rows).
  struct MatDest {
    WMat* m;
    int64_t row0;
  };
  MatDest mat_dest(const TensorSpec& t);

  const WMat& head() const { return c_.tie_word_embeddings ? embed_ : head_; }
  // Element offsets in kv_ of slot s's layer l's K (Hkv, T, Dh) and V (Hkv, T, Dh): each slot
  // one contiguous region of slot_elems_.
  int64_t kcache(int64_t s, int64_t l) const {
    return s * slot_elems_ + l * 2 * c_.h_kv * cap_ * c_.d_head;
  }
  int64_t vcache(int64_t s, int64_t l) const {
    return kcache(s, l) + c_.h_kv * cap_ * c_.d_head;
  }

  // ---- attention (session_cpu_attention.cpp) ----
  void norm_rope(float* h, const float* b, const float* w, const float* rope, int64_t p) const;
  void head_rope_store(const Layer& L, int64_t Kc, int64_t Vc, int64_t h, float* v, int64_t p);
  int64_t first_key(const Layer& L, int64_t n) const;
  void softmax_weights(const Simd& S, float* s, int64_t n) const;
  void attend_rows(const Simd& S, const Layer& L, const float* QKV, int64_t Kc, int64_t Vc,
                   int64_t g, int64_t r0, int64_t r1, int64_t p0, float* s, float* A) const;

  // ---- what every stage calls ----
  // Threads for a stage touching `work` floats: waking a second thread and meeting it at the
  // closing barrier costs microseconds (far more on a loaded machine, where the woken thread
  // may wait a scheduler tick), so a stage too small to repay that runs as a team of one. Bits
  // do not change: a cell's owner and reduction order never depend on the team size.
  int team(int64_t work) const { return work >= PARALLEL_MIN_FLOATS ? cur_nt_ : 1; }

  // out (n) = act(g + bg) * (u + bu) for gate rows [j0, j0 + n) (out may be g), biases where
  // the family has them, through the vectorized kernels.
  void gate(const Simd& S, const float* g, const float* u, const Layer& L, int64_t j0, int64_t n,
            float* out) const {
    const float* gb = L.g_b.p ? L.g_b.p + j0 : nullptr;
    const float* ub = L.u_b.p ? L.u_b.p + j0 : nullptr;
    (act_ == Act::GeluTanh ? S.gelu_mul : S.silu_mul)(g, u, gb, ub, out, n);
  }
  // Whether a projection's output goes straight onto the residual (the panel GEMM accumulating
  // into x, Qwen3's path), or through Y with a bias or a sandwich norm first.
  bool direct(const Buf& bias) const { return !bias.p && !sandwich_; }
  // Columns [j0, j1) of M rows of a projection's output Y (ld apart) onto the residual X (ld
  // apart): X += Y + b without a sandwich norm; with one, Y += b only (out_norm_add finishes).
  void bias_add(float* X, float* Y, int64_t ld, int64_t M, const float* b, int64_t j0,
                int64_t j1) const {
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = j0; j < j1; ++j) {
        const float y = b ? Y[r * ld + j] + b[j] : Y[r * ld + j];
        if (sandwich_)
          Y[r * ld + j] = y;
        else
          X[r * ld + j] += y;
      }
  }
  // Row r of a sandwich family's sublayer output Y: X += rmsnorm(Y, w), Y overwritten.
  void out_norm_add(float* X, float* Y, const float* w, int64_t r) const {
    const int64_t D = c_.d_model;
    rmsnorm(Y + r * D, w, D, c_.rms_eps, Y + r * D);
    for (int64_t j = 0; j < D; ++j) X[r * D + j] += Y[r * D + j];
  }
  // Logits [j0, j1) of M rows (ld apart) soft-capped where the family caps them.
  void cap_logits(const Simd& S, float* Z, int64_t ld, int64_t M, int64_t j0, int64_t j1) const {
    const float cap = float(c_.final_softcap);
    if (!(cap > 0.f)) return;
    for (int64_t r = 0; r < M; ++r) S.softcap(Z + r * ld + j0, j1 - j0, cap);
  }
  // Row id of the embedding into x (D), scaled where the family scales it.
  void embed_row(int64_t id, float* x) const {
    embed_.get_row(id, x);
    if (embed_scale_ > 0.f)
      for (int64_t j = 0; j < c_.d_model; ++j) x[j] *= embed_scale_;
  }

  // M rows of X (n values, ldx apart) as this session's matrices consume them, prepared by
  // thread t for its own products.
  kern::PanelAct input(const Simd& S, const float* X, int64_t M, int64_t n, int64_t ldx,
                       int t) const {
    return act_scratch_.prepare(S, X, M, n, ldx, t);
  }
  // Thread t's scratch for a panel product.
  void* ws(int t) const { return ws_.p + int64_t(t) * ws_bytes_; }
  // Thread t's room for M normed rows (up to max(D, F) values each).
  float* normed(int t) const {
    return scratch_.p + int64_t(t) * step_rows_ * std::max(c_.d_model, c_.d_ff);
  }

  // ---- task sizes (session_cpu.cpp) ----
  int64_t step_task_rows(int64_t N) const;
  int64_t task_rows(int64_t N) const;

  // ---- decode (session_cpu_decode.cpp) ----
  void decode_rows(const int64_t* slot, const int64_t* ids, int64_t M, float* logits);

  // ---- prefill (session_cpu_prefill.cpp) ----
  void head_logits(const Simd& S, float* logits);
  kern::PanelAct act_rows(const Simd& S, const float* X, int64_t M, int64_t n, float* pack);
  void project(const kern::PanelAct& a, int64_t M, const WMat& W, float* Y, bool accumulate);
  void as_consumed(float* X, int64_t M, int64_t n) const;
  void prefill_block(int64_t slot, const int64_t* ids, int64_t M, int64_t p0, float* logits);

  int64_t q_rows_ = 0, rope_hw_ = 1;
  // the family (arch_spec) as this engine applies it
  Act act_ = Act::Silu;
  bool sandwich_ = false, qk_norm_ = true;
  float embed_scale_ = 0.f;  // 0: embeddings unscaled
  float attn_scale_ = 1.f;
  int64_t step_rows_ = 1;  // sequences one decode pass carries: min(slots, kMaxStepRows)
  int nt_ = 1;       // threads prefill uses, omp_get_max_threads() at construction
  int cur_nt_ = 1;   // threads the decode step in flight uses (1 or nt_)
  int choice_ = 1;   // 1: decode with nt_ threads, 0: with one
  double ema_[2] = {0.0, 0.0};  // smoothed seconds per decode token, team of one / of nt_
  int64_t tokens_ = 0, next_probe_ = 2, probe_every_ = 16;
  Arena arena_;  // every WMat's storage; declared first of them, so freed after them
  WMat embed_, head_;
  Buf final_norm_, rope_, rope_local_;
  KvCache kv_;              // slots_ regions of slot_elems_ (kcache, vcache)
  int64_t slot_elems_ = 0;
  std::vector<Layer> layers_;
  Buf x_, xf_, qkv_, attn_, act_buf_, sub_, logits_, scratch_, scores_;
  int64_t score_rows_ = 1;
  // sub_: a step's sublayer outputs (o_proj, down) where they do not accumulate into x_
  Buf gate_up_;  // each thread's gate and up rows of one task, for a decode step's rows
  Buf staging_;             // a tensor's float32 rows on their way into the panels (load)
  ABuf<char> row_tmp_;      // each thread's converted row on its way (load)
  ActScratch act_scratch_;  // bf16, int8: each thread's prepared activation vector (decode)
  int64_t ldx_ = 0;         // elements a prefill activation row takes in xb_ / xq_
  ABuf<uint16_t> xb_;       // bf16 on vdpbf16ps panels: prefill's activation rows as bits
  ABuf<int8_t> xq_;         // int8: prefill's activation rows quantized,
  Buf xs_;                  //   their block scales
  int64_t ws_bytes_ = 0;    // each thread's panel-product scratch, in ws_
  ABuf<char> ws_;
};

}  // namespace cpu_engine
}  // namespace residentk
}  // namespace algenta

// The CPU resident decode engine: the session's model families with float32 activations,
// OpenMP across cores, SIMD within one; weight matrices resident in float32, bfloat16, float16
// or int8 (SessionConfig::weights) as the instruction set's weight panels (kernels.hpp:
// PanelOps), widened to float32 in registers as they stream or multiplied on bf16 / int8 dot
// products; the KV cache in float32, bfloat16 or float16 (SessionConfig::kv, see KvCache).
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
//
// The registry, the refusals and the position are SessionBase's; this file is the compute and
// the layout of the resident buffers (stage_weight says where each tensor's rows go).
//
// Limits: shapes residentk_shape_check accepts; capacity resident_bucket_ctx(max_ctx) <= 65536.
// OpenMP barriers spin by default: on a machine whose cores are busy with other processes a
// spinning thread holds a core its descheduled partner needs, and each stage can cost a
// scheduler tick. Decode therefore tunes its team size at run time (see step()), and
// OMP_WAIT_POLICY=passive helps further on such machines.
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

namespace {

// The decode primitives of the instruction set the GEMM kernels use (host support, or
// ALGENTA_ISA), from the same dispatch table, so one variable pins both.
using Simd = kern::SessionOps;
const Simd& simd() { return *kern::isa().session; }

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
// page edge stops the hardware prefetcher and costs a TLB walk (measured on Zen 4: decode of a
// 35M-parameter model 1.2-1.6x faster in huge pages, float32 to int8). One allocation rounds up
// to a whole huge page once, not once per matrix. Matrices start at 64-byte offsets.
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
    if (f == Dtype::Int8) {
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
    } else if (f == Dtype::Int8) {
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
  CpuSession(const SessionConfig& c, int64_t max_ctx, int64_t slots)
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

  const char* device() const override { return "cpu"; }

 protected:
  // Norms: straight into their resident buffer. Matrices: rows staged as float32 a bounded run
  // at a time, then converted and put into their panels.
  float* stage_weight(const TensorSpec& t, int64_t, int64_t) override {
    if (float* v = vec_dest(t)) return v;
    return staging_.p;
  }
  void commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) override {
    if (vec_dest(t)) return;
    const MatDest d = mat_dest(t);
    const int64_t bad = store_rows(*d.m, d.row0 + r0, staging_.p, r1 - r0, row_tmp_.p, nt_);
    if (bad >= 0) refuse_past_range(t.name, d.m->f, staging_.p[bad], r0 * t.cols() + bad);
  }
  int64_t weight_chunk_elems() const override { return STAGE_ELEMS; }

  void run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) override {
    for (int64_t b = 0; b < n; b += PREFILL_BLOCK) {
      const int64_t m = std::min(PREFILL_BLOCK, n - b);
      prefill_block(slot, ids + b, m, pos_[slot] + b, b + m == n ? logits : nullptr);
    }
  }

  // One sequence steps with the tuned team (see tuned_decode); several step together in
  // groups of up to step_rows_, each group one pass over the weights with all cores. A row's
  // bits are the bits it gets alone (decode_rows), so a sequence's logits do not depend on
  // its company or on how the batch was grouped.
  void run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                      float* logits) override {
    if (B == 1) return tuned_decode(slots[0], ids[0], logits);
    cur_nt_ = nt_;
    for (int64_t b0 = 0; b0 < B; b0 += step_rows_) {
      const int64_t m = std::min(step_rows_, B - b0);
      decode_rows(slots + b0, ids + b0, m, logits + b0 * c_.vocab);
    }
  }

  void run_copy_prefix(int64_t src, int64_t dst, int64_t n) override {
    const int64_t Dh = c_.d_head;
#pragma omp parallel for collapse(2) num_threads(team(n * Dh * c_.n_layers * c_.h_kv * 2))
    for (int64_t l = 0; l < c_.n_layers; ++l)
      for (int64_t h = 0; h < c_.h_kv; ++h) {
        const int64_t off = h * cap_ * Dh;
        kv_.copy(kcache(dst, l) + off, kcache(src, l) + off, n * Dh);
        kv_.copy(vcache(dst, l) + off, vcache(src, l) + off, n * Dh);
      }
  }

  void run_step(int64_t id, float* logits) override { tuned_decode(0, id, logits); }

  void tuned_decode(int64_t slot, int64_t id, float* logits) {
    // Team-size tuning: decode with the team size that has been faster, and now and then try
    // the other one. On an idle machine all cores win (more read bandwidth); on one whose cores
    // are busy with other processes a team of one can be many times faster, because every
    // stage's barrier waits for a thread the OS may not run for a scheduler tick. Logits are
    // bit-identical either way (tests/test_residentk_session.py checks thread counts).
    const bool probing = nt_ > 1 && tokens_ >= next_probe_;
    const int use = probing ? 1 - choice_ : choice_;
    cur_nt_ = use ? nt_ : 1;
    const double t0 = omp_get_wtime();
    decode_rows(&slot, &id, 1, logits);
    const double dt = omp_get_wtime() - t0;
    if (probing) {
      if (ema_[choice_] <= 0.0 || dt < ema_[choice_]) {
        choice_ = use;
        probe_every_ = 16;
      } else {
        probe_every_ = std::min<int64_t>(probe_every_ * 2, 1024);  // a losing probe backs off
      }
      next_probe_ = tokens_ + probe_every_;
    }
    ema_[use] = ema_[use] <= 0.0 ? dt : 0.75 * ema_[use] + 0.25 * dt;
    ++tokens_;
  }

  int64_t run_step_greedy(int64_t id) override {
    run_step(id, logits_.p);
    return greedy_argmax(logits_.p, c_.vocab);
  }

 private:
  // The float32 buffer a norm's weight lives in; null for a matrix.
  float* vec_dest(const TensorSpec& t) {
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
  // The matrix a table entry's rows land in and its first row there (q, k and v share the
  // fused wqkv rows).
  struct MatDest {
    WMat* m;
    int64_t row0;
  };
  MatDest mat_dest(const TensorSpec& t) {
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

  const WMat& head() const { return c_.tie_word_embeddings ? embed_ : head_; }
  // Element offsets in kv_ of slot s's layer l's K (Hkv, T, Dh) and V (Hkv, T, Dh): each slot
  // one contiguous region of slot_elems_.
  int64_t kcache(int64_t s, int64_t l) const {
    return s * slot_elems_ + l * 2 * c_.h_kv * cap_ * c_.d_head;
  }
  int64_t vcache(int64_t s, int64_t l) const {
    return kcache(s, l) + c_.h_kv * cap_ * c_.d_head;
  }

  // In place on one head vector h (Dh): its bias b (or none), per-head RMSNorm with w where the
  // family has one, then rotate-half RoPE at p from table `rope`.
  void norm_rope(float* h, const float* b, const float* w, const float* rope, int64_t p) const {
    const int64_t Dh = c_.d_head, half = Dh / 2;
    if (b)
      for (int64_t i = 0; i < Dh; ++i) h[i] += b[i];
    if (qk_norm_) rmsnorm(h, w, Dh, c_.rms_eps, h);
    const float* cs = rope + p * rope_hw_;
    const float* sn = rope + cap_ * rope_hw_ + p * rope_hw_;
    for (int64_t i = 0; i < half; ++i)
      session_math::rope_pair(h[i], h[i + half], cs[i], sn[i], &h[i], &h[i + half]);
  }

  // Head h of one position's fused q|k|v vector v (Dh) at position p: a query head is normed
  // and rotated in place; a key head is too, then written to its KV slot; a value head is
  // written as is. Decode and prefill both go through here, so the cache holds the same bits.
  void head_rope_store(const Layer& L, int64_t Kc, int64_t Vc, int64_t h, float* v,
                       int64_t p) {
    const int64_t Hq = c_.h_q, Hkv = c_.h_kv, Dh = c_.d_head;
    const float* b = L.qkv_b.p ? L.qkv_b.p + h * Dh : nullptr;
    if (h < Hq) {
      norm_rope(v, b, L.q_norm.p, L.rope, p);
    } else if (h < Hq + Hkv) {
      norm_rope(v, b, L.k_norm.p, L.rope, p);
      kv_.store(Kc + ((h - Hq) * cap_ + p) * Dh, v, Dh);
    } else {
      if (b)
        for (int64_t i = 0; i < Dh; ++i) v[i] += b[i];
      kv_.store(Vc + ((h - Hq - Hkv) * cap_ + p) * Dh, v, Dh);
    }
  }

  // The first key a query at position n - 1 sees: n - sliding_window on a sliding layer, else 0.
  int64_t first_key(const Layer& L, int64_t n) const {
    return L.slides && n > c_.sliding_window ? n - c_.sliding_window : 0;
  }
  // One query's raw dot products s (n) with its keys -> its softmax weights, in place: scaled,
  // soft-capped where the family caps them, then SessionOps::softmax.
  void softmax_weights(const Simd& S, float* s, int64_t n) const {
    const float scale = attn_scale_, cap = float(c_.attn_softcap);
    for (int64_t j = 0; j < n; ++j) s[j] = s[j] * scale;
    if (cap > 0.f) S.softcap(s, n, cap);
    S.softmax(s, n);
  }

  // out (Dh) = softmax(q . K[lo..n) * scale) V[lo..n) for the queries of rows [r0, r1) (positions
  // p0 + r; a decode step's one row: r0 = 0, r1 = 1) in the G query heads that share KV head g,
  // up to kMaxAttendQueries at once reading the keys and values once for all of them
  // (SessionOps::kv_dots / kv_axpys): each query's products, sums and their order its own,
  // whatever group it is in. s: room for min(G (r1 - r0), kMaxAttendQueries) rows of p0 + r1
  // scores.
  void attend_rows(const Simd& S, const Layer& L, const float* QKV, int64_t Kc, int64_t Vc,
                   int64_t g, int64_t r0, int64_t r1, int64_t p0, float* s, float* A) const {
    const int64_t Dh = c_.d_head, G = c_.h_q / c_.h_kv, HD = c_.h_q * Dh;
    const int64_t K = Kc + g * cap_ * Dh, V = Vc + g * cap_ * Dh, total = (r1 - r0) * G;
    for (int64_t t0 = 0; t0 < total; t0 += kMaxAttendQueries) {
      const int nq = int(std::min<int64_t>(kMaxAttendQueries, total - t0));
      const float* q[kMaxAttendQueries];
      float* out[kMaxAttendQueries];
      int64_t lo[kMaxAttendQueries], hi[kMaxAttendQueries];
      for (int t = 0; t < nq; ++t) {  // row-major: lo and hi never decrease with t
        const int64_t r = r0 + (t0 + t) / G, h = g * G + (t0 + t) % G;
        q[t] = QKV + r * q_rows_ + h * Dh;
        out[t] = A + r * HD + h * Dh;
        hi[t] = p0 + r + 1;
        lo[t] = first_key(L, hi[t]);
      }
      // the keys any of them sees [j0, j1), and those all of them see [c0, c1)
      const int64_t j0 = lo[0], j1 = hi[nq - 1], c0 = lo[nq - 1], c1 = hi[0], ld = j1 - j0;
      kv_.dots(S, q, nq, K, Dh, j0, j1, s, ld);
      for (int t = 0; t < nq; ++t) {
        softmax_weights(S, s + t * ld + (lo[t] - j0), hi[t] - lo[t]);
        std::fill(out[t], out[t] + Dh, 0.f);
      }
      // each query's keys in order: those before the common part alone, the common part
      // together, the rest alone
      const bool common = c0 < c1;
      for (int t = 0; t < nq; ++t)
        kv_.axpys(S, s + t * ld + (lo[t] - j0), ld, 1, V, Dh, lo[t], common ? c0 : hi[t],
                  &out[t]);
      if (!common) continue;
      kv_.axpys(S, s + (c0 - j0), ld, nq, V, Dh, c0, c1, out);
      for (int t = 0; t < nq; ++t)
        kv_.axpys(S, s + t * ld + (c1 - j0), ld, 1, V, Dh, c1, hi[t], &out[t]);
    }
  }

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

  // One decode step of M <= step_rows_ sequences: row r appends ids[r] to slot slot[r] at its
  // position; logits (M, V). The stages residentk_dispatch_budget counts, each ONE parallel
  // region whatever M is: every thread norms and prepares all M rows itself (M x D values,
  // no barrier), then the weight rows are shared out and each panel block multiplies all M
  // rows while it is hot, so the weights stream once per step however many sequences step.
  // A cell's bits do not depend on M (PanelOps::gemm), nor on the team size.
  void decode_rows(const int64_t* slot, const int64_t* ids, int64_t M, float* logits) {
    const Simd& S = simd();
    const int64_t D = c_.d_model, Dh = c_.d_head, F = c_.d_ff, Hq = c_.h_q, Hkv = c_.h_kv;
    const int64_t HD = Hq * Dh, V = c_.vocab, heads = Hq + 2 * Hkv;
    int64_t p[kMaxStepRows];
    for (int64_t r = 0; r < M; ++r) p[r] = pos_[slot[r]];
    float *X = x_.p, *QKV = qkv_.p, *A = attn_.p, *Act = act_buf_.p, *XF = xf_.p, *Y = sub_.p;
    int64_t stages = 0;
    // Weight rows per task: one or two panel blocks for one row (a matrix-vector product); for
    // several, prefill's larger tasks, since each task packs the M activation rows once for all
    // of its blocks (64-row tasks cost a third of a 16-row step in packing on Zen 4).
    const auto chunk = [&](int64_t rows) {
      return M == 1 ? step_task_rows(rows) : task_rows(rows);
    };

    for (int64_t r = 0; r < M; ++r) embed_row(ids[r], X + r * D);  // M rows: no team
    ++stages;

    for (int64_t li = 0; li < c_.n_layers; ++li) {
      const Layer& L = layers_[size_t(li)];
#pragma omp parallel num_threads(team(q_rows_ * D))
      {
        const int t = omp_get_thread_num();
        float* xn = normed(t);
        for (int64_t r = 0; r < M; ++r) rmsnorm(X + r * D, L.in_norm.p, D, c_.rms_eps, xn + r * D);
        const kern::PanelAct in = input(S, xn, M, D, D, t);
        rows_dynamic(q_rows_, chunk(q_rows_), [&](int64_t r0, int64_t r1) {
          L.wqkv.gemm(M, in, r0, r1, QKV + r0, q_rows_, false, ws(t));
        });
      }
      ++stages;
#pragma omp parallel for num_threads(team(M * q_rows_ * 4)) schedule(static)
      for (int64_t rh = 0; rh < M * heads; ++rh) {
        const int64_t r = rh / heads, h = rh % heads;
        head_rope_store(L, kcache(slot[r], li), vcache(slot[r], li), h,
                        QKV + r * q_rows_ + h * Dh, p[r]);
      }
      ++stages;
      int64_t span = 0;
      for (int64_t r = 0; r < M; ++r) span += p[r] + 1;
      // the G query heads of a KV head together: its keys and values read once for all of them
#pragma omp parallel for num_threads(team(Hq * span * Dh * 2)) schedule(static)
      for (int64_t rg = 0; rg < M * Hkv; ++rg) {
        const int64_t r = rg / Hkv, g = rg % Hkv;
        attend_rows(S, L, QKV + r * q_rows_, kcache(slot[r], li), vcache(slot[r], li), g, 0, 1,
                    p[r], scores_.p + int64_t(omp_get_thread_num()) * score_rows_ * cap_,
                    A + r * HD);
      }
      ++stages;
#pragma omp parallel num_threads(team(D * HD))
      {
        const int t = omp_get_thread_num();
        const kern::PanelAct in = input(S, A, M, HD, HD, t);
        rows_dynamic(D, chunk(D), [&](int64_t r0, int64_t r1) {
          if (direct(L.o_b)) return L.wo.gemm(M, in, r0, r1, X + r0, D, true, ws(t));
          L.wo.gemm(M, in, r0, r1, Y + r0, D, false, ws(t));
          bias_add(X, Y, D, M, L.o_b.p, r0, r1);
        });
      }
      ++stages;
      if (sandwich_) {
#pragma omp parallel for num_threads(team(M * D)) schedule(static)
        for (int64_t r = 0; r < M; ++r) out_norm_add(X, Y, L.attn_out_norm.p, r);
        ++stages;
      }
#pragma omp parallel num_threads(team(2 * F * D))
      {
        const int t = omp_get_thread_num();
        float* xn = normed(t);
        for (int64_t r = 0; r < M; ++r)
          rmsnorm(X + r * D, L.post_norm.p, D, c_.rms_eps, xn + r * D);
        const kern::PanelAct in = input(S, xn, M, D, D, t);
        const int64_t ck = chunk(F);
        float* g = gate_up_.p + int64_t(t) * 2 * step_rows_ * kMaxTaskRows;
        float* u = g + step_rows_ * kMaxTaskRows;
        rows_dynamic(F, ck, [&](int64_t r0, int64_t r1) {
          // this task's gate and up rows for the M sequences, never stored
          L.wg.gemm(M, in, r0, r1, g, ck, false, ws(t));
          L.wu.gemm(M, in, r0, r1, u, ck, false, ws(t));
          for (int64_t r = 0; r < M; ++r)
            gate(S, g + r * ck, u + r * ck, L, r0, r1 - r0, Act + r * F + r0);
        });
      }
      ++stages;
#pragma omp parallel num_threads(team(D * F))
      {
        const int t = omp_get_thread_num();
        const kern::PanelAct in = input(S, Act, M, F, F, t);
        rows_dynamic(D, chunk(D), [&](int64_t r0, int64_t r1) {
          if (direct(L.d_b)) return L.wd.gemm(M, in, r0, r1, X + r0, D, true, ws(t));
          L.wd.gemm(M, in, r0, r1, Y + r0, D, false, ws(t));
          bias_add(X, Y, D, M, L.d_b.p, r0, r1);
        });
      }
      ++stages;
      if (sandwich_) {
#pragma omp parallel for num_threads(team(M * D)) schedule(static)
        for (int64_t r = 0; r < M; ++r) out_norm_add(X, Y, L.mlp_out_norm.p, r);
        ++stages;
      }
    }

#pragma omp parallel for num_threads(team(M * D)) schedule(static)
    for (int64_t r = 0; r < M; ++r) rmsnorm(X + r * D, final_norm_.p, D, c_.rms_eps, XF + r * D);
    ++stages;
#pragma omp parallel num_threads(team(V * D))
    {
      const int t = omp_get_thread_num();
      const kern::PanelAct in = input(S, XF, M, D, D, t);
      rows_dynamic(V, chunk(V), [&](int64_t r0, int64_t r1) {
        head().gemm(M, in, r0, r1, logits + r0, V, false, ws(t));
        cap_logits(S, logits, V, M, r0, r1);
      });
    }
    ++stages;
    dispatches_ = stages;
  }

  // logits = head . xf_ (the final norm's output, one row) by all threads: prefill's last row.
  void head_logits(const Simd& S, float* logits) {
#pragma omp parallel num_threads(nt_)
    {
      const int t = omp_get_thread_num();
      const kern::PanelAct in = input(S, xf_.p, 1, c_.d_model, c_.d_model, t);
      rows_dynamic(c_.vocab, step_task_rows(c_.vocab), [&](int64_t r0, int64_t r1) {
        head().gemm(1, in, r0, r1, logits + r0, 0, false, ws(t));
        cap_logits(S, logits, 0, 1, r0, r1);
      });
    }
  }

  // Weight rows per task of one decode row's product over N rows: two panel blocks where that
  // still leaves every thread four tasks (so a descheduled thread's share is taken over), one
  // otherwise. Two blocks let AVX-512's int8 tile read eight panels, eight streams, at once
  // (kernels' Q8_DECODE_PANELS); for the other formats the task size was measured neutral (Zen 4,
  // bf16 and f16 steps, 64- and 128-row tasks alternated in one process: within 1-6%, the
  // larger ahead). Task bounds never change a cell's bits.
  int64_t step_task_rows(int64_t N) const {
    const int64_t two = 2 * kern::PANEL_ROWS;
    return N >= 4 * int64_t(nt_) * two ? two : kern::PANEL_ROWS;
  }

  // Weight rows per task of a prefill projection over N rows, whole panel blocks: packing the
  // activation rows costs <1% of the FLOPs at 256, but a narrow matrix needs about four tasks a
  // thread or one thread finishes a task behind the other. Task bounds never change a cell's
  // bits.
  int64_t task_rows(int64_t N) const {
    const int64_t q = kern::PANEL_ROWS;
    const int64_t per_task = ((N + 4 * nt_ - 1) / (4 * nt_) + q - 1) / q * q;
    return std::clamp<int64_t>(per_task, q, kMaxTaskRows);
  }

  // X's M rows (n values each) as this session's panels multiply them, in the prefill buffers:
  // float32 rows as they are (f32, f16; bf16 widening panels: as_consumed rounded them), bf16
  // bits (round_bf16, decode's rounding) or int8 codes and block scales (quantize_q8, decode's
  // rule, row by row).
  // Several rows are then packed into `pack` (packed_elems(M, n) elements) where the panels can
  // take them packed (float32 and vdpbf16ps panels), so every task of the product reads one copy.
  kern::PanelAct act_rows(const Simd& S, const float* X, int64_t M, int64_t n, float* pack) {
    kern::PanelAct a;
    const kern::PanelOps& P = simd().panels[kern::panel_index(c_.weights)];
    if (P.act == kern::ACT_F32) {
      a.f = X, a.ld = n;
    } else if (P.act == kern::ACT_BF16_BITS) {
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r) {
        uint16_t* b = xb_.p + r * ldx_;
        S.round_bf16(X + r * n, n, b, nullptr);  // zeroes its own padding to act_padded(n)
        std::fill(b + kern::act_padded(n), b + ldx_, uint16_t(0));
      }
      a.b = xb_.p, a.ld = ldx_;
    } else {
      const int64_t lds = ldx_ / RESIDENT_INT8_BLOCK;
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r) S.quantize_q8(X + r * n, n, xq_.p + r * ldx_, xs_.p + r * lds);
      a.q = xq_.p, a.s = xs_.p, a.ld = ldx_, a.lds = lds;
    }
    if (P.pack && M > 1) {
      P.pack(M, n, a, pack);
      a.packed = pack;
    }
    return a;
  }

  // Y (M, N) (+)= X (M, K) @ W^T, W (N, K), X prepared by act_rows: the prefill projection,
  // tasks of whole panel blocks over the threads; each cell computed as a decode step computes
  // it (PanelOps::gemm).
  void project(const kern::PanelAct& a, int64_t M, const WMat& W, float* Y, bool accumulate) {
    const int64_t N = W.rows, NB = task_rows(N), tasks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(nt_) schedule(dynamic)
    for (int64_t tk = 0; tk < tasks; ++tk) {
      const int64_t j0 = tk * NB, j1 = std::min(N, j0 + NB);
      W.gemm(M, a, j0, j1, Y + j0, N, accumulate, ws(omp_get_thread_num()));
    }
  }

  // Prefill's activation rows X (M, n), in place, as a decode step's products consume them: for
  // bf16 weights each value rounded to bf16 (half.hpp, as decode's round_bf16). int8 rows are
  // quantized by act_rows, by decode's rule; other formats multiply X as it is. Panels that take
  // bf16 bits need nothing here: act_rows rounds X itself, and rounding a rounded value again
  // changes nothing, so this pass (a read and a write of every value) would only cost time.
  void as_consumed(float* X, int64_t M, int64_t n) const {
    if (c_.weights != Dtype::BF16 ||
        simd().panels[kern::panel_index(Dtype::BF16)].act == kern::ACT_BF16_BITS)
      return;
#pragma omp parallel for num_threads(nt_) schedule(static)
    for (int64_t i = 0; i < M * n; ++i) X[i] = half::bf16_to_f32(half::f32_to_bf16(X[i]));
  }

  // M tokens of slot `slot` at positions p0..p0+M-1 through every layer; logits of the last
  // one when asked. Every stage computes each token's values as a decode step would (the same
  // norms, RoPE, attention and panel products), so a prompt's logits do not depend on how it
  // was split.
  void prefill_block(int64_t slot, const int64_t* ids, int64_t M, int64_t p0, float* logits) {
    const Simd& S = simd();
    const int64_t D = c_.d_model, Dh = c_.d_head, F = c_.d_ff, Hq = c_.h_q, Hkv = c_.h_kv;
    const int64_t G = Hq / Hkv, HD = Hq * Dh;
    Buf X(M * D), Xn(M * D), QKV(M * q_rows_), A(M * HD), Gt(M * F), U(M * F);
    const kern::PanelOps& P = S.panels[kern::panel_index(c_.weights)];
    Buf Pk(P.packed_elems ? P.packed_elems(M, std::max({D, HD, F})) : 0);  // act_rows' packing
    Buf Y(sandwich_ || c_.o_bias || c_.mlp_bias ? M * D : 0);
    // attention tasks: RB rows of the G query heads of one KV head, and their scores
    const int64_t RB = std::max<int64_t>(1, kMaxAttendQueries / G), row_blocks = (M + RB - 1) / RB;
    Buf Sc(int64_t(nt_) * kMaxAttendQueries * (p0 + M));
    for (int64_t r = 0; r < M; ++r) embed_row(ids[r], X.p + r * D);
    // X += the sublayer output Wm . In (+ its bias, through its sandwich norm), each element
    // as a decode step computes it.
    const auto residual = [&](const float* In, const WMat& Wm, const Buf& b, const Buf& out_norm) {
      const kern::PanelAct in = act_rows(S, In, M, Wm.cols, Pk.p);
      if (direct(b)) return project(in, M, Wm, X.p, true);
      project(in, M, Wm, Y.p, false);
      bias_add(X.p, Y.p, D, M, b.p, 0, D);
      if (!sandwich_) return;
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r) out_norm_add(X.p, Y.p, out_norm.p, r);
    };

    for (int64_t li = 0; li < c_.n_layers; ++li) {
      const Layer& L = layers_[size_t(li)];
      const int64_t Kc = kcache(slot, li), Vc = vcache(slot, li);
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r)
        rmsnorm(X.p + r * D, L.in_norm.p, D, c_.rms_eps, Xn.p + r * D);
      as_consumed(Xn.p, M, D);
      project(act_rows(S, Xn.p, M, D, Pk.p), M, L.wqkv, QKV.p, false);
      const int64_t heads = Hq + 2 * Hkv;
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t rh = 0; rh < M * heads; ++rh) {
        const int64_t r = rh / heads, h = rh % heads;
        head_rope_store(L, Kc, Vc, h, QKV.p + r * q_rows_ + h * Dh, p0 + r);
      }
#pragma omp parallel for num_threads(nt_) schedule(dynamic)
      for (int64_t task = 0; task < Hkv * row_blocks; ++task) {
        const int64_t g = task % Hkv, r0 = task / Hkv * RB, r1 = std::min(M, r0 + RB);
        float* s = Sc.p + int64_t(omp_get_thread_num()) * kMaxAttendQueries * (p0 + M);
        attend_rows(S, L, QKV.p, Kc, Vc, g, r0, r1, p0, s, A.p);
      }
      as_consumed(A.p, M, HD);
      residual(A.p, L.wo, L.o_b, L.attn_out_norm);
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r)
        rmsnorm(X.p + r * D, L.post_norm.p, D, c_.rms_eps, Xn.p + r * D);
      as_consumed(Xn.p, M, D);
      const kern::PanelAct xn = act_rows(S, Xn.p, M, D, Pk.p);  // gate and up share it
      project(xn, M, L.wg, Gt.p, false);
      project(xn, M, L.wu, U.p, false);
#pragma omp parallel for num_threads(nt_) schedule(static)
      for (int64_t r = 0; r < M; ++r) gate(S, Gt.p + r * F, U.p + r * F, L, 0, F, Gt.p + r * F);
      as_consumed(Gt.p, M, F);
      residual(Gt.p, L.wd, L.d_b, L.mlp_out_norm);
    }
    if (!logits) return;
    rmsnorm(X.p + (M - 1) * D, final_norm_.p, D, c_.rms_eps, xf_.p);
    head_logits(S, logits);
  }

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

}  // namespace

std::unique_ptr<Session> make_cpu_session(const SessionConfig& cfg, int64_t max_ctx,
                                          int64_t slots) {
  return std::unique_ptr<Session>(new CpuSession(cfg, max_ctx, slots));
}

namespace {
// The test hooks' one body: w (rows, n) in format f (int8 with its block scales, `sc`) put into
// the session's own panels, X (M, n) prepared as a step or a prefill prepares its activations,
// and Y (M, rows) = X w^T through the session's own kernels. `in` keeps the prepared activations
// (they live in `act`) for the hooks that return them.
struct HookProducts {
  ActScratch act;
  kern::PanelAct in;
  HookProducts(Dtype f, const void* w, const float* sc, int64_t rows, int64_t n, const float* X,
               int64_t M, float* Y, bool packed = false)
      : act(f, 1, n, M) {
    Arena arena;
    size_t need = 0;
    WMat(f, rows, n, &arena, &need);
    arena.open(need);
    WMat m(f, rows, n, &arena);
    const size_t row_bytes = size_t(n) * size_t(dtype_info(f).bytes);
    const int64_t blocks = (n + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK;
    for (int64_t o = 0; o < rows; ++o)
      m.put_row(o, static_cast<const char*>(w) + size_t(o) * row_bytes,
                sc ? sc + o * blocks : nullptr);
    in = act.prepare(simd(), X, M, n, n, 0);
    const kern::PanelOps& P = m.ops();
    Buf pk(packed && P.pack && M > 1 ? P.packed_elems(M, n) : 0);
    if (pk.n) {  // as prefill's act_rows
      P.pack(M, n, in, pk.p);
      in.packed = pk.p;
    }
    const ABuf<char> ws(m.ops().ws_bytes(m.cols));
    m.gemm(M, in, 0, rows, Y, rows, false, ws.p);
    in.packed = nullptr;  // pk ends here
  }
};
}  // namespace

const char* cpu_weight_path(Dtype f) { return simd().panels[kern::panel_index(f)].path; }

void cpu_int8_products(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* x,
                       float* y, int8_t* xq, float* xs) {
  const HookProducts h(Dtype::Int8, q, sc, rows, n, x, 1, y);
  std::memcpy(xq, h.in.q, size_t(n));
  const int64_t blocks = (n + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK;
  std::memcpy(xs, h.in.s, size_t(blocks) * sizeof(float));
}

void cpu_int8_gemm(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* X,
                   int64_t M, float* Y) {
  HookProducts(Dtype::Int8, q, sc, rows, n, X, M, Y);
}

void cpu_bf16_products(const uint16_t* w, int64_t rows, int64_t n, const float* x, float* y,
                       uint16_t* xb) {
  const HookProducts h(Dtype::BF16, w, nullptr, rows, n, x, 1, y);
  std::memcpy(xb, h.in.b, size_t(n) * sizeof(uint16_t));
}

void cpu_gate(bool gelu, const float* g, const float* u, int64_t n, float* out) {
  (gelu ? simd().gelu_mul : simd().silu_mul)(g, u, nullptr, nullptr, out, n);
}
double cpu_sum_sq(const float* x, int64_t n) { return simd().sum_sq(x, n); }

void cpu_panel_products(Dtype f, const void* w, int64_t rows, int64_t n, const float* X,
                        int64_t M, float* Y, bool packed) {
  HookProducts(f, w, nullptr, rows, n, X, M, Y, packed);
}

double cpu_read_bandwidth(int64_t bytes, int reps) {
  const int64_t n = std::max<int64_t>(bytes / int64_t(sizeof(float)), 1 << 16);
  // in the weights' kind of memory (an Arena: huge pages), so the roofline is decode's own
  Arena arena;
  arena.open(size_t(n) * sizeof(float));
  Buf a = arena.take<float>(n);
  const int nt = std::max(1, omp_get_max_threads());
  // Touch the pages from the threads that will read them (first-touch placement).
#pragma omp parallel num_threads(nt)
  {
    int64_t r0, r1;
    split(n, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t i = r0; i < r1; ++i) a.p[i] = float(i & 7);
  }
  const Simd& S = simd();
  double best = 0.0;
  volatile float sink = 0.f;
  // each rep reads in every pattern (one prefetched stream, one plain, two and four plain side
  // by side)
  static constexpr struct { int streams; bool prefetch; } patterns[] = {
      {1, true}, {1, false}, {2, false}, {4, false}};
  for (int rep = 0; rep < std::max(1, reps); ++rep)
    for (const auto& pat : patterns) {
      const double t0 = omp_get_wtime();
      float tot = 0.f;
#pragma omp parallel num_threads(nt) reduction(+ : tot)
      {
        int64_t r0, r1;
        split(n, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
        tot += S.sum(a.p + r0, r1 - r0, pat.streams, pat.prefetch);
      }
      const double dt = omp_get_wtime() - t0;
      sink = sink + tot;
      if (dt > 0) best = std::max(best, double(n) * sizeof(float) / dt);
    }
  (void)sink;
  return best;
}

}  // namespace residentk
}  // namespace algenta

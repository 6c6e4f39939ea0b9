// The CPU engine's prefill: blocks of M <= PREFILL_BLOCK tokens through every layer as
// matrix-matrix products on the same panels decode multiplies (PanelOps::gemm never packs a
// weight: the panels are the GEMM's packed layout), the activation rows rounded or quantized
// as a decode step's (act_rows, as_consumed), so a prompt's logits are bit-identical whether
// it is prefilled at once, in any split, or stepped. Only the last row's logits are formed.

#include <omp.h>

#include <algorithm>

#include "algenta/half.hpp"
#include "session_cpu.hpp"

namespace algenta {
namespace residentk {
namespace cpu_engine {

void CpuSession::run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) {
  for (int64_t b = 0; b < n; b += PREFILL_BLOCK) {
    const int64_t m = std::min(PREFILL_BLOCK, n - b);
    prefill_block(slot, ids + b, m, pos_[slot] + b, b + m == n ? logits : nullptr);
  }
}

// logits = head . xf_ (the final norm's output, one row) by all threads: prefill's last row.
void CpuSession::head_logits(const Simd& S, float* logits) {
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

// X's M rows (n values each) as this session's panels multiply them, in the prefill buffers:
// float32 rows as they are (f32, f16; bf16 widening panels: as_consumed rounded them), bf16
// bits (round_bf16, decode's rounding) or int8 codes and block scales (quantize_q8, decode's
// rule, row by row).
// Several rows are then packed into `pack` (packed_elems(M, n) elements) where the panels can
// take them packed (float32 and vdpbf16ps panels), so every task of the product reads one copy.
kern::PanelAct CpuSession::act_rows(const Simd& S, const float* X, int64_t M, int64_t n,
                                    float* pack) {
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
void CpuSession::project(const kern::PanelAct& a, int64_t M, const WMat& W, float* Y,
                         bool accumulate) {
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
void CpuSession::as_consumed(float* X, int64_t M, int64_t n) const {
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
void CpuSession::prefill_block(int64_t slot, const int64_t* ids, int64_t M, int64_t p0,
                               float* logits) {
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

}  // namespace cpu_engine
}  // namespace residentk
}  // namespace algenta

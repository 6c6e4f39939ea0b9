// The CPU engine's decode step (session_cpu.cpp has the stage list and the numerics): one token
// of each of M <= step_rows_ sequences through every layer, each stage ONE OpenMP parallel
// region whatever M is, the weight rows shared out in tasks of whole panel blocks so the
// weights stream once per step; and the team-size tuning of a lone sequence's steps. A row's
// bits never depend on M, the team size or the task bounds (PanelOps::gemm: one
// multiply-add sequence per cell; each cell one owner).

#include <omp.h>

#include <algorithm>

#include "session_cpu.hpp"

namespace algenta {
namespace residentk {
namespace cpu_engine {

// One sequence steps with the tuned team (see tuned_decode); several step together in
// groups of up to step_rows_, each group one pass over the weights with all cores. A row's
// bits are the bits it gets alone (decode_rows), so a sequence's logits do not depend on
// its company or on how the batch was grouped.
void CpuSession::run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                                float* logits) {
  if (B == 1) return tuned_decode(slots[0], ids[0], logits);
  cur_nt_ = nt_;
  for (int64_t b0 = 0; b0 < B; b0 += step_rows_) {
    const int64_t m = std::min(step_rows_, B - b0);
    decode_rows(slots + b0, ids + b0, m, logits + b0 * c_.vocab);
  }
}

void CpuSession::tuned_decode(int64_t slot, int64_t id, float* logits) {
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

int64_t CpuSession::run_step_greedy(int64_t id) {
  run_step(id, logits_.p);
  return greedy_argmax(logits_.p, c_.vocab);
}

// One decode step of M <= step_rows_ sequences: row r appends ids[r] to slot slot[r] at its
// position; logits (M, V). The stages residentk_dispatch_budget counts, each ONE parallel
// region whatever M is: every thread norms and prepares all M rows itself (M x D values,
// no barrier), then the weight rows are shared out and each panel block multiplies all M
// rows while it is hot, so the weights stream once per step however many sequences step.
// A cell's bits do not depend on M (PanelOps::gemm), nor on the team size.
void CpuSession::decode_rows(const int64_t* slot, const int64_t* ids, int64_t M, float* logits) {
  const Simd& S = simd();
  const int64_t D = c_.d_model, Dh = c_.d_head, F = c_.d_ff, Hq = c_.h_q, Hkv = c_.h_kv;
  const int64_t HD = Hq * Dh, V = c_.vocab, heads = Hq + 2 * Hkv;
  int64_t p[kMaxStepRows];
  for (int64_t r = 0; r < M; ++r) p[r] = pos_[slot[r]];
  float *X = x_.p, *QKV = qkv_.p, *A = attn_.p, *Act = act_buf_.p, *XF = xf_.p, *Y = sub_.p;
  int64_t stages = 0;
  // Weight rows per task: one or two panel blocks for one row (a matrix-vector product); for
  // several, prefill's larger tasks, since each task packs the M activation rows once for all
  // of its blocks (perf/RESULTS.md: the cost of packing by task size).
  const auto chunk = [&](int64_t rows) {
    return M == 1 ? step_task_rows(rows) : task_rows(rows);
  };

  // o_proj's and down's stages: x += W . In (K values a row), its weight rows shared out as
  // the other products'; where the family adds a bias or a sandwich norm, through Y (sub_)
  // first, and the sandwich norm one more stage.
  const auto residual = [&](const WMat& W, const float* In, int64_t K, const Buf& b,
                            const Buf& out_norm) {
#pragma omp parallel num_threads(team(D * K))
    {
      const int t = omp_get_thread_num();
      const kern::PanelAct in = input(S, In, M, K, K, t);
      rows_dynamic(D, chunk(D), [&](int64_t r0, int64_t r1) {
        if (direct(b)) return W.gemm(M, in, r0, r1, X + r0, D, true, ws(t));
        W.gemm(M, in, r0, r1, Y + r0, D, false, ws(t));
        bias_add(X, Y, D, M, b.p, r0, r1);
      });
    }
    ++stages;
    if (sandwich_) {
#pragma omp parallel for num_threads(team(M * D)) schedule(static)
      for (int64_t r = 0; r < M; ++r) out_norm_add(X, Y, out_norm.p, r);
      ++stages;
    }
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
    residual(L.wo, A, HD, L.o_b, L.attn_out_norm);
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
    residual(L.wd, Act, F, L.d_b, L.mlp_out_norm);
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

}  // namespace cpu_engine
}  // namespace residentk
}  // namespace algenta

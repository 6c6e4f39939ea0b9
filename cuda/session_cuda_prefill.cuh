// The CUDA session's prefill for a session of one slot (CudaSession's members, after its class
// in session_cuda.cu, the one file that includes this): blocks of up to prefill_rows tokens
// through each layer as GEMMs (session_gemm.cuh, session_gemm_q8.cuh; bf16 on lossk's tile
// GEMM on tensor cores), the activation rows made what decode's products consume first
// (as_consumed), attention and q/k norm + RoPE through decode's own kernels. A session of
// several slots prefills through decode's row kernels instead (run_prefill), for batch
// invariance.
#pragma once

namespace algenta {
namespace residentk {
namespace {

using namespace cudaplan;

// A session of one slot prefills blocks of tokens through GEMMs (fast for long prompts; a
// cell's sum is not formed in decode's order). A session of several prefills through decode's
// own row kernels, step_rows tokens a launch sequence, so a sequence's bits do not depend on
// how its prompt was split, on a prefix copied from another slot instead of recomputed, or on
// the rows beside it: what the scheduler's batch invariance rests on.
inline void CudaSession::run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) {
  use_device();
  if (plan_.slots > 1) {
    for (int64_t b = 0; b < n; b += plan_.step_rows) {
      const int64_t m = std::min(plan_.step_rows, n - b);
      for (int64_t r = 0; r < m; ++r) put_row(r, slot, ids[b + r], pos_[slot] + b + r);
      const bool last = b + m == n;
      run_rows(m, last && logits ? m - 1 : m);
      if (last && logits)
        CK(cudaMemcpyAsync(logits, A(plan_.logits), size_t(c_.vocab) * 4,
                           cudaMemcpyDeviceToHost, stream_));
      // The pinned rows are rewritten by the next group: finish this one first.
      CK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  for (int64_t b = 0; b < n; b += plan_.prefill_rows) {
    const int64_t m = std::min(plan_.prefill_rows, n - b);
    prefill_block(ids + b, m, pos_[0] + b, b + m == n ? logits : nullptr);
  }
}

// X (M, K) as F's products consume it, once before the projections that read it, as the CPU
// engine's prefill: bf16 rounds X in place (k_round_bf16); int8 quantizes it into the plan's
// scratch (k_quantize_rows; X is left as it is); f32 and f16 take it as it is. The returned
// Act is valid until the next as_consumed.
template <Dtype F>
inline CudaSession::Act CudaSession::as_consumed(float* X, int64_t M, int64_t K) {
  if (F == Dtype::BF16) {
    k_round_bf16<<<dim3(unsigned(ceil_div(K, ROW_THREADS)), unsigned(M)), ROW_THREADS, 0,
                   stream_>>>(X, K);
    launched("k_round_bf16");
  }
  if (F != Dtype::Int8) return Act{X};
  const int64_t ldq = ceil_div(K, RESIDENT_INT8_BLOCK) * RESIDENT_INT8_BLOCK;  // <= plan_.q8_ld
  int8_t* q = reinterpret_cast<int8_t*>(P(plan_.p_q8_codes));
  float* s = P(plan_.p_q8_scales);
  k_quantize_rows<<<dim3(unsigned(ceil_div(ldq / RESIDENT_INT8_BLOCK, ROW_THREADS)),
                         unsigned(M)),
                    ROW_THREADS, 0, stream_>>>(X, K, ldq, q, s);
  launched("k_quantize_rows");
  return Act{X, q, s, ldq};
}

// Y (M, N) (+)= X (M, K) W^T, tile chosen by residentk_prefill_gemm_use_narrow_tile(M), but
// for two formats: int8 multiplies X's blocks in integers at every M (k_gemm_q8, decode's
// products); bf16 on the wide tile multiplies on tensor cores: lossk's tile GEMM (bf16 wmma
// steps, float32 accumulators) on X's values, which as_consumed made bf16 (so staging them as
// bf16 is exact), and the resident bf16 rows: decode's products, summed in float32.
template <Dtype F>
inline void CudaSession::gemm(const Act& A, int64_t M, int64_t K, DevMat Wt, int64_t N, float* Y,
                              bool accumulate) {
  const float* X = A.x;
  if (F == Dtype::Int8) {
    k_gemm_q8<<<dim3(unsigned(ceil_div(N, GEMM_BN)), unsigned(ceil_div(M, GEMM_BM))),
                GEMM_THREADS, 0, stream_>>>(A.q, A.ldq, A.s, Wt, Y, M, N, K, accumulate);
    launched("k_gemm_q8");
    return;
  }
  const GemmGrid g = prefill_gemm_grid(M, N, plan_.sms);
  if (F == Dtype::BF16 && !g.narrow) {
    using Tile = Bf16PrefillTile;
    lossk::TileArgs<float> p;
    p.M = M, p.N = N, p.K = K;
    p.A = X, p.lda = K;
    p.B = Wt.w, p.ldb = K;
    p.C = Y, p.ldc = N;
    p.accumulate = accumulate;
    constexpr int bytes = lossk::tile_bytes<Tile>();  // opted in at load (load_format_kernels)
    const dim3 grid(unsigned(ceil_div(M, lossk::BM)), unsigned(ceil_div(N, lossk::BN)));
    gpu::launch_label("prefill");
    lossk::k_tile<Tile><<<grid, lossk::NT, bytes, stream_>>>(lossk::tile_args<Tile>(p));
    gpu::launch_label(nullptr);
    launched("k_tile(prefill)");
    return;
  }
  if (g.narrow) {
    k_gemm_narrow<F><<<unsigned(g.gx), MATVEC_THREADS, 0, stream_>>>(
        X, Wt, Y, M, N, K, g.rows_per_block, accumulate);
    launched("k_gemm_narrow");
  } else {
    k_gemm_wide<F><<<dim3(unsigned(g.gx), unsigned(g.gy)), GEMM_THREADS, 0, stream_>>>(
        X, Wt, Y, M, N, K, accumulate);
    launched("k_gemm_wide");
  }
}

// Prefill's X += Wt . act (M rows): straight into X where the family adds nothing, else
// through Y with the bias (k_bias_residual) and the sandwich norm (out_norm).
template <Dtype Fw>
inline void CudaSession::residual(const Act& a, int64_t M, int64_t K, DevMat Wt, int64_t b_off,
                                  int64_t norm_off, float* X, float* Y) {
  const int64_t D = c_.d_model;
  if (b_off < 0 && !sandwich_) return gemm<Fw>(a, M, K, Wt, D, X, true);
  gemm<Fw>(a, M, K, Wt, D, Y, false);
  k_bias_residual<<<unsigned(ceil_div(M * D, ROW_THREADS)), ROW_THREADS, 0, stream_>>>(
      X, Y, W(b_off), M, D, sandwich_);
  launched("k_bias_residual");
  out_norm(X, Y, norm_off, M, false);
}

// M tokens at positions p0..p0+M-1; the last one's logits when asked.
inline void CudaSession::prefill_block(const int64_t* ids, int64_t M, int64_t p0, float* logits) {
  by_format([&](auto f) { prefill_block<decltype(f)::value>(ids, M, p0, logits); });
}

template <Dtype Fw>
inline void CudaSession::prefill_block(const int64_t* ids, int64_t M, int64_t p0, float* logits) {
  const int64_t D = c_.d_model, F = c_.d_ff, Q = plan_.q_rows, Aw = plan_.attn_width;
  for (int64_t r = 0; r < M; ++r) host_rows_.p[r] = StepRow{ids[r], p0 + r, 0, 0};
  set_rows(M);
  float *X = P(plan_.p_x), *Xn = P(plan_.p_xn), *QKV = P(plan_.p_qkv), *At = P(plan_.p_attn);
  float *Gt = P(plan_.p_gate), *U = P(plan_.p_up), *Y = P(plan_.p_y);
  k_embed<Fw><<<dim3(unsigned(ceil_div(D, ROW_THREADS)), unsigned(M)), ROW_THREADS, 0,
                 stream_>>>(mat(plan_.embed), rows(), X, D, embed_scale_);
  launched("k_embed(prefill)");
  for (int64_t li = 0; li < c_.n_layers; ++li) {
    const LayerOffsets& l = plan_.layers[size_t(li)];
    k_rmsnorm_rows<<<unsigned(M), ROW_THREADS, 0, stream_>>>(X, W(l.in_norm), D, c_.rms_eps, Xn);
    launched("k_rmsnorm_rows(input)");
    gemm<Fw>(as_consumed<Fw>(Xn, M, D), M, D, mat(l.wqkv), Q, QKV, false);
    norm_rope(l, li, QKV, M, false);
    attention(li, QKV, M, 1, At, false);
    residual<Fw>(as_consumed<Fw>(At, M, Aw), M, Aw, mat(l.wo), l.o_b, l.attn_out_norm, X, Y);
    k_rmsnorm_rows<<<unsigned(M), ROW_THREADS, 0, stream_>>>(X, W(l.post_norm), D, c_.rms_eps,
                                                             Xn);
    launched("k_rmsnorm_rows(post)");
    const Act xn = as_consumed<Fw>(Xn, M, D);
    gemm<Fw>(xn, M, D, mat(l.wg), F, Gt, false);
    gemm<Fw>(xn, M, D, mat(l.wu), F, U, false);
    k_gate_act<<<unsigned(ceil_div(M * F, ROW_THREADS)), ROW_THREADS, 0, stream_>>>(
        Gt, U, M * F, F, W(l.g_b), W(l.u_b), gelu_);
    launched("k_gate_act");
    residual<Fw>(as_consumed<Fw>(Gt, M, F), M, F, mat(l.wd), l.d_b, l.mlp_out_norm, X, Y);
  }
  if (logits) {
    head<Fw, 1>(X + (M - 1) * D, 1, 1, false);
    CK(cudaMemcpyAsync(logits, A(plan_.logits), size_t(c_.vocab) * 4, cudaMemcpyDeviceToHost,
                       stream_));
  }
  // The pinned rows are reused by the next block: finish this one first.
  CK(cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

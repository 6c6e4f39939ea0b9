// The CUDA session's decode (CudaSession's members, after its class in session_cuda.cu, the
// one file that includes this): a step's rows (StepRow: token, position, slot, attention path)
// written to pinned memory and copied to the device, then decode's launch sequence over them
// (enqueue_rows: the stages session_cuda.cu's header lists, each a kernel of
// session_kernels.cuh), replayed from a CUDA graph for one row (decode, capture) or launched
// for the up-to-step_rows rows of a batched step or a multi-slot prefill (run_rows).
// Hazards: the pinned rows are rewritten only after the stream that reads them was synchronized
// (every entry point synchronizes before returning); a graph records kernels only, reading the
// rows and the control block when they run, so one graph serves every position.
#pragma once

namespace algenta {
namespace residentk {
namespace {

using namespace cudaplan;

// B rows of distinct slots, step_rows a launch sequence, through the row kernels.
inline void CudaSession::run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                                        float* logits) {
  if (plan_.slots == 1) return run_step(ids[0], logits);  // slot 0 alone: decode's graph
  use_device();
  int64_t launches = 0;
  for (int64_t b = 0; b < B; b += plan_.step_rows) {
    const int64_t m = std::min(plan_.step_rows, B - b);
    for (int64_t r = 0; r < m; ++r) put_row(r, slots[b + r], ids[b + r], pos_[slots[b + r]]);
    launches += run_rows(m, 0);
    CK(cudaMemcpyAsync(logits + b * c_.vocab, A(plan_.logits), size_t(m * c_.vocab) * 4,
                       cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }
  dispatches_ = launches;
}

inline void CudaSession::run_step(int64_t id, float* logits) {
  use_device();
  decode(id);
  CK(cudaMemcpyAsync(logits, act_.f() + plan_.logits, size_t(c_.vocab) * 4,
                     cudaMemcpyDeviceToHost, stream_));
  CK(cudaStreamSynchronize(stream_));
}

inline int64_t CudaSession::run_step_greedy(int64_t id) {
  use_device();
  decode(id);
  CK(cudaMemcpyAsync(&host_.p[0], &ctl()->argmax, sizeof(int64_t), cudaMemcpyDeviceToHost,
                     stream_));
  CK(cudaStreamSynchronize(stream_));
  return host_.p[0];
}

// Pinned row r: token tok at position pos of slot, on the path a decode step there takes
// (splitk_plan of pos + 1 keys: what makes a row's attention the bits of a lone step);
// returns whether it splits.
inline bool CudaSession::put_row(int64_t r, int64_t slot, int64_t tok, int64_t pos) {
  const SplitPlan sp = splitk_plan(pos + 1, plan_.sms, c_.h_q);
  host_rows_.p[r] = StepRow{tok, pos, slot, sp.split ? sp.n_splits : 0};
  return sp.split;
}

// The first n pinned rows into device memory. Every call that enqueues work synchronizes
// before returning, so the previous copy out of the pinned rows has completed.
inline void CudaSession::set_rows(int64_t n) {
  CK(cudaMemcpyAsync(rows_.p, host_rows_.p, size_t(n) * sizeof(StepRow),
                     cudaMemcpyHostToDevice, stream_));
}

// The M pinned rows (put_row) through decode's stages on the row kernels of width PASS_ROWS,
// the head for rows [head_from, M); returns the launches.
inline int64_t CudaSession::run_rows(int64_t M, int64_t head_from) {
  bool deep = false;
  for (int64_t r = 0; r < M; ++r) deep = deep || host_rows_.p[r].n_splits > 0;
  set_rows(M);
  return by_format([&](auto f) {
    return enqueue_rows<decltype(f)::value, PASS_ROWS>(M, pass_rows_, deep, head_from);
  });
}

// The per-row q/k norm + RoPE + KV write and attention launches shared by decode (M = 1) and
// prefill.
// pdl: a decode step's programmatic dependent launch (gpu::launch); prefill launches plainly.
// Each of M rows' positions and slots come from rows_ (StepRow).
inline void CudaSession::norm_rope(const LayerOffsets& l, int64_t li, float* qkv, int64_t M,
                                   bool pdl) {
  gpu::launch(pdl, "k_qk_norm_rope", k_qk_norm_rope_,
              dim3(unsigned(c_.h_q + 2 * c_.h_kv), unsigned(M)),
              dim3(unsigned(plan_.norm_rope_threads)), 0, stream_, qkv, plan_.q_rows,
              W(l.qkv_b), W(l.q_norm), W(l.k_norm), rope_.f() + l.rope, rows(), c_.h_q,
              c_.h_kv, c_.d_head, plan_.capacity, c_.rms_eps, plan_.kv_slot_stride,
              kcache(li), vcache(li));
  launched("k_qk_norm_rope");
}

// S_grid: 1 where no row splits, else the plan's maximum (each row's own S read on the device).
inline void CudaSession::attention(int64_t li, const float* qkv, int64_t M, int64_t S_grid,
                                   float* out, bool pdl) {
  const int64_t window = plan_.layers[size_t(li)].slides ? c_.sliding_window : 0;
  gpu::launch(pdl, "k_attn_partial", k_attn_partial_,
              dim3(unsigned(c_.h_q), unsigned(S_grid), unsigned(M)), dim3(ATTN_THREADS),
              size_t(plan_.attn_smem_bytes), stream_, qkv, plan_.q_rows, kcache(li),
              vcache(li), rows(), plan_.kv_slot_stride, plan_.capacity, c_.h_q / c_.h_kv,
              c_.d_head, attn_scale_, window, float(c_.attn_softcap), plan_.max_splits, out,
              A(plan_.part_acc), A(plan_.part_ml));
  launched("k_attn_partial");
}

// One decode token of slot 0 at P = pos_[0]: its row goes to device memory, then the step's
// kernels run, replayed from the graph of its path (standard or split-K;
// ALGENTA_CUDA_GRAPHS=0 launches them one by one instead). dispatches_ counts kernels.
inline void CudaSession::decode(int64_t id) {
  const bool split = put_row(0, 0, id, pos_[0]);
  set_rows(1);
  if (use_graphs_) {
    const Graph& g = split ? deep_ : standard_;
    CK(cudaGraphLaunch(g.exec, stream_));
    dispatches_ = g.kernels;
  } else {
    dispatches_ = enqueue_decode(split);
  }
}

inline void CudaSession::capture(Graph& out, bool deep) {
  CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  int64_t kernels = 0;
  try {
    kernels = enqueue_decode(deep);
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);  // leave the stream out of capture mode, then rethrow
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t g = nullptr;
  CK(cudaStreamEndCapture(stream_, &g));
  const cudaError_t err = cudaGraphInstantiate(&out.exec, g, 0);
  cudaGraphDestroy(g);
  ck(err, "cudaGraphInstantiate(decode step)");
  out.kernels = kernels;
}

// Enqueues one decode step's kernels on stream_ (its row read on the device); returns how
// many. The split-K path sizes its grid to the plan's maximum split count.
inline int64_t CudaSession::enqueue_decode(bool deep) {
  return by_format([&](auto f) { return enqueue_rows<decltype(f)::value, 1>(1, 1, deep, 0); });
}

// Decode's stages over the M rows in rows_ (of any slots and positions; their tokens,
// positions and paths read on the device), at most nr <= R of them a matvec block: decode's
// one row (R = nr = M = 1, the graphs) or a batched step / multi-slot prefill (R =
// PASS_ROWS). deep: some row splits its attention (the grid sized to the plan's maximum, and
// the merge). The head for rows [head_from, M), into logits' first rows. Returns the launches.
template <Dtype Fw, int R>
inline int64_t CudaSession::enqueue_rows(int64_t M, int nr, bool deep, int64_t head_from) {
  const int64_t D = c_.d_model, F = c_.d_ff, Aw = plan_.attn_width;
  const unsigned passes = unsigned(ceil_div(M, nr));
  int64_t n = 0;
  k_embed<Fw><<<dim3(unsigned(ceil_div(D, ROW_THREADS)), unsigned(M)), ROW_THREADS, 0,
                 stream_>>>(mat(plan_.embed), rows(), A(plan_.x), D, embed_scale_);
  launched("k_embed");
  ++n;
  // The first kernel launches plainly (before it in the stream: the rows' copy).
  const bool p = pdl_;
  const dim3 mv(MATVEC_THREADS);
  for (int64_t li = 0; li < c_.n_layers; ++li) {
    const LayerOffsets& l = plan_.layers[size_t(li)];
    gpu::launch(p, "k_norm_qkv", k_norm_qkv<Fw, R>, dim3(unsigned(plan_.qkv_mv.grid), passes),
                mv, smem(D, nr), stream_, mat(l.wqkv), A(plan_.x), W(l.in_norm), D,
                plan_.q_rows, c_.rms_eps, plan_.qkv_mv.rows_per_block,
                int(plan_.qkv_mv.split), M, nr, A(plan_.qkv));
    launched("k_norm_qkv");
    ++n;
    norm_rope(l, li, A(plan_.qkv), M, p);
    ++n;
    attention(li, A(plan_.qkv), M, deep ? plan_.max_splits : 1, A(plan_.attn), p);
    ++n;
    if (deep) {
      gpu::launch(p, "k_attn_merge", k_attn_merge, dim3(unsigned(c_.h_q), unsigned(M)),
                  dim3(ROW_THREADS), 0, stream_, A(plan_.part_acc), A(plan_.part_ml), rows(),
                  plan_.max_splits, c_.d_head, A(plan_.attn));
      launched("k_attn_merge");
      ++n;
    }
    n += matvec_residual<Fw, R>(plan_.o_mv, l.wo, A(plan_.attn), Aw, l.o_b, l.attn_out_norm, M,
                                nr, p, "k_matvec_residual(o_proj)");
    gpu::launch(p, "k_norm_gateup", k_norm_gateup<Fw, R>,
                dim3(unsigned(plan_.gateup_mv.grid), passes), mv, smem(D, nr), stream_,
                mat(l.wg), mat(l.wu), A(plan_.x), W(l.post_norm), D, F, c_.rms_eps,
                plan_.gateup_mv.rows_per_block, int(plan_.gateup_mv.split), W(l.g_b),
                W(l.u_b), gelu_, M, nr, A(plan_.act));
    launched("k_norm_gateup");
    ++n;
    n += matvec_residual<Fw, R>(plan_.down_mv, l.wd, A(plan_.act), F, l.d_b, l.mlp_out_norm, M,
                                nr, p, "k_matvec_residual(down)");
  }
  if (head_from < M) n += head<Fw, R>(A(plan_.x) + head_from * D, M - head_from, nr, p);
  return n;
}

// Decode's sublayer output onto the residual, o_proj's or down's (the plan's launch mv):
// x (M, D) += W (D, K) . in (M, K) (+ the bias at b_off where the family has one); a sandwich
// family's goes to y instead and out_norm norms it onto x (norm at norm_off). Returns the
// launches.
template <Dtype Fw, int R>
inline int64_t CudaSession::matvec_residual(const MatvecLaunch& mv, const MatOffsets& w,
                                            float* in, int64_t K, int64_t b_off,
                                            int64_t norm_off, int64_t M, int nr, bool pdl,
                                            const char* what) {
  float* y = sandwich_ ? A(plan_.y) : nullptr;  // sublayer outputs through their norm
  gpu::launch(pdl, "k_matvec_residual", k_matvec_residual<Fw, R>,
              dim3(unsigned(mv.grid), unsigned(ceil_div(M, nr))), dim3(MATVEC_THREADS),
              smem(K, nr), stream_, mat(w), in, K, c_.d_model, mv.rows_per_block, int(mv.split),
              W(b_off), M, nr, y, A(plan_.x));
  launched(what);
  return 1 + out_norm(A(plan_.x), y, norm_off, M, pdl);
}

// A sandwich family's X (M, D) += rmsnorm(Y) * w (norm at offset w_off); returns the launches
// (0 for a family without sandwich norms).
inline int64_t CudaSession::out_norm(float* X, const float* Y, int64_t w_off, int64_t M,
                                     bool pdl) {
  if (!sandwich_) return 0;
  gpu::launch(pdl, "k_out_norm_residual", k_out_norm_residual, dim3(unsigned(M)),
              dim3(ROW_THREADS), 0, stream_, X, Y, W(w_off), c_.d_model, c_.rms_eps);
  launched("k_out_norm_residual");
  return 1;
}

// Final norm of the M rows of X (M, D), the head into logits (M, V), and with R == 1 (one
// row) its argmax (into the control block).
template <Dtype Fw, int R>
inline int64_t CudaSession::head(const float* X, int64_t M, int nr, bool pdl) {
  const int64_t D = c_.d_model;
  gpu::launch(pdl, "k_rmsnorm_rows", k_rmsnorm_rows, dim3(unsigned(M)), dim3(ROW_THREADS), 0,
              stream_, X, W(plan_.final_norm), D, c_.rms_eps, A(plan_.xf));
  launched("k_rmsnorm_rows(final)");
  gpu::launch(pdl, "k_head_argmax", k_head_argmax<Fw, R>,
              dim3(unsigned(plan_.head_mv.grid), unsigned(ceil_div(M, nr))),
              dim3(MATVEC_THREADS), smem(D, nr), stream_, mat(plan_.head), A(plan_.xf), D,
              c_.vocab, plan_.head_mv.rows_per_block, float(c_.final_softcap), M, nr,
              A(plan_.logits), A(plan_.argmax_val), static_cast<int64_t*>(blk_idx_.p), ctl());
  launched("k_head_argmax");
  return 2;
}

}  // namespace
}  // namespace residentk
}  // namespace algenta

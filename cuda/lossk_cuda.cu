// lossk on a CUDA device: the fused linear + cross-entropy of lossk.hpp, a chunk of tokens at a
// time, with the same options and the same exactness contract as the CPU backend
// (cpp/src/lossk_cross_entropy.cpp). This file is the host side; the kernels are in
// lossk_tile.cuh (the tile GEMM) and lossk_token.cuh (the per-token kernels), the seed's
// materialized kernels in lossk_seed.cu.
//
// Dimension legend: N tokens, D d_model, V vocab, C chunk, VB = LOSS_VOCAB_BLOCK = BN.
//
// Per call: k_check_* (the data's refusals, into a flag the host waits for: the one
// synchronization), k_prepare (which tokens count, their weight sum), then per chunk
//   1 k_tile<.., EPI_STATS>  logits of a (BM x VB) tile, bias, cap, temperature applied, reduced in
//                            shared memory to per-(row, vocab block) statistics (max, sum of
//                            exp, weighted logit sum, first argmax) and the target's logit; with
//                            gradients the tile is also stored into the chunk's (C, V) logits
//   2 k_merge                one warp per token: the blocks merged in block order -> lse, the
//                            loss terms, argmax, and the gradient's per-token coefficients
//   with gradients:
//   3 k_softmax_grad         the chunk's logits overwritten in place by d loss / d z
//   4 k_tile<.., EPI_STORE>  d_hidden rows = G @ W
//   5 k_tile<.., EPI_STORE>  d_weight += G^T @ H, each cell continuing its chain (accumulator
//                            loaded, never added to afterwards)
//   6 k_bias_grad            d_bias += column sums of G, one chain per cell in token order
// and k_finish (one block: token-order reductions in a fixed tree), k_narrow for half gradients.
// Never materialized: the (N, V) logits; without gradients not even a chunk of them.
//
// Exactness: no atomics in any reduction (the only atomics are the refusal flags, whose values
// are order-free: "some element is bad", "the first bad token"). Every logit cell is one chain
// over d_model in k order whatever tile row it lands in; a token's lse merges its vocab blocks in
// block order; d_weight cells continue one chain over tokens chunk after chunk; per-token sums
// reduce over a partition of [0, N) that depends on N only. So results are bit-identical across
// runs and chunk sizes. cuBLAS is not used: it may choose a different algorithm (another
// summation order) for every row count, i.e. for every chunk size, which this contract forbids.
//
// Precision: float32 and float64 inputs run the SIMT tile (fma chains in the input precision).
// bfloat16/float16 inputs run the forward on tensor cores through nvcuda::wmma (16x16x16, float
// accumulators). Their backward GEMMs take d_logits (float) as one operand: bfloat16 inputs round
// it to bfloat16 (the same exponent range, so the 1/N-scaled softmax gradient cannot underflow),
// float16 inputs run the backward in TF32 (16x16x8), which holds float16 operands exactly and the
// gradient without float16's underflow below 6e-8. The tensor cores' internal summation order
// within one k-step is the hardware's, fixed for given inputs; the chains between k-steps are
// ours, as above.
//
// Errors: every CUDA call is checked; a failure throws StatusError 591 naming the call. A build
// whose CUDA backend finds no usable device throws 590 before any allocation. Nothing here aborts.
// The emulator (cuda/emu) runs all of this in CI; speed is a device's to measure (README).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "lossk_launch.cuh"

namespace algenta {
namespace lossk {

namespace {

template <class T>
int64_t device_chunk(const FusedArgs<T>& a) {
  return device_chunk_for(a.elem, a.chunk, a.n_tok);
}

template <class T>
struct Scratch {
  int* flags;                  // 9 flags, then first_bad
  unsigned long long* first_bad;
  double* prep;                // 4
  uint8_t* valid;              // N
  double *ce, *zl, *ent;       // N (ent with entropy)
  double *ztarget, *lse_c, *coef;  // C, C, 6C
  BlockStatD* stats;           // C * nvb
  T* logits;                   // C * V, with gradients
  T* dw_acc;                   // V * D, for half d_weight
  T* db_acc;                   // V, for half d_bias
  double* sums;                // 14, when the caller passes none
  int64_t bytes;
};

template <class T>
Scratch<T> carve(const FusedArgs<T>& a, const FusedCudaOut<T>& out, void* base) {
  const int64_t N = a.n_tok, V = a.vocab, D = a.d_model, C = device_chunk(a);
  const int64_t nvb = ceil_div(V, BN);
  const bool grad = out.d_hidden || out.d_weight || out.d_bias;
  const bool half_g = is_half(out.grad_elem);
  Carver cv(base);
  Scratch<T> s;
  s.flags = cv.take<int>(9);
  s.first_bad = cv.take<unsigned long long>(1);
  s.prep = cv.take<double>(4);
  s.valid = cv.take<uint8_t>(N);
  s.ce = cv.take<double>(N);
  s.zl = cv.take<double>(N);
  s.ent = a.entropy ? cv.take<double>(N) : nullptr;
  s.ztarget = cv.take<double>(C);
  s.lse_c = cv.take<double>(C);
  s.coef = cv.take<double>(6 * C);
  s.stats = cv.take<BlockStatD>(C * nvb);
  s.sums = cv.take<double>(14);
  s.logits = grad ? cv.take<T>(C * V) : nullptr;
  s.dw_acc = out.d_weight && half_g ? cv.take<T>(V * D) : nullptr;
  s.db_acc = out.d_bias && half_g ? cv.take<T>(V) : nullptr;
  s.bytes = cv.off;
  return s;
}

// The data's refusals, in the CPU backend's order, from the device's flags.
template <class T>
void check_data(const FusedArgs<T>& a, const Scratch<T>& s, cudaStream_t st) {
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  CK(cudaMemsetAsync(s.flags, 0, 9 * sizeof(int), st));
  CK(cudaMemsetAsync(s.first_bad, 0xff, sizeof(unsigned long long), st));
  auto finite = [&](const void* p, int64_t n, Dtype e, int flag) {
    launch_check_finite(p, n, e, s.flags + flag, st);
  };
  const Dtype te = sizeof(T) == 8 ? Dtype::F64 : Dtype::F32;
  finite(a.grad_output, N, te, 0);
  finite(a.grad_lse, N, te, 1);
  finite(a.grad_coef, 3 * N, te, 2);
  finite(a.hidden, N * D, a.elem, 3);
  finite(a.weight, V * D, a.elem, 4);
  finite(a.bias, V, a.elem, 5);
  finite(a.class_weight, V, te, 6);
  finite(a.grad_entropy, N, te, 8);
  if (a.token_weight) {
    k_check_token_weights<T><<<grid_for(N, 256), 256, 0, st>>>(a.token_weight, N, s.flags + 7);
    CK(cudaGetLastError());
  }
  k_check_targets<<<grid_for(N, 256), 256, 0, st>>>(a.targets, N, a.shift, a.seq_len,
                                                    a.has_ignore, a.ignore_index, V, s.first_bad);
  CK(cudaGetLastError());
  int flags[9];
  unsigned long long first = 0;
  CK(cudaMemcpyAsync(flags, s.flags, sizeof flags, cudaMemcpyDeviceToHost, st));
  CK(cudaMemcpyAsync(&first, s.first_bad, sizeof first, cudaMemcpyDeviceToHost, st));
  CK(cudaStreamSynchronize(st));
  static const char* const what[9] = {
      "grad_output contains NaN or infinity", "the gradient of lse contains NaN or infinity",
      "grad_coef contains NaN or infinity", "hidden contains NaN or infinity",
      "weight contains NaN or infinity", "linear_bias contains NaN or infinity",
      "the class weights contain NaN or infinity",
      "token_weight must be finite and >= 0",
      "the gradient of the entropy contains NaN or infinity"};
  static const int order[9] = {0, 1, 8, 2, 3, 4, 5, 6, 7};  // fused_linear_ce_check's order
  for (int i : order)
    if (flags[i]) refuse(LOSS_ERR_NON_FINITE, what[i]);
  refuse_first_target(a.targets, first, a.shift, V, a.has_ignore, st);
}

}  // namespace

template <class T>
int64_t fused_linear_ce_cuda_workspace(const FusedArgs<T>& a, const FusedCudaOut<T>& out) {
  return carve(a, out, nullptr).bytes;
}

template <class T>
void fused_linear_ce_cuda(const FusedArgs<T>& a, FusedCudaOut<T>& out, void* workspace,
                          int64_t workspace_bytes, void* stream) {
  std::string why;
  const int st = fused_linear_ce_check_shape(a, &why);
  if (st != LOSS_OK) refuse(st, why);
  require_device("fused_linear_ce");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab, C = device_chunk(a);
  const int64_t nvb = ceil_div(V, BN);
  const Scratch<T> sc = carve(a, out, workspace);
  if (!workspace || workspace_bytes < sc.bytes)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the workspace has " + std::to_string(workspace_bytes) +
                                         " bytes, this call needs " + std::to_string(sc.bytes));
  const bool want_dh = out.d_hidden, want_dw = out.d_weight, want_db = out.d_bias;
  const bool grad = want_dh || want_dw || want_db;
  const bool half_g = is_half(out.grad_elem);
  if (half_g && !is_half(a.elem))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
  if (out.accuracy && !out.pred)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the accuracy needs the per-token argmax (pred)");
  if ((out.entropy || out.entropy_tok) && !a.entropy)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "an entropy output needs FusedArgs::entropy");
  if ((out.loss || out.z || out.entropy) && a.reduction == Reduction::None)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "reduction none has per-token losses only (loss_tok)");
  check_data(a, sc, s);

  const double cap = a.has_softcap ? a.softcap : 0.0;
  const double tcap = math::tempered_cap(cap, a.temperature);  // the gradient sweep's amplitude
  const T* cw = a.class_weight;
  k_prepare<T><<<1, RT, 0, s>>>(a.targets, N, V, a.shift, a.seq_len, a.has_ignore, a.ignore_index,
                                cw, a.token_weight, sc.valid, sc.prep);
  CK(cudaGetLastError());
  T* dw = want_dw ? (half_g ? sc.dw_acc : static_cast<T*>(out.d_weight)) : nullptr;
  T* db = want_db ? (half_g ? sc.db_acc : static_cast<T*>(out.d_bias)) : nullptr;
  if (db) CK(cudaMemsetAsync(db, 0, sizeof(T) * size_t(V), s));
  const size_t esz = elem_bytes(a.elem);
  const unsigned char* H = static_cast<const unsigned char*>(a.hidden);

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = std::min(C, N - t0);
    TileArgs<T> f;
    f.M = c, f.N = V, f.K = D;
    f.A = H + size_t(t0 * D) * esz, f.lda = D;
    f.B = a.weight, f.ldb = D;
    f.stats = sc.stats, f.nvb = nvb;
    f.logits = grad ? sc.logits : nullptr;
    f.bias = a.bias, f.cap = cap, f.temperature = a.temperature, f.entropy = a.entropy;
    f.stats_w = a.label_smoothing > 0.0 || out.logit_sum ? cw : nullptr;
    f.targets = a.targets, f.valid = sc.valid, f.t0 = t0, f.shift = a.shift;
    f.ztarget = sc.ztarget;
    CK(cudaMemsetAsync(sc.ztarget, 0xff, sizeof(double) * size_t(c), s));  // NaN: no target
    launch_forward(a.elem, f, s);

    MergeArgs<T> m;
    m.stats = sc.stats, m.nvb = nvb, m.c = c, m.t0 = t0, m.V = V, m.shift = a.shift;
    m.valid = sc.valid, m.targets = a.targets, m.cw = cw, m.tw = a.token_weight;
    m.ztarget = sc.ztarget, m.prep = sc.prep;
    m.eps = a.label_smoothing, m.zs = a.z_loss, m.cap = tcap, m.reduction = a.reduction;
    m.grad_scale = a.grad_scale, m.grad_output = a.grad_output, m.grad_lse = a.grad_lse;
    m.grad_coef = a.grad_coef, m.with_grad = grad, m.temperature = a.temperature;
    m.entropy = a.entropy, m.grad_entropy = a.grad_entropy;
    m.entropy_grad_scale = a.entropy_grad_scale, m.ent = sc.ent, m.entropy_tok = out.entropy_tok;
    m.ce = sc.ce, m.zl = sc.zl, m.lse = out.lse, m.loss_tok = out.loss_tok, m.z_tok = out.z_tok;
    m.target_logit = out.target_logit, m.logit_sum = out.logit_sum, m.pred = out.pred;
    m.lse_c = sc.lse_c, m.coef = sc.coef;
    k_merge<T><<<unsigned(ceil_div(c, MERGE_WARPS)), 32 * MERGE_WARPS, 0, s>>>(m);
    CK(cudaGetLastError());
    if (!grad) continue;

    {  // at most 8,192 blocks, as grid_for: columns over x (8 or more a thread, so a row's
       // coefficients are read once for several), rows over y
      const unsigned gx = unsigned(std::min<int64_t>(ceil_div(V, 8 * 256), 64));
      const unsigned gy = unsigned(std::min<int64_t>(c, 8192 / gx));
      k_softmax_grad<T><<<dim3(gx, gy), 256, 0, s>>>(sc.logits, c, V, sc.lse_c, sc.coef, cw, tcap);
    }
    CK(cudaGetLastError());
    launch_backward(a.elem, sc.logits, t0, c, V, D, a.weight, H, out.d_hidden, out.grad_elem, dw,
                    db, s);
  }

  k_finish<T><<<1, RT, 0, s>>>(sc.ce, sc.zl, sc.ent, sc.valid, out.pred, a.targets, a.shift, N,
                               sc.prep, cw != nullptr || a.token_weight != nullptr,
                               a.token_weight != nullptr, a.reduction,
                               out.sums ? out.sums : sc.sums, out.loss, out.z, out.entropy,
                               out.accuracy);
  CK(cudaGetLastError());
  if (half_g) {
    if (want_dw) narrow(sc.dw_acc, out.d_weight, V * D, out.grad_elem, s);
    if (want_db) narrow(sc.db_acc, out.d_bias, V, out.grad_elem, s);
  }
}

template <class T>
void fused_linear_ce_cuda_host(const FusedArgs<T>& a, FusedOut<T>& out) {
  require_device("fused_linear_ce");
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const size_t esz = elem_bytes(a.elem), tsz = sizeof(T);
  FusedArgs<T> d = a;
  DevBuf hidden(a.hidden, size_t(N * D) * esz), weight(a.weight, size_t(V * D) * esz);
  DevBuf bias, targets, cw, tw, go, gl, gc, ge;
  d.hidden = hidden.p;
  d.weight = weight.p;
  if (a.bias) bias = DevBuf(a.bias, size_t(V) * esz), d.bias = bias.p;
  // targets: the scored rows read targets[t + shift] for t < N - shift, all inside the N given
  targets = DevBuf(a.targets, size_t(N) * sizeof(int64_t));
  d.targets = targets.as<int64_t>();
  if (a.class_weight) cw = DevBuf(a.class_weight, size_t(V) * tsz), d.class_weight = cw.as<T>();
  if (a.token_weight) tw = DevBuf(a.token_weight, size_t(N) * tsz), d.token_weight = tw.as<T>();
  if (a.grad_output) go = DevBuf(a.grad_output, size_t(N) * tsz), d.grad_output = go.as<T>();
  if (a.grad_lse) gl = DevBuf(a.grad_lse, size_t(N) * tsz), d.grad_lse = gl.as<T>();
  if (a.grad_coef) gc = DevBuf(a.grad_coef, size_t(3 * N) * tsz), d.grad_coef = gc.as<T>();
  if (a.grad_entropy) ge = DevBuf(a.grad_entropy, size_t(N) * tsz), d.grad_entropy = ge.as<T>();

  FusedCudaOut<T> o;
  o.grad_elem = out.grad_elem;
  const size_t gsz = elem_bytes(out.grad_elem);
  DevBuf lse(size_t(N) * tsz), sums(14 * sizeof(double)), loss_tok, z_tok, pred, tl, ls, et, dh,
      dw, db;
  o.lse = lse.as<T>();
  o.sums = sums.as<double>();
  if (out.loss_tok) loss_tok = DevBuf(size_t(N) * tsz), o.loss_tok = loss_tok.as<T>();
  if (out.z_tok) z_tok = DevBuf(size_t(N) * tsz), o.z_tok = z_tok.as<T>();
  if (out.pred) pred = DevBuf(size_t(N) * sizeof(int64_t)), o.pred = pred.as<int64_t>();
  if (out.target_logit) tl = DevBuf(size_t(N) * tsz), o.target_logit = tl.as<T>();
  if (out.logit_sum) ls = DevBuf(size_t(N) * tsz), o.logit_sum = ls.as<T>();
  if (out.entropy_tok) et = DevBuf(size_t(N) * tsz), o.entropy_tok = et.as<T>();
  if (out.d_hidden) dh = DevBuf(size_t(N * D) * gsz), o.d_hidden = dh.p;
  if (out.d_weight) dw = DevBuf(size_t(V * D) * gsz), o.d_weight = dw.p;
  if (out.d_bias) db = DevBuf(size_t(V) * gsz), o.d_bias = db.p;
  DevBuf ws(size_t(fused_linear_ce_cuda_workspace(d, o)));
  fused_linear_ce_cuda(d, o, ws.p, fused_linear_ce_cuda_workspace(d, o), nullptr);

  to_host(out.lse, o.lse, size_t(N) * tsz);
  to_host(out.loss_tok, o.loss_tok, size_t(N) * tsz);
  to_host(out.z_tok, o.z_tok, size_t(N) * tsz);
  to_host(out.pred, o.pred, size_t(N) * sizeof(int64_t));
  to_host(out.target_logit, o.target_logit, size_t(N) * tsz);
  to_host(out.logit_sum, o.logit_sum, size_t(N) * tsz);
  to_host(out.entropy_tok, o.entropy_tok, size_t(N) * tsz);
  to_host(out.d_hidden, o.d_hidden, size_t(N * D) * gsz);
  // A half d_weight/d_bias lands in the first V*D (V) uint16 of the host accumulators, as the
  // CPU backend leaves it.
  to_host(out.d_weight, o.d_weight, size_t(V * D) * gsz);
  to_host(out.d_bias, o.d_bias, size_t(V) * gsz);
  double s[14];
  to_host(s, o.sums, sizeof s);
  out.ce.total = s[0], out.ce.first = s[1], out.ce.shifted = s[2], out.ce.count = int64_t(s[3]);
  out.z.total = s[4], out.z.first = s[5], out.z.shifted = s[6], out.z.count = int64_t(s[7]);
  out.weight_sum = s[8];
  out.n_correct = int64_t(s[9]);
  out.token_weight_sum = s[10];
  if (a.entropy) out.ent.total = s[11], out.ent.first = s[12], out.ent.shifted = s[13],
                 out.ent.count = out.ce.count;
  out.weighted = a.class_weight != nullptr || a.token_weight != nullptr;
  out.token_weighted = a.token_weight != nullptr;
}

template int64_t fused_linear_ce_cuda_workspace<float>(const FusedArgs<float>&, const FusedCudaOut<float>&);
template int64_t fused_linear_ce_cuda_workspace<double>(const FusedArgs<double>&, const FusedCudaOut<double>&);
template void fused_linear_ce_cuda<float>(const FusedArgs<float>&, FusedCudaOut<float>&, void*, int64_t, void*);
template void fused_linear_ce_cuda<double>(const FusedArgs<double>&, FusedCudaOut<double>&, void*, int64_t, void*);
template void fused_linear_ce_cuda_host<float>(const FusedArgs<float>&, FusedOut<float>&);
template void fused_linear_ce_cuda_host<double>(const FusedArgs<double>&, FusedOut<double>&);

void cuda_set_device(int device) {
  require_device("cuda_set_device");
  CK(cudaSetDevice(device));
}

}  // namespace lossk
}  // namespace algenta

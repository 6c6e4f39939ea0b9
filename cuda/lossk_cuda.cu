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
struct Scratch {
  DataFlags data;              // the data checks' flags
  double* prep;                // 4
  uint8_t* valid;              // N
  double *ce, *zl, *ent;       // N (ent with entropy)
  double *ztarget, *lse_c, *coef;  // C, C, 6C
  BlockStatD* stats;           // C * nvb
  T* logits;                   // C * V, with gradients
  HalfGradAcc<T> acc;          // half gradients' accumulators
  double* sums;                // 14, when the caller passes none
  int64_t bytes;
};

template <class T>
Scratch<T> carve(const FusedArgs<T>& a, const FusedCudaOut<T>& out, void* base) {
  const int64_t N = a.n_tok, V = a.vocab, D = a.d_model;
  const int64_t C = device_chunk_for(a.elem, a.opt.chunk, N), nvb = ceil_div(V, BN);
  const bool grad = out.d_hidden || out.d_weight || out.d_bias;
  Carver cv(base);
  Scratch<T> s;
  s.data = DataFlags::take(cv);
  s.prep = cv.take<double>(4);
  s.valid = cv.take<uint8_t>(N);
  s.ce = cv.take<double>(N);
  s.zl = cv.take<double>(N);
  s.ent = a.opt.entropy ? cv.take<double>(N) : nullptr;
  s.ztarget = cv.take<double>(C);
  s.lse_c = cv.take<double>(C);
  s.coef = cv.take<double>(6 * C);
  s.stats = cv.take<BlockStatD>(C * nvb);
  s.sums = cv.take<double>(14);
  s.logits = grad ? cv.take<T>(C * V) : nullptr;
  s.acc = HalfGradAcc<T>::take(cv, out, V, D);
  s.bytes = cv.off;
  return s;
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
  enter("fused_linear_ce", fused_linear_ce_check_shape(a, &why), why);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const CrossEntropyOptions& o = a.opt;
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const int64_t C = device_chunk_for(a.elem, o.chunk, N), nvb = ceil_div(V, BN);
  const Scratch<T> sc = carve(a, out, workspace);
  const Grads<T> gr = begin_call(workspace, workspace_bytes, sc.bytes, a.elem, out, sc.acc);
  if (out.accuracy && !out.pred)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the accuracy needs the per-token argmax (pred)");
  if ((out.entropy || out.entropy_tok) && !o.entropy)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "an entropy output needs the entropy option");
  if ((out.loss || out.z || out.entropy) && o.reduction == Reduction::None)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "reduction none has per-token losses only (loss_tok)");
  sc.data.refuse_bad(finite_inputs(a), a.token_weight,
                     {a.targets, N, o.shift, a.seq_len, o.has_ignore, o.ignore_index, V}, s);

  const double cap = o.has_softcap ? o.softcap : 0.0;
  const double tcap = math::tempered_cap(cap, o.temperature);  // the gradient sweep's amplitude
  const T* cw = a.class_weight;
  k_prepare<T><<<1, RT, 0, s>>>(a.targets, N, V, o.shift, a.seq_len, o.has_ignore, o.ignore_index,
                                cw, a.token_weight, sc.valid, sc.prep);
  CK(cudaGetLastError());
  start_grads(gr, V, s);
  const size_t esz = elem_bytes(a.elem);
  const unsigned char* H = static_cast<const unsigned char*>(a.hidden);

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = std::min(C, N - t0);
    TileArgs<T> f;
    f.M = c, f.N = V, f.K = D;
    f.A = H + size_t(t0 * D) * esz, f.lda = D;
    f.B = a.weight, f.ldb = D;
    f.stats = sc.stats, f.nvb = nvb;
    f.logits = gr.any ? sc.logits : nullptr;
    f.bias = a.bias, f.cap = cap, f.temperature = o.temperature, f.entropy = o.entropy;
    f.stats_w = o.label_smoothing > 0.0 || out.logit_sum ? cw : nullptr;
    f.targets = a.targets, f.valid = sc.valid, f.t0 = t0, f.shift = o.shift;
    f.ztarget = sc.ztarget;
    CK(cudaMemsetAsync(sc.ztarget, 0xff, sizeof(double) * size_t(c), s));  // NaN: no target
    launch_forward(a.elem, f, s);

    MergeArgs<T> m;
    m.opt = o;
    m.stats = sc.stats, m.nvb = nvb, m.c = c, m.t0 = t0, m.V = V, m.cap = tcap;
    m.valid = sc.valid, m.targets = a.targets, m.cw = cw, m.tw = a.token_weight;
    m.ztarget = sc.ztarget, m.prep = sc.prep;
    m.grad_output = a.grad_output, m.grad_lse = a.grad_lse, m.grad_coef = a.grad_coef;
    m.grad_entropy = a.grad_entropy, m.with_grad = gr.any;
    m.ent = sc.ent, m.entropy_tok = out.entropy_tok;
    m.ce = sc.ce, m.zl = sc.zl, m.lse = out.lse, m.loss_tok = out.loss_tok, m.z_tok = out.z_tok;
    m.target_logit = out.target_logit, m.logit_sum = out.logit_sum, m.pred = out.pred;
    m.lse_c = sc.lse_c, m.coef = sc.coef;
    k_merge<T><<<unsigned(ceil_div(c, MERGE_WARPS)), 32 * MERGE_WARPS, 0, s>>>(m);
    CK(cudaGetLastError());
    if (!gr.any) continue;

    {  // at most 8,192 blocks, as grid_for: columns over x (8 or more a thread, so a row's
       // coefficients are read once for several), rows over y
      const unsigned gx = unsigned(std::min<int64_t>(ceil_div(V, 8 * 256), 64));
      const unsigned gy = unsigned(std::min<int64_t>(c, 8192 / gx));
      k_softmax_grad<T><<<dim3(gx, gy), 256, 0, s>>>(sc.logits, c, V, sc.lse_c, sc.coef, cw, tcap);
    }
    CK(cudaGetLastError());
    launch_backward(a.elem, sc.logits, t0, c, V, D, a.weight, H, out, gr, s);
  }

  k_finish<T><<<1, RT, 0, s>>>(sc.ce, sc.zl, sc.ent, sc.valid, out.pred, a.targets, o.shift, N,
                               sc.prep, cw != nullptr || a.token_weight != nullptr,
                               a.token_weight != nullptr, o.reduction,
                               out.sums ? out.sums : sc.sums, out.loss, out.z, out.entropy,
                               out.accuracy);
  CK(cudaGetLastError());
  end_call(out, gr, V, D, s);
}

template <class T>
void fused_linear_ce_cuda_host(const FusedArgs<T>& a, FusedOut<T>& out) {
  require_device("fused_linear_ce");
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const size_t esz = elem_bytes(a.elem), tsz = sizeof(T), nt = size_t(N) * tsz;
  HostCall call;
  FusedArgs<T> d = a;
  call.in(d.hidden, size_t(N * D) * esz);
  call.in(d.weight, size_t(V * D) * esz);
  call.in(d.bias, size_t(V) * esz);
  // targets: the scored rows read targets[t + shift] for t < N - shift, all inside the N given
  call.in(d.targets, size_t(N) * sizeof(int64_t));
  call.in(d.class_weight, size_t(V) * tsz);
  call.in(d.token_weight, nt);
  call.in(d.grad_output, nt);
  call.in(d.grad_lse, nt);
  call.in(d.grad_coef, 3 * nt);
  call.in(d.grad_entropy, nt);

  FusedCudaOut<T> o;
  double sums[14];
  call.out(sums, o.sums, sizeof sums);
  call.out(out.lse, o.lse, nt);
  call.out(out.loss_tok, o.loss_tok, nt);
  call.out(out.z_tok, o.z_tok, nt);
  call.out(out.pred, o.pred, size_t(N) * sizeof(int64_t));
  call.out(out.target_logit, o.target_logit, nt);
  call.out(out.logit_sum, o.logit_sum, nt);
  call.out(out.entropy_tok, o.entropy_tok, nt);
  call.grads(out, o, N, D, V);
  call.run(d, o, fused_linear_ce_cuda_workspace<T>, fused_linear_ce_cuda<T>);

  out.ce.total = sums[0], out.ce.first = sums[1], out.ce.shifted = sums[2];
  out.ce.count = int64_t(sums[3]);
  out.z.total = sums[4], out.z.first = sums[5], out.z.shifted = sums[6];
  out.z.count = int64_t(sums[7]);
  out.weight_sum = sums[8];
  out.n_correct = int64_t(sums[9]);
  out.token_weight_sum = sums[10];
  if (a.opt.entropy) out.ent.total = sums[11], out.ent.first = sums[12], out.ent.shifted = sums[13],
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

// lossk's fused linear distillation on a CUDA device (lossk.hpp: DistillArgs), the CPU backend's
// (cpp/src/lossk_distill.cpp) options and exactness contract. Host side and its kernels.
//
// Dimension legend: N tokens, D student d_model, Dt teacher d_model, V vocab, C chunk.
//
// Per call: the data's refusals (one synchronization), k_distill_prepare (which tokens count),
// then per chunk
//   1 k_tile (the cross-entropy's logits tile)  the student's and the teacher's (C, V) logits,
//                                               biases applied
//   2 k_distill_row     one block per token: maxima, exp sums, the divergence's shares and H in
//                       fixed trees, then (with gradients) the student's d_logits in place
//   with gradients: d_hidden, d_weight and d_bias as the cross-entropy's (lossk_launch.cuh)
// and k_distill_finish (token-order sums in a fixed tree, the reduced loss). The per-element
// formulas are lossk_math.hpp's, shared with the CPU backend.
// Exactness: no atomics in any reduction; each token's sums run over a partition of [0, V)
// that depends on V only (thread i takes v = i, i + DT, ...) and fold in a fixed tree, so a token's
// results do not depend on the chunk or on the other tokens of its batch. Bits differ from the
// CPU backend's (another summation order, device libm).
#include <algorithm>
#include <cstdint>
#include <string>

#include "lossk_launch.cuh"

namespace algenta {
namespace lossk {

namespace {

// Threads of k_distill_row: 256, so its float64 sums fit the registers without spilling (1024,
// the one-block reductions' RT, caps a thread at 64 registers and spilled 80 bytes).
constexpr int DT = 256;

__device__ double row_sum(double v, double* red) {
  return gpu::block_tree<DT>(v, red, gpu::TreeSum{});
}
__device__ double row_max(double v, double* red) {
  return gpu::block_tree<DT>(v, red, gpu::TreeMax{});
}

// valid (N): counted or not (a target other than ignore_index; every token without targets);
// prep[0]: the count.
__global__ void __launch_bounds__(RT) k_distill_prepare(const int64_t* targets, int64_t N,
                                                        bool has_ignore, int64_t ignore_index,
                                                        uint8_t* valid, double* prep) {
  __shared__ double red[RT];
  double n = 0.0;
  for (int64_t t = threadIdx.x; t < N; t += RT) {
    const bool v = !targets || math::counted(targets, t, 0, 0, has_ignore, ignore_index);
    valid[t] = v;
    n += v;
  }
  n = block_sum(n, red);
  if (threadIdx.x == 0) prep[0] = n;
}

template <class T>
struct RowArgs {
  DistillOptions opt;  // the call's options (lossk.hpp)
  T* zs;               // (c, V) the student's logits, overwritten by d_logits with gradients
  const T* zt;         // (c, V) the teacher's
  int64_t t0, V;
  const uint8_t* valid;
  const int64_t* targets;  // or null
  Objective obj;       // opt.objective as computed (math::effective_objective)
  double lb, l1b;      // log(beta), log(1 - beta) for JSD
  const T* grad_output;
  const double* prep;
  bool with_grad;
  double *div, *ce;    // (N)
};

// One token per block: the CPU backend's per-row arithmetic (lossk_distill.cpp), each sum over
// the block's fixed partition of the vocabulary folded in a fixed tree.
template <class T>
__global__ void __launch_bounds__(DT) k_distill_row(RowArgs<T> a) {
  __shared__ double red[DT];
  const int64_t r = blockIdx.x, t = a.t0 + r, V = a.V;
  T* zs = a.zs + r * V;
  const T* zt = a.zt + r * V;
  if (!a.valid[t]) {
    if (threadIdx.x == 0) a.div[t] = 0.0, a.ce[t] = 0.0;
    if (a.with_grad)
      for (int64_t v = threadIdx.x; v < V; v += DT) st(zs + v, T(0));
    return;
  }
  const double temp = a.opt.temperature, beta = a.opt.beta;
  double ms = -INFINITY, mt = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += DT) {
    ms = fmax(ms, double(ld(zs + v)));
    mt = fmax(mt, double(ld(zt + v)));
  }
  ms = row_max(ms, red);
  mt = row_max(mt, red);
  const bool has_ce = a.targets != nullptr;
  const bool own_e1 = has_ce && temp != 1.0;
  double ss = 0.0, st_ = 0.0, s1 = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += DT) {
    const double zv = double(ld(zs + v));
    ss += exp((zv - ms) / temp);
    st_ += exp((double(ld(zt + v)) - mt) / temp);
    if (own_e1) s1 += exp(zv - ms);
  }
  ss = row_sum(ss, red);
  st_ = row_sum(st_, red);
  s1 = own_e1 ? row_sum(s1, red) : ss;
  const double lss = log(ss), lst = log(st_), ls1 = log(s1);
  const double fs = 1.0 / ss, ft = 1.0 / st_, f1 = 1.0 / s1;
  int64_t y = -1;
  double ct = 0.0;
  if (has_ce) {
    y = a.targets[t];
    ct = (ms - double(ld(zs + y))) + ls1;  // math::token_ce's form
  }
  double dsum = 0.0, hsum = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += DT) {
    const double zv = double(ld(zs + v)), tv = double(ld(zt + v));
    const double lp = (zv - ms) / temp - lss, lq = (tv - mt) / temp - lst;
    const double p = exp((zv - ms) / temp) * fs;
    const math::DivElem e =
        math::div_elem(a.obj, beta, a.lb, a.l1b, lp, lq, p, exp((tv - mt) / temp) * ft);
    dsum += e.term;
    hsum += p * e.h;
  }
  dsum = row_sum(dsum, red);
  hsum = row_sum(hsum, red);  // its barriers also order every read of zs above before the writes
  if (threadIdx.x == 0) a.div[t] = dsum, a.ce[t] = ct;
  if (!a.with_grad) return;
  const double n = a.prep[0];
  const double sc = math::reduction_scales(a.opt.reduction, true, a.opt.grad_scale, n, n,
                                           a.grad_output ? double(a.grad_output[t]) : 1.0, 1.0).ce;
  const double ks = sc * a.opt.soft_weight / temp, kh = sc * a.opt.hard_weight;
  for (int64_t v = threadIdx.x; v < V; v += DT) {
    const double zv = double(ld(zs + v)), tv = double(ld(zt + v));
    double g = 0.0;
    if (ks != 0.0) {
      const double lp = (zv - ms) / temp - lss, lq = (tv - mt) / temp - lst;
      const double p = exp((zv - ms) / temp) * fs, q = exp((tv - mt) / temp) * ft;
      const double h =
          a.obj == Objective::KL ? 0.0 : math::div_elem(a.obj, beta, a.lb, a.l1b, lp, lq, p, q).h;
      g = ks * math::div_grad(a.obj, beta, p, q, h, hsum);
    }
    if (kh != 0.0) g += kh * (exp(own_e1 ? zv - ms : (zv - ms) / temp) * (own_e1 ? f1 : fs)) -
                        (v == y ? kh : 0.0);
    st(zs + v, T(g));
  }
}

// Token-order results in one block over a fixed partition of [0, N): LossSum's (total, first,
// shifted) of loss_t, div_t and ce_t over the counted tokens, and the count; the reduced scalars
// and the per-token outputs when asked for.
template <class T>
__global__ void __launch_bounds__(RT) k_distill_finish(const double* div, const double* ce,
                                                       const uint8_t* valid, int64_t N, double sw,
                                                       double hw, Reduction rk, double* sums,
                                                       T* loss, T* dout, T* cout, T* loss_tok,
                                                       T* div_tok, T* ce_tok) {
  __shared__ double red[RT];
  int64_t lo, hi;
  share(N, &lo, &hi);
  for (int64_t t = lo; t < hi; ++t) {
    const double l = valid[t] ? sw * div[t] + hw * ce[t] : 0.0;
    if (loss_tok) st(loss_tok + t, T(l));
    if (div_tok) st(div_tok + t, T(div[t]));
    if (ce_tok) st(ce_tok + t, T(ce[t]));
  }
  const double first_t = first_counted(valid, lo, hi, red);
  const bool any = first_t < double(N);
  const int64_t f = any ? int64_t(first_t) : 0;
  const double fd = any ? div[f] : 0.0, fc = any ? ce[f] : 0.0, fl = sw * fd + hw * fc;
  double s[7] = {0, 0, 0, 0, 0, 0, 0};  // loss total/shifted, div, ce, count
  for (int64_t t = lo; t < hi; ++t) {
    if (!valid[t]) continue;
    const double l = sw * div[t] + hw * ce[t];
    s[0] += l, s[1] += l - fl, s[2] += div[t], s[3] += div[t] - fd, s[4] += ce[t];
    s[5] += ce[t] - fc, s[6] += 1.0;
  }
  for (int i = 0; i < 7; ++i) s[i] = block_sum(s[i], red);
  if (threadIdx.x != 0) return;
  const double firsts[3] = {fl, fd, fc};
  for (int k = 0; k < 3; ++k) {
    sums[3 * k] = s[2 * k], sums[3 * k + 1] = firsts[k], sums[3 * k + 2] = s[2 * k + 1];
  }
  sums[9] = s[6];
  T* outs[3] = {loss, dout, cout};
  for (int k = 0; k < 3; ++k)
    if (outs[k])
      outs[k][0] =
          T(rk == Reduction::Sum ? s[2 * k] : math::sum_mean(firsts[k], s[2 * k + 1], s[6]));
}

template <class T>
struct DistillScratch {
  DataFlags data;                  // the data checks' flags
  double* prep;                    // 1
  uint8_t *valid, *none;           // N each (none: all zero, the tile's "no target" rows)
  double *div, *ce;                // N each
  double* ztarget;                 // C (the tile writes none: every row is "not counted")
  BlockStatD* stats;               // C * nvb (the tile's statistics, unused)
  T *zs, *zt;                      // C * V each
  HalfGradAcc<T> acc;              // half gradients' accumulators
  double* sums;                    // 10, when the caller passes none
  int64_t bytes;
};

template <class T>
DistillScratch<T> carve(const DistillArgs<T>& a, const DistillCudaOut<T>& out, void* base) {
  const int64_t N = a.n_tok, V = a.vocab, C = device_chunk_for(a.elem, a.opt.chunk, a.n_tok);
  Carver cv(base);
  DistillScratch<T> s;
  s.data = DataFlags::take(cv);
  s.prep = cv.take<double>(1);
  s.valid = cv.take<uint8_t>(N);
  s.none = cv.take<uint8_t>(N);
  s.div = cv.take<double>(N);
  s.ce = cv.take<double>(N);
  s.ztarget = cv.take<double>(C);
  s.stats = cv.take<BlockStatD>(C * ceil_div(V, BN));
  s.zs = cv.take<T>(C * V);
  s.zt = cv.take<T>(C * V);
  s.acc = HalfGradAcc<T>::take(cv, out, V, a.d_model);
  s.sums = cv.take<double>(10);
  s.bytes = cv.off;
  return s;
}

}  // namespace

template <class T>
int64_t fused_linear_distill_cuda_workspace(const DistillArgs<T>& a, const DistillCudaOut<T>& out) {
  return carve(a, out, nullptr).bytes;
}

template <class T>
void fused_linear_distill_cuda(const DistillArgs<T>& a, DistillCudaOut<T>& out, void* workspace,
                               int64_t workspace_bytes, void* stream) {
  std::string why;
  int st = fused_linear_distill_check_shape(a, &why);
  if (st == LOSS_OK && a.shard)
    st = LOSS_ERR_LENGTH_MISMATCH, why = "the vocab-parallel form computes on the CPU backend only";
  enter("fused_linear_distill", st, why);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const DistillOptions& o = a.opt;
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  const int64_t C = device_chunk_for(a.elem, o.chunk, N), nvb = ceil_div(V, BN);
  const DistillScratch<T> sc = carve(a, out, workspace);
  const Grads<T> gr = begin_call(workspace, workspace_bytes, sc.bytes, a.elem, out, sc.acc);
  if ((out.loss || out.div || out.ce) && o.reduction == Reduction::None)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "reduction none has per-token losses only (loss_tok)");
  sc.data.refuse_bad(finite_inputs(a), static_cast<const T*>(nullptr),
                     {a.targets, N, 0, 0, o.has_ignore, o.ignore_index, V}, s);

  k_distill_prepare<<<1, RT, 0, s>>>(a.targets, N, o.has_ignore, o.ignore_index, sc.valid,
                                     sc.prep);
  CK(cudaGetLastError());
  CK(cudaMemsetAsync(sc.none, 0, size_t(N), s));
  start_grads(gr, V, s);
  const Objective obj = math::effective_objective(o.objective, o.beta);
  const unsigned char* H = static_cast<const unsigned char*>(a.hidden);
  const unsigned char* TH = static_cast<const unsigned char*>(a.t_hidden);
  const size_t esz = elem_bytes(a.elem), tesz = elem_bytes(a.t_elem);

  for (int64_t t0 = 0; t0 < N; t0 += C) {
    const int64_t c = std::min(C, N - t0);
    // Both heads' logits (biased; no cap, T = 1: the row kernel divides by T in double). Every
    // row is "not counted" for the tile (none), so it picks no target logit.
    for (int head = 0; head < 2; ++head) {
      TileArgs<T> f;
      f.M = c, f.N = V, f.K = head ? a.t_d_model : D;
      f.A = head ? TH + size_t(t0 * a.t_d_model) * tesz : H + size_t(t0 * D) * esz;
      f.lda = f.K;
      f.B = head ? a.t_weight : a.weight, f.ldb = f.K;
      f.stats = sc.stats, f.nvb = nvb;
      f.logits = head ? sc.zt : sc.zs;
      f.bias = head ? a.t_bias : a.bias;
      f.valid = sc.none, f.t0 = t0, f.ztarget = sc.ztarget;
      launch_forward(head ? a.t_elem : a.elem, f, s);
    }
    RowArgs<T> r;
    r.opt = o;
    r.zs = sc.zs, r.zt = sc.zt, r.t0 = t0, r.V = V, r.valid = sc.valid, r.targets = a.targets;
    r.obj = obj;
    r.lb = obj == Objective::JSD ? std::log(o.beta) : 0.0;
    r.l1b = obj == Objective::JSD ? std::log1p(-o.beta) : 0.0;
    r.grad_output = a.grad_output;
    r.prep = sc.prep, r.with_grad = gr.any, r.div = sc.div, r.ce = sc.ce;
    k_distill_row<T><<<unsigned(c), DT, 0, s>>>(r);
    CK(cudaGetLastError());
    if (!gr.any) continue;
    launch_backward(a.elem, sc.zs, t0, c, V, D, a.weight, H, out, gr, s);
  }
  k_distill_finish<T><<<1, RT, 0, s>>>(sc.div, sc.ce, sc.valid, N, o.soft_weight, o.hard_weight,
                                       o.reduction, out.sums ? out.sums : sc.sums, out.loss,
                                       out.div, out.ce, out.loss_tok, out.div_tok, out.ce_tok);
  CK(cudaGetLastError());
  end_call(out, gr, V, D, s);
}

template <class T>
void fused_linear_distill_cuda_host(const DistillArgs<T>& a, DistillOut<T>& out) {
  require_device("fused_linear_distill");
  const int64_t N = a.n_tok, D = a.d_model, Dt = a.t_d_model, V = a.vocab;
  const size_t esz = elem_bytes(a.elem), tesz = elem_bytes(a.t_elem), nt = size_t(N) * sizeof(T);
  HostCall call;
  DistillArgs<T> d = a;
  call.in(d.hidden, size_t(N * D) * esz);
  call.in(d.weight, size_t(V * D) * esz);
  call.in(d.t_hidden, size_t(N * Dt) * tesz);
  call.in(d.t_weight, size_t(V * Dt) * tesz);
  call.in(d.bias, size_t(V) * esz);
  call.in(d.t_bias, size_t(V) * tesz);
  call.in(d.targets, size_t(N) * sizeof(int64_t));
  call.in(d.grad_output, nt);

  DistillCudaOut<T> o;
  double sums[10];
  call.out(sums, o.sums, sizeof sums);
  call.out(out.loss_tok, o.loss_tok, nt);
  call.out(out.div_tok, o.div_tok, nt);
  call.out(out.ce_tok, o.ce_tok, nt);
  call.grads(out, o, N, D, V);
  call.run(d, o, fused_linear_distill_cuda_workspace<T>, fused_linear_distill_cuda<T>);

  LossSum* ls[3] = {&out.loss, &out.div, &out.ce};
  for (int k = 0; k < 3; ++k)
    ls[k]->total = sums[3 * k], ls[k]->first = sums[3 * k + 1], ls[k]->shifted = sums[3 * k + 2],
    ls[k]->count = int64_t(sums[9]);
}

template int64_t fused_linear_distill_cuda_workspace<float>(const DistillArgs<float>&, const DistillCudaOut<float>&);
template int64_t fused_linear_distill_cuda_workspace<double>(const DistillArgs<double>&, const DistillCudaOut<double>&);
template void fused_linear_distill_cuda<float>(const DistillArgs<float>&, DistillCudaOut<float>&, void*, int64_t, void*);
template void fused_linear_distill_cuda<double>(const DistillArgs<double>&, DistillCudaOut<double>&, void*, int64_t, void*);
template void fused_linear_distill_cuda_host<float>(const DistillArgs<float>&, DistillOut<float>&);
template void fused_linear_distill_cuda_host<double>(const DistillArgs<double>&, DistillOut<double>&);

}  // namespace lossk
}  // namespace algenta

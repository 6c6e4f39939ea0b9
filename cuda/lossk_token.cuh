// The per-token kernels of lossk's fused loss on a CUDA device (k_prepare, k_merge,
// k_softmax_grad, k_bias_grad, k_narrow, k_finish; see lossk_cuda.cu for the order they run in).
// Their arithmetic per token is lossk_math.hpp's, shared with the CPU backend.
#pragma once

#include "lossk_tile.cuh"

namespace algenta {
namespace lossk {
namespace {

constexpr int RT = 1024;  // threads of the one-block reductions

// Token weights: the flag is set when any is NaN, infinite or negative.
template <class T>
__global__ void k_check_token_weights(const T* p, int64_t n, int* flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    if (!math::token_weight_ok(double(p[i]))) {
      atomicExch(flag, 1);
      return;
    }
}

// Sums and minima over the block in a fixed tree (gpu::block_tree): the same bits on every run.
__device__ double block_sum(double v, double* red) { return gpu::block_tree<RT>(v, red, gpu::TreeSum{}); }
__device__ double block_min(double v, double* red) { return gpu::block_tree<RT>(v, red, gpu::TreeMin{}); }

// Thread i's contiguous share of [0, n): a partition that depends on n only.
__device__ __forceinline__ void share(int64_t n, int64_t* lo, int64_t* hi) {
  *lo = n * int64_t(threadIdx.x) / RT;
  *hi = n * int64_t(threadIdx.x + 1) / RT;
}

// The first counted token (as a double; infinity when none) of the block's partition [lo, hi).
__device__ double first_counted(const uint8_t* valid, int64_t lo, int64_t hi, double* red) {
  double first_t = INFINITY;
  for (int64_t t = lo; t < hi; ++t)
    if (valid[t]) {
      first_t = double(t);
      break;
    }
  return block_min(first_t, red);
}

// prep: (0) counted tokens, (1) their sum of u w_y (token weight times class weight), (2) sum of
// all class weights (V without), (3) their sum of u (the count without token weights). valid: per
// token, counted or not.
template <class T>
__global__ void __launch_bounds__(RT) k_prepare(const int64_t* targets, int64_t N, int64_t V,
                                                int64_t shift, int64_t seq, bool has_ignore,
                                                int64_t ignore, const T* cw, const T* tw,
                                                uint8_t* valid, double* prep) {
  __shared__ double red[RT];
  int64_t lo, hi;
  share(N, &lo, &hi);
  double cnt = 0.0, ws = 0.0, us = 0.0;
  for (int64_t t = lo; t < hi; ++t) {
    const bool v = math::counted(targets, t, shift, seq, has_ignore, ignore);
    valid[t] = v;
    if (v) {
      const double u = math::token_weight_of(tw, t, shift);
      cnt += 1.0;
      us += u;
      ws += u * (cw ? double(cw[targets[t + shift]]) : 1.0);
    }
  }
  cnt = block_sum(cnt, red);
  ws = block_sum(ws, red);
  us = block_sum(us, red);
  double wa = double(V);
  if (cw) {
    share(V, &lo, &hi);
    double a = 0.0;
    for (int64_t v = lo; v < hi; ++v) a += double(cw[v]);
    wa = block_sum(a, red);
  }
  if (threadIdx.x == 0) {
    prep[0] = cnt;
    prep[1] = ws;
    prep[2] = wa;
    prep[3] = us;
  }
}

template <class T>
struct MergeArgs {
  CrossEntropyOptions opt;            // the call's options (lossk.hpp)
  const BlockStatD* stats = nullptr;  // (c, nvb)
  int64_t nvb = 0, c = 0, t0 = 0, V = 0;
  const uint8_t* valid = nullptr;
  const int64_t* targets = nullptr;
  const T* cw = nullptr;
  const T* tw = nullptr;            // (N) token weights, aligned with targets, or null
  const double* ztarget = nullptr;  // (c)
  const double* prep = nullptr;
  double cap = 0.0;                 // the soft cap's tempered amplitude (math::tempered_cap)
  const T* grad_output = nullptr;
  const T* grad_lse = nullptr;
  const T* grad_coef = nullptr;
  const T* grad_entropy = nullptr;  // (N) the entropy's upstream gradient (None), or null
  bool with_grad = false;
  double* ce = nullptr;   // (N)
  double* zl = nullptr;   // (N)
  double* ent = nullptr;  // (N) u_t H_t, with entropy
  T* entropy_tok = nullptr;  // (N) or null
  T* lse = nullptr;       // (N) or null
  T* loss_tok = nullptr;  // (N) or null
  T* z_tok = nullptr;     // (N) or null
  T* target_logit = nullptr;
  T* logit_sum = nullptr;
  int64_t* pred = nullptr;
  double* lse_c = nullptr;  // (c) the chunk rows' lse, for k_softmax_grad
  // (c, 6): a, b, the target's term (cap's derivative applied), target, the entropy's e, max
  double* coef = nullptr;
};

// A token's vocab blocks merged as lossk_math's merge_blocks merges them, the same bits, by one
// warp, whose lanes read the records side by side where one thread a token walked its row one
// record at a time: the overall max (the first block holding it: a max is exact, ties go to the
// lower block) from each lane's strided share; then 32 records at a time copied to shared memory
// with coalesced 8-byte loads, each lane forms its block's factor, and lane 0 adds the blocks in
// block order. Every lane returns the result.
constexpr int MERGE_WARPS = 4;  // tokens a k_merge block
static_assert(sizeof(BlockStatD) == 5 * sizeof(double), "a record is copied as 5 doubles");
__device__ math::Merged warp_merge_blocks(const BlockStatD* st, int64_t nvb) {
  __shared__ double raw[MERGE_WARPS][32 * 5];  // 32 records
  __shared__ double fac[MERGE_WARPS][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  double mx = -INFINITY;
  int64_t mb = INT64_MAX;  // a lane without blocks never wins a tie
  for (int64_t b = lane; b < nvb; b += 32) {
    const double m = __ldg(&st[b].max);
    if (b == lane || m > mx) mx = m, mb = b;
  }
  for (int off = 16; off; off >>= 1) {
    const double om = __shfl_xor_sync(0xffffffffu, mx, off);
    const int64_t ob = __shfl_xor_sync(0xffffffffu, mb, off);
    if (om > mx || (om == mx && ob < mb)) mx = om, mb = ob;
  }
  math::Merged r{mx, 0.0, 0.0, 0.0, mb};
  const BlockStatD* rec = reinterpret_cast<const BlockStatD*>(raw[w]);
  for (int64_t b0 = 0; b0 < nvb; b0 += 32) {
    const int nb = int(min(int64_t(32), nvb - b0));
    const double* src = reinterpret_cast<const double*>(st + b0);
    for (int i = lane; i < 5 * nb; i += 32) raw[w][i] = __ldg(src + i);
    __syncwarp();
    if (lane < nb) fac[w][lane] = math::merge_factor(rec[lane].max, mx);
    __syncwarp();
    if (lane == 0)
      for (int j = 0; j < nb; ++j) math::merge_add(r, rec[j], fac[w][j]);
    __syncwarp();
  }
  r.sumexp = __shfl_sync(0xffffffffu, r.sumexp, 0);
  r.sumz = __shfl_sync(0xffffffffu, r.sumz, 0);
  r.sument = __shfl_sync(0xffffffffu, r.sument, 0);
  return r;
}

// One warp per token of the chunk (MERGE_WARPS a block): its blocks merged (warp_merge_blocks),
// then lane 0 runs the same arithmetic as the CPU backend's step 2.
template <class T>
__global__ void __launch_bounds__(32 * MERGE_WARPS) k_merge(MergeArgs<T> a) {
  const int64_t r = int64_t(blockIdx.x) * MERGE_WARPS + (threadIdx.x >> 5);
  if (r >= a.c) return;  // the whole warp: r is the warp's
  const math::Merged mg = warp_merge_blocks(a.stats + r * a.nvb, a.nvb);
  if ((threadIdx.x & 31) != 0) return;
  const int64_t t = a.t0 + r, V = a.V;
  const CrossEntropyOptions& o = a.opt;
  const double m = mg.max, sz = mg.sumz;
  if (a.pred) a.pred[t] = mg.block * BN + a.stats[r * a.nvb + mg.block].arg;
  const bool valid = a.valid[t] != 0;
  const double zt = a.ztarget[r];
  if (a.logit_sum) a.logit_sum[t] = T(sz);
  if (a.target_logit) a.target_logit[t] = T(valid ? zt : NAN);
  const double logse = log(mg.sumexp);
  const double l = m + logse;
  const double w_all = a.prep[2], eps = o.label_smoothing, zs = o.lse_square_scale;
  double ct = 0.0, zl = 0.0, wy = 1.0, u = 1.0;
  int64_t y = -1;
  if (valid) {
    y = a.targets[t + o.shift];
    wy = a.cw ? double(a.cw[y]) : 1.0;
    u = math::token_weight_of(a.tw, t, o.shift);
    ct = u * math::token_ce(m, logse, zt, sz, wy, w_all, eps, V, a.cw != nullptr);
    zl = u * (zs * l * l);
  }
  a.ce[t] = ct;
  a.zl[t] = zl;
  if (a.lse) a.lse[t] = T(l);
  if (a.loss_tok) a.loss_tok[t] = T(ct + zl);
  if (a.z_tok) a.z_tok[t] = T(zl);
  const double dmax = o.entropy ? mg.sument / mg.sumexp : 0.0;  // max - E[z']
  if (o.entropy) {
    const double h = valid ? u * math::token_entropy(mg, logse) : 0.0;
    a.ent[t] = h;
    if (a.entropy_tok) a.entropy_tok[t] = T(h);
  }
  if (!a.with_grad) return;
  a.lse_c[r] = l;
  math::Coef g;
  if (a.grad_coef) {
    const T* k3 = a.grad_coef + 3 * t;
    g = {double(k3[0]), double(k3[1]), valid ? double(k3[2]) : 0.0};
  } else {
    const math::Scales sc = math::reduction_scales(o.reduction, valid, o.grad_scale, a.prep[3],
                                                   a.prep[1],
                                                   a.grad_output ? double(a.grad_output[t]) : 1.0,
                                                   u);
    g = math::grad_coef(sc, eps, V, wy, w_all, zs, l, a.grad_lse ? double(a.grad_lse[t]) : 0.0);
    if (a.grad_entropy || o.entropy_grad_scale != 0.0) {
      const double s_h =
          math::entropy_scale(o.reduction, valid, o.entropy_grad_scale, a.prep[3],
                              a.grad_entropy ? double(a.grad_entropy[t]) : 0.0, u);
      g = math::with_entropy(g, s_h, dmax);
    }
  }
  g = math::tempered(g, o.temperature);
  const double f = g.c != 0.0 ? math::cap_slope<T>(zt, a.cap) : 1.0;
  double* k = a.coef + 6 * r;
  k[0] = g.a;
  k[1] = g.b;
  k[2] = g.c * f;
  k[3] = double(y);
  k[4] = g.e;
  k[5] = m;
}

// The chunk's logits (c, V) overwritten by their gradient, as the CPU backend's softmax_grad.
template <class T>
__global__ void k_softmax_grad(T* g, int64_t c, int64_t V, const double* lse_c, const double* coef,
                               const T* w, double cap) {
  const T ic = cap > 0.0 ? T(1.0 / cap) : T(0);
  // Rows over grid.y, each row's columns over grid.x: a row's coefficients are read once a
  // thread, and no element pays a 64-bit division for its row.
  for (int64_t r = blockIdx.y; r < c; r += gridDim.y) {
    const double* k = coef + 6 * r;  // a, b, the target's term, target, e, max
    const double ka = __ldg(k), kb = __ldg(k + 1), kt = __ldg(k + 2), ky = __ldg(k + 3);
    const double ke = __ldg(k + 4), kmax = __ldg(k + 5);
    const T lse = T(__ldg(lse_c + r));
    const bool zero = ka == 0.0 && kb == 0.0 && kt == 0.0 && ke == 0.0;
    T* row = g + r * V;
    // Columns shifted back to the 32-byte sector the row starts in, so a warp's accesses fill
    // whole sectors whatever V is (lanes before column 0 idle).
    const int64_t off = (r * V) % (32 / int64_t(sizeof(T)));
    for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x - off; v < V;
         v += int64_t(gridDim.x) * blockDim.x) {
      if (v < 0) continue;
      if (zero) {
        st(row + v, T(0));
        continue;
      }
      const T x = ld(row + v);
      // with the entropy's share p (a + e (z - max)), as the CPU backend's softmax_grad
      const T pa = ke != 0.0 ? T(ka) + T(ke) * (x - T(kmax)) : T(ka);
      T d = dexp(x - lse) * pa - T(kb) * (w ? gpu::ld_guarded(w + v) : T(1));
      if (cap > 0.0) {
        const T tz = x * ic;
        d *= (T(1) - tz) * (T(1) + tz);
      }
      if (double(v) == ky) d -= T(kt);
      st(row + v, d);
    }
  }
}

// d_bias (V) += column sums of the chunk's gradient: one chain per cell, in token order.
template <class T>
__global__ void k_bias_grad(const T* g, int64_t c, int64_t V, T* db) {
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= V) return;
  T acc = ld(db + v);
  for (int64_t r = 0; r < c; ++r) acc += __ldg(g + r * V + v);
  st(db + v, acc);
}

template <class T, class XO>
__global__ void k_narrow(const T* src, XO* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    put(dst + i, float(__ldg(src + i)));
}

// Token-order results in one block over a fixed partition of [0, N): LossSum's (total, first,
// shifted, count) of u ce and u z, the weight sums, correct argmaxes; and the reduced loss.
template <class T>
__global__ void __launch_bounds__(RT) k_finish(const double* ce, const double* zl,
                                               const double* ent, const uint8_t* valid,
                                               const int64_t* pred,
                                               const int64_t* targets, int64_t shift, int64_t N,
                                               const double* prep, bool weighted,
                                               bool token_weighted, Reduction red_kind,
                                               double* sums, T* loss, T* zout, T* eout,
                                               float* accuracy) {
  __shared__ double red[RT];
  int64_t lo, hi;
  share(N, &lo, &hi);
  const double first_t = first_counted(valid, lo, hi, red);
  const bool any = first_t < double(N);
  const double fce = any ? ce[int64_t(first_t)] : 0.0, fz = any ? zl[int64_t(first_t)] : 0.0;
  const double fe = any && ent ? ent[int64_t(first_t)] : 0.0;
  double tce = 0.0, sce = 0.0, tz = 0.0, sz = 0.0, te = 0.0, se = 0.0, cnt = 0.0, correct = 0.0;
  for (int64_t t = lo; t < hi; ++t) {
    if (!valid[t]) continue;
    tce += ce[t];
    sce += ce[t] - fce;
    tz += zl[t];
    sz += zl[t] - fz;
    if (ent) te += ent[t], se += ent[t] - fe;
    cnt += 1.0;
    if (pred && pred[t] == targets[t + shift]) correct += 1.0;
  }
  tce = block_sum(tce, red);
  sce = block_sum(sce, red);
  tz = block_sum(tz, red);
  sz = block_sum(sz, red);
  if (ent) te = block_sum(te, red), se = block_sum(se, red);
  cnt = block_sum(cnt, red);
  correct = block_sum(correct, red);
  if (threadIdx.x != 0) return;
  const double wsum = prep[1], usum = prep[3];
  double* o = sums;
  o[0] = tce, o[1] = fce, o[2] = sce, o[3] = cnt;
  o[4] = tz, o[5] = fz, o[6] = sz, o[7] = cnt;
  o[8] = wsum, o[9] = correct, o[10] = usum;
  o[11] = te, o[12] = fe, o[13] = se;
  // FusedOut::reduced, on the device
  const double ce_mean = math::sum_mean(fce, sce, cnt);
  const double z_mean = math::z_mean(token_weighted, tz, usum, fz, sz, cnt);
  if (loss) loss[0] = T(math::reduced_loss(red_kind, weighted, tce, ce_mean, wsum, tz, z_mean));
  if (zout) zout[0] = T(red_kind == Reduction::Sum ? tz : z_mean);
  if (eout)  // the entropy reduces as the z-loss term does (FusedOut::entropy_mean)
    eout[0] = T(red_kind == Reduction::Sum ? te
                                           : math::z_mean(token_weighted, te, usum, fe, se, cnt));
  if (accuracy) accuracy[0] = cnt > 0.0 ? float(correct / cnt) : NAN;
}


}  // namespace
}  // namespace lossk
}  // namespace algenta

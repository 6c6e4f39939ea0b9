// Host-side launch helpers both fused lossk losses share on a CUDA device (lossk_cuda.cu, the
// cross-entropy; lossk_distill.cu, distillation): the workspace carver, the data checks, a call's
// frame (its host-side refusals, gradient accumulators and their narrowing), the copies of a call
// from host memory, and the tile GEMMs of the logits and of the two gradient products for an
// element type.
#pragma once

#include <algorithm>
#include <vector>

#include "lossk_token.cuh"

namespace algenta {
namespace lossk {
namespace {

// Carves one caller-provided block into 256-byte aligned pieces; also sizes it (base null).
struct Carver {
  unsigned char* base;
  int64_t off = 0;
  explicit Carver(void* b) : base(static_cast<unsigned char*>(b)) {}
  template <class X>
  X* take(int64_t count) {
    X* p = base ? reinterpret_cast<X*>(base + off) : nullptr;
    off += round_up(std::max<int64_t>(count, 1) * int64_t(sizeof(X)), 256);
    return p;
  }
};

// The data check "every element of p (n of element type e) is finite" into *flag (set when not).
inline void launch_check_finite(const void* p, int64_t n, Dtype e, int* flag, cudaStream_t st) {
  if (!p) return;
  const unsigned g = grid_for(n, 256);
  switch (e) {
    case Dtype::F32:
      k_check_finite<float><<<g, 256, 0, st>>>(static_cast<const float*>(p), n, flag);
      break;
    case Dtype::F64:
      k_check_finite<double><<<g, 256, 0, st>>>(static_cast<const double*>(p), n, flag);
      break;
    case Dtype::BF16:
      k_check_finite<__nv_bfloat16><<<g, 256, 0, st>>>(static_cast<const __nv_bfloat16*>(p), n,
                                                       flag);
      break;
    case Dtype::F16:
      k_check_finite<__half><<<g, 256, 0, st>>>(static_cast<const __half*>(p), n, flag);
      break;
    default:
      break;
  }
  CK(cudaGetLastError());
}

// The 586 refusal of the first bad token k_check_targets found (first: ~0 when none), reading
// its target back from the device.
inline void refuse_first_target(const int64_t* targets, unsigned long long first, int64_t shift,
                                int64_t V, bool has_ignore, cudaStream_t st) {
  if (first == ~0ull) return;
  const int64_t t = int64_t(first) + shift;
  int64_t y = 0;
  CK(cudaMemcpyAsync(&y, targets + t, sizeof y, cudaMemcpyDeviceToHost, st));
  CK(cudaStreamSynchronize(st));
  refuse(LOSS_ERR_TARGET_OUT_OF_RANGE, target_refusal(y, t, V, has_ignore));
}

// The targets a call checks (null: none): rows [0, n), each scored against targets[t + shift]
// within sequences of seq_len rows, ignore_index skipped when has_ignore, in [0, vocab) else.
struct TargetCheck {
  const int64_t* targets;
  int64_t n, shift, seq_len;
  bool has_ignore;
  int64_t ignore_index, vocab;
};

// The data checks' flags in a call's workspace: one per finite input (lossk.hpp's finite_inputs),
// one after them for the token weights, and the first bad target.
constexpr int kDataFlags = 16;
struct DataFlags {
  int* flags;
  unsigned long long* first_bad;

  static DataFlags take(Carver& cv) {
    DataFlags d;
    d.flags = cv.take<int>(kDataFlags);
    d.first_bad = cv.take<unsigned long long>(1);
    return d;
  }

  // The data's refusals, in the CPU backend's order: the first non-finite input in list order
  // (585), token weights that are not finite and >= 0 (585), the first counted target out of
  // range (586). The call's one synchronization, before any other work.
  template <class T>
  void refuse_bad(const std::vector<FiniteInput>& inputs, const T* token_weight,
                  const TargetCheck& tc, cudaStream_t st) const {
    const int n_in = int(inputs.size());
    CK(cudaMemsetAsync(flags, 0, kDataFlags * sizeof(int), st));
    CK(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), st));
    for (int i = 0; i < n_in; ++i)
      launch_check_finite(inputs[size_t(i)].p, inputs[size_t(i)].n, inputs[size_t(i)].elem,
                          flags + i, st);
    if (token_weight) {
      k_check_token_weights<T><<<grid_for(tc.n, 256), 256, 0, st>>>(token_weight, tc.n,
                                                                   flags + n_in);
      CK(cudaGetLastError());
    }
    if (tc.targets) {
      k_check_targets<<<grid_for(tc.n, 256), 256, 0, st>>>(tc.targets, tc.n, tc.shift,
                                                          tc.seq_len, tc.has_ignore,
                                                          tc.ignore_index, tc.vocab, first_bad);
      CK(cudaGetLastError());
    }
    int h[kDataFlags];
    unsigned long long first = 0;
    CK(cudaMemcpyAsync(h, flags, sizeof h, cudaMemcpyDeviceToHost, st));
    CK(cudaMemcpyAsync(&first, first_bad, sizeof first, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < n_in; ++i)
      if (h[i]) refuse(LOSS_ERR_NON_FINITE, inputs[size_t(i)].what);
    if (h[n_in]) refuse(LOSS_ERR_NON_FINITE, "token_weight must be finite and >= 0");
    refuse_first_target(tc.targets, first, tc.shift, tc.vocab, tc.has_ignore, st);
  }
};

// ---- a call's frame ----------------------------------------------------------------------------

// The accumulators of a call's half gradients in its workspace: d_weight (V, D) and d_bias (V)
// in T, narrowed into the caller's arrays by end_call; null where not wanted or not half.
template <class T>
struct HalfGradAcc {
  T* dw = nullptr;
  T* db = nullptr;

  static HalfGradAcc take(Carver& cv, const DeviceGradOut<T>& out, int64_t V, int64_t D) {
    HalfGradAcc g;
    if (!is_half(out.grad_elem)) return g;
    if (out.d_weight) g.dw = cv.take<T>(V * D);
    if (out.d_bias) g.db = cv.take<T>(V);
    return g;
  }
};

// Where a call's gradient products write: d_weight and d_bias as T accumulators (the caller's
// arrays, or HalfGradAcc's for half gradients).
template <class T>
struct Grads {
  T* dw = nullptr;
  T* db = nullptr;
  bool any = false;  // any gradient wanted
};

// The first refusals of a device call, before anything is carved: the core's shape check
// (status, why), then a build or host without a usable device (590).
inline void enter(const char* fn, int status, const std::string& why) {
  if (status != LOSS_OK) refuse(status, why);
  require_device(fn);
}

// The host-side refusals every device call makes next (a workspace short of `need` bytes, half
// gradients of inputs that are not half), and its gradient accumulators.
template <class T>
Grads<T> begin_call(const void* workspace, int64_t workspace_bytes, int64_t need, Dtype elem,
                    const DeviceGradOut<T>& out, const HalfGradAcc<T>& acc) {
  if (!workspace || workspace_bytes < need)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "the workspace has " + std::to_string(workspace_bytes) +
                                         " bytes, this call needs " + std::to_string(need));
  const bool half = is_half(out.grad_elem);
  if (half && !is_half(elem))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
  Grads<T> g;
  g.any = out.d_hidden || out.d_weight || out.d_bias;
  if (out.d_weight) g.dw = half ? acc.dw : static_cast<T*>(out.d_weight);
  if (out.d_bias) g.db = half ? acc.db : static_cast<T*>(out.d_bias);
  return g;
}

// After the data checks, before the first chunk: each bias gradient's chain starts at 0.
template <class T>
void start_grads(const Grads<T>& g, int64_t V, cudaStream_t s) {
  if (g.db) CK(cudaMemsetAsync(g.db, 0, sizeof(T) * size_t(V), s));
}

// The chunk the device runs: the caller's, and for half inputs rounded down to a multiple of 16
// (at least 16) so d_weight's tensor-core k-steps group the same tokens for every chunk size.
inline int64_t device_chunk_for(Dtype elem, int64_t chunk, int64_t n_tok) {
  int64_t c = std::min(chunk, n_tok);
  if (elem == Dtype::BF16 || elem == Dtype::F16) c = std::min(n_tok, std::max<int64_t>(16, c - c % 16));
  return c;
}

// Launches the tile of the inputs' element type: F64 (T = double), or for T = float BF16, F16 or
// F32 (any other).
template <class T, class F64, class BF16, class F16, class F32>
void launch_for(Dtype elem, const TileArgs<T>& p, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<F64>(p, s);
  } else if (elem == Dtype::BF16) {
    launch_tile<BF16>(p, s);
  } else if (elem == Dtype::F16) {
    launch_tile<F16>(p, s);
  } else {
    launch_tile<F32>(p, s);
  }
}

// The forward tile for the inputs' element type.
template <class T>
void launch_forward(Dtype elem, const TileArgs<T>& p, cudaStream_t s) {
  launch_for<T, LogitsTile<SIMT, double, double>, LogitsTile<WMMA_BF16, float, __nv_bfloat16>,
             LogitsTile<WMMA_F16, float, __half>, LogitsTile<SIMT, float, float>>(elem, p, s);
}

// d_hidden rows = G (c, V) @ W (V, D), written in ge: the inputs' own type, or float32 for half
// inputs with float32 gradients.
template <class T>
void launch_dhidden(Dtype elem, const TileArgs<T>& p, Dtype ge, cudaStream_t s) {
  typedef DHiddenTile<SIMT, double, double, double> F64;
  typedef DHiddenTile<SIMT, float, float, float> F32;
  if (ge == elem)
    launch_for<T, F64, DHiddenTile<WMMA_BF16, float, __nv_bfloat16, __nv_bfloat16>,
               DHiddenTile<WMMA_TF32, float, __half, __half>, F32>(elem, p, s);
  else
    launch_for<T, F64, DHiddenTile<WMMA_BF16, float, __nv_bfloat16, float>,
               DHiddenTile<WMMA_TF32, float, __half, float>, F32>(elem, p, s);
}

// d_weight (V, D) += G^T (V, c) @ H (c, D), into the T accumulator.
template <class T>
void launch_dweight(Dtype elem, const TileArgs<T>& p, cudaStream_t s) {
  launch_for<T, DWeightTile<SIMT, double, double>, DWeightTile<WMMA_BF16, float, __nv_bfloat16>,
             DWeightTile<WMMA_TF32, float, __half>, DWeightTile<SIMT, float, float>>(elem, p, s);
}

// The gradient products of one chunk [t0, t0 + c) from its d_logits G (c, V), each when its
// output is set: d_hidden rows = G @ W (in out.grad_elem), d_weight += G^T @ H (the accumulator
// g.dw, each cell continuing its chain), d_bias += column sums of G (g.db). H: the chunk's input
// rows' base.
template <class T>
void launch_backward(Dtype elem, const T* G, int64_t t0, int64_t c, int64_t V, int64_t D,
                     const void* weight, const unsigned char* H, const DeviceGradOut<T>& out,
                     const Grads<T>& gr, cudaStream_t s) {
  const size_t esz = elem_bytes(elem);
  if (out.d_hidden) {
    TileArgs<T> g;
    g.M = c, g.N = D, g.K = V;
    g.A = G, g.lda = V;
    g.B = weight, g.ldb = D;
    g.C = static_cast<unsigned char*>(out.d_hidden) + size_t(t0 * D) * elem_bytes(out.grad_elem);
    g.ldc = D;
    launch_dhidden(elem, g, out.grad_elem, s);
  }
  if (gr.dw) {
    TileArgs<T> g;
    g.M = V, g.N = D, g.K = c;
    g.A = G, g.lda = V;
    g.B = H + size_t(t0 * D) * esz, g.ldb = D;
    g.C = gr.dw, g.ldc = D, g.accumulate = t0 > 0;
    launch_dweight(elem, g, s);
  }
  if (gr.db) {
    k_bias_grad<T><<<unsigned(ceil_div(V, 256)), 256, 0, s>>>(G, c, V, gr.db);
    CK(cudaGetLastError());
  }
}

template <class T>
void narrow(const T* src, void* dst, int64_t n, Dtype e, cudaStream_t s) {
  const unsigned g = grid_for(n, 256);
  if (e == Dtype::BF16) k_narrow<T, __nv_bfloat16><<<g, 256, 0, s>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  else k_narrow<T, __half><<<g, 256, 0, s>>>(src, static_cast<__half*>(dst), n);
  CK(cudaGetLastError());
}

// After the last chunk: half gradients' accumulators narrowed into the caller's arrays.
template <class T>
void end_call(const DeviceGradOut<T>& out, const Grads<T>& g, int64_t V, int64_t D,
              cudaStream_t s) {
  if (!is_half(out.grad_elem)) return;
  if (out.d_weight) narrow(g.dw, out.d_weight, V * D, out.grad_elem, s);
  if (out.d_bias) narrow(g.db, out.d_bias, V, out.grad_elem, s);
}

// ---- calls from host memory (the NumPy API's device="cuda") ------------------------------------

// The device side of a call from host memory: inputs copied to the device, outputs allocated
// there and copied back by run(), everything freed on scope exit.
class HostCall {
 public:
  // p: a host array of `bytes` (or null) -> its device copy
  template <class P>
  void in(P*& p, size_t bytes) {
    if (!p) return;
    bufs_.emplace_back(static_cast<const void*>(p), bytes);
    p = static_cast<P*>(bufs_.back().p);
  }
  // dev: device memory of `bytes` for the host output `host` (none where host is null), copied
  // back by run()
  template <class H, class D>
  void out(H* host, D*& dev, size_t bytes) {
    if (!host) return;
    bufs_.emplace_back(bytes);
    dev = static_cast<D*>(bufs_.back().p);
    back_.push_back({static_cast<void*>(host), bufs_.back().p, bytes});
  }
  // The gradients GradOut h asks for, in d: a half d_weight (d_bias) lands in the first V*D (V)
  // uint16 of h's accumulators, as the CPU backend leaves it.
  template <class T>
  void grads(const GradOut<T>& h, DeviceGradOut<T>& d, int64_t N, int64_t D, int64_t V) {
    const size_t gsz = elem_bytes(h.grad_elem);
    d.grad_elem = h.grad_elem;
    out(h.d_hidden, d.d_hidden, size_t(N * D) * gsz);
    out(h.d_weight, d.d_weight, size_t(V * D) * gsz);
    out(h.d_bias, d.d_bias, size_t(V) * gsz);
  }
  // The device call on its own workspace, then every output back to the host.
  template <class Args, class Out, class Workspace, class Call>
  void run(const Args& a, Out& o, Workspace&& workspace, Call&& call) {
    const int64_t bytes = workspace(a, o);
    DevBuf ws{size_t(bytes)};
    call(a, o, ws.p, bytes, nullptr);
    for (const Back& b : back_) to_host(b.host, b.dev, b.bytes);
  }

 private:
  struct Back {
    void* host;
    const void* dev;
    size_t bytes;
  };
  std::vector<DevBuf> bufs_;
  std::vector<Back> back_;
};

}  // namespace
}  // namespace lossk
}  // namespace algenta

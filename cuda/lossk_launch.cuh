// Host-side launch helpers both fused lossk losses share on a CUDA device (lossk_cuda.cu, the
// cross-entropy; lossk_distill.cu, distillation): the workspace carver and the tile GEMMs of the
// logits and of the two gradient products for an element type.
#pragma once

#include <algorithm>

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

// The chunk the device runs: the caller's, and for half inputs rounded down to a multiple of 16
// (at least 16) so d_weight's tensor-core k-steps group the same tokens for every chunk size.
inline int64_t device_chunk_for(Dtype elem, int64_t chunk, int64_t n_tok) {
  int64_t c = std::min(chunk, n_tok);
  if (elem == Dtype::BF16 || elem == Dtype::F16) c = std::min(n_tok, std::max<int64_t>(16, c - c % 16));
  return c;
}

// The forward tile for the inputs' element type.
template <class T>
void launch_forward(Dtype elem, const TileArgs<T>& p, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<LogitsTile<SIMT, double, double>>(p, s);
  } else {
    switch (elem) {
      case Dtype::BF16:
        launch_tile<LogitsTile<WMMA_BF16, float, __nv_bfloat16>>(p, s);
        break;
      case Dtype::F16:
        launch_tile<LogitsTile<WMMA_F16, float, __half>>(p, s);
        break;
      default:
        launch_tile<LogitsTile<SIMT, float, float>>(p, s);
    }
  }
}

// d_hidden rows = G (c, V) @ W (V, D), written in grad_elem.
template <class T>
void launch_dhidden(Dtype elem, const TileArgs<T>& p, Dtype ge, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<DHiddenTile<SIMT, double, double, double>>(p, s);
  } else {
    switch (elem) {
      case Dtype::BF16:
        if (ge == Dtype::BF16)
          launch_tile<DHiddenTile<WMMA_BF16, float, __nv_bfloat16, __nv_bfloat16>>(p, s);
        else
          launch_tile<DHiddenTile<WMMA_BF16, float, __nv_bfloat16, float>>(p, s);
        break;
      case Dtype::F16:
        if (ge == Dtype::F16)
          launch_tile<DHiddenTile<WMMA_TF32, float, __half, __half>>(p, s);
        else
          launch_tile<DHiddenTile<WMMA_TF32, float, __half, float>>(p, s);
        break;
      default:
        launch_tile<DHiddenTile<SIMT, float, float, float>>(p, s);
    }
  }
}

// d_weight (V, D) += G^T (V, c) @ H (c, D), into the T accumulator.
template <class T>
void launch_dweight(Dtype elem, const TileArgs<T>& p, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    launch_tile<DWeightTile<SIMT, double, double>>(p, s);
  } else {
    switch (elem) {
      case Dtype::BF16:
        launch_tile<DWeightTile<WMMA_BF16, float, __nv_bfloat16>>(p, s);
        break;
      case Dtype::F16:
        launch_tile<DWeightTile<WMMA_TF32, float, __half>>(p, s);
        break;
      default:
        launch_tile<DWeightTile<SIMT, float, float>>(p, s);
    }
  }
}

// The gradient products of one chunk [t0, t0 + c) from its d_logits G (c, V), each when its
// output is set: d_hidden rows = G @ W (in ge), d_weight += G^T @ H (the T accumulator dw, each
// cell continuing its chain), d_bias += column sums of G (db). H: the chunk's input rows' base.
template <class T>
void launch_backward(Dtype elem, const T* G, int64_t t0, int64_t c, int64_t V, int64_t D,
                     const void* weight, const unsigned char* H, void* d_hidden, Dtype ge, T* dw,
                     T* db, cudaStream_t s) {
  const size_t esz = elem_bytes(elem);
  if (d_hidden) {
    TileArgs<T> g;
    g.M = c, g.N = D, g.K = V;
    g.A = G, g.lda = V;
    g.B = weight, g.ldb = D;
    g.C = static_cast<unsigned char*>(d_hidden) + size_t(t0 * D) * elem_bytes(ge);
    g.ldc = D;
    launch_dhidden(elem, g, ge, s);
  }
  if (dw) {
    TileArgs<T> g;
    g.M = V, g.N = D, g.K = c;
    g.A = G, g.lda = V;
    g.B = H + size_t(t0 * D) * esz, g.ldb = D;
    g.C = dw, g.ldc = D, g.accumulate = t0 > 0;
    launch_dweight(elem, g, s);
  }
  if (db) {
    k_bias_grad<T><<<unsigned(ceil_div(V, 256)), 256, 0, s>>>(G, c, V, db);
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

}  // namespace
}  // namespace lossk
}  // namespace algenta

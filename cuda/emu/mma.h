// The CUDA emulator's stand-in for <mma.h>: nvcuda::wmma's fragments with plain loops, in the
// shapes the backend uses: 16x16x16 (bf16/f16 operands) and 16x16x8 (tf32 operands, stored as
// float and rounded with __float_to_tf32 as on a device).
//
// On a device a fragment's elements are spread over the warp's 32 lanes in an unspecified
// layout; here every lane holds the whole tile, which every use the API allows (elementwise
// access through x[] / num_elements, loads, stores, mma) cannot tell apart. Each operation is a
// warp barrier first, as the API requires a converged warp (a divergent one is reported as a
// deadlock, see cuda/emu/README.md). mma_sync accumulates each output element as one float chain
// over k in increasing order; the device's tensor cores add in an order of their own, so bits
// differ from a device (tolerances in the tests), never between two emulated runs.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};  // a fragment element type: float storage holding a tf32 value
}  // namespace precision

// float rounded to tf32 (10 explicit mantissa bits), ties away from zero as cvt.rna.tf32.f32;
// the low 13 bits are zero. NaN and infinity pass unchanged.
inline float __float_to_tf32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace detail {
template <class T>
struct storage {
  typedef T type;
};
template <>
struct storage<precision::tf32> {
  typedef float type;
};
inline float widen(float x) { return x; }
inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float widen(__half x) { return __half2float(x); }
template <class Use, int M, int N, int K>
struct dims;
template <int M, int N, int K>
struct dims<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct dims<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct dims<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};
inline void converge(const char* what) { ::algenta_emu::syncwarp(what); }
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && (K == 16 || (K == 8 && (std::is_same<T, precision::tf32>::value ||
                                                              std::is_same<Use, accumulator>::value))),
                "the emulator implements 16x16x16, and 16x16x8 for tf32");
  typedef typename detail::storage<T>::type element_type;
  static constexpr int rows = detail::dims<Use, M, N, K>::rows;
  static constexpr int cols = detail::dims<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  element_type x[num_elements];  // row-major (r, c) at x[r * cols + c]
};

template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f,
                          typename fragment<Use, M, N, K, T, L>::element_type v) {
  detail::converge("wmma::fill_fragment");
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

// matrix_a / matrix_b: the layout is the fragment's own.
template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f,
                             const typename fragment<Use, M, N, K, T, L>::element_type* p,
                             unsigned ldm) {
  static_assert(!std::is_same<Use, accumulator>::value, "an accumulator load names its layout");
  detail::converge("wmma::load_matrix_sync");
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c)
      f.x[r * f.cols + c] = std::is_same<L, row_major>::value ? p[size_t(r) * ldm + c]
                                                               : p[size_t(c) * ldm + r];
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const T* p, unsigned ldm,
                             layout_t layout) {
  detail::converge("wmma::load_matrix_sync");
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c)
      f.x[r * f.cols + c] = layout == mem_row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r];
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm,
                              layout_t layout) {
  detail::converge("wmma::store_matrix_sync");
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c) {
      T& dst = layout == mem_row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r];
      dst = f.x[r * f.cols + c];
    }
}

template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC, void>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b,
                     const fragment<accumulator, M, N, K, TC, void>& c) {
  detail::converge("wmma::mma_sync");
  // Every lane of a warp holds the same tiles, so its 32 lanes ask for one product 32 times:
  // the last product of each warp (of the block this OS thread runs) is kept and reused when all
  // three inputs are byte-equal (a pure function of them, so reuse cannot change a bit), sparing
  // the emulator 31 of every 32 tile products. One entry per warp, not one per OS thread: in a
  // reverse or random thread order the warps' lanes interleave.
  struct Last {
    bool valid = false;
    decltype(a.x) ax;
    decltype(b.x) bx;
    decltype(c.x) cx;
    decltype(d.x) dx;
  };
  static thread_local Last lasts[32];
  const ::algenta_emu::Thread& th = *::algenta_emu::t_thread;
  const ::algenta_emu::BlockInfo& blk = *::algenta_emu::t_block;
  Last& last = lasts[((th.idx.z * blk.dim.y + th.idx.y) * blk.dim.x + th.idx.x) / 32 % 32];
  if (last.valid && std::memcmp(last.ax, a.x, sizeof a.x) == 0 &&
      std::memcmp(last.bx, b.x, sizeof b.x) == 0 && std::memcmp(last.cx, c.x, sizeof c.x) == 0) {
    std::memcpy(d.x, last.dx, sizeof d.x);
    return;
  }
  std::memcpy(last.ax, a.x, sizeof a.x);
  std::memcpy(last.bx, b.x, sizeof b.x);
  std::memcpy(last.cx, c.x, sizeof c.x);
  TC out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      TC acc = c.x[i * N + j];
      for (int k = 0; k < K; ++k)
        acc = fmaf(detail::widen(a.x[i * K + k]), detail::widen(b.x[k * N + j]), acc);
      out[i * N + j] = acc;
    }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
  std::memcpy(last.dx, out, sizeof out);
  last.valid = true;
}

}  // namespace wmma
}  // namespace nvcuda

// The seed's materialized cross-entropy on a CUDA device (ce_from_logits, its gradient, a
// device-side running sum): float64 logits the caller already holds, one block per row, checked
// on the device with the fused loss's data checks (lossk_common.cuh).
#include <cstdint>
#include <string>

#include "lossk_common.cuh"

namespace algenta {
namespace lossk {

namespace {

constexpr int CT = 256;  // threads per row of k_ce_rows

// A row's max or sum over the block's CT threads, in a fixed tree.
__device__ double row_reduce(double v, double* red, bool is_max) {
  return is_max ? gpu::block_tree<CT>(v, red, gpu::TreeMax{})
                : gpu::block_tree<CT>(v, red, gpu::TreeSum{});
}

// One block per row: max, then the sum of exp(z - max) (strided per thread, fixed tree).
__global__ void __launch_bounds__(CT) k_ce_rows(const double* logits, const int64_t* targets,
                                                int64_t V, double* loss, double* lse) {
  __shared__ double red[CT];
  const int64_t t = blockIdx.x;
  const double* z = logits + t * V;
  double m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += CT) m = fmax(m, z[v]);
  m = row_reduce(m, red, true);
  double se = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += CT) se += exp(z[v] - m);
  se = row_reduce(se, red, false);
  if (threadIdx.x == 0) {
    const double logse = log(se);
    if (loss) loss[t] = (m - z[targets[t]]) + logse;  // exact log(V) for equal logits
    if (lse) lse[t] = m + logse;
  }
}

__global__ void k_ce_grad(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                          const double* lse, double scale, double* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * V;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / V, v = i % V;
    double g = exp(logits[i] - lse[r]) * scale;
    if (v == targets[r]) g -= scale;
    out[i] = g;
  }
}

// LossSum::add over the tokens in order: one thread, the only order that matches the host's.
__global__ void k_loss_sum_add(const double* loss, int64_t n, double* st) {
  double total = st[0], first = st[1], shifted = st[2], count = st[3];
  for (int64_t t = 0; t < n; ++t) {
    if (count == 0.0) first = loss[t];
    total += loss[t];
    shifted += loss[t] - first;
    count += 1.0;
  }
  st[0] = total, st[1] = first, st[2] = shifted, st[3] = count;
}

// Dims and data of materialized logits, checked on the device (585 then 586, as the host check).
void check_logits(const double* logits, const int64_t* targets, int64_t n, int64_t V, cudaStream_t s) {
  std::string why;
  if (n < 1 || V < 1 || n > LOSS_MAX_TOKENS || V > LOSS_MAX_VOCAB) {
    const int st = ce_from_logits_check(nullptr, nullptr, n, V, &why);
    refuse(st, why);
  }
  require_device("ce_from_logits");
  DevBuf flags(sizeof(int) + sizeof(unsigned long long) * 2);
  int* f = flags.as<int>();
  unsigned long long* first = reinterpret_cast<unsigned long long*>(flags.as<unsigned char>() + 8);
  CK(cudaMemsetAsync(f, 0, sizeof(int), s));
  CK(cudaMemsetAsync(first, 0xff, sizeof *first, s));
  k_check_finite<double><<<grid_for(n * V, 256), 256, 0, s>>>(logits, n * V, f);
  CK(cudaGetLastError());
  k_check_targets<<<grid_for(n, 256), 256, 0, s>>>(targets, n, 0, 1, false, 0, V, first);
  CK(cudaGetLastError());
  int bad = 0;
  unsigned long long fb = 0;
  CK(cudaMemcpyAsync(&bad, f, sizeof bad, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&fb, first, sizeof fb, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  if (bad) refuse(LOSS_ERR_NON_FINITE, "logits contain NaN or infinity");
  if (fb != ~0ull) {
    int64_t y = 0;
    CK(cudaMemcpy(&y, targets + fb, sizeof y, cudaMemcpyDeviceToHost));
    refuse(LOSS_ERR_TARGET_OUT_OF_RANGE, "target " + std::to_string(y) + " at token " +
                                             std::to_string(fb) + " is outside [0, " +
                                             std::to_string(V) + ")");
  }
}

}  // namespace

void ce_from_logits_cuda(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                         double* loss_tok, double* lse, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  check_logits(logits, targets, n, V, s);
  k_ce_rows<<<unsigned(n), CT, 0, s>>>(logits, targets, V, loss_tok, lse);
  CK(cudaGetLastError());
}

void ce_grad_logits_cuda(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                         double scale, double* out, void* stream) {
  if (!loss_scalars_ok(scale)) refuse(LOSS_ERR_NON_FINITE, "scale must be finite");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  check_logits(logits, targets, n, V, s);
  DevBuf lse(size_t(n) * sizeof(double));
  k_ce_rows<<<unsigned(n), CT, 0, s>>>(logits, targets, V, nullptr, lse.as<double>());
  CK(cudaGetLastError());
  k_ce_grad<<<grid_for(n * V, 256), 256, 0, s>>>(logits, targets, n, V, lse.as<double>(), scale, out);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));  // lse is freed on return
}

void loss_sum_add_cuda(const double* loss_tok, int64_t n, double* state, void* stream) {
  if (n < 0) refuse(LOSS_ERR_EMPTY_DIMENSION, "n_tok must be >= 0");
  if (n == 0) return;
  require_device("CEAccumulator");
  k_loss_sum_add<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(loss_tok, n, state);
  CK(cudaGetLastError());
}

void ce_from_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                              LossSum& sum, double* lse, double* loss_tok) {
  require_device("ce_from_logits");
  DevBuf z(logits, size_t(n * V) * sizeof(double)), t(targets, size_t(n) * sizeof(int64_t));
  DevBuf l(size_t(n) * sizeof(double)), e(size_t(n) * sizeof(double));
  double st[4] = {sum.total, sum.first, sum.shifted, double(sum.count)};
  DevBuf state(st, sizeof st);
  ce_from_logits_cuda(z.as<double>(), t.as<int64_t>(), n, V, l.as<double>(), e.as<double>(), nullptr);
  loss_sum_add_cuda(l.as<double>(), n, state.as<double>(), nullptr);
  to_host(lse, e.p, size_t(n) * sizeof(double));
  to_host(loss_tok, l.p, size_t(n) * sizeof(double));
  to_host(st, state.p, sizeof st);
  sum.total = st[0], sum.first = st[1], sum.shifted = st[2], sum.count = int64_t(st[3]);
}

void ce_grad_logits_cuda_host(const double* logits, const int64_t* targets, int64_t n, int64_t V,
                              double scale, double* out) {
  require_device("ce_grad_logits");
  DevBuf z(logits, size_t(n * V) * sizeof(double)), t(targets, size_t(n) * sizeof(int64_t));
  DevBuf g(size_t(n * V) * sizeof(double));
  ce_grad_logits_cuda(z.as<double>(), t.as<int64_t>(), n, V, scale, g.as<double>(), nullptr);
  to_host(out, g.p, size_t(n * V) * sizeof(double));
}

}  // namespace lossk
}  // namespace algenta

// The CUDA backend's entry points in a build without one (neither ALGENTA_GPU nor
// ALGENTA_CUDA_EMU): no kernels are compiled in, so every entry point refuses (residentk 604,
// lossk 589), after the host-side refusals a CUDA build would make first.
#include "algenta/lossk.hpp"
#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/session_base.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"

namespace algenta {

namespace {
const char* const kWhy =
    "this binary was built without a CUDA backend, so no CUDA kernels are compiled in; rebuild "
    "with -Ccmake.define.ALGENTA_GPU=ON (or ALGENTA_CUDA_EMU=ON for the CPU emulator) or use "
    "device='cpu'";
}  // namespace

namespace residentk {

const CudaBackend& cuda_backend() {
  static const CudaBackend b = [] {
    CudaBackend r;
    r.kind = "none";
    r.why = kWhy;
    return r;
  }();
  return b;
}

std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx,
                                           int64_t slots) {
  session_open_check(cfg, max_ctx);  // the host's refusals come first, as in a CUDA build
  session_slots_check(slots);
  throw StatusError(Family::Resident, RESIDENT_ERR_NO_KERNELS, std::string("device='cuda': ") + kWhy);
}

bool cuda_emulator_fail_after(int64_t) { return false; }
bool cuda_emulator_traffic(bool, std::vector<KernelTraffic>*) { return false; }
int64_t cuda_emulator_pdl_launches() { return -1; }
bool cuda_emulator_pdl_probe(int) { return false; }

double cuda_copy_bandwidth(int64_t, int) {
  throw StatusError(Family::Resident, RESIDENT_ERR_NO_KERNELS,
                    std::string("cuda_copy_bandwidth: ") + kWhy);
}

}  // namespace residentk

namespace lossk {

namespace {
[[noreturn]] void no_backend(const char* fn) {
  throw StatusError(Family::Loss, LOSS_ERR_NO_CUDA_BACKEND,
                    std::string(fn) + ": device='cuda': " + kWhy);
}
template <class T>
void shape_first(const FusedArgs<T>& a) {
  std::string why;
  const int st = fused_linear_ce_check_shape(a, &why);
  if (st != LOSS_OK) throw StatusError(Family::Loss, st, why);
}
}  // namespace

template <class T>
int64_t fused_linear_ce_cuda_workspace(const FusedArgs<T>& a, const FusedCudaOut<T>&) {
  shape_first(a);
  no_backend("fused_linear_ce");
}
template <class T>
void fused_linear_ce_cuda(const FusedArgs<T>& a, FusedCudaOut<T>&, void*, int64_t, void*) {
  shape_first(a);
  no_backend("fused_linear_ce");
}
template <class T>
void fused_linear_ce_cuda_host(const FusedArgs<T>& a, FusedOut<T>&) {
  shape_first(a);
  no_backend("fused_linear_ce");
}
template int64_t fused_linear_ce_cuda_workspace<float>(const FusedArgs<float>&, const FusedCudaOut<float>&);
template int64_t fused_linear_ce_cuda_workspace<double>(const FusedArgs<double>&, const FusedCudaOut<double>&);
template void fused_linear_ce_cuda<float>(const FusedArgs<float>&, FusedCudaOut<float>&, void*, int64_t, void*);
template void fused_linear_ce_cuda<double>(const FusedArgs<double>&, FusedCudaOut<double>&, void*, int64_t, void*);
template void fused_linear_ce_cuda_host<float>(const FusedArgs<float>&, FusedOut<float>&);
template void fused_linear_ce_cuda_host<double>(const FusedArgs<double>&, FusedOut<double>&);

template <class T>
void distill_shape_first(const DistillArgs<T>& a) {
  std::string why;
  const int st = fused_linear_distill_check_shape(a, &why);
  if (st != LOSS_OK) throw StatusError(Family::Loss, st, why);
}
template <class T>
int64_t fused_linear_distill_cuda_workspace(const DistillArgs<T>& a, const DistillCudaOut<T>&) {
  distill_shape_first(a);
  no_backend("fused_linear_distill");
}
template <class T>
void fused_linear_distill_cuda(const DistillArgs<T>& a, DistillCudaOut<T>&, void*, int64_t, void*) {
  distill_shape_first(a);
  no_backend("fused_linear_distill");
}
template <class T>
void fused_linear_distill_cuda_host(const DistillArgs<T>& a, DistillOut<T>&) {
  distill_shape_first(a);
  no_backend("fused_linear_distill");
}
template int64_t fused_linear_distill_cuda_workspace<float>(const DistillArgs<float>&, const DistillCudaOut<float>&);
template int64_t fused_linear_distill_cuda_workspace<double>(const DistillArgs<double>&, const DistillCudaOut<double>&);
template void fused_linear_distill_cuda<float>(const DistillArgs<float>&, DistillCudaOut<float>&, void*, int64_t, void*);
template void fused_linear_distill_cuda<double>(const DistillArgs<double>&, DistillCudaOut<double>&, void*, int64_t, void*);
template void fused_linear_distill_cuda_host<float>(const DistillArgs<float>&, DistillOut<float>&);
template void fused_linear_distill_cuda_host<double>(const DistillArgs<double>&, DistillOut<double>&);

void ce_from_logits_cuda(const double*, const int64_t*, int64_t, int64_t, double*, double*, void*) {
  no_backend("ce_from_logits");
}
void ce_grad_logits_cuda(const double*, const int64_t*, int64_t, int64_t, double, double*, void*) {
  no_backend("ce_grad_logits");
}
void loss_sum_add_cuda(const double*, int64_t, double*, void*) { no_backend("CEAccumulator"); }
void ce_from_logits_cuda_host(const double*, const int64_t*, int64_t, int64_t, LossSum&, double*,
                              double*) {
  no_backend("ce_from_logits");
}
void cuda_set_device(int) { no_backend("cuda_set_device"); }
void ce_grad_logits_cuda_host(const double*, const int64_t*, int64_t, int64_t, double, double*) {
  no_backend("ce_grad_logits");
}

}  // namespace lossk
}  // namespace algenta

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
  throw StatusError(Family::Resident, RESIDENT_ERR_NO_KERNELS,
                    std::string("device='cuda': ") + kWhy);
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
int shape_status(const FusedArgs<T>& a, std::string* why) {
  return fused_linear_ce_check_shape(a, why);
}
template <class T>
int shape_status(const DistillArgs<T>& a, std::string* why) {
  return fused_linear_distill_check_shape(a, why);
}
// The shape refusal a CUDA build makes first, then no backend (589).
template <class Args>
[[noreturn]] void refuse(const Args& a, const char* fn) {
  std::string why;
  const int st = shape_status(a, &why);
  if (st != LOSS_OK) throw StatusError(Family::Loss, st, why);
  no_backend(fn);
}
}  // namespace

// Each fused op's three CUDA entry points (workspace size, device buffers, host buffers) refuse
// alike, for float and double.
#define ALGENTA_NO_CUDA_OP(op, Args, Out, CudaOut)                                             \
  template <class T>                                                                          \
  int64_t op##_cuda_workspace(const Args<T>& a, const CudaOut<T>&) {                          \
    refuse(a, #op);                                                                           \
  }                                                                                           \
  template <class T>                                                                          \
  void op##_cuda(const Args<T>& a, CudaOut<T>&, void*, int64_t, void*) {                      \
    refuse(a, #op);                                                                           \
  }                                                                                           \
  template <class T>                                                                          \
  void op##_cuda_host(const Args<T>& a, Out<T>&) {                                            \
    refuse(a, #op);                                                                           \
  }                                                                                           \
  template int64_t op##_cuda_workspace<float>(const Args<float>&, const CudaOut<float>&);    \
  template int64_t op##_cuda_workspace<double>(const Args<double>&, const CudaOut<double>&); \
  template void op##_cuda<float>(const Args<float>&, CudaOut<float>&, void*, int64_t, void*); \
  template void op##_cuda<double>(const Args<double>&, CudaOut<double>&, void*, int64_t,     \
                                  void*);                                                     \
  template void op##_cuda_host<float>(const Args<float>&, Out<float>&);                       \
  template void op##_cuda_host<double>(const Args<double>&, Out<double>&);

ALGENTA_NO_CUDA_OP(fused_linear_ce, FusedArgs, FusedOut, FusedCudaOut)
ALGENTA_NO_CUDA_OP(fused_linear_distill, DistillArgs, DistillOut, DistillCudaOut)
#undef ALGENTA_NO_CUDA_OP

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

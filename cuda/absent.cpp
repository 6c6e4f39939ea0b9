// The CUDA backend's entry points in a build without one (neither ALGENTA_GPU nor
// ALGENTA_CUDA_EMU): no kernels are compiled in, so every entry point refuses with 604.
#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

namespace {
const char* const kWhy =
    "this binary was built without a CUDA backend, so no CUDA kernels are compiled in; rebuild "
    "with -Ccmake.define.ALGENTA_GPU=ON (or ALGENTA_CUDA_EMU=ON for the CPU emulator) or use "
    "device='cpu'";
}  // namespace

const CudaBackend& cuda_backend() {
  static const CudaBackend b = [] {
    CudaBackend r;
    r.kind = "none";
    r.why = kWhy;
    return r;
  }();
  return b;
}

std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx) {
  session_open_check(cfg, max_ctx);  // the host's refusals come first, as in a CUDA build
  throw StatusError(Family::Resident, RESIDENT_ERR_NO_KERNELS, std::string("device='cuda': ") + kWhy);
}

bool cuda_emulator_fail_after(int64_t) { return false; }

double cuda_copy_bandwidth(int64_t, int) {
  throw StatusError(Family::Resident, RESIDENT_ERR_NO_KERNELS,
                    std::string("cuda_copy_bandwidth: ") + kWhy);
}

}  // namespace residentk
}  // namespace algenta

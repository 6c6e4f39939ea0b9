// The residentk probe (the seed's residentk.probe): the contract's shape checks first, then the
// CUDA backend's own answer (cuda_backend(), session.hpp) to whether kernels are compiled in and
// a device can run them. The contract itself never asks a backend anything.
#include "algenta/residentk.hpp"
#include "algenta/session.hpp"

namespace algenta {
namespace residentk {

bool resident_gpu_kernels_compiled() { return cuda_backend().kind != "none"; }

bool resident_available() { return cuda_backend().usable; }

ResidentProbe resident_session_probe(const ModelShape& m) {
  ResidentProbe p;
  p.kernels_compiled = resident_gpu_kernels_compiled();
  p.dispatch_budget = residentk_dispatch_budget(m.n_layers);
  p.resident_f32_elems = residentk_weight_elems(m);
  const int shape = residentk_shape_check(m);
  // A refused shape is answered without touching the driver: no hardware could have helped.
  p.device_present = shape == RESIDENT_OK && resident_available();
  if (shape != RESIDENT_OK)
    p.status = shape;
  else if (!p.kernels_compiled)
    p.status = RESIDENT_ERR_NO_KERNELS;
  else if (!p.device_present)
    p.status = RESIDENT_ERR_NO_ACCELERATOR;
  else
    p.status = RESIDENT_OK;
  p.session_possible = p.status == RESIDENT_OK;
  return p;
}

}  // namespace residentk
}  // namespace algenta

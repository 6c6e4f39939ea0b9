// The device half of residentk.probe: is there a CUDA device this binary's kernels can run on.
//
// Compiled only with ALGENTA_GPU=ON, into the same _core module, against the static CUDA runtime
// so the module imports on a host with no driver at all. Every CUDA call's error, a missing or
// too-old driver included, reads as "no usable device"; nothing here throws or aborts.
#include <cuda_runtime.h>

#include "algenta/residentk.hpp"

namespace algenta {
namespace residentk {

namespace {
// Never launched: it exists so cudaFuncGetAttributes can ask whether the current device has a
// compatible image (SASS for its architecture, or PTX it can JIT) among those compiled in.
__global__ void probe_kernel(int* out) {
  if (out) *out = 1;
}
}  // namespace

bool cuda_device_usable() noexcept {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count < 1) {
    cudaGetLastError();  // leave no pending error for a later caller to trip over
    return false;
  }
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaFuncAttributes attr{};
  err = cudaFuncGetAttributes(&attr, probe_kernel);
  if (err != cudaSuccess) {  // e.g. cudaErrorNoKernelImageForDevice on a pre-Ampere GPU
    cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace residentk
}  // namespace algenta

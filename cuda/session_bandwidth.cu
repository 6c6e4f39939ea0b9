// The device's copy bandwidth (cuda_copy_bandwidth, session.hpp): the roofline the decode
// benchmark (perf/bench_decode_gpu.py) divides by. Best of `reps` timed device-to-device copies;
// bytes read plus bytes written per second.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/status_error.hpp"
#include "common.cuh"
#include "session_cuda_host.cuh"

namespace algenta {
namespace residentk {

double cuda_copy_bandwidth(int64_t bytes, int reps) {
  if (bytes < 1 || reps < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "bytes and reps must be >= 1");
  const CudaBackend& be = cuda_backend();
  if (!be.usable) refuse(RESIDENT_ERR_NO_ACCELERATOR, "no usable CUDA device: " + be.why);
  gpu::DeviceBuffer a, b;
  ck(a.allocate(bytes), "cudaMalloc(bandwidth src)");
  ck(b.allocate(bytes), "cudaMalloc(bandwidth dst)");
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  ck(cudaEventCreate(&e0), "cudaEventCreate");
  if (cudaEventCreate(&e1) != cudaSuccess) {
    cudaEventDestroy(e0);
    ck(cudaGetLastError(), "cudaEventCreate");
  }
  double best = 0.0;
  cudaError_t err = cudaMemcpy(b.p, a.p, size_t(bytes), cudaMemcpyDeviceToDevice);  // warm-up
  for (int r = 0; r < reps && err == cudaSuccess; ++r) {
    float ms = 0.f;
    if ((err = cudaEventRecord(e0)) != cudaSuccess) break;
    if ((err = cudaMemcpyAsync(b.p, a.p, size_t(bytes), cudaMemcpyDeviceToDevice)) != cudaSuccess)
      break;
    if ((err = cudaEventRecord(e1)) != cudaSuccess) break;
    if ((err = cudaEventSynchronize(e1)) != cudaSuccess) break;
    if ((err = cudaEventElapsedTime(&ms, e0, e1)) != cudaSuccess) break;
    if (ms > 0.f) best = std::max(best, 2.0 * double(bytes) / (double(ms) * 1e-3));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  ck(err, "cudaMemcpy(device to device, timed)");
  return best;
}

}  // namespace residentk
}  // namespace algenta

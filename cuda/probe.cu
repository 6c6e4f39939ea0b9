// The CUDA backend's answer to "is there a device this binary's kernels run on" (cuda_backend(),
// declared in session.hpp), which the residentk probe and the session factory ask.
//
// Compiled with ALGENTA_GPU (nvcc, against the static CUDA runtime, so the module imports on a
// host with no driver at all) or ALGENTA_CUDA_EMU (the CPU emulator, whose one device is always
// there unless ALGENTA_EMU_DEVICES=0). Every CUDA call's error, a missing or too-old driver
// included, reads as "no usable device" with the error and the driver and runtime versions in
// `why`; nothing here throws or aborts.
#include <cuda_runtime.h>

#include <string>

#ifdef ALGENTA_CUDA_EMU
#include "common.cuh"
#endif

#include "algenta/session.hpp"

namespace algenta {
namespace residentk {

namespace {

// Never launched: it exists so cudaFuncGetAttributes can ask whether the current device has a
// compatible image (SASS for its architecture, or PTX it can JIT) among those compiled in.
__global__ void probe_kernel(int* out) {
  if (out) *out = 1;
}

std::string version(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

std::string failed(const char* call, cudaError_t e, int driver, int runtime) {
  cudaGetLastError();  // leave no pending error for a later caller to trip over
  return std::string(call) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         "); " + (driver > 0 ? "the driver supports CUDA " + version(driver) : "no CUDA driver found") +
         ", this binary's runtime is CUDA " + version(runtime);
}

CudaBackend ask() {
  CudaBackend b;
#ifdef ALGENTA_CUDA_EMU
  b.kind = "emulator";
#else
  b.kind = "device";
#endif
  if (cudaDriverGetVersion(&b.driver_version) != cudaSuccess) b.driver_version = 0;
  if (cudaRuntimeGetVersion(&b.runtime_version) != cudaSuccess) b.runtime_version = 0;
  cudaGetLastError();
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    b.why = failed("cudaGetDeviceCount", err, b.driver_version, b.runtime_version);
    return b;
  }
  if (count < 1) {
    b.why = "cudaGetDeviceCount found no device";
    return b;
  }
  int dev = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) {
    b.why = failed("cudaGetDevice", err, b.driver_version, b.runtime_version);
    return b;
  }
  cudaDeviceProp p{};
  if ((err = cudaGetDeviceProperties(&p, dev)) != cudaSuccess) {
    b.why = failed("cudaGetDeviceProperties", err, b.driver_version, b.runtime_version);
    return b;
  }
  b.device_name = std::string(p.name) + " (sm_" + std::to_string(p.major) +
                  std::to_string(p.minor) + ", " + std::to_string(p.multiProcessorCount) + " SMs)";
  cudaFuncAttributes attr{};
  if ((err = cudaFuncGetAttributes(&attr, probe_kernel)) != cudaSuccess) {
    // e.g. cudaErrorNoKernelImageForDevice on a GPU older than the compiled architectures
    b.why = failed("cudaFuncGetAttributes(a compiled kernel)", err, b.driver_version,
                   b.runtime_version) + ", on " + b.device_name;
    return b;
  }
  b.usable = true;
  return b;
}

}  // namespace

bool cuda_emulator_fail_after(int64_t n) {
#ifdef ALGENTA_CUDA_EMU
  algenta_emu::fail_after(long(n));
  return true;
#else
  (void)n;
  return false;
#endif
}

#ifdef ALGENTA_CUDA_EMU
namespace {
// The emulator's PDL checks on trial: mode 0 waits before reading, 1 reads first, 2 never waits.
__global__ void k_pdl_probe(const int* in, int* out, int mode) {
  if (mode == 2) return;
  if (mode == 0) gpu::pdl_wait();
  const int v = __ldg(in);
  if (mode == 1) gpu::pdl_wait();
  if (threadIdx.x == 0) __stwb(out, v + 1);
}
}  // namespace
#endif

int64_t cuda_emulator_pdl_launches() {
#ifdef ALGENTA_CUDA_EMU
  return algenta_emu::pdl_launches();
#else
  return -1;
#endif
}

bool cuda_emulator_pdl_probe(int mode) {
#ifdef ALGENTA_CUDA_EMU
  int* buf = nullptr;
  if (cudaMalloc(&buf, 2 * sizeof(int)) != cudaSuccess) return false;
  const int zero = 41;
  cudaMemcpy(buf, &zero, sizeof(int), cudaMemcpyHostToDevice);
  gpu::launch(true, "k_pdl_probe", k_pdl_probe, dim3(1), dim3(32), 0, nullptr, buf, buf + 1, mode);
  int got = 0;
  cudaMemcpy(&got, buf + 1, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(buf);
  return got == 42;
#else
  (void)mode;
  return false;
#endif
}

bool cuda_emulator_traffic(bool start, std::vector<KernelTraffic>* out) {
#ifdef ALGENTA_CUDA_EMU
  if (start) {
    algenta_emu::traffic_start();
    return true;
  }
  for (const algenta_emu::KernelTraffic& k : algenta_emu::traffic_stop()) {
    KernelTraffic t;
    t.kernel = k.kernel;
    const algenta_emu::TrafficStats* src[2] = {&k.load, &k.store};
    int64_t* dst[2] = {t.load, t.store};
    for (int i = 0; i < 2; ++i) {
      dst[i][0] = int64_t(src[i]->requests);
      dst[i][1] = int64_t(src[i]->sectors);
      dst[i][2] = int64_t(src[i]->ideal_sectors);
      dst[i][3] = int64_t(src[i]->bytes);
    }
    if (out) out->push_back(t);
  }
  return true;
#else
  (void)start;
  (void)out;
  return false;
#endif
}

const CudaBackend& cuda_backend() {
  // Thread-safe one-time initialization; the CUDA runtime's own initialization result is
  // sticky for the process, so asking again could not change the answer.
  static const CudaBackend b = ask();
  return b;
}

}  // namespace residentk
}  // namespace algenta

// The CUDA emulator's host side: the runtime API over memory, streams, graphs, events and errors
// (the device side, fibers and the block scheduler, is emu_scheduler.cpp). See cuda/emu/README.md.
//
// Host side. Streams are queues run lazily: a kernel, copy or memset runs when something forces
// it (a synchronization, a blocking copy, cudaFree), never at enqueue. Work on the legacy default
// stream is ordered after earlier work on the blocking streams and before later work on them;
// non-blocking streams are ordered with nothing. So host code that reads a result before the
// stream that produces it was synchronized, or relies on an order between a non-blocking stream
// and the legacy stream, sees stale or wrong data here as it could on a device. Fresh device
// allocations and shared memory are filled with 0xff bytes (NaN as float), so reading what was
// never written shows up in results too.
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"

#include "emu_internal.hpp"

namespace algenta_emu {

// ---- streams, graphs, events: the host-side objects -------------------------------------------------------------------------------
namespace {
std::atomic<long> g_fail_in{0};
// True when this call is the one fail_after() asked to fail.
bool injected() {
  long v = g_fail_in.load();
  while (v > 0)
    if (g_fail_in.compare_exchange_weak(v, v - 1)) return v == 1;
  return false;
}
}  // namespace

void fail_after(long n) { g_fail_in = n > 0 ? n : 0; }

using Op = std::function<void()>;

struct Stream {
  bool legacy = false;
  bool blocking = true;
  std::deque<Op> q;
  Graph* capture = nullptr;
  bool capture_invalid = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id capture_thread;
};
struct Graph {
  std::vector<Op> nodes;
};
struct GraphExec {
  std::vector<Op> nodes;
};
struct Event {
  double ms = -1.0;
  Stream* stream = nullptr;
  bool timing = true;
};

namespace {

struct Func {
  int max_dyn = int(DEFAULT_DYN_SMEM);
  bool loaded = false;
};

struct Device {
  std::recursive_mutex mu;
  std::map<uintptr_t, size_t> dev;     // device allocations: base -> bytes
  std::map<uintptr_t, size_t> pinned;  // cudaMallocHost allocations
  size_t dev_bytes = 0;
  Stream legacy;
  std::vector<Stream*> streams;  // created, in creation order
  std::set<Event*> events;
  std::set<Graph*> graphs;
  std::set<GraphExec*> execs;
  std::map<const void*, Func> funcs;
  uint64_t launches = 0;
  Device() { legacy.legacy = true; }
};

Device& dev() {
  static Device* d = new Device;  // never destroyed: streams may be torn down at exit after it
  return *d;
}

thread_local cudaError_t t_last = cudaSuccess;

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) t_last = e;
  return e;
}

bool no_device() { return config().devices == 0; }

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

const std::pair<const uintptr_t, size_t>* find_in(const std::map<uintptr_t, size_t>& m,
                                                  const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return nullptr;
  --it;
  if (a < it->first || a - it->first > it->second || n > it->second - (a - it->first))
    return nullptr;
  return &*it;
}

bool is_dev(const void* p, size_t n) { return find_in(dev().dev, p, n) != nullptr; }
bool is_pinned(const void* p, size_t n) { return find_in(dev().pinned, p, n) != nullptr; }

Stream* resolve(cudaStream_t s) {
  Device& d = dev();
  if (s == nullptr || s == cudaStreamLegacy) return &d.legacy;
  for (Stream* x : d.streams)
    if (x == s) return x;
  return nullptr;
}

void drain(Stream& s) {
  while (!s.q.empty()) {
    Op op = std::move(s.q.front());
    s.q.pop_front();
    op();
  }
}

void drain_all() {
  Device& d = dev();
  drain(d.legacy);
  for (Stream* s : d.streams) drain(*s);
}

// A capture this host thread must not disturb with a synchronizing call: every active capture
// in global mode, and this thread's own in thread-local mode.
bool capture_forbids_sync() {
  bool any = false;
  for (Stream* s : dev().streams) {
    if (!s->capture) continue;
    if (s->mode == cudaStreamCaptureModeGlobal ||
        (s->mode == cudaStreamCaptureModeThreadLocal &&
         s->capture_thread == std::this_thread::get_id())) {
      s->capture_invalid = true;
      any = true;
    }
  }
  return any;
}

bool any_blocking_capture() {
  for (Stream* s : dev().streams)
    if (s->capture && s->blocking) return true;
  return false;
}

// Queue op on s with CUDA's ordering against the legacy default stream.
cudaError_t enqueue(Stream& s, Op op) {
  Device& d = dev();
  if (s.capture) {
    s.capture->nodes.push_back(std::move(op));
    return cudaSuccess;
  }
  if (s.legacy) {
    // The legacy stream waits for all blocking streams: one of them capturing makes this an
    // implicit dependency on a capture, which CUDA refuses.
    if (any_blocking_capture()) {
      for (Stream* x : d.streams)
        if (x->capture && x->blocking) x->capture_invalid = true;
      return cudaErrorStreamCaptureImplicit;
    }
    for (Stream* x : d.streams)
      if (x->blocking) drain(*x);
  } else if (s.blocking) {
    drain(d.legacy);
  }
  s.q.push_back(std::move(op));
  return cudaSuccess;
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "cudaErrorUnknown";
}

const char* error_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unrecognized error code";
}

}  // namespace

cudaError_t enqueue_launch(const LaunchSpec& spec, std::shared_ptr<const std::function<void()>> body) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (no_device()) return ret(cudaErrorNoDevice);
  if (injected()) return ret(cudaErrorLaunchFailure);
  Stream* s = resolve(spec.stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  const dim3 g = spec.grid, b = spec.block;
  if (g.x < 1 || g.y < 1 || g.z < 1 || g.x > 2147483647u || g.y > 65535 || g.z > 65535 ||
      b.x < 1 || b.y < 1 || b.z < 1 || b.x > 1024 || b.y > 1024 || b.z > 64 ||
      uint64_t(b.x) * b.y * b.z > 1024)
    return ret(cudaErrorInvalidConfiguration);
  Func& f = d.funcs[spec.fn];
  if (spec.smem > size_t(f.max_dyn)) {
    // CUDA: above 48 KiB of dynamic shared memory only after the kernel opted in.
    return ret(cudaErrorInvalidValue);
  }
  if (s->capture && !f.loaded) {
    // With lazy module loading (CUDA 12's default) a kernel's first use loads its module, which
    // a capture cannot record; load every kernel (cudaFuncGetAttributes) before capturing.
    std::string m = std::string("kernel ") + spec.name +
                    " first used inside a stream capture: load every kernel before capturing";
    note(m.c_str());
    s->capture_invalid = true;
    return ret(cudaErrorStreamCaptureUnsupported);
  }
  f.loaded = true;
  const LaunchSpec copy = spec;
  return ret(enqueue(*s, [copy, body, seq = ++d.launches] { run_grid(copy, *body, seq); }));
}

}  // namespace algenta_emu

using namespace algenta_emu;

// ---- errors, versions, devices -----------------------------------------------------------------
cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last; }
const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }
const char* cudaGetErrorString(cudaError_t e) { return error_string(e); }
cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = no_device() ? 0 : 13000;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* n) {
  if (!n) return ret(cudaErrorInvalidValue);
  *n = config().devices;
  return no_device() ? ret(cudaErrorNoDevice) : cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  if (!d) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (no_device()) return ret(cudaErrorNoDevice);
  return d == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (!p) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  if (d != 0) return ret(cudaErrorInvalidDevice);
  const Config& c = config();
  std::memset(p, 0, sizeof *p);
  std::snprintf(p->name, sizeof p->name, "algenta CUDA emulator (H200-like, %d SMs, order %s)",
                c.sms, c.order_name.c_str());
  p->totalGlobalMem = c.mem_total;
  p->sharedMemPerBlock = DEFAULT_DYN_SMEM;
  p->sharedMemPerBlockOptin = OPTIN_SMEM;
  p->sharedMemPerMultiprocessor = SMEM_PER_SM;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->maxThreadsPerMultiProcessor = 2048;
  p->multiProcessorCount = c.sms;
  p->major = 9;
  p->minor = 0;
  p->l2CacheSize = 50 << 20;
  p->memoryBusWidth = 6144;
  p->clockRate = 1980000;
  p->memoryClockRate = 2619000;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  if (capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  drain_all();
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!free_bytes || !total_bytes) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  *total_bytes = config().mem_total;
  *free_bytes = config().mem_total - std::min(config().mem_total, d.dev_bytes);
  return cudaSuccess;
}

// ---- memory --------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!p) return ret(cudaErrorInvalidValue);
  *p = nullptr;
  if (no_device()) return ret(cudaErrorNoDevice);
  if (bytes == 0) return cudaSuccess;
  if (bytes > config().mem_total - std::min(config().mem_total, d.dev_bytes))
    return ret(cudaErrorMemoryAllocation);
  const size_t rounded = (bytes + 255) / 256 * 256;
  void* q = std::aligned_alloc(256, rounded);
  if (!q) return ret(cudaErrorMemoryAllocation);
  // Fresh device memory holds whatever was there: 0xff bytes (NaN as float, -1 as integers)
  // make a read of never-written memory visible in results.
  if (config().poison) std::memset(q, 0xff, rounded);
  d.dev[reinterpret_cast<uintptr_t>(q)] = bytes;
  d.dev_bytes += bytes;
  *p = q;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!p) return cudaSuccess;
  auto it = d.dev.find(reinterpret_cast<uintptr_t>(p));
  if (it == d.dev.end()) return ret(cudaErrorInvalidDevicePointer);
  if (capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  drain_all();  // cudaFree synchronizes the device
  d.dev_bytes -= it->second;
  d.dev.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!p) return ret(cudaErrorInvalidValue);
  *p = nullptr;
  if (no_device()) return ret(cudaErrorNoDevice);
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* q = std::aligned_alloc(4096, rounded);
  if (!q) return ret(cudaErrorMemoryAllocation);
  d.pinned[reinterpret_cast<uintptr_t>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!p) return cudaSuccess;
  auto it = d.pinned.find(reinterpret_cast<uintptr_t>(p));
  if (it == d.pinned.end()) return ret(cudaErrorInvalidValue);
  if (capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  drain_all();
  d.pinned.erase(it);
  std::free(p);
  return cudaSuccess;
}

namespace {

// Checks a copy's pointers against its declared direction (device side inside one allocation,
// host side outside every one) and tells whether its host side is pinned.
cudaError_t classify(void* dst, const void* src, size_t n, cudaMemcpyKind& kind, bool& pinned) {
  const bool ddev = is_dev(dst, n), sdev = is_dev(src, n);
  if (kind == cudaMemcpyDefault)
    kind = ddev ? (sdev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                : (sdev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  bool ok = false;
  switch (kind) {
    case cudaMemcpyHostToDevice: ok = ddev && !is_dev(src, 1); pinned = is_pinned(src, n); break;
    case cudaMemcpyDeviceToHost: ok = sdev && !is_dev(dst, 1); pinned = is_pinned(dst, n); break;
    case cudaMemcpyDeviceToDevice: ok = ddev && sdev; pinned = true; break;
    case cudaMemcpyHostToHost: ok = !is_dev(dst, 1) && !is_dev(src, 1); pinned = false; break;
    default: return cudaErrorInvalidMemcpyDirection;
  }
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return ret(cudaErrorInvalidValue);
  bool pinned = false;
  const cudaError_t e = classify(dst, src, n, kind, pinned);
  if (e != cudaSuccess) return ret(e);
  if (s->capture) {
    if (!pinned) {  // a graph's memcpy node cannot refer to pageable host memory
      s->capture_invalid = true;
      return ret(cudaErrorStreamCaptureUnsupported);
    }
    return ret(enqueue(*s, [dst, src, n] { std::memcpy(dst, src, n); }));
  }
  if (kind == cudaMemcpyHostToDevice && !pinned) {
    // Pageable source: staged before the call returns, so the caller may reuse it at once.
    auto staged = std::make_shared<std::vector<unsigned char>>(
        static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + n);
    return ret(enqueue(*s, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); }));
  }
  const cudaError_t q = enqueue(*s, [dst, src, n] { std::memcpy(dst, src, n); });
  if (q != cudaSuccess) return ret(q);
  // Device to pageable host memory returns only once the copy is done.
  if ((kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost) && !pinned) drain(*s);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  if (capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return ret(cudaErrorInvalidValue);
  bool pinned = false;
  const cudaError_t e = classify(dst, src, n, kind, pinned);
  if (e != cudaSuccess) return ret(e);
  const cudaError_t q = enqueue(d.legacy, [dst, src, n] { std::memcpy(dst, src, n); });
  if (q != cudaSuccess) return ret(q);
  drain(d.legacy);  // synchronous with respect to the host
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (n == 0) return cudaSuccess;
  if (!is_dev(p, n)) return ret(cudaErrorInvalidValue);
  return ret(enqueue(*s, [p, value, n] { std::memset(p, value, n); }));
}

// Asynchronous with respect to the host, on the legacy default stream (what the runtime's docs
// say of device memory): a non-blocking stream is not ordered after it.
cudaError_t cudaMemset(void* p, int value, size_t n) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  if (capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  if (n == 0) return cudaSuccess;
  if (!is_dev(p, n)) return ret(cudaErrorInvalidValue);
  return ret(enqueue(d.legacy, [p, value, n] { std::memset(p, value, n); }));
}

// ---- streams --------------------------------------------------------------------------------
namespace {
// A new stream or event under the device's lock; `keep` sets it from the flags and registers it
// with the device, which is all the two creations do differently.
template <class H, class Keep>
cudaError_t create_handle(H** out, Keep keep) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!out) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  H* x = new H;
  keep(d, x);
  *out = x;
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  return create_handle(s, [flags](Device& d, Stream* x) {
    x->blocking = !(flags & cudaStreamNonBlocking);
    d.streams.push_back(x);
  });
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  Stream* s = resolve(stream);
  if (!s || s->legacy) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) return ret(cudaErrorStreamCaptureUnsupported);
  drain(*s);  // its pending work still completes
  d.streams.erase(std::find(d.streams.begin(), d.streams.end(), s));
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (no_device()) return ret(cudaErrorNoDevice);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) {
    s->capture_invalid = true;
    return ret(cudaErrorStreamCaptureUnsupported);
  }
  if (s->legacy && capture_forbids_sync()) return ret(cudaErrorStreamCaptureUnsupported);
  drain(*s);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  // A lazy queue is never "in progress": querying runs it, so polling loops terminate.
  return cudaStreamSynchronize(stream);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned int) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  Stream* s = resolve(stream);
  if (!s || !e || !d.events.count(e)) return ret(cudaErrorInvalidResourceHandle);
  if (e->stream && e->stream != s) drain(*e->stream);  // conservative: all of it, not up to e
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->legacy) return ret(cudaErrorStreamCaptureUnsupported);
  if (s->capture) return ret(cudaErrorIllegalState);
  s->capture = new Graph;
  s->capture_invalid = false;
  s->mode = mode;
  s->capture_thread = std::this_thread::get_id();
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* g) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  Stream* s = resolve(stream);
  if (!s || !g) return ret(cudaErrorInvalidValue);
  if (!s->capture) return ret(cudaErrorIllegalState);
  if (s->mode == cudaStreamCaptureModeThreadLocal &&
      s->capture_thread != std::this_thread::get_id())
    return ret(cudaErrorStreamCaptureWrongThread);
  Graph* graph = s->capture;
  s->capture = nullptr;
  if (s->capture_invalid) {
    delete graph;
    *g = nullptr;
    return ret(cudaErrorStreamCaptureInvalidated);
  }
  d.graphs.insert(graph);
  *g = graph;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* st) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  Stream* s = resolve(stream);
  if (!s || !st) return ret(cudaErrorInvalidValue);
  *st = !s->capture ? cudaStreamCaptureStatusNone
                    : s->capture_invalid ? cudaStreamCaptureStatusInvalidated
                                         : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

// ---- graphs ----------------------------------------------------------------------------------
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!exec || !g || !d.graphs.count(g)) return ret(cudaErrorInvalidValue);
  GraphExec* x = new GraphExec;
  x->nodes = g->nodes;
  d.execs.insert(x);
  *exec = x;
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (injected()) return ret(cudaErrorLaunchFailure);
  if (!exec || !d.execs.count(exec)) return ret(cudaErrorInvalidResourceHandle);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) {  // child graphs are not emulated
    s->capture_invalid = true;
    return ret(cudaErrorStreamCaptureUnsupported);
  }
  for (const Op& op : exec->nodes) {
    const cudaError_t e = enqueue(*s, op);
    if (e != cudaSuccess) return ret(e);
  }
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!g || !d.graphs.erase(g)) return ret(cudaErrorInvalidValue);
  delete g;
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!exec || !d.execs.erase(exec)) return ret(cudaErrorInvalidValue);
  delete exec;
  return cudaSuccess;
}

// ---- events ----------------------------------------------------------------------------------
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  return create_handle(e, [flags](Device& d, Event* x) {
    x->timing = !(flags & cudaEventDisableTiming);
    d.events.insert(x);
  });
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!e || !d.events.erase(e)) return ret(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!e || !d.events.count(e)) return ret(cudaErrorInvalidResourceHandle);
  Stream* s = resolve(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) {  // event nodes are not emulated
    s->capture_invalid = true;
    return ret(cudaErrorStreamCaptureUnsupported);
  }
  e->ms = -1.0;
  e->stream = s;
  return ret(enqueue(*s, [e] { e->ms = now_ms(); }));
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!e || !d.events.count(e)) return ret(cudaErrorInvalidResourceHandle);
  if (e->stream) drain(*e->stream);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!ms || !a || !b || !d.events.count(a) || !d.events.count(b))
    return ret(cudaErrorInvalidResourceHandle);
  if (!a->timing || !b->timing) return ret(cudaErrorInvalidResourceHandle);
  if (a->ms < 0 || b->ms < 0) return ret(cudaErrorNotReady);
  *ms = float(b->ms - a->ms);
  return cudaSuccess;
}

// ---- kernels ---------------------------------------------------------------------------------
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void* fn) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!a || !fn) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  Func& f = d.funcs[fn];
  f.loaded = true;
  std::memset(a, 0, sizeof *a);
  // Static shared memory is allocated per declaration as blocks reach it, so its size is not
  // known before a launch; 0 here means the opt-in headroom below is the device's whole limit.
  a->sharedSizeBytes = 0;
  a->maxThreadsPerBlock = 1024;
  a->numRegs = 32;
  a->ptxVersion = 90;
  a->binaryVersion = 90;
  a->maxDynamicSharedSizeBytes = f.max_dyn;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!fn) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  Func& f = d.funcs[fn];
  f.loaded = true;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || size_t(value) > OPTIN_SMEM) return ret(cudaErrorInvalidValue);
    f.max_dyn = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  return ret(cudaErrorInvalidValue);
}

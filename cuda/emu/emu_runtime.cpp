// The CUDA emulator's runtime: fibers and the block scheduler (device side), memory, streams,
// graphs, events and errors (host side). See cuda/emu/README.md for the model; cuda_runtime.h
// for the interface. Written for x86-64 Linux (the fiber switch is 20 lines of assembly).
//
// Device side. A block's CUDA threads are fibers on one OS thread, each with its own stack. The
// scheduler scans them in the configured order and runs each ready one until it blocks at a
// barrier or returns. __syncthreads releases when every live thread of the block has reached it
// (the same source line: a divergent barrier is reported, not silently matched); a warp barrier
// (inside every shuffle, ballot and __syncwarp) when every lane of its mask has. A scan that finds
// nothing runnable while threads are live is a deadlock: the emulator prints what each group of
// threads waits for, names the kernel and aborts. Blocks of a grid run on a pool of OS threads.
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

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define ALGENTA_EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// ---- fiber switch ------------------------------------------------------------------------------
// algenta_emu_switch(&save, to): saves the callee-saved registers, MXCSR and the x87 control word
// on the current stack, stores the stack pointer in *save, loads `to` and restores the same from
// there. A new fiber's stack is laid out (init_stack) so that this returns into the trampoline,
// which calls entry(arg) from r12 / rbx. No system call: the 10x over swapcontext that makes the
// emulated suites affordable.
extern "C" void algenta_emu_switch(void** save, void* to);
extern "C" void algenta_emu_trampoline();
asm(R"(
  .text
  .p2align 4
  .globl algenta_emu_switch
  .hidden algenta_emu_switch
  .type algenta_emu_switch,@function
algenta_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size algenta_emu_switch, .-algenta_emu_switch

  .p2align 4
  .globl algenta_emu_trampoline
  .hidden algenta_emu_trampoline
  .type algenta_emu_trampoline,@function
algenta_emu_trampoline:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size algenta_emu_trampoline, .-algenta_emu_trampoline
)");

namespace algenta_emu {

__thread Thread* t_thread = nullptr;
__thread BlockInfo* t_block = nullptr;

namespace {

[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char* fmt, ...) {
  std::fprintf(stderr, "algenta CUDA emulator: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

void note(const char* msg) {
  std::fprintf(stderr, "algenta CUDA emulator: %s\n", msg);
  std::fflush(stderr);
}

// ---- configuration (environment, read once) ----------------------------------------------------
enum class Order { Forward, Reverse, Random };

struct Config {
  Order order = Order::Forward;
  uint64_t seed = 0;
  int sms = 132;
  int workers = 1;
  int devices = 1;
  bool poison = true;
  size_t stack_bytes = size_t(256) << 10;
  size_t mem_total = size_t(140) << 30;
  std::string order_name = "forward";
};

long env_long(const char* name, long dflt, long lo, long hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end || x < lo || x > hi) fatal("%s=%s: expected an integer in [%ld, %ld]", name, v, lo, hi);
  return x;
}

const Config& config() {
  static const Config c = [] {
    Config k;
    const char* o = std::getenv("ALGENTA_EMU_ORDER");
    const std::string s = o ? o : "forward";
    if (s == "forward" || s.empty()) {
      k.order = Order::Forward;
    } else if (s == "reverse") {
      k.order = Order::Reverse;
    } else if (s.rfind("random", 0) == 0) {
      k.order = Order::Random;
      k.seed = 1;
      if (s.size() > 6) {
        if (s[6] != ':') fatal("ALGENTA_EMU_ORDER=%s: expected forward, reverse or random[:SEED]", o);
        char* end = nullptr;
        k.seed = std::strtoull(s.c_str() + 7, &end, 10);
        if (*end || s.size() == 7) fatal("ALGENTA_EMU_ORDER=%s: SEED must be an integer", o);
      }
    } else {
      fatal("ALGENTA_EMU_ORDER=%s: expected forward, reverse or random[:SEED]", o);
    }
    k.order_name = k.order == Order::Random ? "random:" + std::to_string(k.seed) : s.empty() ? "forward" : s;
    k.sms = int(env_long("ALGENTA_EMU_SMS", 132, 1, 1024));
    k.workers = int(env_long("ALGENTA_EMU_WORKERS", std::max(1, omp_get_num_procs()), 1, 256));
    k.devices = int(env_long("ALGENTA_EMU_DEVICES", 1, 0, 1));
    k.poison = env_long("ALGENTA_EMU_POISON", 1, 0, 1) != 0;
    k.stack_bytes = size_t(env_long("ALGENTA_EMU_STACK_KIB", 256, 16, 1 << 16)) << 10;
    k.mem_total = size_t(env_long("ALGENTA_EMU_MEM_GIB", 140, 1, 1 << 20)) << 30;
    return k;
  }();
  return c;
}

constexpr size_t DEFAULT_DYN_SMEM = 48 << 10;   // what every device grants without an opt-in
constexpr size_t OPTIN_SMEM = 227 << 10;        // Hopper's per-block opt-in maximum
constexpr size_t SMEM_PER_SM = 228 << 10;
constexpr size_t SMEM_ALIGN = 128;

uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// 0..n-1 in the configured order; `salt` varies the random order per launch and block.
void make_order(std::vector<int>& out, int n, uint64_t salt) {
  out.resize(size_t(n));
  for (int i = 0; i < n; ++i) out[size_t(i)] = i;
  const Config& c = config();
  if (c.order == Order::Reverse) {
    std::reverse(out.begin(), out.end());
  } else if (c.order == Order::Random) {
    uint64_t st = c.seed * 0x2545f4914f6cdd1dull ^ salt;
    for (int i = n - 1; i > 0; --i) std::swap(out[size_t(i)], out[splitmix(st) % uint64_t(i + 1)]);
  }
}

// ---- device side: fibers and one block ---------------------------------------------------------
enum class St : uint8_t { Fresh, Ready, AtBlock, AtWarp, Done };

struct Fiber {
  void* sp = nullptr;
  char* stack_lo = nullptr;
  Thread th{};
  St st = St::Fresh;
  unsigned warp = 0;
  unsigned mask = 0;  // the warp barrier's mask while St::AtWarp
  const char* site = nullptr;
#ifdef ALGENTA_EMU_ASAN
  void* fake = nullptr;
#endif
};

struct WarpState {
  unsigned exists = 0;   // lanes present in the block
  unsigned waiting = 0;  // lanes at a warp barrier
  unsigned exited = 0;
  uint64_t slot[32];
};

struct Zone {
  const char* key;
  void* p;
  size_t bytes;
};

void* alloc_poisoned(size_t bytes) {
  void* p = ::operator new(bytes ? bytes : 1, std::align_val_t(SMEM_ALIGN));
  if (config().poison) std::memset(p, 0xff, bytes);
  return p;
}
void free_aligned(void* p) { ::operator delete(p, std::align_val_t(SMEM_ALIGN)); }

void fiber_main(Fiber* f);

// The scheduler of one OS worker thread: its fiber stacks (mapped once, reused by every block
// it runs) and the state of the block in flight.
struct Sched {
  void* sp = nullptr;  // the scheduler's own context while a fiber runs
  std::vector<Fiber> fibers;
  char* arena = nullptr;
  size_t arena_bytes = 0;
#ifdef ALGENTA_EMU_ASAN
  const void* own_bottom = nullptr;
  size_t own_size = 0;
  void* own_fake = nullptr;
#endif

  const LaunchSpec* spec = nullptr;
  const std::function<void()>* body = nullptr;
  BlockInfo bi{};
  int nthreads = 0, live = 0, at_block = 0;
  std::vector<WarpState> warps;
  std::vector<int> order;
  void* dyn = nullptr;
  std::vector<Zone> zones;
  Fiber* cur = nullptr;

  ~Sched() {
    if (arena) munmap(arena, arena_bytes);
  }

  void ensure_stacks(int n) {
    const size_t sb = config().stack_bytes, page = size_t(sysconf(_SC_PAGESIZE));
    if (int(fibers.size()) >= n) return;
    // One mapping for 1024 stacks (the most threads a block may have), each with a guard page
    // below it: an overflowing kernel faults instead of corrupting its neighbour. Pages are
    // only backed where a fiber actually touched them.
    if (!arena) {
      const size_t per = sb + page;
      arena_bytes = per * 1024;
      void* p = mmap(nullptr, arena_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fatal("cannot map %zu bytes of fiber stacks", arena_bytes);
      arena = static_cast<char*>(p);
      for (int i = 0; i < 1024; ++i) mprotect(arena + size_t(i) * per, page, PROT_NONE);
    }
    const size_t old = fibers.size();
    fibers.resize(size_t(n));
    for (size_t i = old; i < size_t(n); ++i)
      fibers[i].stack_lo = arena + i * (sb + page) + page;
  }

  void* init_stack(Fiber& f) {
    const uintptr_t top = (uintptr_t(f.stack_lo) + config().stack_bytes) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16);  // 16-aligned after the ret
    *--sp = uint64_t(reinterpret_cast<uintptr_t>(&algenta_emu_trampoline));
    *--sp = 0;                                                   // rbp
    *--sp = uint64_t(reinterpret_cast<uintptr_t>(&f));           // rbx: entry's argument
    *--sp = uint64_t(reinterpret_cast<uintptr_t>(&fiber_main));  // r12: entry
    *--sp = 0;                                                   // r13
    *--sp = 0;                                                   // r14
    *--sp = 0;                                                   // r15
    --sp;
    uint32_t mx;
    uint16_t cw;
    __asm__ volatile("stmxcsr %0" : "=m"(mx));
    __asm__ volatile("fnstcw %0" : "=m"(cw));
    std::memcpy(sp, &mx, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &cw, 2);
    return sp;
  }

  void resume(Fiber& f) {
    cur = &f;
    t_thread = &f.th;
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_start_switch_fiber(&own_fake, f.stack_lo, config().stack_bytes);
#endif
    algenta_emu_switch(&sp, f.sp);
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_finish_switch_fiber(own_fake, nullptr, nullptr);
#endif
    t_thread = nullptr;
    cur = nullptr;
  }

  // From inside a fiber: back to the scheduler (dying: the fiber never runs again).
  void yield(Fiber& f, bool dying = false) {
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f.fake, own_bottom, own_size);
#else
    (void)dying;
#endif
    algenta_emu_switch(&f.sp, sp);
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake, nullptr, nullptr);
#endif
  }

  std::string where() const {
    char b[160];
    std::snprintf(b, sizeof b, "kernel %s, block (%u,%u,%u) of (%u,%u,%u), %d threads",
                  spec->name, bi.idx.x, bi.idx.y, bi.idx.z, bi.grid.x, bi.grid.y, bi.grid.z,
                  nthreads);
    return b;
  }

  void release_block() {
    const char* site = nullptr;
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = fibers[size_t(i)];
      if (f.st != St::AtBlock) continue;
      if (!site) site = f.site;
      else if (std::strcmp(site, f.site) != 0)
        fatal("%s: divergent __syncthreads: threads wait at %s and at %s (undefined behaviour "
              "on a device: every thread of a block must reach the same barrier)",
              where().c_str(), site, f.site);
    }
    for (int i = 0; i < nthreads; ++i)
      if (fibers[size_t(i)].st == St::AtBlock) fibers[size_t(i)].st = St::Ready;
    at_block = 0;
  }

  void on_exit(Fiber& f) {
    f.st = St::Done;
    --live;
    WarpState& w = warps[f.warp];
    const unsigned bit = 1u << f.th.lane;
    w.exited |= bit;
    for (unsigned l = 0; l < 32; ++l) {
      if (!(w.waiting >> l & 1u)) continue;
      const Fiber& o = fibers[size_t(f.warp * 32 + l)];
      if (o.mask & bit)
        fatal("%s: thread %u exited while lane %u of its warp waits for it in a warp-synchronous "
              "call at %s (mask 0x%08x)",
              where().c_str(), f.warp * 32 + f.th.lane, l, o.site, o.mask);
    }
    if (at_block > 0 && at_block == live) release_block();
  }

  [[noreturn]] void deadlock() {
    std::string what;
    std::map<std::string, int> groups;
    for (int i = 0; i < nthreads; ++i) {
      const Fiber& f = fibers[size_t(i)];
      char b[200];
      if (f.st == St::AtBlock) {
        std::snprintf(b, sizeof b, "__syncthreads at %s", f.site);
      } else if (f.st == St::AtWarp) {
        std::snprintf(b, sizeof b, "a warp barrier at %s (mask 0x%08x; lanes of it missing: 0x%08x)",
                      f.site, f.mask, f.mask & ~warps[f.warp].waiting);
      } else {
        continue;
      }
      ++groups[b];
    }
    for (auto& g : groups) what += "\n  " + std::to_string(g.second) + " thread(s) wait in " + g.first;
    fatal("%s: deadlock: %d live thread(s), none can proceed:%s", where().c_str(), live,
          what.c_str());
  }

  void run_block(const LaunchSpec& s, const std::function<void()>& fn, uint3 idx, uint64_t salt) {
    spec = &s;
    body = &fn;
    bi.idx = idx;
    bi.dim = s.block;
    bi.grid = s.grid;
    nthreads = int(s.block.x * s.block.y * s.block.z);
    ensure_stacks(nthreads);
    live = nthreads;
    at_block = 0;
    const int nwarps = (nthreads + 31) / 32;
    warps.assign(size_t(nwarps), WarpState{});
    for (int w = 0; w < nwarps; ++w) {
      const int lanes = std::min(32, nthreads - 32 * w);
      warps[size_t(w)].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
    }
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = fibers[size_t(i)];
      const unsigned u = unsigned(i);
      f.th.idx = uint3{u % s.block.x, (u / s.block.x) % s.block.y, u / (s.block.x * s.block.y)};
      f.th.lane = u & 31u;
      f.warp = u >> 5;
      f.st = St::Fresh;
      f.mask = 0;
      f.site = nullptr;
    }
    dyn = s.smem ? alloc_poisoned(s.smem) : nullptr;
    t_block = &bi;
    make_order(order, nthreads, salt);
    while (live > 0) {
      bool ran = false;
      for (int k : order) {
        Fiber& f = fibers[size_t(k)];
        if (f.st == St::Fresh) {
          f.sp = init_stack(f);
          f.st = St::Ready;
        }
        if (f.st != St::Ready) continue;
        resume(f);
        ran = true;
      }
      if (!ran) deadlock();
    }
    t_block = nullptr;
    if (dyn) free_aligned(dyn);
    dyn = nullptr;
    for (Zone& z : zones) free_aligned(z.p);
    zones.clear();
  }
};

thread_local std::unique_ptr<Sched> t_sched_owner;
__thread Sched* t_sched = nullptr;

Sched& sched() {
  if (!t_sched) {
    t_sched_owner.reset(new Sched);
    t_sched = t_sched_owner.get();
  }
  return *t_sched;
}

void fiber_main(Fiber* f) {
  Sched& s = *t_sched;
#ifdef ALGENTA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.own_bottom, &s.own_size);
#endif
  (*s.body)();
  s.on_exit(*f);
  s.yield(*f, /*dying=*/true);
  __builtin_unreachable();
}

Fiber& current(const char* what) {
  if (!t_sched || !t_sched->cur) fatal("%s called outside a kernel", what);
  return *t_sched->cur;
}

}  // namespace

// ---- device built-ins ----------------------------------------------------------------------------
void syncthreads(const char* site) {
  Fiber& f = current("__syncthreads");
  Sched& s = *t_sched;
  f.st = St::AtBlock;
  f.site = site;
  if (++s.at_block == s.live) s.release_block();
  s.yield(f);
}

void syncwarp(const char* site, unsigned mask) {
  Fiber& f = current("a warp-synchronous call");
  Sched& s = *t_sched;
  WarpState& w = s.warps[f.warp];
  const unsigned bit = 1u << f.th.lane;
  if (!(mask & bit))
    fatal("%s: lane %u calls a warp-synchronous function at %s with mask 0x%08x, which excludes "
          "itself", s.where().c_str(), f.th.lane, site, mask);
  if (mask & ~w.exists)
    fatal("%s: warp %u: mask 0x%08x at %s names lanes the block does not have (0x%08x exist)",
          s.where().c_str(), f.warp, mask, site, w.exists);
  if (mask & w.exited)
    fatal("%s: warp %u: mask 0x%08x at %s names lanes that have exited (0x%08x)",
          s.where().c_str(), f.warp, mask, site, mask & w.exited);
  f.st = St::AtWarp;
  f.mask = mask;
  f.site = site;
  w.waiting |= bit;
  if ((w.waiting & mask) == mask) {
    for (unsigned l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& o = s.fibers[size_t(f.warp * 32 + l)];
      if (o.mask != mask)
        fatal("%s: warp %u: lanes meet at warp barriers with different masks (0x%08x at %s, "
              "0x%08x at %s)", s.where().c_str(), f.warp, mask, site, o.mask, o.site);
      o.st = St::Ready;
    }
    w.waiting &= ~mask;
  }
  s.yield(f);
}

uint64_t warp_exchange(unsigned mask, uint64_t v, int src, const char* site) {
  Fiber& f = current("a warp shuffle");
  Sched& s = *t_sched;
  WarpState& w = s.warps[f.warp];
  w.slot[f.th.lane] = v;
  syncwarp(site, mask);
  // A lane outside [0, 32), or one outside the mask (whose value CUDA leaves undefined), gives
  // the caller's own value.
  const uint64_t r = (src >= 0 && src < 32 && (mask >> src & 1u)) ? w.slot[src] : v;
  syncwarp(site, mask);  // the slot stays until every lane has read it
  return r;
}

unsigned warp_ballot(unsigned mask, bool pred, const char* site) {
  Fiber& f = current("__ballot_sync");
  Sched& s = *t_sched;
  WarpState& w = s.warps[f.warp];
  w.slot[f.th.lane] = pred ? 1 : 0;
  syncwarp(site, mask);
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && w.slot[l]) r |= 1u << l;
  syncwarp(site, mask);
  return r;
}

void* dynamic_smem_ptr() {
  current("extern __shared__");
  return t_sched->dyn;
}

void* static_smem_ptr(const char* key, size_t bytes, size_t align) {
  current("__shared__");
  Sched& s = *t_sched;
  if (align > SMEM_ALIGN) fatal("__shared__ %s: alignment %zu > %zu", key, align, SMEM_ALIGN);
  for (const Zone& z : s.zones)
    if (z.key == key || std::strcmp(z.key, key) == 0) return z.p;
  void* p = alloc_poisoned(bytes);
  s.zones.push_back(Zone{key, p, bytes});
  return p;
}

const char* order_name() { return config().order_name.c_str(); }

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

// ---- host side -------------------------------------------------------------------------------
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

void run_kernel(const LaunchSpec& spec, const std::function<void()>& body) {
  Device& d = dev();
  const uint64_t seq = ++d.launches;
  const dim3 g = spec.grid;
  const int64_t n = int64_t(g.x) * g.y * g.z;
  std::vector<int> order;
  if (n > (int64_t(1) << 31) - 1) fatal("kernel %s: %lld blocks", spec.name, (long long)n);
  make_order(order, int(n), seq * 0x9e3779b97f4a7c15ull);
  auto block_at = [&](int k) {
    const unsigned b = unsigned(order[size_t(k)]);
    return uint3{b % g.x, (b / g.x) % g.y, b / (g.x * g.y)};
  };
  const int workers = int(std::min<int64_t>(config().workers, n));
  if (workers <= 1) {
    Sched& s = sched();
    for (int k = 0; k < int(n); ++k) s.run_block(spec, body, block_at(k), seq * 1000003u + uint64_t(k));
    return;
  }
  std::atomic<int> next{0};
#pragma omp parallel num_threads(workers)
  {
    Sched& s = sched();
    for (;;) {
      const int k = next.fetch_add(1);
      if (k >= int(n)) break;
      s.run_block(spec, body, block_at(k), seq * 1000003u + uint64_t(k));
    }
  }
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
  return ret(enqueue(*s, [copy, body] { run_kernel(copy, *body); }));
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
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!s) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  Stream* x = new Stream;
  x->blocking = !(flags & cudaStreamNonBlocking);
  d.streams.push_back(x);
  *s = x;
  return cudaSuccess;
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
  Device& d = dev();
  std::lock_guard<std::recursive_mutex> lock(d.mu);
  if (!e) return ret(cudaErrorInvalidValue);
  if (no_device()) return ret(cudaErrorNoDevice);
  Event* x = new Event;
  x->timing = !(flags & cudaEventDisableTiming);
  d.events.insert(x);
  *e = x;
  return cudaSuccess;
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

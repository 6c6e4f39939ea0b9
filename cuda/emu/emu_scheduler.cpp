// The CUDA emulator's device side: fibers, the block scheduler and the device built-ins (the host
// side, the runtime API, is emu_api.cpp). See cuda/emu/README.md for the model; cuda_runtime.h
// for the interface. Written for x86-64 Linux (the fiber switch is 20 lines of assembly).
//
// Device side. A block's CUDA threads are fibers on one OS thread, each with its own stack. The
// scheduler scans them in the configured order and runs each ready one until it blocks at a
// barrier or returns. __syncthreads releases when every live thread of the block has reached it
// (the same source line: a divergent barrier is reported, not silently matched); a warp barrier
// (inside every shuffle, ballot and __syncwarp) when every lane of its mask has. A scan that finds
// nothing runnable while threads are live is a deadlock: the emulator prints what each group of
// threads waits for, names the kernel and aborts. Blocks of a grid run on a pool of OS threads.
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
#include <unordered_map>
#include <vector>

#include "cuda_runtime.h"

#include "emu_internal.hpp"
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define ALGENTA_EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// ---- fiber switch ------------------------------------------------------------------------------
// algenta_emu_switch(&save, to): pushes the callee-saved general registers on the current stack,
// stores the stack pointer in *save, loads `to` and pops the same from there. A new fiber's stack
// is laid out (init_stack) so that this returns into the trampoline, which calls entry(arg) from
// r12 / rbx. No system call: the 10x over swapcontext that makes the emulated suites affordable.
// MXCSR and the x87 control word are not switched: every fiber of a worker runs on that worker's
// OS thread with its floating-point environment, and no kernel changes rounding or flushing
// modes (ldmxcsr/stmxcsr and fldcw/fnstcw were a third of the emulator's time, being
// microcoded on the hosts CI runs on).
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
  movq %rsp, (%rdi)
  movq %rsi, %rsp
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
__thread const char* t_launch_label = nullptr;
__thread BlockInfo* t_block = nullptr;

void fatal(const char* fmt, ...) {
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

static long env_long(const char* name, long dflt, long lo, long hi) {
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

namespace {

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
  std::unordered_map<const void*, uint32_t> reached;  // traffic: times this lane reached a site
#ifdef ALGENTA_EMU_ASAN
  void* fake = nullptr;
#endif
};

// What a lane asks of the warp barrier it waits at: only to meet, a shuffle (the value of lane
// src[lane]) or a ballot. The barrier's last lane to arrive computes every lane's answer into
// out[], so one barrier serves a shuffle: a lane's out[] is next written when that lane arrives
// again, after it has read it.
enum class WarpOp : uint8_t { Meet, Exchange, Ballot };

struct WarpState {
  unsigned exists = 0;   // lanes present in the block
  unsigned waiting = 0;  // lanes at a warp barrier
  unsigned exited = 0;
  WarpOp op[32];
  int src[32];
  uint64_t slot[32];  // each lane's value at arrival
  uint64_t out[32];   // each lane's answer, written at release
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
  // Traffic of the block in flight: the byte ranges of each warp instruction (keyed by warp,
  // site, the n-th time its lanes reached the site, load or store), folded at the block's end.
  struct Instr {
    const void* site;
    uint32_t warp, nth;
    bool store;
    bool operator==(const Instr& o) const {
      return site == o.site && warp == o.warp && nth == o.nth && store == o.store;
    }
  };
  struct InstrHash {
    size_t operator()(const Instr& i) const {
      return std::hash<const void*>()(i.site) ^ (size_t(i.warp) << 40) ^ (size_t(i.nth) << 1) ^
             size_t(i.store);
    }
  };
  std::unordered_map<Instr, std::vector<std::pair<uintptr_t, uint32_t>>, InstrHash> accesses;
  void fold_traffic();

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
    return sp;
  }

  // A pass runs the block's ready fibers in the configured order, each until it blocks or
  // returns. A fiber that stops switches straight to the next ready one of the pass (one switch,
  // not two through the scheduler); the last of the pass switches back to the scheduler, which
  // starts the next pass, or reports a deadlock when a pass finds no fiber ready.
  int pos = -1;             // the running fiber's position in `order` during a pass
  bool from_sched = false;  // the switch in flight leaves the scheduler's own stack

  Fiber* next_in_pass() {
    for (int p = pos + 1; p < nthreads; ++p) {
      Fiber& f = fibers[size_t(order[size_t(p)])];
      if (f.st == St::Fresh) {
        f.sp = init_stack(f);
        f.st = St::Ready;
      }
      if (f.st == St::Ready) {
        pos = p;
        return &f;
      }
    }
    return nullptr;
  }

  // From the scheduler: one pass; false when no fiber was ready.
  bool run_pass() {
    pos = -1;
    Fiber* f = next_in_pass();
    if (!f) return false;
    cur = f;
    t_thread = &f->th;
    from_sched = true;
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_start_switch_fiber(&own_fake, f->stack_lo, config().stack_bytes);
#endif
    algenta_emu_switch(&sp, f->sp);
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_finish_switch_fiber(own_fake, nullptr, nullptr);
#endif
    t_thread = nullptr;
    cur = nullptr;
    return true;
  }

  // From inside a fiber: on to the pass's next fiber, or back to the scheduler (dying: the
  // fiber never runs again).
  void yield(Fiber& f, bool dying = false) {
    Fiber* n = next_in_pass();
    cur = n;
    t_thread = n ? &n->th : nullptr;
    from_sched = false;
#ifdef ALGENTA_EMU_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f.fake, n ? n->stack_lo : own_bottom,
                                   n ? config().stack_bytes : own_size);
#else
    (void)dying;
#endif
    algenta_emu_switch(&f.sp, n ? n->sp : sp);
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
    if (f.th.pdl_pending)
      fatal("%s: thread %u of a programmatic dependent launch exited without gpu::pdl_wait() "
            "(the next kernel's wait would not order it after the kernel before this one)",
            where().c_str(), f.warp * 32 + f.th.lane);
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
      f.th.pdl_pending = s.pdl;
      f.warp = u >> 5;
      f.st = St::Fresh;
      f.mask = 0;
      f.site = nullptr;
      f.reached.clear();
    }
    dyn = s.smem ? alloc_poisoned(s.smem) : nullptr;
    t_block = &bi;
    make_order(order, nthreads, salt);
    while (live > 0)
      if (!run_pass()) deadlock();
    t_block = nullptr;
    if (!accesses.empty()) fold_traffic();
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

// ---- global-memory traffic ----------------------------------------------------------------------
std::mutex g_traffic_mu;
std::map<std::string, KernelTraffic> g_traffic_by_kernel;

void Sched::fold_traffic() {
  KernelTraffic k;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  std::vector<uintptr_t> sectors;
  for (auto& [instr, acc] : accesses) {
    ranges.clear();
    sectors.clear();
    for (const auto& [a, n] : acc) {
      ranges.push_back({a, a + n});
      for (uintptr_t sct = a >> 5; sct <= (a + n - 1) >> 5; ++sct) sectors.push_back(sct);
    }
    std::sort(ranges.begin(), ranges.end());
    uint64_t needed = 0;
    uintptr_t end = 0;
    for (const auto& [a, b] : ranges) {  // the union of the lanes' byte ranges
      if (b <= end) continue;
      needed += b - std::max(a, end);
      end = b;
    }
    std::sort(sectors.begin(), sectors.end());
    const uint64_t distinct = uint64_t(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
    TrafficStats& t = instr.store ? k.store : k.load;
    t.requests += 1;
    t.sectors += distinct;
    t.ideal_sectors += (needed + 31) / 32;
    t.bytes += needed;
  }
  accesses.clear();
  const std::string name =
      std::string(spec->name) + (spec->label ? std::string("[") + spec->label + "]" : "");
  std::lock_guard<std::mutex> lock(g_traffic_mu);
  KernelTraffic& g = g_traffic_by_kernel[name];
  g.kernel = name;
  for (auto [dst, src] : {std::make_pair(&g.load, &k.load), std::make_pair(&g.store, &k.store)}) {
    dst->requests += src->requests;
    dst->sectors += src->sectors;
    dst->ideal_sectors += src->ideal_sectors;
    dst->bytes += src->bytes;
  }
}

void fiber_main(Fiber* f) {
  Sched& s = *t_sched;
#ifdef ALGENTA_EMU_ASAN
  // The scheduler's stack bounds, which ASan needs for the switches back to it, are those of
  // the stack a fiber first entered from the scheduler left.
  if (s.from_sched)
    __sanitizer_finish_switch_fiber(nullptr, &s.own_bottom, &s.own_size);
  else
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
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

// Global-memory traffic (cuda_runtime.h): the interface the intrinsics and the hook call.
bool g_traffic = false;

void traffic_access(const void* p, unsigned bytes, bool store) {
  const void* site = __builtin_return_address(0);
  Sched* s = t_sched;
  if (!s || !s->cur) return;  // host code touching device memory: not a kernel's access
  Fiber& f = *s->cur;
  const uint32_t nth = f.reached[site]++;
  s->accesses[Sched::Instr{site, f.warp, nth, store}].push_back({uintptr_t(p), bytes});
}

void traffic_start() {
  std::lock_guard<std::mutex> lock(g_traffic_mu);
  g_traffic_by_kernel.clear();
  g_traffic = true;
}

std::vector<KernelTraffic> traffic_stop() {
  std::lock_guard<std::mutex> lock(g_traffic_mu);
  g_traffic = false;
  std::vector<KernelTraffic> out;
  for (auto& [name, k] : g_traffic_by_kernel) out.push_back(k);
  g_traffic_by_kernel.clear();
  return out;
}


// ---- device built-ins ----------------------------------------------------------------------------
void syncthreads(const char* site) {
  Fiber& f = current("__syncthreads");
  Sched& s = *t_sched;
  f.st = St::AtBlock;
  f.site = site;
  if (++s.at_block == s.live) s.release_block();
  s.yield(f);
}

// A warp barrier over `mask`: the lane's request (op, value, src) is in its warp's slots.
static void warp_barrier(const char* site, unsigned mask, WarpOp op, uint64_t v, int src) {
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
  w.op[f.th.lane] = op;
  w.slot[f.th.lane] = v;
  w.src[f.th.lane] = src;
  w.waiting |= bit;
  if ((w.waiting & mask) == mask) {
    unsigned ballot = 0;
    for (unsigned l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& o = s.fibers[size_t(f.warp * 32 + l)];
      if (o.mask != mask)
        fatal("%s: warp %u: lanes meet at warp barriers with different masks (0x%08x at %s, "
              "0x%08x at %s)", s.where().c_str(), f.warp, mask, site, o.mask, o.site);
      o.st = St::Ready;
      if (w.slot[l]) ballot |= 1u << l;
    }
    for (unsigned l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      if (w.op[l] == WarpOp::Exchange) {
        // A lane outside [0, 32), or one outside the mask (whose value CUDA leaves undefined),
        // gives the caller's own value.
        const int from = w.src[l];
        w.out[l] = (from >= 0 && from < 32 && (mask >> from & 1u)) ? w.slot[from] : w.slot[l];
      } else if (w.op[l] == WarpOp::Ballot) {
        w.out[l] = ballot;
      }
    }
    w.waiting &= ~mask;
  }
  s.yield(f);
}

void syncwarp(const char* site, unsigned mask) { warp_barrier(site, mask, WarpOp::Meet, 0, 0); }

uint64_t warp_exchange(unsigned mask, uint64_t v, int src, const char* site) {
  warp_barrier(site, mask, WarpOp::Exchange, v, src);
  return t_sched->warps[t_sched->cur->warp].out[t_sched->cur->th.lane];
}

unsigned warp_ballot(unsigned mask, bool pred, const char* site) {
  warp_barrier(site, mask, WarpOp::Ballot, pred ? 1 : 0, 0);
  return unsigned(t_sched->warps[t_sched->cur->warp].out[t_sched->cur->th.lane]);
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

void pdl_waited() {
  if (t_thread) t_thread->pdl_pending = false;
}

static std::atomic<int64_t> g_pdl_grids{0};
int64_t pdl_launches() { return g_pdl_grids.load(); }

void pdl_violation(const void* p, bool store) {
  fatal("%s: thread (%u,%u,%u) of a programmatic dependent launch %s global memory at %p "
        "before gpu::pdl_wait() (on a device the kernel before it may still be writing)",
        sched().where().c_str(), t_thread->idx.x, t_thread->idx.y, t_thread->idx.z,
        store ? "wrote" : "read", p);
}

// ---- the grid: blocks over a pool of OS threads ---------------------------------------------
// Called by the host side when a launch runs (seq: the launch's number, which salts the order).
void run_grid(const LaunchSpec& spec, const std::function<void()>& body, uint64_t seq) {
  if (spec.pdl) g_pdl_grids.fetch_add(1);
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

}  // namespace algenta_emu


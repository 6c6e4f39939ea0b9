// Picks the kernel table for this host once: the best instruction set the CPU reports, or the
// one named by ALGENTA_ISA (for tests and benchmarks that compare variants on one machine).
// AMX: Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); a tile instruction before the grant dies with SIGILL. The request is made here,
// once, before the amx table can be chosen, and a refusal falls back to the next instruction set
// with the reason in isa_note(). The grant covers every thread of the process, present and later.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "algenta/kernels.hpp"

namespace algenta {
namespace kern {

extern const IsaTable isa_generic_table;
#ifdef ALGENTA_HAS_ISA_amx
extern const IsaTable isa_amx_table;
#endif
#ifdef ALGENTA_HAS_ISA_avx2
extern const IsaTable isa_avx2_table;
#endif
#ifdef ALGENTA_HAS_ISA_avx512
extern const IsaTable isa_avx512_table;
#endif
#ifdef ALGENTA_HAS_ISA_avx512bf16
extern const IsaTable isa_avx512bf16_table;
#endif

namespace {

struct Choice {
  const IsaTable* table = nullptr;
  std::string error;
  std::string note;
};

#if defined(__x86_64__)
// CPUID.(EAX=7, ECX=0):EDX bits 22 (AMX-BF16), 24 (AMX-TILE), 25 (AMX-INT8).
bool cpu_reports_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 22 & 1) && (d >> 24 & 1) && (d >> 25 & 1);
}

// "" once the kernel granted the tile state, else why not (asked at most once per process).
const std::string& amx_refusal() {
  static const std::string why = [] {
    constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr unsigned long XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
      return std::string("the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
             std::strerror(errno) + ")";
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0 ||
        !(granted & (1ul << XFEATURE_XTILEDATA)))
      return std::string("the kernel did not grant the AMX tile state (ARCH_GET_XCOMP_PERM)");
    return std::string();
  }();
  return why;
}
#endif

bool host_has(const char* name) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // F16C (half <-> float conversion) came with every AVX2 CPU; it is checked all the same.
  if (std::strcmp(name, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  if (std::strcmp(name, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  // AVX-512 plus vdpbf16ps and vpdpbusd (AMD Zen 4 and later, Intel Cooper Lake and Sapphire
  // Rapids on: every one of them has both).
  if (std::strcmp(name, "avx512bf16") == 0)
    return host_has("avx512") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vnni");
  // avx512bf16 plus the tiles, granted (amx_refusal says why not)
  if (std::strcmp(name, "amx") == 0)
    return host_has("avx512bf16") && cpu_reports_amx() && amx_refusal().empty();
#endif
  return std::strcmp(name, "generic") == 0;
}

const IsaTable* const compiled[] = {
#ifdef ALGENTA_HAS_ISA_amx
    &isa_amx_table,
#endif
#ifdef ALGENTA_HAS_ISA_avx512bf16
    &isa_avx512bf16_table,
#endif
#ifdef ALGENTA_HAS_ISA_avx512
    &isa_avx512_table,
#endif
#ifdef ALGENTA_HAS_ISA_avx2
    &isa_avx2_table,
#endif
    &isa_generic_table,
};

// Why the CPU's AMX is not used, where it has it ("" otherwise).
std::string amx_note() {
#if defined(__x86_64__) && defined(ALGENTA_HAS_ISA_amx)
  if (cpu_reports_amx() && !amx_refusal().empty()) return "amx: " + amx_refusal();
#endif
  return std::string();
}

Choice choose() {
  Choice c;
  const char* want = std::getenv("ALGENTA_ISA");
  if (want && *want) {
    for (const IsaTable* t : compiled) {
      if (std::strcmp(t->name, want) != 0) continue;
      if (!host_has(t->name)) {
        c.error = std::string("ALGENTA_ISA=") + want + ": this CPU does not support it";
        const std::string why = std::strcmp(want, "amx") == 0 ? amx_note() : std::string();
        if (!why.empty()) c.error += " (" + why + ")";
        return c;
      }
      c.table = t;
      return c;
    }
    c.error = std::string("ALGENTA_ISA=") + want + ": unknown instruction set (compiled:";
    for (const IsaTable* t : compiled) c.error += std::string(" ") + t->name;
    c.error += ")";
    return c;
  }
  c.note = amx_note();
  for (const IsaTable* t : compiled)
    if (host_has(t->name)) {
      c.table = t;
      return c;
    }
  c.table = &isa_generic_table;
  return c;
}

const Choice& choice() {
  static const Choice c = choose();  // thread-safe one-time init (C++11 magic statics)
  return c;
}

}  // namespace

const IsaTable& isa() {
  const Choice& c = choice();
  if (!c.table) throw std::invalid_argument(c.error);
  return *c.table;
}

const char* isa_name() {
  const Choice& c = choice();
  return c.table ? c.table->name : c.error.c_str();
}

const char* isa_names() {
  static const std::string names = [] {
    std::string s;
    for (const IsaTable* t : compiled) s += (s.empty() ? "" : ",") + std::string(t->name);
    return s;
  }();
  return names.c_str();
}

const char* isa_note() { return choice().note.c_str(); }

}  // namespace kern
}  // namespace algenta

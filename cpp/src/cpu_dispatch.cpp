// Picks the kernel table for this host once: the best instruction set the CPU reports, or the
// one named by ALGENTA_ISA (for tests and benchmarks that compare variants on one machine).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "algenta/kernels.hpp"

namespace algenta {
namespace kern {

extern const IsaTable isa_generic_table;
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
};

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
#endif
  return std::strcmp(name, "generic") == 0;
}

Choice choose() {
  const IsaTable* compiled[] = {
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
  Choice c;
  const char* want = std::getenv("ALGENTA_ISA");
  if (want && *want) {
    for (const IsaTable* t : compiled) {
      if (std::strcmp(t->name, want) != 0) continue;
      if (!host_has(t->name)) {
        c.error = std::string("ALGENTA_ISA=") + want + ": this CPU does not support it";
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

}  // namespace kern
}  // namespace algenta

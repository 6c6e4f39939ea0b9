// What the two halves of the CUDA emulator's runtime share: emu_scheduler.cpp (fibers, one
// block's scheduler, a grid's blocks over OS threads, the device built-ins) and emu_api.cpp (the
// CUDA runtime API: memory, streams, graphs, events, errors). Not part of the emulated CUDA
// interface (cuda_runtime.h is).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_runtime.h"

namespace algenta_emu {

// Prints "algenta CUDA emulator: ..." and aborts: an emulated program that would be undefined
// on a device (a divergent barrier, a deadlock) or a malformed environment variable.
[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char* fmt, ...);
void note(const char* msg);  // one line on stderr

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

const Config& config();

constexpr size_t DEFAULT_DYN_SMEM = 48 << 10;   // what every device grants without an opt-in
constexpr size_t OPTIN_SMEM = 227 << 10;        // Hopper's per-block opt-in maximum
constexpr size_t SMEM_PER_SM = 228 << 10;
constexpr size_t SMEM_ALIGN = 128;

// Runs every block of one launch (in the configured order, on config().workers OS threads).
void run_grid(const LaunchSpec& spec, const std::function<void()>& body, uint64_t seq);

}  // namespace algenta_emu

// The process-wide slot behind ChunkScratch (buffer.hpp).
#include <mutex>

#include "algenta/buffer.hpp"

namespace algenta {

namespace {
std::mutex slot_mutex;
Buffer<unsigned char> slot;  // idle block, or empty
constexpr size_t kMaxKept = size_t(1) << 30;
}  // namespace

ChunkScratch::ChunkScratch(size_t bytes) {
  if (bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(slot_mutex);
    if (slot.size() >= bytes) {
      buf_ = std::move(slot);
      return;
    }
  }
  buf_ = Buffer<unsigned char>(bytes);  // may throw bad_alloc; nothing is held yet
}

ChunkScratch::~ChunkScratch() {
  if (buf_.size() == 0 || buf_.size() > kMaxKept) return;
  std::lock_guard<std::mutex> lock(slot_mutex);
  if (buf_.size() > slot.size()) slot = std::move(buf_);  // the old (smaller) block is freed
}

size_t ChunkScratch::release_cached() {
  Buffer<unsigned char> old;
  {
    std::lock_guard<std::mutex> lock(slot_mutex);
    old = std::move(slot);
  }
  return old.size();
}

size_t ChunkScratch::cached_bytes() {
  std::lock_guard<std::mutex> lock(slot_mutex);
  return slot.size();
}

}  // namespace algenta

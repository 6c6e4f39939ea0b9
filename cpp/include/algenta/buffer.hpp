// Internal: uninitialized scratch for the hot paths. Large buffers are 2 MiB aligned and
// advised as transparent huge pages, so first touch costs one fault per 2 MiB instead of one
// per 4 KiB: on virtual machines that fault cost, not the arithmetic, dominated the fused
// backward's fresh (C, V) logit chunk. Contents start undefined; every user writes before it
// reads. Allocation failure throws std::bad_alloc (MemoryError in Python).
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace algenta {

// malloc for large blocks: 2 MiB aligned and advised as transparent huge pages from 2 MiB up,
// else 64-byte aligned. Released with std::free (so a caller may hand it to an owner that frees
// it, or shrink it with realloc). Throws std::bad_alloc.
inline void* huge_malloc(size_t bytes) {
  const size_t huge = size_t(1) << 21;
  if (bytes > size_t(-1) - huge) throw std::bad_alloc();
  const size_t align = bytes >= huge ? huge : 64;
  void* p = nullptr;
  if (posix_memalign(&p, align, (bytes + align - 1) / align * align) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == huge) madvise(p, (bytes + huge - 1) / huge * huge, MADV_HUGEPAGE);  // a hint only
#endif
  return p;
}

template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n) : n_(n) {
    if (n == 0) return;
    if (n > size_t(-1) / sizeof(T) - (size_t(1) << 21)) throw std::bad_alloc();
    p_ = static_cast<T*>(huge_malloc(n * sizeof(T)));
  }
  ~Buffer() { std::free(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept { std::free(p_); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; return *this; }

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// The scratch of one fused backward's logit chunk, up to 1 GiB, is kept for the next call in a
// process-wide slot (one block; concurrent calls each get their own and the larger block is the
// one kept). Reallocating it costs a first-touch fault and a kernel zero-fill of every page on
// every call: about a tenth of a float64 forward+backward. release_cached() gives it back.
class ChunkScratch {
 public:
  explicit ChunkScratch(size_t bytes);
  ~ChunkScratch();
  ChunkScratch(const ChunkScratch&) = delete;
  ChunkScratch& operator=(const ChunkScratch&) = delete;
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(buf_.data());
  }
  // Frees the cached block; returns the bytes it held.
  static size_t release_cached();
  static size_t cached_bytes();

 private:
  Buffer<unsigned char> buf_;
};

}  // namespace algenta

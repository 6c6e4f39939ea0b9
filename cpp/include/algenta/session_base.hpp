// The half of a session that does not depend on where it computes, written once for every
// engine: the open check, the weight registry, the position, the refusals every call makes
// before any work (the only place a session request is checked: the bindings and the Python
// faces convert types and nothing else), and the session's one lock. An engine derives from
// SessionBase and implements the run_* hooks (its compute) and stage_weight/commit_weight (where
// a tensor's float32 rows go).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algenta/session.hpp"
#include "algenta/session_weights.hpp"

namespace algenta {
namespace residentk {

// Refuses slots outside [1, RESIDENT_MAX_SLOTS] (601 / 602), else returns it.
int64_t session_slots_check(int64_t slots);

// A session's one lock: reentrant for the thread that holds it (a caller's sequence of calls,
// each of which takes it again), every other thread waits. Not a std::recursive_mutex because
// unlock() and seal() must tell the holder from any other thread (std::logic_error, where a
// recursive mutex would have undefined behaviour).
class SessionLock {
 public:
  void lock();
  void unlock();
  // How often the calling thread holds it (0: it does not).
  int64_t held() const;

 private:
  mutable std::mutex m_;
  std::condition_variable free_;
  std::thread::id owner_;
  int64_t depth_ = 0;
};

class SessionBase : public Session {
 public:
  const SessionConfig& config() const override { return c_; }
  int64_t max_ctx() const override { return max_ctx_; }
  int64_t capacity() const override { return cap_; }
  int64_t position() const override { return pos_[0]; }
  int64_t slots() const override { return slots_; }
  int64_t slot_position(int64_t slot) const override;
  int64_t dispatches_per_token() const override { return dispatches_; }

  void set_weight(const std::string& name, const std::vector<int64_t>& shape, const void* data,
                  Dtype type) override;
  std::vector<int64_t> weight_shape(const std::string& name) const override;
  std::vector<std::string> missing_weights() const override;

  void prefill(const int64_t* ids, int64_t n, float* logits) override;
  void step(int64_t id, float* logits) override;
  int64_t step_greedy(int64_t id) override;
  void check_tokens(const int64_t* ids, int64_t n, const char* what) const override;
  void reset() override;

  void prefill_slot(int64_t slot, const int64_t* ids, int64_t n, float* logits) override;
  std::unique_ptr<float[]> step_slots(const int64_t* slots, int64_t n_slots, const int64_t* ids,
                                      int64_t n_ids) override;
  void truncate_slot(int64_t slot, int64_t n) override;
  void copy_prefix(int64_t src, int64_t dst, int64_t n) override;

  void lock() override;
  void unlock() override;
  void seal(const std::string& why) override;

 protected:
  // Runs session_open_check (throws its refusal) before the engine allocates anything, and
  // refuses slots outside [1, RESIDENT_MAX_SLOTS] (601 / 602).
  SessionBase(const SessionConfig& c, int64_t max_ctx, int64_t slots = 1);

  // The engine's compute, called with mu_ held after every refusal has passed, at the slots'
  // positions pos_[slot]. They must not change pos_: SessionBase advances it after they return,
  // so a throw (a 608 from a device, a MemoryError) leaves every position where it was.
  // run_step and run_step_greedy act on slot 0.
  virtual void run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) = 0;
  virtual void run_step(int64_t id, float* logits) = 0;
  virtual int64_t run_step_greedy(int64_t id) = 0;
  // B distinct slots, one token each. The default serves an engine of one slot (B = 1, slot
  // 0: run_step); an engine of several overrides it.
  virtual void run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                              float* logits);
  // Copy positions [0, n) of src's cache to dst's (an engine of several slots overrides it).
  virtual void run_copy_prefix(int64_t src, int64_t dst, int64_t n);
  virtual void run_reset() {}
  // Where a tensor's float32 rows [r0, r1) are written (stage) and what happens once they are
  // (commit), see WeightRegistry::set; chunk_elems bounds a run (a staging buffer's size).
  virtual float* stage_weight(const TensorSpec& t, int64_t r0, int64_t r1) = 0;
  virtual void commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) = 0;
  virtual int64_t weight_chunk_elems() const;

  const SessionConfig c_;
  const int64_t max_ctx_, cap_, slots_;
  // Every call that writes the cache, the weights or the scratch holds mu_: threads sharing one
  // session are serialized (the bindings release the GIL), never interleaved inside a step.
  // The positions and the stage count are atomics so the property reads need no lock.
  mutable SessionLock mu_;
  std::unique_ptr<std::atomic<int64_t>[]> pos_;  // (slots) each slot's position
  std::atomic<int64_t> dispatches_{0};
  WeightRegistry weights_;

 private:
  // Takes mu_; refuses (SessionSealed, naming `what`) while its holder has sealed the session.
  void acquire(const char* what) const;
  // Holds mu_ for one call that writes (acquire).
  class Writing {
   public:
    Writing(const SessionBase& s, const char* what) : s_(s) { s.acquire(what); }
    ~Writing() { s_.mu_.unlock(); }
    Writing(const Writing&) = delete;
    Writing& operator=(const Writing&) = delete;

   private:
    const SessionBase& s_;
  };
  void check_call(int64_t slot, int64_t n) const;  // 607 weights missing, 606 past capacity
  void check_id(int64_t id, const char* what) const;      // 601 outside [0, V)
  void check_slot(int64_t slot, const char* what) const;  // 601 outside [0, slots)
  // Why the holder sealed the session ("" when it has not); read and written by the holder only.
  std::string sealed_;
};

}  // namespace residentk
}  // namespace algenta

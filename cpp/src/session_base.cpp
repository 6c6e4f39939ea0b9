// SessionBase: the refusals, the registry, the position and the lock every engine shares (see
// session_base.hpp).
#include "algenta/session_base.hpp"

#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "algenta/residentk.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

namespace {
[[noreturn]] void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Resident, code, msg);
}
}  // namespace

int64_t session_slots_check(int64_t slots) {
  if (slots < 1)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION,
           "slots must be >= 1 (sequences the session holds), got " + std::to_string(slots));
  if (slots > RESIDENT_MAX_SLOTS)
    refuse(RESIDENT_ERR_DIMENSION_TOO_LARGE, "slots " + std::to_string(slots) +
                                                 " exceeds RESIDENT_MAX_SLOTS (" +
                                                 std::to_string(RESIDENT_MAX_SLOTS) + ")");
  return slots;
}

void SessionLock::lock() {
  const std::thread::id me = std::this_thread::get_id();
  std::unique_lock<std::mutex> l(m_);
  if (depth_ > 0 && owner_ == me) {
    ++depth_;
    return;
  }
  free_.wait(l, [this] { return depth_ == 0; });
  owner_ = me;
  depth_ = 1;
}

void SessionLock::unlock() {
  std::unique_lock<std::mutex> l(m_);
  if (depth_ == 0 || owner_ != std::this_thread::get_id())
    throw std::logic_error("unlock: this thread does not hold the session");
  if (--depth_ > 0) return;
  owner_ = std::thread::id();
  l.unlock();
  free_.notify_one();
}

int64_t SessionLock::held() const {
  const std::lock_guard<std::mutex> l(m_);
  return depth_ > 0 && owner_ == std::this_thread::get_id() ? depth_ : 0;
}

SessionBase::SessionBase(const SessionConfig& c, int64_t max_ctx, int64_t slots)
    : c_(c),
      max_ctx_(max_ctx),
      cap_(session_open_check(c, max_ctx)),
      slots_(session_slots_check(slots)),
      pos_(new std::atomic<int64_t>[size_t(slots_)]),
      weights_(c) {
  for (int64_t s = 0; s < slots_; ++s) pos_[s] = 0;
  const int64_t per = residentk_cache_elements(c.n_layers, c.h_kv, c.d_head, cap_);
  if (per > std::numeric_limits<int64_t>::max() / 8 / slots_)  // bytes of float32 K and V
    refuse(RESIDENT_ERR_DIMENSION_TOO_LARGE,
           std::to_string(slots_) + " slots of " + std::to_string(per) +
               " KV elements each overflow a 64-bit byte count");
}

int64_t SessionBase::weight_chunk_elems() const { return int64_t(1) << 20; }

void SessionBase::acquire(const char* what) const {
  mu_.lock();
  if (sealed_.empty()) return;
  const std::string why = sealed_;
  mu_.unlock();
  throw SessionSealed(std::string(what) + "() " + why);
}

void SessionBase::lock() { acquire("lock"); }

void SessionBase::unlock() {
  if (mu_.held() == 1) sealed_.clear();  // the holder's last release: nothing stays sealed
  mu_.unlock();
}

void SessionBase::seal(const std::string& why) {
  if (mu_.held() == 0) throw std::logic_error("seal: this thread does not hold the session");
  sealed_ = why;
}

void SessionBase::set_weight(const std::string& name, const std::vector<int64_t>& shape,
                             const void* data, Dtype type) {
  const Writing w(*this, "set_weight");
  weights_.set(
      name, shape, data, type, weight_chunk_elems(),
      [this](const TensorSpec& t, int64_t r0, int64_t r1) { return stage_weight(t, r0, r1); },
      [this](const TensorSpec& t, int64_t r0, int64_t r1) { commit_weight(t, r0, r1); });
}

std::vector<int64_t> SessionBase::weight_shape(const std::string& name) const {
  return weights_.shape(name);
}

std::vector<std::string> SessionBase::missing_weights() const {
  const std::lock_guard<SessionLock> lock(mu_);
  return weights_.missing();
}

void SessionBase::check_call(int64_t slot, int64_t n) const {
  weights_.check_ready();
  const int64_t p = pos_[slot];
  if (p + n > cap_)
    refuse(RESIDENT_ERR_CONTEXT_FULL,
           (slots_ > 1 ? "slot " + std::to_string(slot) + ": " : std::string()) + "position " +
               std::to_string(p) + " + " + std::to_string(n) + " tokens exceeds the capacity " +
               std::to_string(cap_) + " of this session's KV cache");
}

void SessionBase::check_id(int64_t id, const char* what) const {
  if (id < 0 || id >= c_.vocab)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, std::string(what) + ": token id " + std::to_string(id) +
                                             " is outside the vocabulary [0, " +
                                             std::to_string(c_.vocab) + ")");
}

void SessionBase::check_tokens(const int64_t* ids, int64_t n, const char* what) const {
  for (int64_t i = 0; i < n; ++i) check_id(ids[i], what);
}

void SessionBase::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= slots_)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, std::string(what) + ": slot " + std::to_string(slot) +
                                             " outside [0, " + std::to_string(slots_) + ")");
}

int64_t SessionBase::slot_position(int64_t slot) const {
  check_slot(slot, "slot_position");
  return pos_[slot];
}

void SessionBase::prefill(const int64_t* ids, int64_t n, float* logits) {
  prefill_slot(0, ids, n, logits);
}

void SessionBase::prefill_slot(int64_t slot, const int64_t* ids, int64_t n, float* logits) {
  const Writing w(*this, "prefill");
  check_slot(slot, "prefill");
  if (n < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "prefill needs at least one token");
  check_tokens(ids, n, "prefill");  // a bad id is 601 even where the slot is full (606)
  check_call(slot, n);
  run_prefill(slot, ids, n, logits);
  pos_[slot] += n;
}

void SessionBase::step(int64_t id, float* logits) {
  const Writing w(*this, "step");
  check_id(id, "step");
  check_call(0, 1);
  run_step(id, logits);
  ++pos_[0];
}

int64_t SessionBase::step_greedy(int64_t id) {
  const Writing w(*this, "step_greedy");
  check_id(id, "step_greedy");
  check_call(0, 1);
  const int64_t t = run_step_greedy(id);
  ++pos_[0];
  return t;
}

std::unique_ptr<float[]> SessionBase::step_slots(const int64_t* slots, int64_t n_slots,
                                                 const int64_t* ids, int64_t n_ids) {
  const Writing w(*this, "step_slots");
  if (n_slots != n_ids)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "step_slots: " + std::to_string(n_slots) +
                                             " slots but " + std::to_string(n_ids) +
                                             " token ids");
  const int64_t B = n_slots;
  if (B < 1)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "step_slots needs at least one slot");
  if (B > slots_)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "step_slots takes 1 to " + std::to_string(slots_) +
                                             " sequences (the session's slots), got " +
                                             std::to_string(B));
  check_tokens(ids, B, "step_slots");
  // Two rows of one slot would write the same KV position: refuse before any work.
  std::vector<char> seen(size_t(slots_), 0);
  for (int64_t b = 0; b < B; ++b) {
    check_slot(slots[b], "step_slots");
    if (seen[size_t(slots[b])]++)
      refuse(RESIDENT_ERR_EMPTY_DIMENSION,
             "step_slots: slot " + std::to_string(slots[b]) + " named twice in one step");
    check_call(slots[b], 1);
  }
  // B <= slots_ <= RESIDENT_MAX_SLOTS and V <= RESIDENT_MAX_VOCAB: at most 2^32 floats.
  std::unique_ptr<float[]> logits(new float[size_t(B) * size_t(c_.vocab)]);
  run_step_slots(slots, ids, B, logits.get());
  for (int64_t b = 0; b < B; ++b) ++pos_[slots[b]];
  return logits;
}

void SessionBase::run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                                 float* logits) {
  if (slots_ != 1 || B != 1 || slots[0] != 0)  // a bug: an engine of several slots overrides
    throw std::logic_error("run_step_slots not implemented by this engine");
  run_step(ids[0], logits);
}

void SessionBase::truncate_slot(int64_t slot, int64_t n) {
  const Writing w(*this, "truncate_slot");
  check_slot(slot, "truncate");
  if (n < 0 || n > pos_[slot])
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "truncate: slot " + std::to_string(slot) + " holds " +
                                             std::to_string(pos_[slot].load()) +
                                             " positions; cannot keep " + std::to_string(n));
  pos_[slot] = n;
}

void SessionBase::copy_prefix(int64_t src, int64_t dst, int64_t n) {
  const Writing w(*this, "copy_prefix");
  check_slot(src, "copy_prefix");
  check_slot(dst, "copy_prefix");
  if (src == dst)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION,
           "copy_prefix: source and destination are both slot " + std::to_string(src) +
               " (truncate rewinds a slot in place)");
  if (n < 0 || n > pos_[src])
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "copy_prefix: slot " + std::to_string(src) +
                                             " holds " + std::to_string(pos_[src].load()) +
                                             " positions; cannot copy " + std::to_string(n));
  if (n > 0) run_copy_prefix(src, dst, n);
  pos_[dst] = n;
}

void SessionBase::run_copy_prefix(int64_t, int64_t, int64_t) {
  throw std::logic_error("run_copy_prefix not implemented by this engine");  // a bug
}

void SessionBase::reset() {
  const Writing w(*this, "reset");
  run_reset();
  pos_[0] = 0;
}

}  // namespace residentk
}  // namespace algenta

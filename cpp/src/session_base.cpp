// SessionBase: the refusals, the registry and the position every engine shares (see
// session_base.hpp).
#include "algenta/session_base.hpp"

#include "algenta/residentk.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

namespace {
[[noreturn]] void refuse(int code, const std::string& msg) {
  throw StatusError(Family::Resident, code, msg);
}
}  // namespace

SessionBase::SessionBase(const SessionConfig& c, int64_t max_ctx)
    : c_(c), max_ctx_(max_ctx), cap_(session_open_check(c, max_ctx)), weights_(c) {}

int64_t SessionBase::weight_chunk_elems() const { return int64_t(1) << 20; }

void SessionBase::set_weight(const std::string& name, const std::vector<int64_t>& shape,
                             const void* data, Dtype type) {
  const std::lock_guard<std::mutex> lock(mu_);
  weights_.set(
      name, shape, data, type, weight_chunk_elems(),
      [this](const TensorSpec& t, int64_t r0, int64_t r1) { return stage_weight(t, r0, r1); },
      [this](const TensorSpec& t, int64_t r0, int64_t r1) { commit_weight(t, r0, r1); });
}

std::vector<int64_t> SessionBase::weight_shape(const std::string& name) const {
  return weights_.shape(name);
}

std::vector<std::string> SessionBase::missing_weights() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return weights_.missing();
}

void SessionBase::check_call(int64_t n) const {
  weights_.check_ready();
  if (pos_ + n > cap_)
    refuse(RESIDENT_ERR_CONTEXT_FULL, "position " + std::to_string(pos_.load()) + " + " +
                                          std::to_string(n) + " tokens exceeds the capacity " +
                                          std::to_string(cap_) + " of this session's KV cache");
}

void SessionBase::check_id(int64_t id) const {
  if (id < 0 || id >= c_.vocab)
    refuse(RESIDENT_ERR_EMPTY_DIMENSION, "token id " + std::to_string(id) + " outside [0, " +
                                             std::to_string(c_.vocab) + ")");
}

void SessionBase::prefill(const int64_t* ids, int64_t n, float* logits) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (n < 1) refuse(RESIDENT_ERR_EMPTY_DIMENSION, "prefill needs at least one token");
  check_call(n);
  for (int64_t i = 0; i < n; ++i) check_id(ids[i]);
  run_prefill(ids, n, logits);
  pos_ += n;
}

void SessionBase::step(int64_t id, float* logits) {
  const std::lock_guard<std::mutex> lock(mu_);
  check_call(1);
  check_id(id);
  run_step(id, logits);
  ++pos_;
}

int64_t SessionBase::step_greedy(int64_t id) {
  const std::lock_guard<std::mutex> lock(mu_);
  check_call(1);
  check_id(id);
  const int64_t t = run_step_greedy(id);
  ++pos_;
  return t;
}

void SessionBase::reset() {
  const std::lock_guard<std::mutex> lock(mu_);
  run_reset();
  pos_ = 0;
}

}  // namespace residentk
}  // namespace algenta

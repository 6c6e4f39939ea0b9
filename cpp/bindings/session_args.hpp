// The session factories' flat Python arguments -> SessionConfig, shared by the CPU and CUDA
// session bindings so both read them in one order.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "algenta/session.hpp"

namespace algenta {
namespace residentk {

inline SessionConfig session_config(int64_t d_model, int64_t h_q, int64_t h_kv, int64_t d_head,
                                    int64_t d_ff, int64_t n_layers, int64_t vocab, double rms_eps,
                                    double rope_theta, bool tied,
                                    const std::string& weights = "f32") {
  SessionConfig c;
  if (!residentk_parse_weight_format(weights, &c.weights))  // pybind11: ValueError
    throw std::invalid_argument("weights must be 'f32', 'bf16', 'f16' or 'int8', got '" +
                                weights + "'");
  c.d_model = d_model;
  c.h_q = h_q;
  c.h_kv = h_kv;
  c.d_head = d_head;
  c.d_ff = d_ff;
  c.n_layers = n_layers;
  c.vocab = vocab;
  c.rms_eps = rms_eps;
  c.rope_theta = rope_theta;
  c.tie_word_embeddings = tied;
  return c;
}

}  // namespace residentk
}  // namespace algenta

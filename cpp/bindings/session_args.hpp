// The session factories' flat Python arguments -> SessionConfig, shared by the CPU and CUDA
// session bindings so both read them in one order, and the one parser of weight- and KV-format
// names (the contract bindings and both session factories).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "algenta/session.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

// A format name within one of the contract's lists -> Dtype; anything else is a refused caller
// input (ResidentError, a ValueError, status 601 as for the session's unknown device name),
// naming the ones the core knows.
template <std::size_t N>
Dtype format_arg(const std::string& name, const Dtype (&set)[N], const char* what) {
  for (Dtype f : set)
    if (name == dtype_name(f)) return f;
  std::string known;
  for (Dtype g : set) known += std::string(known.empty() ? "'" : ", '") + dtype_name(g) + "'";
  throw StatusError(Family::Resident, RESIDENT_ERR_EMPTY_DIMENSION,
                    std::string(what) + " must be one of " + known + ", got '" + name + "'");
}
// "f32" | "bf16" | "f16" | "int8"
inline Dtype weight_format(const std::string& name) {
  return format_arg(name, kWeightFormats, "weight format");
}
// "f32" | "bf16" | "f16"
inline Dtype kv_format(const std::string& name) {
  return format_arg(name, kKvFormats, "KV cache format");
}

inline SessionConfig session_config(int64_t d_model, int64_t h_q, int64_t h_kv, int64_t d_head,
                                    int64_t d_ff, int64_t n_layers, int64_t vocab, double rms_eps,
                                    double rope_theta, bool tied,
                                    const std::string& weights = "f32",
                                    const std::string& kv = "f32") {
  SessionConfig c;
  c.weights = weight_format(weights);
  c.kv = kv_format(kv);
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

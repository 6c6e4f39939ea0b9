// A session's family fields (SessionConfig's arch and what follows it) from one Python dict,
// shared by the CPU and CUDA session bindings and the tensor table: the Python config reader
// (algenta.residentk.config) writes the dict, so a field added here is added in one place.
// An unknown key or value is a refused caller input (601 naming it), never ignored.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "algenta/session.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"

namespace algenta {
namespace residentk {

inline Arch arch_arg(const std::string& name) {
  std::string known;
  for (const ArchSpec& a : arch_specs()) {
    if (name == a.name) return a.arch;
    known += std::string(known.empty() ? "'" : ", '") + a.name + "'";
  }
  throw StatusError(Family::Resident, RESIDENT_ERR_WEIGHT_LENGTH,
                    "arch must be one of " + known + ", got '" + name + "'");
}

inline RopeType rope_type_arg(const std::string& name) {
  if (name == "default") return RopeType::Default;
  if (name == "linear") return RopeType::Linear;
  if (name == "llama3") return RopeType::Llama3;
  throw StatusError(Family::Resident, RESIDENT_ERR_WEIGHT_LENGTH,
                    "rope_type must be 'default', 'linear' or 'llama3', got '" + name + "'");
}

inline void apply_family(SessionConfig& c, const pybind11::dict& f) {
  namespace py = pybind11;
  for (const auto& kv : f) {
    const std::string k = py::str(kv.first);
    const py::handle v = kv.second;
    if (k == "arch") c.arch = arch_arg(v.cast<std::string>());
    else if (k == "qkv_bias") c.qkv_bias = v.cast<bool>();
    else if (k == "o_bias") c.o_bias = v.cast<bool>();
    else if (k == "mlp_bias") c.mlp_bias = v.cast<bool>();
    else if (k == "sliding_window") c.sliding_window = v.cast<int64_t>();
    else if (k == "sliding_layers") {
      c.sliding_layers.clear();
      for (bool b : v.cast<std::vector<bool>>()) c.sliding_layers.push_back(b ? 1 : 0);
    } else if (k == "attn_scale") c.attn_scale = v.cast<double>();
    else if (k == "attn_softcap") c.attn_softcap = v.cast<double>();
    else if (k == "final_softcap") c.final_softcap = v.cast<double>();
    else if (k == "rope_type") c.rope_type = rope_type_arg(v.cast<std::string>());
    else if (k == "rope_factor") c.rope_factor = v.cast<double>();
    else if (k == "rope_low_freq_factor") c.rope_low_freq_factor = v.cast<double>();
    else if (k == "rope_high_freq_factor") c.rope_high_freq_factor = v.cast<double>();
    else if (k == "rope_original_ctx") c.rope_original_ctx = v.cast<int64_t>();
    else if (k == "rope_local_theta") c.rope_local_theta = v.cast<double>();
    else
      throw StatusError(Family::Resident, RESIDENT_ERR_EMPTY_DIMENSION,
                        "unknown family field '" + k + "'");
  }
}

}  // namespace residentk
}  // namespace algenta

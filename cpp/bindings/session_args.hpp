// The residentk bindings' flat Python arguments -> the core's records, written once for the
// contract, the probe, the session factories, the tensor table and the launch plan: the seed's
// seven integers of a model shape -> ModelShape (flat_shape: the one place the flat shape becomes
// the record), a factory's arguments -> SessionConfig, a weight- or KV-format name -> Dtype; and
// the core's constants and plain functions under their own names. Conversion only: every check
// of the values is the core's.
#pragma once
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/status_error.hpp"
#include "dtype_args.hpp"
#include "family_args.hpp"

namespace algenta {
namespace residentk {

// A format name within one of the contract's lists -> Dtype; anything else is a refused caller
// input (ResidentError, a ValueError, status 601 as for the session's unknown device name),
// naming the argument (`what`), the formats there are and what kind of format it is.
template <std::size_t N>
Dtype format_arg(const std::string& name, const Dtype (&set)[N], const char* what,
                 const char* kind) {
  Dtype f;
  if (dtype_in(name, set, &f)) return f;
  throw StatusError(Family::Resident, RESIDENT_ERR_EMPTY_DIMENSION,
                    std::string(what) + " must be one of " + dtype_names(set) + " (" + kind +
                        "), got '" + name + "'");
}
// "f32" | "bf16" | "f16" | "int8"
inline Dtype weight_format(const std::string& name, const char* what = "weights") {
  return format_arg(name, kWeightFormats, what, "the weight format");
}
// "f32" | "bf16" | "f16"
inline Dtype kv_format(const std::string& name, const char* what = "kv") {
  return format_arg(name, kKvFormats, what, "the KV cache format");
}

// f as the Python API calls it: the seed's seven integers of a model shape first, in its order,
// then f's other arguments.
template <class R, class... A>
auto flat_shape(R (*f)(const ModelShape&, A...)) {
  return [f](int64_t d_model, int64_t h_q, int64_t h_kv, int64_t d_head, int64_t d_ff,
             int64_t n_layers, int64_t vocab, A... rest) {
    return f(ModelShape{d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab},
             std::forward<A>(rest)...);
  };
}
// m.def(name, flat_shape(f), the seven names, extra...): extra names f's other arguments.
template <class R, class... A, class... Extra>
void def_flat_shape(pybind11::module_& m, const char* name, R (*f)(const ModelShape&, A...),
                    const Extra&... extra) {
  namespace py = pybind11;
  m.def(name, flat_shape(f), py::arg("d_model"), py::arg("h_q"), py::arg("h_kv"),
        py::arg("d_head"), py::arg("d_ff"), py::arg("n_layers"), py::arg("vocab"), extra...);
}

// A session's config from a factory's arguments, in the one order every factory and the plan
// take them: the shape, the two scalars, the tie, the format names, the family dict
// (family_args.hpp).
inline SessionConfig session_config(const ModelShape& m, double rms_eps, double rope_theta,
                                    bool tied, const std::string& weights = "f32",
                                    const std::string& kv = "f32",
                                    const pybind11::dict& family = pybind11::dict()) {
  SessionConfig c;
  c.weights = weight_format(weights);
  c.kv = kv_format(kv);
  static_cast<ModelShape&>(c) = m;
  c.rms_eps = rms_eps;
  c.rope_theta = rope_theta;
  c.tie_word_embeddings = tied;
  apply_family(c, family);
  return c;
}

// make(config, max_ctx, slots) with the GIL released: an engine allocates its resident buffers
// when it opens.
template <class Make>
std::unique_ptr<Session> open_session(Make make, const ModelShape& m, double rms_eps,
                                      double rope_theta, bool tied, int64_t max_ctx,
                                      const std::string& weights, const std::string& kv,
                                      int64_t slots, const pybind11::dict& family) {
  const SessionConfig c = session_config(m, rms_eps, rope_theta, tied, weights, kv, family);
  pybind11::gil_scoped_release nogil;
  return make(c, max_ctx, slots);
}

// A constant or a plain function under its C++ name, which the Python faces use too: the name is
// spelled once. set_constants(m, {ALGENTA_CONSTANT(X), ...}); def_functions(m,
// ALGENTA_FUNCTION(f), ...).
#define ALGENTA_CONSTANT(name) std::pair<const char*, int64_t>(#name, int64_t(name))
#define ALGENTA_FUNCTION(fn) std::make_pair(#fn, &fn)
inline void set_constants(pybind11::module_& m,
                          std::initializer_list<std::pair<const char*, int64_t>> constants) {
  for (const auto& c : constants) m.attr(c.first) = c.second;
}
template <class... F>
void def_functions(pybind11::module_& m, const std::pair<const char*, F>&... fns) {
  (m.def(fns.first, fns.second), ...);
}

}  // namespace residentk
}  // namespace algenta

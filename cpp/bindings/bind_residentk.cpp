// pybind11 bindings of the residentk contract and probe: conversion only. Every number comes
// from cpp/src/residentk_contract.cpp; the checks return codes, so the one refusal here is a
// weight-format name that names no format (a string, not a number). A model shape arrives as
// the seed's seven flat integers and reaches the core as one ModelShape (session_args.hpp).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <utility>

#include "algenta/residentk.hpp"
#include "session_args.hpp"

namespace py = pybind11;
using namespace algenta::residentk;
using namespace pybind11::literals;

namespace {

py::tuple shape_check(const ModelShape& m) {
  std::string why;
  const int st = residentk_shape_check(m, &why);
  return py::make_tuple(st, why);
}

// The footprint's options from the flat Python arguments: the format names first, so an unknown
// one is refused before any number is looked at.
FootprintOpts footprint_opts(bool tied, int64_t tp, bool check_tier, const std::string& format,
                             const std::string& kv) {
  FootprintOpts o;
  o.format = weight_format(format, "format");
  o.kv_format = kv_format(kv, "kv_format");
  o.tied = tied;
  o.tp = tp;
  o.check_tier = check_tier;
  return o;
}

py::dict footprint(const ModelShape& m, int64_t max_ctx, bool tied, int64_t tp, bool check_tier,
                   const std::string& format, const std::string& kv) {
  const FootprintOpts o = footprint_opts(tied, tp, check_tier, format, kv);
  std::string why;
  const ResidentFootprint f = residentk_footprint(m, max_ctx, o, &why);
  return py::dict("status"_a = f.status, "reason"_a = why, "attn"_a = f.attn, "mlp"_a = f.mlp,
                  "norms"_a = f.norms, "embed"_a = f.embed, "lm_head"_a = f.lm_head,
                  "weights"_a = f.weights, "kv_cache"_a = f.kv_cache,
                  "kv_per_pos"_a = f.kv_per_pos, "total"_a = f.total,
                  "weight_bytes"_a = f.weight_bytes, "kv_bytes"_a = f.kv_bytes,
                  "total_bytes"_a = f.total_bytes);
}

int64_t max_ctx_fitting(const ModelShape& m, bool tied, int64_t tp, int64_t budget_bytes,
                        bool check_tier, const std::string& format, const std::string& kv) {
  return residentk_max_ctx_fitting(m, budget_bytes,
                                   footprint_opts(tied, tp, check_tier, format, kv));
}

// A format list's names, in its order.
template <std::size_t N>
py::tuple format_names(const algenta::Dtype (&formats)[N]) {
  py::tuple t(N);
  for (std::size_t i = 0; i < N; ++i) t[i] = py::str(algenta::dtype_name(formats[i]));
  return t;
}

py::dict probe(const ModelShape& m) {
  ResidentProbe p;
  {
    py::gil_scoped_release nogil;  // the first device question initializes the CUDA runtime
    p = resident_session_probe(m);
  }
  return py::dict("kernels_compiled"_a = p.kernels_compiled, "device_present"_a = p.device_present,
                  "session_possible"_a = p.session_possible,
                  "dispatch_budget"_a = p.dispatch_budget,
                  "resident_f32_elems"_a = p.resident_f32_elems, "status"_a = p.status);
}

}  // namespace

void bind_residentk(py::module_& m) {
  py::module_ r = m.def_submodule("residentk", "residentk contract and probe");
  set_constants(
      r, {ALGENTA_CONSTANT(RESIDENT_OK), ALGENTA_CONSTANT(RESIDENT_ERR_EMPTY_DIMENSION),
          ALGENTA_CONSTANT(RESIDENT_ERR_DIMENSION_TOO_LARGE),
          ALGENTA_CONSTANT(RESIDENT_ERR_HEAD_GEOMETRY), ALGENTA_CONSTANT(RESIDENT_ERR_NO_KERNELS),
          ALGENTA_CONSTANT(RESIDENT_ERR_NO_ACCELERATOR),
          ALGENTA_CONSTANT(RESIDENT_ERR_CONTEXT_FULL), ALGENTA_CONSTANT(RESIDENT_ERR_WEIGHT_LENGTH),
          ALGENTA_CONSTANT(RESIDENT_ERR_LAUNCH_FAILED), ALGENTA_CONSTANT(RESIDENT_ERR_NON_FINITE),
          ALGENTA_CONSTANT(RESIDENT_CODE_OUT_OF_RANGE), ALGENTA_CONSTANT(RESIDENT_MAX_CONTEXT),
          ALGENTA_CONSTANT(RESIDENT_MAX_SLOTS), ALGENTA_CONSTANT(RESIDENT_DEFAULT_CONTEXT),
          ALGENTA_CONSTANT(RESIDENT_MAX_D_MODEL), ALGENTA_CONSTANT(RESIDENT_MAX_HEADS),
          ALGENTA_CONSTANT(RESIDENT_MAX_D_HEAD), ALGENTA_CONSTANT(RESIDENT_MAX_D_FF),
          ALGENTA_CONSTANT(RESIDENT_MAX_LAYERS), ALGENTA_CONSTANT(RESIDENT_MAX_VOCAB),
          ALGENTA_CONSTANT(RESIDENT_MAX_STAGED_FLOATS), ALGENTA_CONSTANT(RESIDENT_SPLITK_MIN_KEYS),
          ALGENTA_CONSTANT(RESIDENT_SPLITK_BLOCKS_PER_CORE),
          ALGENTA_CONSTANT(RESIDENT_SPLITK_FALLBACK_SPLITS),
          ALGENTA_CONSTANT(RESIDENT_SPLITK_MAX_SPLITS),
          ALGENTA_CONSTANT(RESIDENT_PREFILL_NARROW_BELOW_ROWS),
          ALGENTA_CONSTANT(RESIDENT_INT8_BLOCK)});
  r.attr("RESIDENT_WEIGHT_FORMATS") = format_names(kWeightFormats);
  r.attr("RESIDENT_KV_FORMATS") = format_names(kKvFormats);

  r.def("residentk_status_name", [](int64_t c) { return std::string(residentk_status_name(c)); });
  r.def("residentk_dims_check",  // the layer's five: n_layers and vocab are not looked at
        [](int64_t d, int64_t hq, int64_t hkv, int64_t dh, int64_t ff) {
          return residentk_dims_check(ModelShape{d, hq, hkv, dh, ff});
        });
  def_flat_shape(r, "residentk_shape_check", &shape_check);
  def_functions(r, ALGENTA_FUNCTION(residentk_context_check),
                ALGENTA_FUNCTION(residentk_cache_elements),
                ALGENTA_FUNCTION(residentk_dispatch_budget),
                ALGENTA_FUNCTION(residentk_dispatch_budget_deep),
                ALGENTA_FUNCTION(residentk_scalars_ok),
                ALGENTA_FUNCTION(residentk_splitk_should_split),
                ALGENTA_FUNCTION(residentk_splitk_max_n_splits),
                ALGENTA_FUNCTION(residentk_splitk_policy),
                ALGENTA_FUNCTION(residentk_prefill_gemm_use_narrow_tile),
                ALGENTA_FUNCTION(resident_bucket_ctx), ALGENTA_FUNCTION(residentk_smem_tier_bytes),
                ALGENTA_FUNCTION(resident_gpu_kernels_compiled));
  def_flat_shape(r, "residentk_weight_elems", &residentk_weight_elems, py::arg("max_ctx"),
                 py::arg("tied"));
  r.def(
      "residentk_matrix_bytes",
      [](int64_t rows, int64_t cols, const std::string& format) {
        return residentk_matrix_bytes(rows, cols, weight_format(format, "format"));
      },
      py::arg("rows"), py::arg("cols"), py::arg("format") = "f32");
  def_flat_shape(r, "residentk_footprint", &footprint, py::arg("max_ctx"), py::arg("tied"),
                 py::arg("tp"), py::arg("check_tier"), py::arg("format") = "f32",
                 py::arg("kv_format") = "f32");
  def_flat_shape(r, "residentk_max_ctx_fitting", &max_ctx_fitting, py::arg("tied"),
                 py::arg("tp"), py::arg("budget_bytes"), py::arg("check_tier"),
                 py::arg("format") = "f32", py::arg("kv_format") = "f32");

  // The first device question initializes the CUDA runtime (up to seconds on a GPU host).
  r.def("resident_available", &resident_available, py::call_guard<py::gil_scoped_release>());
  def_flat_shape(r, "resident_session_probe", &probe);
}

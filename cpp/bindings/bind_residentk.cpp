// pybind11 bindings of the residentk contract and probe: conversion only. Every number comes
// from cpp/src/residentk_contract.cpp; the checks return codes, so the one refusal here is a
// weight-format name that names no format (a string, not a number).
#include <pybind11/pybind11.h>

#include <iterator>
#include <string>

#include "algenta/residentk.hpp"
#include "session_args.hpp"

namespace py = pybind11;
using namespace algenta::residentk;
using algenta::Dtype;

void bind_residentk(py::module_& m) {
  py::module_ r = m.def_submodule("residentk", "residentk contract and probe");
  r.attr("RESIDENT_OK") = int(RESIDENT_OK);
  r.attr("RESIDENT_ERR_EMPTY_DIMENSION") = int(RESIDENT_ERR_EMPTY_DIMENSION);
  r.attr("RESIDENT_ERR_DIMENSION_TOO_LARGE") = int(RESIDENT_ERR_DIMENSION_TOO_LARGE);
  r.attr("RESIDENT_ERR_HEAD_GEOMETRY") = int(RESIDENT_ERR_HEAD_GEOMETRY);
  r.attr("RESIDENT_ERR_NO_KERNELS") = int(RESIDENT_ERR_NO_KERNELS);
  r.attr("RESIDENT_ERR_NO_ACCELERATOR") = int(RESIDENT_ERR_NO_ACCELERATOR);
  r.attr("RESIDENT_ERR_CONTEXT_FULL") = int(RESIDENT_ERR_CONTEXT_FULL);
  r.attr("RESIDENT_ERR_WEIGHT_LENGTH") = int(RESIDENT_ERR_WEIGHT_LENGTH);
  r.attr("RESIDENT_ERR_LAUNCH_FAILED") = int(RESIDENT_ERR_LAUNCH_FAILED);
  r.attr("RESIDENT_ERR_NON_FINITE") = int(RESIDENT_ERR_NON_FINITE);
  r.attr("RESIDENT_CODE_OUT_OF_RANGE") = int(RESIDENT_CODE_OUT_OF_RANGE);
  r.attr("RESIDENT_MAX_CONTEXT") = RESIDENT_MAX_CONTEXT;
  r.attr("RESIDENT_MAX_SLOTS") = RESIDENT_MAX_SLOTS;
  r.attr("RESIDENT_DEFAULT_CONTEXT") = RESIDENT_DEFAULT_CONTEXT;
  r.attr("RESIDENT_MAX_D_MODEL") = RESIDENT_MAX_D_MODEL;
  r.attr("RESIDENT_MAX_HEADS") = RESIDENT_MAX_HEADS;
  r.attr("RESIDENT_MAX_D_HEAD") = RESIDENT_MAX_D_HEAD;
  r.attr("RESIDENT_MAX_D_FF") = RESIDENT_MAX_D_FF;
  r.attr("RESIDENT_MAX_LAYERS") = RESIDENT_MAX_LAYERS;
  r.attr("RESIDENT_MAX_VOCAB") = RESIDENT_MAX_VOCAB;
  r.attr("RESIDENT_MAX_STAGED_FLOATS") = RESIDENT_MAX_STAGED_FLOATS;
  r.attr("RESIDENT_SPLITK_MIN_KEYS") = RESIDENT_SPLITK_MIN_KEYS;
  r.attr("RESIDENT_SPLITK_BLOCKS_PER_CORE") = RESIDENT_SPLITK_BLOCKS_PER_CORE;
  r.attr("RESIDENT_SPLITK_FALLBACK_SPLITS") = RESIDENT_SPLITK_FALLBACK_SPLITS;
  r.attr("RESIDENT_SPLITK_MAX_SPLITS") = RESIDENT_SPLITK_MAX_SPLITS;
  r.attr("RESIDENT_PREFILL_NARROW_BELOW_ROWS") = RESIDENT_PREFILL_NARROW_BELOW_ROWS;
  r.attr("RESIDENT_INT8_BLOCK") = RESIDENT_INT8_BLOCK;
  py::tuple formats(std::size(kWeightFormats));
  for (std::size_t i = 0; i < std::size(kWeightFormats); ++i)
    formats[i] = py::str(residentk_weight_format_name(kWeightFormats[i]));
  r.attr("RESIDENT_WEIGHT_FORMATS") = formats;
  py::tuple kv_formats(std::size(kKvFormats));
  for (std::size_t i = 0; i < std::size(kKvFormats); ++i)
    kv_formats[i] = py::str(residentk_kv_format_name(kKvFormats[i]));
  r.attr("RESIDENT_KV_FORMATS") = kv_formats;

  r.def("residentk_smem_tier_bytes", &residentk_smem_tier_bytes);
  r.def("residentk_status_name", [](int64_t c) { return std::string(residentk_status_name(c)); });
  r.def("residentk_dims_check", &residentk_dims_check);
  r.def("residentk_shape_check", [](int64_t d, int64_t hq, int64_t hkv, int64_t dh, int64_t ff,
                                    int64_t l, int64_t v) {
    std::string why;
    const int st = residentk_shape_check(d, hq, hkv, dh, ff, l, v, &why);
    return py::make_tuple(st, why);
  });
  r.def("residentk_context_check", &residentk_context_check);
  r.def("residentk_cache_elements", &residentk_cache_elements);
  r.def("residentk_dispatch_budget", &residentk_dispatch_budget);
  r.def("residentk_dispatch_budget_deep", &residentk_dispatch_budget_deep);
  r.def("residentk_weight_elems", &residentk_weight_elems);
  r.def("residentk_scalars_ok", &residentk_scalars_ok);
  r.def("residentk_splitk_should_split", &residentk_splitk_should_split);
  r.def("residentk_splitk_max_n_splits", &residentk_splitk_max_n_splits);
  r.def("residentk_splitk_policy", &residentk_splitk_policy);
  r.def("residentk_prefill_gemm_use_narrow_tile", &residentk_prefill_gemm_use_narrow_tile);
  r.def("resident_bucket_ctx", &resident_bucket_ctx);
  r.def(
      "residentk_matrix_bytes",
      [](int64_t rows, int64_t cols, const std::string& format) {
        return residentk_matrix_bytes(rows, cols, weight_format(format));
      },
      py::arg("rows"), py::arg("cols"), py::arg("format") = "f32");
  r.def(
      "residentk_footprint",
      [](int64_t d, int64_t hq, int64_t hkv, int64_t dh, int64_t ff, int64_t l, int64_t v,
         int64_t ctx, bool tied, int64_t tp, bool check_tier, const std::string& format,
         const std::string& kv) {
        const Dtype fmt = weight_format(format), kvf = kv_format(kv);
        std::string why;
        const ResidentFootprint f = residentk_footprint(d, hq, hkv, dh, ff, l, v, ctx, tied, tp,
                                                        &why, check_tier, fmt, kvf);
        py::dict o;
        o["status"] = f.status;
        o["reason"] = why;
        o["attn"] = f.attn;
        o["mlp"] = f.mlp;
        o["norms"] = f.norms;
        o["embed"] = f.embed;
        o["lm_head"] = f.lm_head;
        o["weights"] = f.weights;
        o["kv_cache"] = f.kv_cache;
        o["kv_per_pos"] = f.kv_per_pos;
        o["total"] = f.total;
        o["weight_bytes"] = f.weight_bytes;
        o["kv_bytes"] = f.kv_bytes;
        o["total_bytes"] = f.total_bytes;
        return o;
      },
      py::arg("d_model"), py::arg("h_q"), py::arg("h_kv"), py::arg("d_head"), py::arg("d_ff"),
      py::arg("n_layers"), py::arg("vocab"), py::arg("max_ctx"), py::arg("tied"), py::arg("tp"),
      py::arg("check_tier"), py::arg("format") = "f32", py::arg("kv_format") = "f32");
  r.def(
      "residentk_max_ctx_fitting",
      [](int64_t d, int64_t hq, int64_t hkv, int64_t dh, int64_t ff, int64_t l, int64_t v,
         bool tied, int64_t tp, int64_t budget_bytes, bool check_tier, const std::string& format,
         const std::string& kv) {
        return residentk_max_ctx_fitting(d, hq, hkv, dh, ff, l, v, tied, tp, budget_bytes,
                                         check_tier, weight_format(format), kv_format(kv));
      },
      py::arg("d_model"), py::arg("h_q"), py::arg("h_kv"), py::arg("d_head"), py::arg("d_ff"),
      py::arg("n_layers"), py::arg("vocab"), py::arg("tied"), py::arg("tp"),
      py::arg("budget_bytes"), py::arg("check_tier"), py::arg("format") = "f32",
      py::arg("kv_format") = "f32");

  r.def("resident_gpu_kernels_compiled", &resident_gpu_kernels_compiled);
  // The first device question initializes the CUDA runtime (up to seconds on a GPU host).
  r.def("resident_available", &resident_available, py::call_guard<py::gil_scoped_release>());
  r.def(
      "resident_session_probe",
      [](int64_t d, int64_t hq, int64_t hkv, int64_t dh, int64_t ff, int64_t l, int64_t v) {
        ResidentProbe p;
        {
          py::gil_scoped_release nogil;
          p = resident_session_probe(d, hq, hkv, dh, ff, l, v);
        }
        py::dict o;
        o["kernels_compiled"] = p.kernels_compiled;
        o["device_present"] = p.device_present;
        o["session_possible"] = p.session_possible;
        o["dispatch_budget"] = p.dispatch_budget;
        o["resident_f32_elems"] = p.resident_f32_elems;
        o["status"] = p.status;
        return o;
      });
}

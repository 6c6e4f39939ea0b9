// pybind11 bindings of the lossk family: shape/length validation, status -> exception, GIL
// release. No arithmetic: every number comes from cpp/src.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "algenta/buffer.hpp"
#include "algenta/kernels.hpp"
#include "algenta/lossk.hpp"
#include "algenta/status_error.hpp"

namespace py = pybind11;
using namespace algenta::lossk;
using algenta::Family;
using algenta::StatusError;

template <class T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

namespace {

[[noreturn]] void refuse(int status, const std::string& why) {
  throw StatusError(Family::Loss, status, why);
}

void require_len(const char* name, py::ssize_t have, int64_t need) {
  if (have < need)
    refuse(LOSS_ERR_LENGTH_MISMATCH, std::string(name) + " has " + std::to_string(have) +
                                         " elements, the declared shape needs " +
                                         std::to_string(need));
}

Reduction parse_reduction(const std::string& r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  refuse(LOSS_ERR_UNKNOWN_OBJECTIVE, "reduction must be 'mean', 'sum' or 'none', got '" + r + "'");
}

template <class T>
py::dict fused(carray<T> hidden, carray<T> weight, carray<int64_t> targets, int64_t n_tok,
               int64_t d_model, int64_t vocab, int64_t chunk, const std::string& reduction,
               bool has_ignore, int64_t ignore_index, double label_smoothing, bool want_dh,
               bool want_dw, std::optional<carray<T>> grad_output, bool want_loss_tok) {
  FusedArgs<T> a;
  a.n_tok = n_tok;
  a.d_model = d_model;
  a.vocab = vocab;
  a.chunk = chunk;
  a.reduction = parse_reduction(reduction);
  a.has_ignore = has_ignore;
  a.ignore_index = ignore_index;
  a.label_smoothing = label_smoothing;
  // Dimensions first: the length products below are only formed for in-ceiling shapes.
  const int st = loss_dims_check(n_tok, d_model, vocab);
  if (st != LOSS_OK) {
    std::string why;
    fused_linear_ce_check(a, &why);
    refuse(st, why);
  }
  require_len("hidden", hidden.size(), n_tok * d_model);
  require_len("weight", weight.size(), vocab * d_model);
  require_len("targets", targets.size(), n_tok);
  if (grad_output) require_len("grad_output", grad_output->size(), n_tok);
  a.hidden = hidden.data();
  a.weight = weight.data();
  a.targets = targets.data();
  a.grad_output = grad_output ? grad_output->data() : nullptr;
  std::string why;
  const int status = fused_linear_ce_check(a, &why);
  if (status != LOSS_OK) refuse(status, why);
  algenta::kern::isa();  // an invalid ALGENTA_ISA is refused here, before any allocation

  py::array_t<T> lse(n_tok), loss_tok;
  py::object dh = py::none(), dw = py::none();
  FusedOut<T> out;
  out.lse = lse.mutable_data();
  if (want_loss_tok) {
    loss_tok = py::array_t<T>(n_tok);
    out.loss_tok = loss_tok.mutable_data();
  }
  if (want_dh) {
    py::array_t<T> g({n_tok, d_model});
    out.d_hidden = g.mutable_data();
    dh = g;
  }
  if (want_dw) {
    py::array_t<T> g({vocab, d_model});
    out.d_weight = g.mutable_data();
    dw = g;
  }
  {
    py::gil_scoped_release nogil;
    fused_linear_ce<T>(a, out);
  }
  py::dict d;
  d["total"] = out.sum.total;
  d["mean"] = out.sum.mean();
  d["n_valid"] = out.sum.count;
  d["lse"] = lse;
  d["loss_tok"] = want_loss_tok ? py::object(loss_tok) : py::object(py::none());
  d["d_hidden"] = dh;
  d["d_weight"] = dw;
  return d;
}

void logits_check(const carray<double>& logits, const carray<int64_t>& targets, int64_t n_tok,
                  int64_t vocab) {
  // Empty/too-large dims before any length product is formed.
  if (n_tok < 1 || vocab < 1 || n_tok > LOSS_MAX_TOKENS || vocab > LOSS_MAX_VOCAB) {
    std::string why;
    const int st = ce_from_logits_check(nullptr, nullptr, n_tok, vocab, &why);
    refuse(st, why);
  }
  if (n_tok > LOSS_MAX_LOGIT_CELLS * 64 / vocab)  // beyond any logits a caller can hand us
    refuse(LOSS_ERR_DIMENSION_TOO_LARGE, "n_tok * vocab exceeds 2^33 cells");
  require_len("logits", logits.size(), n_tok * vocab);
  require_len("targets", targets.size(), n_tok);
  std::string why;
  const int st = ce_from_logits_check(logits.data(), targets.data(), n_tok, vocab, &why);
  if (st != LOSS_OK) refuse(st, why);
}

}  // namespace

void bind_lossk(py::module_& m) {
  py::module_ l = m.def_submodule("lossk", "lossk contract and kernels");
  l.attr("LOSS_OK") = int(LOSS_OK);
  l.attr("LOSS_ERR_EMPTY_DIMENSION") = int(LOSS_ERR_EMPTY_DIMENSION);
  l.attr("LOSS_ERR_LENGTH_MISMATCH") = int(LOSS_ERR_LENGTH_MISMATCH);
  l.attr("LOSS_ERR_DIMENSION_TOO_LARGE") = int(LOSS_ERR_DIMENSION_TOO_LARGE);
  l.attr("LOSS_ERR_WORK_BUDGET") = int(LOSS_ERR_WORK_BUDGET);
  l.attr("LOSS_ERR_NON_FINITE") = int(LOSS_ERR_NON_FINITE);
  l.attr("LOSS_ERR_TARGET_OUT_OF_RANGE") = int(LOSS_ERR_TARGET_OUT_OF_RANGE);
  l.attr("LOSS_ERR_BAD_CHUNK") = int(LOSS_ERR_BAD_CHUNK);
  l.attr("LOSS_ERR_UNKNOWN_OBJECTIVE") = int(LOSS_ERR_UNKNOWN_OBJECTIVE);
  l.attr("LOSS_MAX_WORK_CELLS") = LOSS_MAX_WORK_CELLS;
  l.attr("LOSS_MAX_LOGIT_CELLS") = LOSS_MAX_LOGIT_CELLS;
  l.attr("LOSS_MAX_TOKENS") = LOSS_MAX_TOKENS;
  l.attr("LOSS_MAX_D_MODEL") = LOSS_MAX_D_MODEL;
  l.attr("LOSS_MAX_VOCAB") = LOSS_MAX_VOCAB;
  l.attr("LOSS_TRANSCENDENTAL_FLOOR") = LOSS_TRANSCENDENTAL_FLOOR;
  l.attr("LOSS_VOCAB_BLOCK") = LOSS_VOCAB_BLOCK;

  l.def("loss_status_name", [](int64_t c) { return std::string(loss_status_name(c)); });
  l.def("loss_dims_check", &loss_dims_check);
  l.def("loss_chunk_check", &loss_chunk_check);
  l.def("loss_logit_cells", &loss_logit_cells);
  l.def("loss_work_fits", &loss_work_fits);
  l.def("loss_max_chunk", &loss_max_chunk);
  l.def("loss_scalars_ok", &loss_scalars_ok);
  l.def("loss_tol_for", &loss_tol_for);
  l.def("loss_targets_in_range", [](carray<int64_t> targets, int64_t n_tok, int64_t vocab) {
    return loss_targets_in_range(targets.data(), int64_t(targets.size()), n_tok, vocab);
  });

  py::class_<LossSum>(l, "LossSum")
      .def(py::init<>())
      .def_readonly("total", &LossSum::total)
      .def_readonly("count", &LossSum::count)
      .def_property_readonly("mean", &LossSum::mean);

  l.def(
      "ce_from_logits",
      [](carray<double> logits, carray<int64_t> targets, int64_t n_tok, int64_t vocab,
         LossSum& sum, bool want_lse) -> py::object {
        logits_check(logits, targets, n_tok, vocab);
        py::array_t<double> lse(want_lse ? n_tok : 0);
        {
          py::gil_scoped_release nogil;
          ce_from_logits(logits.data(), targets.data(), n_tok, vocab, sum,
                         want_lse ? lse.mutable_data() : nullptr);
        }
        return want_lse ? py::object(lse) : py::object(py::none());
      },
      py::arg("logits"), py::arg("targets"), py::arg("n_tok"), py::arg("vocab"), py::arg("sum"),
      py::arg("want_lse") = false);
  l.def("ce_grad_logits", [](carray<double> logits, carray<int64_t> targets, int64_t n_tok,
                             int64_t vocab, double scale) {
    if (!loss_scalars_ok(scale)) refuse(LOSS_ERR_NON_FINITE, "scale must be finite");
    logits_check(logits, targets, n_tok, vocab);
    py::array_t<double> out(n_tok * vocab);
    {
      py::gil_scoped_release nogil;
      ce_grad_logits(logits.data(), targets.data(), n_tok, vocab, scale, out.mutable_data());
    }
    return out;
  });
  l.def("release_scratch", [] { return algenta::ChunkScratch::release_cached(); },
        "Free the kept logit-chunk scratch; returns the bytes it held.");
  l.def("scratch_bytes", [] { return algenta::ChunkScratch::cached_bytes(); });
  l.def("fused_linear_ce_f32", &fused<float>);
  l.def("fused_linear_ce_f64", &fused<double>);
}

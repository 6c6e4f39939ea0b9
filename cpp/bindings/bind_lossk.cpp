// pybind11 bindings of the lossk family: shape/length validation, status -> exception, GIL
// release. No arithmetic: every number comes from cpp/src.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algenta/buffer.hpp"
#include "algenta/kernels.hpp"
#include "algenta/lossk.hpp"
#include "algenta/status_error.hpp"
#include "dtype_args.hpp"

namespace py = pybind11;
using namespace algenta::lossk;
using algenta::Dtype;
using algenta::dtype_arg;
using algenta::is_half;
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

// The element types lossk computes in or takes (dtype.hpp): halves compute in float32.
constexpr Dtype kLossDtypes[] = {Dtype::F32, Dtype::F64, Dtype::BF16, Dtype::F16};
Dtype parse_elem(const std::string& e, const char* what) { return dtype_arg(e, kLossDtypes, what); }


// device="cpu" or "cuda" (the NumPy API's: host arrays in and out, the work on the device).
bool on_cuda(const std::string& device) {
  if (device == "cpu") return false;
  if (device == "cuda") return true;
  throw py::value_error("device must be 'cpu' or 'cuda', got '" + device + "'");
}

// A half-precision input: the caller's C-contiguous 2-byte buffer (bit patterns), never copied.
const void* half_data(const py::array& a, const char* name) {
  if (a.itemsize() != 2 || !(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + " must be a C-contiguous array of 2-byte elements "
                         "(float16, or bfloat16 bit patterns)");
  return a.data();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A gradient accumulator narrowed in place by the core: its first n uint16 hold the result.
// The buffer shrinks to them (realloc) and the array owns it, so a half gradient never holds
// its float32 accumulator's memory after the call.
py::array own_narrowed(std::unique_ptr<void, FreeDeleter>& buf, std::vector<int64_t> shape,
                       int64_t n) {
  void* p = std::realloc(buf.get(), size_t(std::max<int64_t>(n, 1)) * 2);
  if (p) buf.release();
  else p = buf.release();  // shrinking failed: keep the larger block
  py::capsule owner(p, [](void* q) { std::free(q); });
  return py::array_t<uint16_t>(shape, static_cast<uint16_t*>(p), owner);
}

// The gradient arrays of one call, handed to the core through out's d_hidden, d_weight,
// d_weight_half and d_bias: T arrays, or half bits (one_chunk: the core narrows each d_weight
// cell from its tile; otherwise a float32 accumulator on huge pages, narrowed in place and
// shrunk by finish()).
template <class T>
struct GradArrays {
  py::object dh = py::none(), dw = py::none(), db = py::none();
  std::unique_ptr<void, FreeDeleter> dw_buf, db_buf;

  template <class Out>
  void allocate(Out& out, bool want_dh, bool want_dw, bool want_db, Dtype grad_elem,
                bool one_chunk, int64_t n_tok, int64_t d_model, int64_t vocab) {
    out.grad_elem = grad_elem;
    if (want_dh) {
      if (is_half(grad_elem)) {
        py::array_t<uint16_t> g({n_tok, d_model});
        out.d_hidden = g.mutable_data();
        dh = g;
      } else {
        py::array_t<T> g({n_tok, d_model});
        out.d_hidden = g.mutable_data();
        dh = g;
      }
    }
    if (want_dw) {
      if (is_half(grad_elem) && one_chunk) {
        py::array_t<uint16_t> g({vocab, d_model});
        out.d_weight_half = g.mutable_data();
        dw = g;
      } else if (is_half(grad_elem)) {
        // As large as the weight: huge pages, so first touch is not a fault per 4 KiB.
        dw_buf.reset(algenta::huge_malloc(size_t(vocab) * size_t(d_model) * sizeof(T)));
        out.d_weight = static_cast<T*>(dw_buf.get());
      } else {
        py::array_t<T> g({vocab, d_model});
        out.d_weight = g.mutable_data();
        dw = g;
      }
    }
    if (want_db) {
      if (is_half(grad_elem)) {
        db_buf.reset(algenta::huge_malloc(size_t(vocab) * sizeof(T)));
        out.d_bias = static_cast<T*>(db_buf.get());
      } else {
        py::array_t<T> g(vocab);
        out.d_bias = g.mutable_data();
        db = g;
      }
    }
  }

  void finish(int64_t vocab, int64_t d_model) {
    if (dw_buf) dw = own_narrowed(dw_buf, {vocab, d_model}, vocab * d_model);
    if (db_buf) db = own_narrowed(db_buf, {vocab}, vocab);
  }
};

template <class T>
py::dict fused(const py::array& hidden, const py::array& weight, carray<int64_t> targets,
               int64_t n_tok, int64_t d_model, int64_t vocab, int64_t chunk, Dtype elem,
               const std::string& reduction, bool has_ignore, int64_t ignore_index,
               double label_smoothing, std::optional<double> softcap, double temperature,
               double z_loss, int64_t shift, int64_t seq_len,
               const std::optional<py::array>& bias,
               const std::optional<carray<T>>& class_weight,
               const std::optional<carray<T>>& token_weight, bool want_dh, bool want_dw,
               bool want_db, Dtype grad_elem, const std::optional<carray<T>>& grad_output,
               double grad_scale, const std::optional<carray<T>>& grad_lse,
               const std::optional<carray<T>>& grad_coef, bool want_loss_tok, bool want_z_tok,
               bool want_pred, bool want_shard_stats, bool want_entropy,
               const std::optional<carray<T>>& grad_entropy, double entropy_grad_scale,
               bool cuda) {
  FusedArgs<T> a;
  a.n_tok = n_tok;
  a.d_model = d_model;
  a.vocab = vocab;
  a.chunk = chunk;
  a.elem = elem;
  a.reduction = parse_reduction(reduction);
  a.has_ignore = has_ignore;
  a.ignore_index = ignore_index;
  a.label_smoothing = label_smoothing;
  a.has_softcap = softcap.has_value();
  a.softcap = softcap ? *softcap : 0.0;
  a.temperature = temperature;
  a.z_loss = z_loss;
  a.shift = shift;
  a.seq_len = seq_len;
  a.grad_scale = grad_scale;
  a.entropy = want_entropy;
  a.entropy_grad_scale = entropy_grad_scale;
  if (is_half(grad_elem) && !is_half(elem))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
  // Dimensions first: the length products below are only formed for in-ceiling shapes.
  const int st = loss_dims_check(n_tok, d_model, vocab);
  if (st != LOSS_OK) {
    std::string why;
    fused_linear_ce_check(a, &why);
    refuse(st, why);
  }
  // The input buffers: T elements (cast to T if they are not: a copy the Python layer avoids)
  // or, for half inputs, the caller's 2-byte elements as they are.
  carray<T> hT, wT, bT;
  if (is_half(elem)) {
    a.hidden = half_data(hidden, "hidden");
    a.weight = half_data(weight, "weight");
    if (bias) a.bias = half_data(*bias, "linear_bias");
  } else {
    hT = carray<T>::ensure(hidden);
    wT = carray<T>::ensure(weight);
    if (!hT || !wT) throw py::type_error("hidden and weight must be arrays of real numbers");
    a.hidden = hT.data();
    a.weight = wT.data();
    if (bias) {
      bT = carray<T>::ensure(*bias);
      if (!bT) throw py::type_error("linear_bias must be an array of real numbers");
      a.bias = bT.data();
    }
  }
  require_len("hidden", hidden.size(), n_tok * d_model);
  require_len("weight", weight.size(), vocab * d_model);
  require_len("targets", targets.size(), n_tok);
  if (bias) require_len("linear_bias", bias->size(), vocab);
  if (class_weight) require_len("class weights", class_weight->size(), vocab);
  if (token_weight) require_len("token_weight", token_weight->size(), n_tok);
  if (grad_output) require_len("grad_output", grad_output->size(), n_tok);
  if (grad_lse) require_len("the gradient of lse", grad_lse->size(), n_tok);
  if (grad_coef) require_len("grad_coef", grad_coef->size(), 3 * n_tok);
  if (grad_entropy) require_len("the gradient of the entropy", grad_entropy->size(), n_tok);
  a.targets = targets.data();
  a.class_weight = class_weight ? class_weight->data() : nullptr;
  a.token_weight = token_weight ? token_weight->data() : nullptr;
  a.grad_output = grad_output ? grad_output->data() : nullptr;
  a.grad_lse = grad_lse ? grad_lse->data() : nullptr;
  a.grad_coef = grad_coef ? grad_coef->data() : nullptr;
  a.grad_entropy = grad_entropy ? grad_entropy->data() : nullptr;
  // device="cuda": the data's own checks (585/586) run on the device, after the copy, as they do
  // for CUDA tensors; everything else is refused here first.
  std::string why;
  const int status = cuda ? fused_linear_ce_check_shape(a, &why) : fused_linear_ce_check(a, &why);
  if (status != LOSS_OK) refuse(status, why);
  if (!cuda) algenta::kern::isa();  // an invalid ALGENTA_ISA is refused here, before any allocation

  py::array_t<T> lse(n_tok), loss_tok, z_tok, target_logit, logit_sum, entropy_tok;
  py::array_t<int64_t> pred;
  FusedOut<T> out;
  out.lse = lse.mutable_data();
  if (want_loss_tok) {
    loss_tok = py::array_t<T>(n_tok);
    out.loss_tok = loss_tok.mutable_data();
  }
  if (want_z_tok) {
    z_tok = py::array_t<T>(n_tok);
    out.z_tok = z_tok.mutable_data();
  }
  if (want_pred) {
    pred = py::array_t<int64_t>(n_tok);
    out.pred = pred.mutable_data();
  }
  if (want_entropy) {
    entropy_tok = py::array_t<T>(n_tok);
    out.entropy_tok = entropy_tok.mutable_data();
  }
  if (want_shard_stats) {
    target_logit = py::array_t<T>(n_tok);
    logit_sum = py::array_t<T>(n_tok);
    out.target_logit = target_logit.mutable_data();
    out.logit_sum = logit_sum.mutable_data();
  }
  GradArrays<T> ga;
  ga.allocate(out, want_dh, want_dw, want_db, grad_elem,
              !cuda && fused_linear_ce_chunk(a) >= n_tok, n_tok, d_model, vocab);
  {
    py::gil_scoped_release nogil;
    if (cuda) fused_linear_ce_cuda_host<T>(a, out);
    else fused_linear_ce<T>(a, out);
  }
  ga.finish(vocab, d_model);
  py::dict d;
  d["total"] = out.reduced(Reduction::Sum);
  d["mean"] = out.reduced(Reduction::Mean);
  d["z_total"] = out.z.total;
  d["z_mean"] = out.z_mean();
  d["entropy_total"] =
      want_entropy ? py::object(py::float_(out.ent.total)) : py::object(py::none());
  d["entropy_mean"] = want_entropy ? py::object(py::float_(out.entropy_mean()))
                                   : py::object(py::none());
  d["entropy_tok"] = want_entropy ? py::object(entropy_tok) : py::object(py::none());
  d["n_valid"] = out.ce.count;
  d["weight_sum"] = out.weight_sum;
  d["n_correct"] = out.n_correct;
  d["lse"] = lse;
  d["loss_tok"] = want_loss_tok ? py::object(loss_tok) : py::object(py::none());
  d["z_tok"] = want_z_tok ? py::object(z_tok) : py::object(py::none());
  d["pred"] = want_pred ? py::object(pred) : py::object(py::none());
  d["target_logit"] = want_shard_stats ? py::object(target_logit) : py::object(py::none());
  d["logit_sum"] = want_shard_stats ? py::object(logit_sum) : py::object(py::none());
  d["d_hidden"] = ga.dh;
  d["d_weight"] = ga.dw;
  d["d_bias"] = ga.db;
  return d;
}

template <class T>
std::optional<carray<T>> as_opt(const std::optional<py::array>& x) {
  std::optional<carray<T>> r;
  if (x) {
    carray<T> c = carray<T>::ensure(*x);
    if (!c) throw py::type_error("expected an array of real numbers");
    r = c;
  }
  return r;
}

py::dict fused_any(const py::array& hidden, const py::array& weight, carray<int64_t> targets,
                   int64_t n_tok, int64_t d_model, int64_t vocab, int64_t chunk,
                   const std::string& elem, const std::string& reduction, bool has_ignore,
                   int64_t ignore_index, double label_smoothing, std::optional<double> softcap,
                   double temperature, double z_loss, int64_t shift, int64_t seq_len,
                   const std::optional<py::array>& bias,
                   const std::optional<py::array>& class_weight,
                   const std::optional<py::array>& token_weight, bool want_dh, bool want_dw,
                   bool want_db, const std::string& grad_elem,
                   const std::optional<py::array>& grad_output, double grad_scale,
                   const std::optional<py::array>& grad_lse,
                   const std::optional<py::array>& grad_coef, bool want_loss_tok, bool want_z_tok,
                   bool want_pred, bool want_shard_stats, bool want_entropy,
                   const std::optional<py::array>& grad_entropy, double entropy_grad_scale,
                   const std::string& device) {
  const bool cuda = on_cuda(device);
  const Dtype e = parse_elem(elem, "elem");
  const Dtype ge = grad_elem.empty() ? e : parse_elem(grad_elem, "grad_elem");
  if (e == Dtype::F64) {
    if (ge != Dtype::F64) refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 inputs give float64 gradients");
    return fused<double>(hidden, weight, targets, n_tok, d_model, vocab, chunk, e, reduction,
                         has_ignore, ignore_index, label_smoothing, softcap, temperature,
                         z_loss, shift, seq_len, bias, as_opt<double>(class_weight),
                         as_opt<double>(token_weight), want_dh, want_dw, want_db,
                         ge, as_opt<double>(grad_output), grad_scale, as_opt<double>(grad_lse),
                         as_opt<double>(grad_coef), want_loss_tok, want_z_tok, want_pred,
                         want_shard_stats, want_entropy, as_opt<double>(grad_entropy),
                         entropy_grad_scale, cuda);
  }
  if (ge == Dtype::F64) refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 gradients need float64 inputs");
  return fused<float>(hidden, weight, targets, n_tok, d_model, vocab, chunk, e, reduction,
                      has_ignore, ignore_index, label_smoothing, softcap, temperature, z_loss,
                      shift, seq_len, bias, as_opt<float>(class_weight),
                      as_opt<float>(token_weight), want_dh, want_dw, want_db, ge,
                      as_opt<float>(grad_output), grad_scale, as_opt<float>(grad_lse),
                      as_opt<float>(grad_coef), want_loss_tok, want_z_tok, want_pred,
                      want_shard_stats, want_entropy, as_opt<float>(grad_entropy),
                      entropy_grad_scale, cuda);
}

// ---- fused linear distillation ------------------------------------------------------------

Objective parse_objective(const std::string& o) {
  if (o == "kl") return Objective::KL;
  if (o == "reverse_kl") return Objective::ReverseKL;
  if (o == "jsd") return Objective::JSD;
  refuse(LOSS_ERR_UNKNOWN_OBJECTIVE,
         "objective must be 'kl', 'reverse_kl' or 'jsd', got '" + o + "'");
}

// An input the core reads: the caller's half bits as they are, or T elements (cast to T if they
// are not: a copy the Python layer avoids), kept alive by `keep`.
template <class T>
const void* input_data(const py::array& x, Dtype e, carray<T>& keep, const char* name) {
  if (is_half(e)) return half_data(x, name);
  keep = carray<T>::ensure(x);
  if (!keep) throw py::type_error(std::string(name) + " must be an array of real numbers");
  return keep.data();
}

// A keyword argument of the raw distillation binding as X: a missing key or a value of another
// type is a TypeError naming it (as pybind11 refuses a typed signature's arguments).
template <class X>
X kwarg(const py::dict& k, const char* n) {
  if (!k.contains(n))
    throw py::type_error(std::string("fused_linear_distill: missing argument '") + n + "'");
  const std::string why = std::string("fused_linear_distill: argument '") + n +
                          "' has the wrong type (" + std::string(py::str(k[n].get_type())) + ")";
  try {
    return k[n].cast<X>();
  } catch (const py::cast_error&) {
    throw py::type_error(why);
  } catch (const py::error_already_set&) {  // NumPy's refusal of a ragged or odd array (the
    throw py::type_error(why);                // Python error was fetched into the exception)
  }
}

template <class T>
py::dict distill(const py::dict& k, Dtype elem, Dtype t_elem, Dtype grad_elem) {
  auto arr = [&](const char* n) { return kwarg<py::array>(k, n); };
  auto opt = [&](const char* n) {
    return k.contains(n) && !k[n].is_none() ? std::optional<py::array>(arr(n)) : std::nullopt;
  };
  DistillArgs<T> a;
  a.elem = elem;
  a.t_elem = t_elem;
  a.n_tok = kwarg<int64_t>(k, "n_tok");
  a.d_model = kwarg<int64_t>(k, "d_model");
  a.t_d_model = kwarg<int64_t>(k, "t_d_model");
  a.vocab = kwarg<int64_t>(k, "vocab");
  a.chunk = kwarg<int64_t>(k, "chunk");
  a.objective = parse_objective(kwarg<std::string>(k, "objective"));
  a.beta = kwarg<double>(k, "beta");
  a.temperature = kwarg<double>(k, "temperature");
  a.hard_weight = kwarg<double>(k, "hard_weight");
  a.soft_weight = kwarg<double>(k, "soft_weight");
  a.reduction = parse_reduction(kwarg<std::string>(k, "reduction"));
  a.has_ignore = kwarg<bool>(k, "has_ignore");
  a.ignore_index = kwarg<int64_t>(k, "ignore_index");
  a.grad_scale = kwarg<double>(k, "grad_scale");
  a.shard = k.contains("shard") && kwarg<bool>(k, "shard");
  const bool want_dh = kwarg<bool>(k, "want_dh"), want_dw = kwarg<bool>(k, "want_dw"),
             want_db = kwarg<bool>(k, "want_db");
  if (is_half(grad_elem) && !is_half(elem))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
  const std::optional<py::array> bias = opt("bias"), t_bias = opt("t_bias"),
                                 targets_in = opt("targets");
  // Dimensions first: the length products below are only formed for in-ceiling shapes.
  std::string why;
  int st = LOSS_OK;
  for (const int64_t d : {a.d_model, a.t_d_model})
    if ((st = loss_dims_check(a.n_tok, d, a.vocab)) != LOSS_OK) {
      fused_linear_distill_check_shape(a, &why);
      refuse(st, why);
    }
  carray<int64_t> targets;
  if (targets_in) {
    targets = carray<int64_t>::ensure(*targets_in);
    if (!targets) throw py::type_error("target must be an array of integers");
    require_len("target", targets.size(), a.n_tok);
    a.targets = targets.data();
  }
  // element types and scalars before any input is converted
  if ((st = fused_linear_distill_check_shape(a, &why)) != LOSS_OK) refuse(st, why);
  carray<T> keep[6];
  const py::array h = arr("hidden"), w = arr("weight"), th = arr("t_hidden"), tw = arr("t_weight");
  a.hidden = input_data<T>(h, elem, keep[0], "student_input");
  a.weight = input_data<T>(w, elem, keep[1], "student_weight");
  if (bias) a.bias = input_data<T>(*bias, elem, keep[2], "student_bias");
  a.t_hidden = input_data<T>(th, t_elem, keep[3], "teacher_input");
  a.t_weight = input_data<T>(tw, t_elem, keep[4], "teacher_weight");
  if (t_bias) a.t_bias = input_data<T>(*t_bias, t_elem, keep[5], "teacher_bias");
  require_len("student_input", h.size(), a.n_tok * a.d_model);
  require_len("student_weight", w.size(), a.vocab * a.d_model);
  require_len("teacher_input", th.size(), a.n_tok * a.t_d_model);
  require_len("teacher_weight", tw.size(), a.vocab * a.t_d_model);
  if (bias) require_len("student_bias", bias->size(), a.vocab);
  if (t_bias) require_len("teacher_bias", t_bias->size(), a.vocab);
  // per-token arrays of T: the upstream gradient, the vocab-parallel form's inputs
  carray<T> per_tok_in[4];
  const char* per_tok_names[4] = {"grad_output", "shard_lse", "shard_h", "shard_coef"};
  const T** per_tok_dst[4] = {&a.grad_output, &a.shard_lse, &a.shard_h, &a.shard_coef};
  const int64_t per_tok_width[4] = {1, 3, 1, 2};
  for (int i = 0; i < 4; ++i) {
    const std::optional<py::array> x = opt(per_tok_names[i]);
    if (!x) continue;
    per_tok_in[i] = carray<T>::ensure(*x);
    if (!per_tok_in[i]) throw py::type_error(std::string(per_tok_names[i]) +
                                             " must be an array of real numbers");
    require_len(per_tok_names[i], per_tok_in[i].size(), per_tok_width[i] * a.n_tok);
    *per_tok_dst[i] = per_tok_in[i].data();
  }
  // device="cuda": the data's own checks (585/586) run on the device, after the copy
  const bool cuda = on_cuda(k.contains("device") ? kwarg<std::string>(k, "device") : "cpu");
  st = cuda ? fused_linear_distill_check_shape(a, &why) : fused_linear_distill_check(a, &why);
  if (st != LOSS_OK) refuse(st, why);
  if (!cuda) algenta::kern::isa();  // an invalid ALGENTA_ISA is refused here, before any allocation

  DistillOut<T> out;
  const bool per_tok = a.reduction == Reduction::None;
  py::array_t<T> loss_tok, div_tok, ce_tok;
  if (per_tok) {
    loss_tok = py::array_t<T>(a.n_tok);
    div_tok = py::array_t<T>(a.n_tok);
    ce_tok = py::array_t<T>(a.n_tok);
    out.loss_tok = loss_tok.mutable_data();
    out.div_tok = div_tok.mutable_data();
    out.ce_tok = ce_tok.mutable_data();
  }
  py::array_t<T> shard_stats;
  const bool want_stats = k.contains("want_shard_stats") && kwarg<bool>(k, "want_shard_stats");
  if (want_stats) {
    shard_stats = py::array_t<T>({a.n_tok, int64_t(6)});
    out.shard_stats = shard_stats.mutable_data();
  }
  GradArrays<T> ga;
  ga.allocate(out, want_dh, want_dw, want_db, grad_elem,
              !cuda && fused_linear_distill_chunk(a) >= a.n_tok, a.n_tok, a.d_model, a.vocab);
  {
    py::gil_scoped_release nogil;
    if (cuda) fused_linear_distill_cuda_host<T>(a, out);
    else fused_linear_distill<T>(a, out);
  }
  ga.finish(a.vocab, a.d_model);
  py::dict d;
  const Reduction r = per_tok ? Reduction::Mean : a.reduction;
  d["loss"] = out.reduced(r);
  d["divergence"] = out.div_reduced(r);
  d["ce"] = out.ce_reduced(r);
  d["n_valid"] = out.loss.count;
  d["loss_tok"] = per_tok ? py::object(loss_tok) : py::object(py::none());
  d["div_tok"] = per_tok ? py::object(div_tok) : py::object(py::none());
  d["ce_tok"] = per_tok ? py::object(ce_tok) : py::object(py::none());
  d["shard_stats"] = want_stats ? py::object(shard_stats) : py::object(py::none());
  d["d_hidden"] = ga.dh;
  d["d_weight"] = ga.dw;
  d["d_bias"] = ga.db;
  return d;
}

// kwargs: hidden, weight, bias, t_hidden, t_weight, t_bias, targets (or None), elem, t_elem,
// grad_elem ("" for elem's), n_tok, d_model, t_d_model, vocab, chunk, objective, beta,
// temperature, hard_weight, soft_weight, reduction, has_ignore, ignore_index, want_dh, want_dw,
// want_db, grad_output (None or per token), grad_scale; the vocab-parallel form's shard_lse,
// shard, shard_lse, shard_h, shard_coef and want_shard_stats (DistillArgs, DistillOut); device
// ("cpu" or "cuda": host arrays either way).
py::dict distill_any(const py::dict& k) {
  const Dtype e = parse_elem(kwarg<std::string>(k, "elem"), "elem");
  const Dtype te = parse_elem(kwarg<std::string>(k, "t_elem"), "t_elem");
  const std::string g = kwarg<std::string>(k, "grad_elem");
  const Dtype ge = g.empty() ? e : parse_elem(g, "grad_elem");
  if (e == Dtype::F64) {
    if (ge != Dtype::F64) refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 inputs give float64 gradients");
    return distill<double>(k, e, te, ge);
  }
  if (ge == Dtype::F64) refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 gradients need float64 inputs");
  return distill<float>(k, e, te, ge);
}

// ---- device pointers (algenta.torch's CUDA tensors) ----------------------------------------------
// Pointers arrive as integers (0 for none) from algenta.torch, which derives every one from a
// tensor whose device, dtype, shape and contiguity it has checked; these entry points are
// private to it. The shapes are checked again here, the data on the device.

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

struct DevCall {
  FusedArgs<float> f;
  FusedArgs<double> d;
  FusedCudaOut<float> of;
  FusedCudaOut<double> od;
  bool f64 = false;
};

DevCall dev_args(const py::dict& k) {
  auto i64 = [&](const char* n) { return k[n].cast<int64_t>(); };
  auto f64 = [&](const char* n) { return k[n].cast<double>(); };
  auto p = [&](const char* n) { return k.contains(n) ? k[n].cast<uintptr_t>() : uintptr_t(0); };
  DevCall c;
  const Dtype e = parse_elem(k["elem"].cast<std::string>(), "elem");
  const Dtype ge = parse_elem(k["grad_elem"].cast<std::string>(), "grad_elem");
  c.f64 = e == Dtype::F64;
  if (c.f64 != (ge == Dtype::F64))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 gradients go with float64 inputs only");
  auto set = [&](auto& a, auto& o, auto tag) {
    typedef decltype(tag) T;
    a.hidden = ptr<const void>(p("hidden"));
    a.weight = ptr<const void>(p("weight"));
    a.bias = ptr<const void>(p("bias"));
    a.elem = e;
    a.targets = ptr<const int64_t>(p("targets"));
    a.class_weight = ptr<const T>(p("class_weight"));
    a.token_weight = ptr<const T>(p("token_weight"));
    a.n_tok = i64("n_tok"), a.d_model = i64("d_model"), a.vocab = i64("vocab");
    a.chunk = i64("chunk");
    a.reduction = parse_reduction(k["reduction"].cast<std::string>());
    a.has_ignore = k["has_ignore"].cast<bool>();
    a.ignore_index = i64("ignore_index");
    a.label_smoothing = f64("label_smoothing");
    a.has_softcap = !k["softcap"].is_none();
    a.softcap = a.has_softcap ? f64("softcap") : 0.0;
    a.temperature = f64("temperature");
    a.z_loss = f64("z_loss");
    a.shift = i64("shift"), a.seq_len = i64("seq_len");
    a.grad_output = ptr<const T>(p("grad_output"));
    a.grad_scale = f64("grad_scale");
    a.grad_lse = ptr<const T>(p("grad_lse"));
    a.entropy = k.contains("entropy_on") && k["entropy_on"].cast<bool>();
    a.grad_entropy = ptr<const T>(p("grad_entropy"));
    a.entropy_grad_scale = k.contains("entropy_grad_scale") ? f64("entropy_grad_scale") : 0.0;
    o.loss = ptr<T>(p("loss"));
    o.entropy = ptr<T>(p("entropy"));
    o.entropy_tok = ptr<T>(p("entropy_tok"));
    o.z = ptr<T>(p("z"));
    o.loss_tok = ptr<T>(p("loss_tok"));
    o.z_tok = ptr<T>(p("z_tok"));
    o.lse = ptr<T>(p("lse"));
    o.pred = ptr<int64_t>(p("pred"));
    o.accuracy = ptr<float>(p("accuracy"));
    o.d_hidden = ptr<void>(p("d_hidden"));
    o.d_weight = ptr<void>(p("d_weight"));
    o.d_bias = ptr<void>(p("d_bias"));
    o.grad_elem = ge;
  };
  if (c.f64) set(c.d, c.od, double());
  else set(c.f, c.of, float());
  return c;
}

template <class T>
void shape_ok(const FusedArgs<T>& a) {
  std::string why;
  const int st = fused_linear_ce_check_shape(a, &why);
  if (st != LOSS_OK) refuse(st, why);
}

// data=false: sizes and lengths only (device="cuda" checks the data on the device).
void logits_check(const carray<double>& logits, const carray<int64_t>& targets, int64_t n_tok,
                  int64_t vocab, bool data = true) {
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
  if (!data) return;
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
  l.attr("LOSS_ERR_NO_CUDA_BACKEND") = int(LOSS_ERR_NO_CUDA_BACKEND);
  l.attr("LOSS_ERR_NO_DEVICE") = int(LOSS_ERR_NO_DEVICE);
  l.attr("LOSS_ERR_DEVICE_FAILED") = int(LOSS_ERR_DEVICE_FAILED);
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
         LossSum& sum, bool per_token, const std::string& device) -> py::object {
        const bool cuda = on_cuda(device);
        logits_check(logits, targets, n_tok, vocab, !cuda);
        py::array_t<double> loss(per_token ? n_tok : 0), lse(per_token ? n_tok : 0);
        {
          py::gil_scoped_release nogil;
          double* l = per_token ? lse.mutable_data() : nullptr;
          double* o = per_token ? loss.mutable_data() : nullptr;
          if (cuda) ce_from_logits_cuda_host(logits.data(), targets.data(), n_tok, vocab, sum, l, o);
          else ce_from_logits(logits.data(), targets.data(), n_tok, vocab, sum, l, o);
        }
        return per_token ? py::object(py::make_tuple(loss, lse)) : py::object(py::none());
      },
      py::arg("logits"), py::arg("targets"), py::arg("n_tok"), py::arg("vocab"), py::arg("sum"),
      py::arg("per_token") = false, py::arg("device") = "cpu",
      "Adds the tokens' losses to sum; per_token=True also returns (loss, lse) per token.");
  l.def(
      "ce_grad_logits",
      [](carray<double> logits, carray<int64_t> targets, int64_t n_tok, int64_t vocab,
         double scale, const std::string& device) {
        const bool cuda = on_cuda(device);
        if (!loss_scalars_ok(scale)) refuse(LOSS_ERR_NON_FINITE, "scale must be finite");
        logits_check(logits, targets, n_tok, vocab, !cuda);
        py::array_t<double> out(n_tok * vocab);
        {
          py::gil_scoped_release nogil;
          if (cuda)
            ce_grad_logits_cuda_host(logits.data(), targets.data(), n_tok, vocab, scale,
                                     out.mutable_data());
          else
            ce_grad_logits(logits.data(), targets.data(), n_tok, vocab, scale, out.mutable_data());
        }
        return out;
      },
      py::arg("logits"), py::arg("targets"), py::arg("n_tok"), py::arg("vocab"),
      py::arg("scale"), py::arg("device") = "cpu");
  l.def("release_scratch", [] { return algenta::ChunkScratch::release_cached(); },
        "Free the kept logit-chunk scratch; returns the bytes it held.");
  l.def("scratch_bytes", [] { return algenta::ChunkScratch::cached_bytes(); });
  l.def("fused_linear_ce", &fused_any, py::arg("hidden"), py::arg("weight"), py::arg("targets"),
        py::arg("n_tok"), py::arg("d_model"), py::arg("vocab"), py::arg("chunk"), py::kw_only(),
        py::arg("elem") = "f64", py::arg("reduction") = "mean", py::arg("has_ignore") = false,
        py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
        py::arg("softcap") = py::none(), py::arg("temperature") = 1.0, py::arg("z_loss") = 0.0,
        py::arg("shift") = 0, py::arg("seq_len") = 0, py::arg("bias") = py::none(),
        py::arg("class_weight") = py::none(),
        py::arg("token_weight") = py::none(), py::arg("want_dh") = false,
        py::arg("want_dw") = false, py::arg("want_db") = false,
        py::arg("grad_elem") = "", py::arg("grad_output") = py::none(),
        py::arg("grad_scale") = 1.0, py::arg("grad_lse") = py::none(),
        py::arg("grad_coef") = py::none(), py::arg("want_loss_tok") = false,
        py::arg("want_z_tok") = false, py::arg("want_pred") = false,
        py::arg("want_shard_stats") = false, py::arg("want_entropy") = false,
        py::arg("grad_entropy") = py::none(), py::arg("entropy_grad_scale") = 0.0,
        py::arg("device") = "cpu",
        "The fused linear cross-entropy core (see lossk.hpp): elem names hidden/weight/bias's "
        "storage (f32, f64, or bf16/f16 bit patterns), grad_elem the gradients' (default: elem); "
        "device='cuda' runs it on the CUDA backend (host arrays in and out).");

  // algenta.torch's CUDA tensors: keyword dicts of sizes, options and pointers (see dev_args).
  l.def("fused_linear_distill", [](py::kwargs k) { return distill_any(k); });
  l.def("cuda_set_device", &cuda_set_device);
  l.def("fused_linear_ce_dev_workspace", [](const py::dict& k) {
    DevCall c = dev_args(k);
    if (c.f64) {
      shape_ok(c.d);
      return fused_linear_ce_cuda_workspace(c.d, c.od);
    }
    shape_ok(c.f);
    return fused_linear_ce_cuda_workspace(c.f, c.of);
  });
  l.def("fused_linear_ce_dev", [](const py::dict& k, uintptr_t workspace, int64_t ws_bytes,
                                  uintptr_t stream) {
    DevCall c = dev_args(k);
    py::gil_scoped_release nogil;
    if (c.f64) fused_linear_ce_cuda(c.d, c.od, ptr<void>(workspace), ws_bytes, ptr<void>(stream));
    else fused_linear_ce_cuda(c.f, c.of, ptr<void>(workspace), ws_bytes, ptr<void>(stream));
  });
  l.def("ce_from_logits_dev", [](uintptr_t logits, uintptr_t targets, int64_t n_tok,
                                 int64_t vocab, uintptr_t loss, uintptr_t lse, uintptr_t stream) {
    py::gil_scoped_release nogil;
    ce_from_logits_cuda(ptr<const double>(logits), ptr<const int64_t>(targets), n_tok, vocab,
                        ptr<double>(loss), ptr<double>(lse), ptr<void>(stream));
  });
  l.def("ce_grad_logits_dev", [](uintptr_t logits, uintptr_t targets, int64_t n_tok,
                                 int64_t vocab, double scale, uintptr_t out, uintptr_t stream) {
    py::gil_scoped_release nogil;
    ce_grad_logits_cuda(ptr<const double>(logits), ptr<const int64_t>(targets), n_tok, vocab,
                        scale, ptr<double>(out), ptr<void>(stream));
  });
  l.def("loss_sum_add_dev", [](uintptr_t loss, int64_t n_tok, uintptr_t state, uintptr_t stream) {
    py::gil_scoped_release nogil;
    loss_sum_add_cuda(ptr<const double>(loss), n_tok, ptr<double>(state), ptr<void>(stream));
  });
}

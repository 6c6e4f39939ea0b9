// pybind11 bindings of the lossk family: argument conversion, buffer lengths, status ->
// exception, GIL release. No arithmetic: every number comes from cpp/src.
//
// The fused losses take (options record, keyword arguments) in two conventions: host arrays
// (fused_linear_ce, fused_linear_distill: the NumPy API) and device pointers
// (fused_linear_ce_dev: algenta.torch's CUDA tensors). The record, algenta.lossk._args's
// CrossEntropyOptions or DistillOptions, becomes lossk.hpp's in one place (read_shared,
// ce_options, distill_options).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
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

void refuse_unless_ok(int status, const std::string& why) {
  if (status != LOSS_OK) refuse(status, why);
}

void require_len(const char* name, py::ssize_t have, int64_t need) {
  if (have < need)
    refuse(LOSS_ERR_LENGTH_MISMATCH, std::string(name) + " has " + std::to_string(have) +
                                         " elements, the declared shape needs " +
                                         std::to_string(need));
}

std::string type_name(const py::handle& x) { return py::str(py::type::of(x)); }

// The value of `x` as X; a value of another type is a TypeError naming `what` (as pybind11
// refuses a typed signature's arguments).
template <class X>
X as(const py::handle& x, const std::string& what) {
  try {
    return x.cast<X>();
  } catch (const py::cast_error&) {
  } catch (const py::error_already_set&) {  // NumPy's refusal of a ragged or odd array (the
  }                                          // Python error was fetched into the exception)
  throw py::type_error(what + " has the wrong type (" + type_name(x) + ")");
}

// The keyword arguments of one call of a fused loss (everything but its options record): a
// missing one, or one of another type, is a TypeError naming it.
struct Kw {
  const py::dict& k;
  const char* fn;
  mutable std::set<std::string> read{};  // every name asked for, given or not
  bool given(const char* n) const {
    read.insert(n);
    return k.contains(n) && !k[n].is_none();
  }
  template <class X>
  X get(const char* n) const {
    read.insert(n);
    if (!k.contains(n))
      throw py::type_error(std::string(fn) + ": missing argument '" + n + "'");
    return as<X>(k[n], std::string(fn) + ": argument '" + n + "'");
  }
  // A keyword the entry point never asked for is a caller's mistake (a misspelt or retired
  // output flag), refused by name rather than dropped. Checked once the call has read what it
  // reads, so after the work: the only callers are algenta's own Python layers, whose tests
  // meet it first.
  void refuse_unread() const {
    for (const auto& item : k) {
      const std::string n = py::str(item.first);
      if (!read.count(n))
        throw py::type_error(std::string(fn) + ": unexpected argument '" + n + "'");
    }
  }
  template <class X>
  X get(const char* n, X absent) const {
    return given(n) ? get<X>(n) : absent;
  }
  std::optional<py::array> array(const char* n) const {
    return given(n) ? std::optional<py::array>(get<py::array>(n)) : std::nullopt;
  }
};

// ---- the options record -------------------------------------------------------------------
// algenta.lossk._args's CrossEntropyOptions and DistillOptions, read by field name into
// lossk.hpp's records: the one place a Python record becomes a C++ one, for every entry point.
// Values are converted, never judged: every range is the core's check to refuse.

template <class X>
X field(const py::handle& rec, const char* n) {
  if (!py::hasattr(rec, n))
    throw py::type_error(std::string("the options record has no field '") + n + "'");
  return as<X>(rec.attr(n), std::string("option '") + n + "'");
}

Reduction parse_reduction(const std::string& r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  refuse(LOSS_ERR_UNKNOWN_OBJECTIVE, "reduction must be 'mean', 'sum' or 'none', got '" + r + "'");
}

Objective parse_objective(const std::string& o) {
  if (o == "kl") return Objective::KL;
  if (o == "reverse_kl") return Objective::ReverseKL;
  if (o == "jsd") return Objective::JSD;
  refuse(LOSS_ERR_UNKNOWN_OBJECTIVE,
         "objective must be 'kl', 'reverse_kl' or 'jsd', got '" + o + "'");
}

// The fields both records have. chunk None: the largest the logit budget admits for n_tok tokens
// of vocab classes (1 where those are refused anyway: the core refuses them first).
void read_shared(const py::handle& r, LossOptions& o, int64_t n_tok, int64_t vocab) {
  o.reduction = parse_reduction(field<std::string>(r, "reduction"));
  const auto chunk = field<std::optional<int64_t>>(r, "chunk");
  o.chunk = chunk ? *chunk : std::max<int64_t>(loss_max_chunk(n_tok, vocab), 1);
  const auto ignore = field<std::optional<int64_t>>(r, "ignore_index");
  o.has_ignore = ignore.has_value();
  if (ignore) o.ignore_index = *ignore;
  o.temperature = field<double>(r, "temperature");
  o.grad_scale = field<double>(r, "grad_scale");
}

CrossEntropyOptions ce_options(const py::handle& r, int64_t n_tok, int64_t vocab) {
  CrossEntropyOptions o;
  read_shared(r, o, n_tok, vocab);
  o.label_smoothing = field<double>(r, "label_smoothing");
  const auto cap = field<std::optional<double>>(r, "softcap");
  o.has_softcap = cap.has_value();
  o.softcap = cap.value_or(0.0);
  o.lse_square_scale = field<double>(r, "lse_square_scale");
  o.shift = field<int64_t>(r, "shift");
  o.entropy = field<bool>(r, "entropy");
  o.entropy_grad_scale = field<double>(r, "entropy_grad_scale");
  return o;
}

DistillOptions distill_options(const py::handle& r, int64_t n_tok, int64_t vocab) {
  DistillOptions o;
  o.objective = parse_objective(field<std::string>(r, "objective"));
  read_shared(r, o, n_tok, vocab);
  o.beta = field<double>(r, "beta");
  o.hard_weight = field<double>(r, "hard_weight");
  o.soft_weight = field<double>(r, "soft_weight");
  return o;
}

// ---- element types ------------------------------------------------------------------------

// The element types lossk computes in or takes (dtype.hpp): halves compute in float32.
constexpr Dtype kLossDtypes[] = {Dtype::F32, Dtype::F64, Dtype::BF16, Dtype::F16};
Dtype parse_elem(const std::string& e, const char* what) { return dtype_arg(e, kLossDtypes, what); }

// A call's input and gradient element types (elem, grad_elem; "" or absent: elem's). The compute
// type is double for float64 inputs, float for every other.
struct Elems {
  Dtype in, grad;
};

Elems read_elems(const Kw& k) {
  const Dtype e = parse_elem(k.get<std::string>("elem"), "elem");
  const std::string g = k.get<std::string>("grad_elem", "");
  const Dtype ge = g.empty() ? e : parse_elem(g, "grad_elem");
  if (e == Dtype::F64 && ge != Dtype::F64)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 inputs give float64 gradients");
  if (e != Dtype::F64 && ge == Dtype::F64)
    refuse(LOSS_ERR_LENGTH_MISMATCH, "float64 gradients need float64 inputs");
  return {e, ge};
}

void require_half_inputs(const Elems& e) {
  if (is_half(e.grad) && !is_half(e.in))
    refuse(LOSS_ERR_LENGTH_MISMATCH, "half-precision gradients need half-precision inputs");
}

// ---- host arrays --------------------------------------------------------------------------

// device="cpu" or "cuda" (the NumPy API's: host arrays in and out, the work on the device).
bool on_cuda(const std::string& device) {
  if (device == "cpu") return false;
  if (device == "cuda") return true;
  throw py::value_error("device must be 'cpu' or 'cuda', got '" + device + "'");
}
bool on_cuda(const Kw& k) { return on_cuda(k.get<std::string>("device", "cpu")); }

// A half-precision input: the caller's C-contiguous 2-byte buffer (bit patterns), never copied.
const void* half_data(const py::array& a, const char* name) {
  if (a.itemsize() != 2 || !(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + " must be a C-contiguous array of 2-byte elements "
                         "(float16, or bfloat16 bit patterns)");
  return a.data();
}

// An input the core reads in element type e: the caller's half bits as they are, or T elements
// (cast to T if they are not: a copy the Python layer avoids), kept alive by `keep`; at least
// `need` elements.
template <class T>
const void* input_data(const py::array& x, Dtype e, carray<T>& keep, const char* name,
                       int64_t need) {
  const void* p;
  if (is_half(e)) {
    p = half_data(x, name);
  } else {
    keep = carray<T>::ensure(x);
    if (!keep) throw py::type_error(std::string(name) + " must be an array of real numbers");
    p = keep.data();
  }
  require_len(name, x.size(), need);
  return p;
}

// An optional array of T the core reads (class or token weights, a per-token upstream gradient):
// converted to T, at least `need` elements; null when not given.
template <class T>
const T* compute_data(const Kw& k, const char* key, const char* name, int64_t need,
                      carray<T>& keep) {
  const std::optional<py::array> x = k.array(key);
  if (!x) return nullptr;
  keep = carray<T>::ensure(*x);
  if (!keep) throw py::type_error(std::string(name) + " must be an array of real numbers");
  require_len(name, keep.size(), need);
  return keep.data();
}

// The targets (int64), at least n_tok of them.
const int64_t* targets_data(const py::array& x, carray<int64_t>& keep, const char* name,
                            int64_t n_tok) {
  keep = carray<int64_t>::ensure(x);
  if (!keep) throw py::type_error(std::string(name) + " must be an array of integers");
  require_len(name, keep.size(), n_tok);
  return keep.data();
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

// A per-token output of T (n cells) when wanted: the array, its data in *dst.
template <class T>
py::object per_token(bool want, int64_t n, T** dst) {
  if (!want) return py::none();
  py::array_t<T> a(n);
  *dst = a.mutable_data();
  return std::move(a);
}

// The gradient arrays of one call (want_dh, want_dw, want_db), handed to the core through its
// GradOut: T arrays, or half bits (one_chunk: the core narrows each d_weight cell from its tile;
// otherwise a float32 accumulator on huge pages, narrowed in place and shrunk by finish()).
template <class T>
struct GradArrays {
  py::object dh = py::none(), dw = py::none(), db = py::none();
  std::unique_ptr<void, FreeDeleter> dw_buf, db_buf;
  int64_t vocab = 0, d_model = 0;

  void allocate(const Kw& k, GradOut<T>& out, Dtype grad_elem, bool one_chunk, int64_t n_tok,
                int64_t d_model_, int64_t vocab_) {
    vocab = vocab_, d_model = d_model_;
    out.grad_elem = grad_elem;
    const bool half = is_half(grad_elem);
    if (k.get<bool>("want_dh", false)) {
      py::array g = half ? py::array(py::array_t<uint16_t>({n_tok, d_model}))
                         : py::array(py::array_t<T>({n_tok, d_model}));
      out.d_hidden = g.mutable_data();
      dh = g;
    }
    if (k.get<bool>("want_dw", false)) {
      if (half && one_chunk) {
        py::array_t<uint16_t> g({vocab, d_model});
        out.d_weight_half = g.mutable_data();
        dw = g;
      } else if (half) {
        // As large as the weight: huge pages, so first touch is not a fault per 4 KiB.
        dw_buf.reset(algenta::huge_malloc(size_t(vocab) * size_t(d_model) * sizeof(T)));
        out.d_weight = static_cast<T*>(dw_buf.get());
      } else {
        py::array_t<T> g({vocab, d_model});
        out.d_weight = g.mutable_data();
        dw = g;
      }
    }
    if (k.get<bool>("want_db", false)) {
      if (half) {
        db_buf.reset(algenta::huge_malloc(size_t(vocab) * sizeof(T)));
        out.d_bias = static_cast<T*>(db_buf.get());
      } else {
        py::array_t<T> g(vocab);
        out.d_bias = g.mutable_data();
        db = g;
      }
    }
  }

  // After the core ran: half accumulators as their narrowed arrays, every gradient into d.
  void finish(py::dict& d) {
    if (dw_buf) dw = own_narrowed(dw_buf, {vocab, d_model}, vocab * d_model);
    if (db_buf) db = own_narrowed(db_buf, {vocab}, vocab);
    d["d_hidden"] = dh;
    d["d_weight"] = dw;
    d["d_bias"] = db;
  }
};

// The last refusals of a host call, before any output is allocated: the core's check (status,
// why), and for the CPU backend an invalid ALGENTA_ISA.
void admit(int status, const std::string& why, bool cuda) {
  refuse_unless_ok(status, why);
  if (!cuda) algenta::kern::isa();
}

// The core with the GIL released: the CPU backend's, or the CUDA backend's from host memory.
template <class Args, class Out, class Cpu, class Cuda>
void run_core(bool cuda, const Args& a, Out& out, Cpu&& cpu, Cuda&& on_device) {
  py::gil_scoped_release nogil;
  if (cuda) on_device(a, out);
  else cpu(a, out);
}

// fused_linear_ce(opts, **k). k: hidden, weight, targets, bias, class_weight, token_weight (host
// arrays), n_tok, d_model, vocab, seq_len, elem, grad_elem, the per-token upstream gradients
// grad_output, grad_lse, grad_entropy and grad_coef, the outputs wanted (want_dh, want_dw,
// want_db, want_loss_tok, want_z_tok, want_pred, want_shard_stats) and device.
template <class T>
py::dict fused(const py::handle& rec, const Kw& k, const Elems& e, bool cuda) {
  FusedArgs<T> a;
  a.n_tok = k.get<int64_t>("n_tok");
  a.d_model = k.get<int64_t>("d_model");
  a.vocab = k.get<int64_t>("vocab");
  a.seq_len = k.get<int64_t>("seq_len", 0);
  a.elem = e.in;
  a.opt = ce_options(rec, a.n_tok, a.vocab);
  require_half_inputs(e);
  const int64_t N = a.n_tok, D = a.d_model, V = a.vocab;
  std::string why;
  // Dimensions first: the length products below are only formed for in-ceiling shapes.
  if (loss_dims_check(N, D, V) != LOSS_OK) refuse(fused_linear_ce_check_shape(a, &why), why);
  carray<T> h, w, b, c[6];
  carray<int64_t> t;
  a.hidden = input_data<T>(k.get<py::array>("hidden"), e.in, h, "hidden", N * D);
  a.weight = input_data<T>(k.get<py::array>("weight"), e.in, w, "weight", V * D);
  a.targets = targets_data(k.get<py::array>("targets"), t, "targets", N);
  if (const auto bias = k.array("bias")) a.bias = input_data<T>(*bias, e.in, b, "linear_bias", V);
  a.class_weight = compute_data<T>(k, "class_weight", "class weights", V, c[0]);
  a.token_weight = compute_data<T>(k, "token_weight", "token_weight", N, c[1]);
  a.grad_output = compute_data<T>(k, "grad_output", "grad_output", N, c[2]);
  a.grad_lse = compute_data<T>(k, "grad_lse", "the gradient of lse", N, c[3]);
  a.grad_coef = compute_data<T>(k, "grad_coef", "grad_coef", 3 * N, c[4]);
  a.grad_entropy = compute_data<T>(k, "grad_entropy", "the gradient of the entropy", N, c[5]);
  // device="cuda": the data's own checks (585/586) run on the device, after the copy, as they do
  // for CUDA tensors; everything else is refused here first.
  admit(cuda ? fused_linear_ce_check_shape(a, &why) : fused_linear_ce_check(a, &why), why, cuda);

  FusedOut<T> out;
  const bool stats = k.get<bool>("want_shard_stats", false);
  py::array_t<T> lse(N);
  out.lse = lse.mutable_data();
  py::dict d;
  d["loss_tok"] = per_token<T>(k.get<bool>("want_loss_tok", false), N, &out.loss_tok);
  d["z_tok"] = per_token<T>(k.get<bool>("want_z_tok", false), N, &out.z_tok);
  d["pred"] = per_token<int64_t>(k.get<bool>("want_pred", false), N, &out.pred);
  d["entropy_tok"] = per_token<T>(a.opt.entropy, N, &out.entropy_tok);
  d["target_logit"] = per_token<T>(stats, N, &out.target_logit);
  d["logit_sum"] = per_token<T>(stats, N, &out.logit_sum);
  GradArrays<T> ga;
  ga.allocate(k, out, e.grad, !cuda && fused_linear_ce_chunk(a) >= N, N, D, V);
  run_core(cuda, a, out, fused_linear_ce<T>, fused_linear_ce_cuda_host<T>);
  ga.finish(d);
  d["total"] = out.reduced(Reduction::Sum);
  d["mean"] = out.reduced(Reduction::Mean);
  d["z_total"] = out.z.total;
  d["z_mean"] = out.z_mean();
  d["entropy_total"] = a.opt.entropy ? py::object(py::float_(out.ent.total)) : py::none();
  d["entropy_mean"] = a.opt.entropy ? py::object(py::float_(out.entropy_mean())) : py::none();
  d["n_valid"] = out.ce.count;
  d["weight_sum"] = out.weight_sum;
  d["n_correct"] = out.n_correct;
  d["lse"] = lse;
  d["chunk"] = a.opt.chunk;  // the one asked for (None: the largest the budget admits)
  return d;
}

// fused_linear_distill(opts, **k). k: hidden, weight, bias (the student's), t_hidden, t_weight,
// t_bias (the teacher's), targets (or None), elem, t_elem, grad_elem, n_tok, d_model, t_d_model,
// vocab, grad_output (None or per token), want_dh, want_dw, want_db, device; the vocab-parallel
// form's shard, shard_lse, shard_h, shard_coef and want_shard_stats (DistillArgs, DistillOut).
template <class T>
py::dict distill(const py::handle& rec, const Kw& k, const Elems& e, bool cuda) {
  DistillArgs<T> a;
  a.elem = e.in;
  a.t_elem = parse_elem(k.get<std::string>("t_elem"), "t_elem");
  a.n_tok = k.get<int64_t>("n_tok");
  a.d_model = k.get<int64_t>("d_model");
  a.t_d_model = k.get<int64_t>("t_d_model");
  a.vocab = k.get<int64_t>("vocab");
  a.opt = distill_options(rec, a.n_tok, a.vocab);
  a.shard = k.get<bool>("shard", false);
  require_half_inputs(e);
  const int64_t N = a.n_tok, D = a.d_model, Dt = a.t_d_model, V = a.vocab;
  const std::optional<py::array> bias = k.array("bias"), t_bias = k.array("t_bias"),
                                 targets = k.array("targets");
  // Dimensions first: the length products below are only formed for in-ceiling shapes.
  std::string why;
  for (const int64_t dm : {D, Dt})
    if (loss_dims_check(N, dm, V) != LOSS_OK)
      refuse(fused_linear_distill_check_shape(a, &why), why);
  carray<int64_t> t;
  if (targets) a.targets = targets_data(*targets, t, "target", N);
  // element types and scalars before any input is converted
  refuse_unless_ok(fused_linear_distill_check_shape(a, &why), why);
  carray<T> keep[10];
  a.hidden = input_data<T>(k.get<py::array>("hidden"), e.in, keep[0], "student_input", N * D);
  a.weight = input_data<T>(k.get<py::array>("weight"), e.in, keep[1], "student_weight", V * D);
  if (bias) a.bias = input_data<T>(*bias, e.in, keep[2], "student_bias", V);
  a.t_hidden =
      input_data<T>(k.get<py::array>("t_hidden"), a.t_elem, keep[3], "teacher_input", N * Dt);
  a.t_weight =
      input_data<T>(k.get<py::array>("t_weight"), a.t_elem, keep[4], "teacher_weight", V * Dt);
  if (t_bias) a.t_bias = input_data<T>(*t_bias, a.t_elem, keep[5], "teacher_bias", V);
  a.grad_output = compute_data<T>(k, "grad_output", "grad_output", N, keep[6]);
  a.shard_lse = compute_data<T>(k, "shard_lse", "shard_lse", 3 * N, keep[7]);
  a.shard_h = compute_data<T>(k, "shard_h", "shard_h", N, keep[8]);
  a.shard_coef = compute_data<T>(k, "shard_coef", "shard_coef", 2 * N, keep[9]);
  // device="cuda": the data's own checks (585/586) run on the device, after the copy
  admit(cuda ? fused_linear_distill_check_shape(a, &why) : fused_linear_distill_check(a, &why),
        why, cuda);

  DistillOut<T> out;
  const bool per_tok = a.opt.reduction == Reduction::None;
  const bool stats = k.get<bool>("want_shard_stats", false);
  py::dict d;
  d["loss_tok"] = per_token<T>(per_tok, N, &out.loss_tok);
  d["div_tok"] = per_token<T>(per_tok, N, &out.div_tok);
  d["ce_tok"] = per_token<T>(per_tok, N, &out.ce_tok);
  py::object shard_stats = py::none();
  if (stats) {
    py::array_t<T> s({N, int64_t(6)});
    out.shard_stats = s.mutable_data();
    shard_stats = s;
  }
  d["shard_stats"] = shard_stats;
  GradArrays<T> ga;
  ga.allocate(k, out, e.grad, !cuda && fused_linear_distill_chunk(a) >= N, N, D, V);
  run_core(cuda, a, out, fused_linear_distill<T>, fused_linear_distill_cuda_host<T>);
  ga.finish(d);
  const Reduction r = per_tok ? Reduction::Mean : a.opt.reduction;
  d["loss"] = out.reduced(r);
  d["divergence"] = out.div_reduced(r);
  d["ce"] = out.ce_reduced(r);
  d["n_valid"] = out.loss.count;
  return d;
}

// The host-array convention of both fused losses: (options record, keyword arguments), run by
// the loss's instantiation for the compute type of the inputs' elem.
typedef py::dict (*HostLoss)(const py::handle&, const Kw&, const Elems&, bool);
py::dict host_call(const py::handle& rec, const py::dict& kwargs, const char* fn, HostLoss f32,
                   HostLoss f64) {
  const Kw k{kwargs, fn};
  const bool cuda = on_cuda(k);
  const Elems e = read_elems(k);
  py::dict out = (e.in == Dtype::F64 ? f64 : f32)(rec, k, e, cuda);
  k.refuse_unread();
  return out;
}

// ---- device pointers (algenta.torch's CUDA tensors) ---------------------------------------
// Pointers arrive as integers (0 for none) from algenta.torch, which derives every one from a
// tensor whose device, dtype, shape and contiguity it has checked; these entry points are
// private to it. The shapes are checked again here, the data on the device.

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// fused_linear_ce_dev(opts, k, ...). k: the pointers of hidden, weight, bias, targets,
// class_weight, token_weight, grad_output, grad_lse, grad_entropy and of the outputs (loss, z,
// loss_tok, z_tok, lse, pred, accuracy, entropy, entropy_tok, d_hidden, d_weight, d_bias), n_tok,
// d_model, vocab, seq_len, elem and grad_elem.
struct DevCall {
  FusedArgs<float> f;
  FusedArgs<double> d;
  FusedCudaOut<float> of;
  FusedCudaOut<double> od;
  bool f64 = false;
};

DevCall dev_args(const py::handle& rec, const py::dict& kwargs) {
  const Kw k{kwargs, "fused_linear_ce_dev"};
  auto p = [&](const char* n) { return k.get<uintptr_t>(n, 0); };
  DevCall c;
  const Elems e = read_elems(k);
  c.f64 = e.in == Dtype::F64;
  const int64_t n_tok = k.get<int64_t>("n_tok"), vocab = k.get<int64_t>("vocab");
  const CrossEntropyOptions opt = ce_options(rec, n_tok, vocab);
  auto set = [&](auto& a, auto& o, auto tag) {
    typedef decltype(tag) T;
    a.hidden = ptr<const void>(p("hidden"));
    a.weight = ptr<const void>(p("weight"));
    a.bias = ptr<const void>(p("bias"));
    a.elem = e.in;
    a.targets = ptr<const int64_t>(p("targets"));
    a.n_tok = n_tok, a.d_model = k.get<int64_t>("d_model"), a.vocab = vocab;
    a.seq_len = k.get<int64_t>("seq_len", 0);
    a.opt = opt;
    // the arrays of T in and out, by the names algenta.torch passes them
    const T** in[] = {&a.class_weight, &a.token_weight, &a.grad_output, &a.grad_lse,
                      &a.grad_entropy};
    const char* in_names[] = {"class_weight", "token_weight", "grad_output", "grad_lse",
                              "grad_entropy"};
    for (size_t i = 0; i < std::size(in); ++i) *in[i] = ptr<const T>(p(in_names[i]));
    T** out[] = {&o.loss, &o.z, &o.loss_tok, &o.z_tok, &o.lse, &o.entropy, &o.entropy_tok};
    const char* out_names[] = {"loss", "z", "loss_tok", "z_tok", "lse", "entropy", "entropy_tok"};
    for (size_t i = 0; i < std::size(out); ++i) *out[i] = ptr<T>(p(out_names[i]));
    o.pred = ptr<int64_t>(p("pred"));
    o.accuracy = ptr<float>(p("accuracy"));
    o.d_hidden = ptr<void>(p("d_hidden"));
    o.d_weight = ptr<void>(p("d_weight"));
    o.d_bias = ptr<void>(p("d_bias"));
    o.grad_elem = e.grad;
  };
  if (c.f64) set(c.d, c.od, double());
  else set(c.f, c.of, float());
  return c;
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
  for (const auto& [name, code] : {std::pair<const char*, int>{"LOSS_OK", LOSS_OK},
                                   {"LOSS_ERR_EMPTY_DIMENSION", LOSS_ERR_EMPTY_DIMENSION},
                                   {"LOSS_ERR_LENGTH_MISMATCH", LOSS_ERR_LENGTH_MISMATCH},
                                   {"LOSS_ERR_DIMENSION_TOO_LARGE", LOSS_ERR_DIMENSION_TOO_LARGE},
                                   {"LOSS_ERR_WORK_BUDGET", LOSS_ERR_WORK_BUDGET},
                                   {"LOSS_ERR_NON_FINITE", LOSS_ERR_NON_FINITE},
                                   {"LOSS_ERR_TARGET_OUT_OF_RANGE", LOSS_ERR_TARGET_OUT_OF_RANGE},
                                   {"LOSS_ERR_BAD_CHUNK", LOSS_ERR_BAD_CHUNK},
                                   {"LOSS_ERR_UNKNOWN_OBJECTIVE", LOSS_ERR_UNKNOWN_OBJECTIVE},
                                   {"LOSS_ERR_NO_CUDA_BACKEND", LOSS_ERR_NO_CUDA_BACKEND},
                                   {"LOSS_ERR_NO_DEVICE", LOSS_ERR_NO_DEVICE},
                                   {"LOSS_ERR_DEVICE_FAILED", LOSS_ERR_DEVICE_FAILED}})
    l.attr(name) = code;
  for (const auto& [name, ceiling] :
       {std::pair<const char*, int64_t>{"LOSS_MAX_WORK_CELLS", LOSS_MAX_WORK_CELLS},
        {"LOSS_MAX_LOGIT_CELLS", LOSS_MAX_LOGIT_CELLS}, {"LOSS_MAX_TOKENS", LOSS_MAX_TOKENS},
        {"LOSS_MAX_D_MODEL", LOSS_MAX_D_MODEL}, {"LOSS_MAX_VOCAB", LOSS_MAX_VOCAB},
        {"LOSS_VOCAB_BLOCK", LOSS_VOCAB_BLOCK}})
    l.attr(name) = ceiling;
  l.attr("LOSS_TRANSCENDENTAL_FLOOR") = LOSS_TRANSCENDENTAL_FLOOR;

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
  l.def(
      "fused_linear_ce",
      [](const py::object& opts, const py::kwargs& k) {
        return host_call(opts, k, "fused_linear_ce", fused<float>, fused<double>);
      },
      py::arg("opts"),
      "The fused linear cross-entropy core (see lossk.hpp) on host arrays: opts is an "
      "algenta.lossk._args.CrossEntropyOptions, the keywords the arrays, their sizes and element "
      "types (f32, f64, or bf16/f16 bit patterns), the outputs wanted and device ('cuda': the "
      "CUDA backend, host arrays in and out).");
  l.def(
      "fused_linear_distill",
      [](const py::object& opts, const py::kwargs& k) {
        return host_call(opts, k, "fused_linear_distill", distill<float>, distill<double>);
      },
      py::arg("opts"), "Fused linear distillation on host arrays; opts a DistillOptions.");
  l.def("cuda_set_device", &cuda_set_device);
  // algenta.torch's CUDA tensors: the options record and a dict of sizes and pointers.
  l.def("fused_linear_ce_dev_workspace", [](const py::object& opts, const py::dict& k) {
    DevCall c = dev_args(opts, k);
    std::string why;
    if (c.f64) {
      refuse_unless_ok(fused_linear_ce_check_shape(c.d, &why), why);
      return fused_linear_ce_cuda_workspace(c.d, c.od);
    }
    refuse_unless_ok(fused_linear_ce_check_shape(c.f, &why), why);
    return fused_linear_ce_cuda_workspace(c.f, c.of);
  });
  l.def("fused_linear_ce_dev", [](const py::object& opts, const py::dict& k, uintptr_t workspace,
                                  int64_t ws_bytes, uintptr_t stream) {
    DevCall c = dev_args(opts, k);
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

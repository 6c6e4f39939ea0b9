// pybind11 bindings of the resident decode session (algenta._core.session): argument conversion,
// GIL release, nothing else. The Python face is algenta.residentk.session.ResidentSession.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"
#include "session_args.hpp"

namespace py = pybind11;
using namespace pybind11::literals;
using algenta::residentk::ModelShape;
using algenta::residentk::Session;
using algenta::residentk::SessionConfig;

namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using algenta::Dtype;

[[noreturn]] void refuse(int code, const std::string& msg) {
  throw algenta::StatusError(algenta::Family::Resident, code, msg);
}

// A 1-D int64 array's elements; an array of any other rank is not a sequence (601, `what`).
const int64_t* sequence(const I64& a, const char* what) {
  if (a.ndim() != 1) refuse(algenta::residentk::RESIDENT_ERR_EMPTY_DIMENSION, what);
  return a.data();
}

// ids appended to one slot -> the last one's logits (vocab)
py::array_t<float> prefill_slot(Session& x, int64_t slot, const I64& ids) {
  const int64_t* p = sequence(ids, "prefill takes a 1-D sequence of token ids");
  py::array_t<float> out(x.config().vocab);
  float* o = out.mutable_data();
  const int64_t n = ids.shape(0);
  {
    py::gil_scoped_release nogil;
    x.prefill_slot(slot, p, n, o);
  }
  return out;
}

// One step of several slots -> logits (B, vocab), which the core allocates once it has checked
// the request (B is the caller's: a refused step allocates nothing); the array takes them over.
py::array_t<float> step_slots(Session& x, const I64& slots, const I64& ids) {
  const char* what = "step_slots takes two 1-D sequences: slots and token ids";
  const int64_t *ps = sequence(slots, what), *pi = sequence(ids, what);
  const int64_t B = slots.shape(0), V = x.config().vocab;
  std::unique_ptr<float[]> rows;
  {
    py::gil_scoped_release nogil;
    rows = x.step_slots(ps, B, pi, ids.shape(0));
  }
  float* p = rows.release();
  py::capsule owner(p, [](void* q) { delete[] static_cast<float*>(q); });
  return py::array_t<float>({B, V}, p, owner);
}

std::unique_ptr<Session> cpu_session(const ModelShape& m, double rms_eps, double rope_theta,
                                     bool tied, int64_t max_ctx, const std::string& weights,
                                     const std::string& kv, int64_t slots,
                                     const py::dict& family) {
  return algenta::residentk::open_session(algenta::residentk::make_cpu_session, m, rms_eps,
                                          rope_theta, tied, max_ctx, weights, kv, slots, family);
}

py::list tensor_table(const ModelShape& m, bool tied, const py::dict& family) {
  const SessionConfig c = algenta::residentk::session_config(m, 1e-6, 1e6, tied, "f32", "f32",
                                                             family);
  py::list out;
  for (const auto& t : algenta::residentk::model_tensors(c))
    out.append(py::make_tuple(t.name, py::tuple(py::cast(t.shape)), t.layer,
                              algenta::residentk::field_name(t.field)));
  return out;
}

}  // namespace

void bind_session_cuda(py::module_& s);

void bind_session(py::module_& m) {
  py::module_ s = m.def_submodule("session", "resident decode session engines");

  s.def(
      "widen",
      [](const py::array& a, const std::string& source, int64_t n) {
        // What set_weight stores before its format: a ggml block type's bytes widened to
        // float32 (tests compare it block by block with the gguf package's dequantizers).
        static constexpr Dtype kBlocks[] = {Dtype::Q8_0, Dtype::Q4_0, Dtype::Q4_K, Dtype::Q6_K};
        const Dtype t = algenta::dtype_arg(source, kBlocks, "source");
        const algenta::DtypeInfo& info = dtype_info(t);
        if (a.itemsize() != 1 || !(a.flags() & py::array::c_style) || n < 0 ||
            n % info.block != 0 || int64_t(a.nbytes()) != n / info.block * info.bytes)
          throw py::value_error(std::string("widen: a C-contiguous uint8 array of whole ") +
                                info.long_name + " blocks holding n values");
        py::array_t<float> out(n);
        const void* p = a.data();
        float* o = out.mutable_data();
        int64_t bad;
        {
          py::gil_scoped_release nogil;
          bad = algenta::residentk::widen_checked(p, t, 0, n, o);
        }
        if (bad >= 0)
          refuse(algenta::residentk::RESIDENT_ERR_NON_FINITE,
                 "value " + std::to_string(bad) + " widens to a non-finite number");
        return out;
      },
      py::arg("data"), py::arg("source"), py::arg("n"),
      "n float32 values of ggml blocks (q8_0, q4_0, q4_k, q6_k), as a session widens them.");

  py::class_<Session>(s, "Session")
      .def_property_readonly("device", [](const Session& x) { return std::string(x.device()); })
      .def_property_readonly("max_ctx", &Session::max_ctx)
      .def_property_readonly("capacity", &Session::capacity)
      .def_property_readonly("position", &Session::position)
      .def_property_readonly("dispatches_per_token", &Session::dispatches_per_token)
      .def("set_weight",
           [](Session& x, const std::string& name, const py::array& a, const std::string& source,
              py::object shape_arg) {
             // The element type is named by the caller (bf16 arrives as uint16 bit patterns, a
             // ggml block type as its raw bytes with the tensor's shape beside them); the
             // binding only checks that the buffer holds exactly that many bytes, densely.
             static constexpr Dtype kSources[] = {Dtype::F32,  Dtype::BF16, Dtype::F16,
                                                  Dtype::Q8_0, Dtype::Q4_0, Dtype::Q4_K,
                                                  Dtype::Q6_K};
             const Dtype t = dtype_arg(source, kSources, "source");
             const algenta::DtypeInfo& info = dtype_info(t);
             std::vector<int64_t> shape;
             if (!algenta::is_ggml_block(t)) {
               if (!shape_arg.is_none())
                 throw py::type_error("set_weight: shape= is only for a ggml block source");
               if (a.itemsize() != info.bytes || !(a.flags() & py::array::c_style))
                 throw py::type_error("set_weight(source='" + source + "') needs a C-contiguous "
                                      "array of " + std::to_string(info.bytes) +
                                      "-byte elements");
               shape.assign(a.shape(), a.shape() + a.ndim());
             } else {
               if (shape_arg.is_none())
                 throw py::type_error("set_weight(source='" + source + "') needs shape=");
               shape = shape_arg.cast<std::vector<int64_t>>();
               if (a.itemsize() != 1 || !(a.flags() & py::array::c_style))
                 throw py::type_error("set_weight(source='" + source + "') needs a C-contiguous "
                                      "uint8 array of the blocks' bytes");
               // Whole blocks per row, and exactly the bytes they take: a row split inside a
               // block, or a short buffer, would be read past its end.
               int64_t elems = 1;
               for (int64_t d : shape) {
                 if (d < 1 || elems > (int64_t(1) << 40) / d)
                   refuse(algenta::residentk::RESIDENT_ERR_WEIGHT_LENGTH,
                                   "tensor '" + name + "': shape is empty or too large");
                 elems *= d;
               }
               if (shape.empty() || shape.back() % info.block != 0)
                 refuse(algenta::residentk::RESIDENT_ERR_WEIGHT_LENGTH,
                                 "tensor '" + name + "': a " + info.long_name + " row holds whole "
                                 "blocks of " + std::to_string(info.block) + " values");
               if (int64_t(a.nbytes()) != elems / info.block * info.bytes)
                 refuse(algenta::residentk::RESIDENT_ERR_WEIGHT_LENGTH,
                                 "tensor '" + name + "': " + std::to_string(a.nbytes()) +
                                 " bytes, its " + info.long_name + " blocks take " +
                                 std::to_string(elems / info.block * info.bytes));
             }
             const void* p = a.data();
             py::gil_scoped_release nogil;
             x.set_weight(name, shape, p, t);
           },
           py::arg("name"), py::arg("array"), py::arg("source") = "f32",
           py::arg("shape") = py::none(),
           "Set a tensor from its f32, f16 or bf16 (uint16 bit patterns) elements, or from a "
           "ggml block type's bytes (q8_0, q4_0, q4_k, q6_k; shape= the tensor's shape), "
           "widened exactly to float32 and checked finite.")
      .def("missing_weights", &Session::missing_weights,
           py::call_guard<py::gil_scoped_release>())
      .def("weight_shape", &Session::weight_shape, py::arg("name"))
      .def("prefill", [](Session& x, const I64& ids) { return prefill_slot(x, 0, ids); },
           py::arg("ids"))
      .def("step",
           [](Session& x, int64_t id) {
             py::array_t<float> out(x.config().vocab);
             float* o = out.mutable_data();
             {
               py::gil_scoped_release nogil;
               x.step(id, o);
             }
             return out;
           },
           py::arg("id"))
      .def("step_greedy", &Session::step_greedy, py::arg("id"),
           py::call_guard<py::gil_scoped_release>(),
           "step(id), returning only the argmax of its logits (numpy.argmax's order).")
      .def("check_tokens",
           [](const Session& x, const I64& ids, const std::string& what) {
             x.check_tokens(sequence(ids, "check_tokens takes a 1-D sequence of token ids"),
                            ids.shape(0), what.c_str());
           },
           py::arg("ids"), py::arg("what"),
           "Refuse (601) the first id outside the vocabulary, as prefill would, changing nothing.")
      .def("reset", &Session::reset, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("slots", &Session::slots)
      .def("slot_position", &Session::slot_position, py::arg("slot"))
      .def("prefill_slot", &prefill_slot, py::arg("slot"), py::arg("ids"))
      .def("step_slots", &step_slots, py::arg("slots"), py::arg("ids"),
           "One decode step of several slots at once -> logits (B, vocab), row b for slots[b].")
      .def("truncate_slot", &Session::truncate_slot, py::arg("slot"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      .def("copy_prefix", &Session::copy_prefix, py::arg("src"), py::arg("dst"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      // The session's one lock, held across a caller's calls (waited on without the GIL, so
      // its holder may run Python in between); seal refuses the holder's own writes meanwhile.
      .def("lock", &Session::lock, py::call_guard<py::gil_scoped_release>())
      .def("unlock", &Session::unlock)
      .def("seal", &Session::seal, py::arg("why"));

  algenta::residentk::def_flat_shape(
      s, "cpu_session", &cpu_session, py::arg("rms_eps"), py::arg("rope_theta"),
      py::arg("tie_word_embeddings"), py::arg("max_ctx"), py::arg("weights") = "f32",
      py::arg("kv") = "f32", py::arg("slots") = 1, py::arg("family") = py::dict(),
      "A CPU session of `slots` sequences holding its weight matrices in `weights` ('f32', "
      "'bf16', 'f16', 'int8') and its KV cache in `kv` ('f32', 'bf16', 'f16'); weights are set "
      "afterwards with set_weight.");

  algenta::residentk::def_flat_shape(
      s, "tensor_table", &tensor_table, py::arg("tie_word_embeddings"),
      py::arg("family") = py::dict(),
      "(name, shape, layer, field) of every tensor a session with this config holds, in "
      "checkpoint order: the engines' own table.");

  s.def(
      "decode_stages",
      [](int64_t n_layers, const py::dict& family) {
        SessionConfig c;
        c.n_layers = n_layers;
        algenta::residentk::apply_family(c, family);
        return algenta::residentk::decode_stages(c);
      },
      py::arg("n_layers"), py::arg("family") = py::dict(),
      "Decode stages (dispatches) per token of a session of this family: n_layers * 6 + 3 for "
      "Qwen3, 8 per layer for the families with sandwich norms.");

  {
    py::list archs;
    for (const auto& a : algenta::residentk::arch_specs())
      archs.append(py::dict(
          "name"_a = a.name, "hf_class"_a = a.hf_class, "qk_norm"_a = a.qk_norm,
          "qkv_bias"_a = a.qkv_bias, "norm_plus_one"_a = a.norm_plus_one,
          "embed_scaled"_a = a.embed_scaled, "sandwich"_a = a.sandwich,
          "act"_a = a.act == algenta::residentk::Act::Silu ? "silu" : "gelu_pytorch_tanh",
          "mlp_norm"_a = a.mlp_norm));
    s.attr("ARCHS") = archs;
  }

  s.def(
      "greedy_argmax",
      [](const F32& logits) {
        if (logits.ndim() != 1 || logits.size() < 1)
          refuse(algenta::residentk::RESIDENT_ERR_EMPTY_DIMENSION,
                 "greedy_argmax takes a non-empty 1-D array");
        return algenta::residentk::greedy_argmax(logits.data(), logits.size());
      },
      py::arg("logits"), "The engines' greedy pick: numpy.argmax's order (first NaN wins).");

  s.def(
      "cpu_weight_paths",
      [] {
        py::dict d;
        for (algenta::Dtype f : algenta::residentk::kWeightFormats)
          d[algenta::dtype_name(f)] = algenta::residentk::cpu_weight_path(f);
        return d;
      },
      "What multiplies the CPU session's weights in each format on the active instruction set.");

  s.def("cpu_read_bandwidth", &algenta::residentk::cpu_read_bandwidth, py::arg("bytes"),
        py::arg("reps") = 5, py::call_guard<py::gil_scoped_release>(),
        "Best all-core streaming read bandwidth (bytes/s) over reps passes of a bytes-sized "
        "buffer.");

  s.def(
      "cpu_int8_products",
      [](py::array_t<int8_t, py::array::c_style | py::array::forcecast> q, F32 sc, F32 x) {
        using algenta::Family;
        using algenta::StatusError;
        namespace rk = algenta::residentk;
        if (q.ndim() != 2 || x.ndim() != 1 || sc.ndim() != 2)
          throw StatusError(Family::Resident, rk::RESIDENT_ERR_WEIGHT_LENGTH,
                            "cpu_int8_products: q (rows, n), scales (rows, blocks), x (n)");
        const int64_t rows = q.shape(0), n = q.shape(1);
        const int64_t blocks = (n + rk::RESIDENT_INT8_BLOCK - 1) / rk::RESIDENT_INT8_BLOCK;
        if (x.shape(0) != n || sc.shape(0) != rows || sc.shape(1) != blocks || n < 1)
          throw StatusError(Family::Resident, rk::RESIDENT_ERR_WEIGHT_LENGTH,
                            "cpu_int8_products: shapes do not agree (x must have q's columns, "
                            "scales ceil(n / 32) per row)");
        py::array_t<float> y(rows);
        py::array_t<int8_t> xq(n);
        py::array_t<float> xs(blocks);
        rk::cpu_int8_products(q.data(), sc.data(), rows, n, x.data(), y.mutable_data(),
                              xq.mutable_data(), xs.mutable_data());
        return py::make_tuple(y, xq, xs);
      },
      py::arg("q"), py::arg("scales"), py::arg("x"),
      "Test hook: the int8 decode product of the active ISA -> (y, x's int8 values, x's block "
      "scales).");

  s.def(
      "cpu_int8_gemm",
      [](py::array_t<int8_t, py::array::c_style | py::array::forcecast> q, F32 sc,
         F32 X) {
        using algenta::Family;
        using algenta::StatusError;
        namespace rk = algenta::residentk;
        if (q.ndim() != 2 || X.ndim() != 2 || sc.ndim() != 2 || q.shape(1) < 1 ||
            X.shape(1) != q.shape(1) || sc.shape(0) != q.shape(0) ||
            sc.shape(1) != (q.shape(1) + rk::RESIDENT_INT8_BLOCK - 1) / rk::RESIDENT_INT8_BLOCK)
          throw StatusError(Family::Resident, rk::RESIDENT_ERR_WEIGHT_LENGTH,
                            "cpu_int8_gemm: q (rows, n), scales (rows, ceil(n / 32)), X (M, n)");
        const int64_t rows = q.shape(0), n = q.shape(1), M = X.shape(0);
        py::array_t<float> Y({M, rows});
        rk::cpu_int8_gemm(q.data(), sc.data(), rows, n, X.data(), M, Y.mutable_data());
        return Y;
      },
      py::arg("q"), py::arg("scales"), py::arg("X"),
      "Test hook: the int8 prefill GEMM of the active ISA.");

  s.def(
      "cpu_q4_gemm",
      [](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> codes, F32 sc, F32 X) {
        namespace rk = algenta::residentk;
        const int64_t blocks = codes.ndim() == 2 ? (codes.shape(1) + 31) / 32 : 0;
        if (codes.ndim() != 2 || X.ndim() != 2 || sc.ndim() != 2 || codes.shape(1) < 1 ||
            X.shape(1) != codes.shape(1) || sc.shape(0) != codes.shape(0) ||
            sc.shape(1) != blocks)
          refuse(rk::RESIDENT_ERR_WEIGHT_LENGTH,
                 "cpu_q4_gemm: codes (rows, n), scales (rows, ceil(n / 32)), X (M, n)");
        const uint8_t* c = codes.data();
        for (py::ssize_t i = 0; i < codes.size(); ++i)
          if (c[i] > 15) refuse(rk::RESIDENT_ERR_WEIGHT_LENGTH, "cpu_q4_gemm: codes are 0..15");
        const int64_t rows = codes.shape(0), n = codes.shape(1), M = X.shape(0);
        py::array_t<float> Y({M, rows});
        rk::cpu_q4_gemm(c, sc.data(), rows, n, X.data(), M, Y.mutable_data());
        return Y;
      },
      py::arg("codes"), py::arg("scales"), py::arg("X"),
      "Test hook: the Q4_0 GEMM of the active ISA (M == 1: a decode step's product).");

  s.def(
      "cpu_gate",
      [](F32 g, F32 u, bool gelu) {
        namespace rk = algenta::residentk;
        if (g.ndim() != 1 || u.ndim() != 1 || g.shape(0) != u.shape(0))
          throw algenta::StatusError(algenta::Family::Resident, rk::RESIDENT_ERR_WEIGHT_LENGTH,
                                     "cpu_gate: g (n) and u (n)");
        py::array_t<float> out(g.shape(0));
        rk::cpu_gate(gelu, g.data(), u.data(), g.shape(0), out.mutable_data());
        return out;
      },
      py::arg("g"), py::arg("u"), py::arg("gelu") = false,
      "Test hook: the MLP gate of the active ISA, silu(g) * u (gelu_tanh(g) * u with gelu).");
  s.def(
      "cpu_sum_sq",
      [](F32 x) {
        if (x.ndim() != 1)
          throw algenta::StatusError(algenta::Family::Resident,
                                     algenta::residentk::RESIDENT_ERR_WEIGHT_LENGTH,
                                     "cpu_sum_sq: x (n)");
        return algenta::residentk::cpu_sum_sq(x.data(), x.shape(0));
      },
      py::arg("x"), "Test hook: RMSNorm's sum of squares in double, as the active ISA sums it.");

  s.def(
      "cpu_bf16_products",
      [](py::array_t<uint16_t, py::array::c_style | py::array::forcecast> w, F32 x) {
        using algenta::Family;
        using algenta::StatusError;
        namespace rk = algenta::residentk;
        if (w.ndim() != 2 || x.ndim() != 1 || x.shape(0) != w.shape(1) || w.shape(1) < 1)
          throw StatusError(Family::Resident, rk::RESIDENT_ERR_WEIGHT_LENGTH,
                            "cpu_bf16_products: w (rows, n) bf16 bits and x (n)");
        const int64_t rows = w.shape(0), n = w.shape(1);
        py::array_t<float> y(rows);
        py::array_t<uint16_t> xb(n);
        rk::cpu_bf16_products(w.data(), rows, n, x.data(), y.mutable_data(), xb.mutable_data());
        return py::make_tuple(y, xb);
      },
      py::arg("w"), py::arg("x"),
      "Test hook: the bf16 decode product of the active ISA -> (y, x's bf16 bits).");

  s.def(
      "cpu_panel_products",
      [](const py::array& w, F32 X, const std::string& weights, bool packed) {
        namespace rk = algenta::residentk;
        static constexpr Dtype kFormats[] = {Dtype::F32, Dtype::BF16, Dtype::F16};
        const Dtype f = dtype_arg(weights, kFormats, "weights");
        if (w.ndim() != 2 || X.ndim() != 2 || w.shape(1) < 1 || w.shape(0) < 1 ||
            X.shape(0) < 1 || X.shape(1) != w.shape(1))
          refuse(rk::RESIDENT_ERR_WEIGHT_LENGTH,
                 "cpu_panel_products: w (rows, n) and X (M, n), none of them empty");
        if (w.itemsize() != dtype_info(f).bytes || !(w.flags() & py::array::c_style))
          throw py::type_error("cpu_panel_products(weights='" + weights + "') needs a "
                               "C-contiguous w of " + std::to_string(dtype_info(f).bytes) +
                               "-byte elements");
        const int64_t rows = w.shape(0), n = w.shape(1), M = X.shape(0);
        py::array_t<float> Y({M, rows});
        const void* wp = w.data();
        const float* xp = X.data();
        float* yp = Y.mutable_data();
        {
          py::gil_scoped_release nogil;
          rk::cpu_panel_products(f, wp, rows, n, xp, M, yp, packed);
        }
        return Y;
      },
      py::arg("w"), py::arg("X"), py::arg("weights"), py::arg("packed") = true,
      "Test hook: X (M, n) times w (rows, n) in the session's f32, bf16 or f16 panels (bf16 and "
      "f16 as uint16 bits): M == 1 a decode step's product, M > 1 the prefill GEMM (X packed "
      "once, as prefill packs it) or, packed=False, a batched decode step's.");

  // cuda_backend, cuda_session, cuda_copy_bandwidth and the cuda_plan submodule
  // (bind_session_cuda.cpp): the CUDA backend where the build has one, its refusal otherwise.
  bind_session_cuda(s);
}

// pybind11 bindings of the CUDA backend's entry points (algenta._core.session.cuda_*), whichever
// build provides them (a device, the CPU emulator, or the 604 refusals), and of its host-side
// launch plan (algenta._core.session.cuda_plan), which every build compiles so the CPU test suite
// can check grid sizes, split counts, buffer sizes and offsets. Argument conversion and GIL
// release only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algenta/residentk.hpp"
#include "algenta/session.hpp"
#include "algenta/session_cuda_plan.hpp"
#include "session_args.hpp"

namespace py = pybind11;
using namespace pybind11::literals;
using algenta::residentk::ModelShape;
using algenta::residentk::Session;
using algenta::residentk::SessionConfig;
namespace cp = algenta::residentk::cudaplan;

namespace {

py::dict matvec_dict(const cp::MatvecLaunch& m) {
  return py::dict("rows"_a = m.rows, "rows_per_block"_a = m.rows_per_block, "grid"_a = m.grid,
                  "split"_a = m.split);
}

py::dict mat_dict(const cp::MatOffsets& m) {
  return py::dict("data"_a = m.data, "scales"_a = m.scales);
}

std::unique_ptr<Session> cuda_session(const ModelShape& m, double rms_eps, double rope_theta,
                                      bool tied, int64_t max_ctx, const std::string& weights,
                                      const std::string& kv, const py::dict& family,
                                      int64_t slots) {
  return algenta::residentk::open_session(algenta::residentk::make_cuda_session, m, rms_eps,
                                          rope_theta, tied, max_ctx, weights, kv, slots, family);
}

// Every buffer size, offset and launch shape of make_plan as a dict, or its refusal.
py::dict plan(const ModelShape& m, double rms_eps, double rope_theta, bool tied, int64_t max_ctx,
              int64_t sms, const std::string& weights, const std::string& kv, int64_t slots) {
  const SessionConfig c =
      algenta::residentk::session_config(m, rms_eps, rope_theta, tied, weights, kv);
  const cp::Plan pl = cp::make_plan(c, max_ctx, sms, slots);
  py::dict d("status"_a = pl.status, "why"_a = pl.why);
  if (pl.status != algenta::residentk::RESIDENT_OK) return d;
  const char* scalars[] = {"sms", "capacity", "q_rows", "attn_width", "elem_bytes",
                           "final_norm", "weight_bytes", "kv_elems", "kv_layer_stride",
                           "rope_floats", "x", "xf", "qkv", "attn", "act", "logits",
                           "part_acc", "part_ml", "argmax_val", "act_floats", "max_splits",
                           "prefill_rows", "p_x", "p_xn", "p_qkv", "p_attn", "p_gate",
                           "p_up", "prefill_floats", "staged_floats", "attn_smem_bytes",
                           "norm_rope_threads", "staged_bytes", "kv_elem_bytes", "q8_ld",
                           "p_q8_codes", "p_q8_scales", "slots", "kv_slot_stride",
                           "step_rows", "row_entries", "y"};
  const int64_t vals[] = {pl.sms, pl.capacity, pl.q_rows, pl.attn_width, pl.elem_bytes,
                          pl.final_norm, pl.weight_bytes, pl.kv_elems, pl.kv_layer_stride,
                          pl.rope_floats, pl.x, pl.xf, pl.qkv, pl.attn, pl.act, pl.logits,
                          pl.part_acc, pl.part_ml, pl.argmax_val, pl.act_floats,
                          pl.max_splits, pl.prefill_rows, pl.p_x, pl.p_xn, pl.p_qkv,
                          pl.p_attn, pl.p_gate, pl.p_up, pl.prefill_floats,
                          pl.staged_floats, pl.attn_smem_bytes, pl.norm_rope_threads,
                          pl.staged_bytes, pl.kv_elem_bytes, pl.q8_ld, pl.p_q8_codes,
                          pl.p_q8_scales, pl.slots, pl.kv_slot_stride, pl.step_rows,
                          pl.row_entries, pl.y};
  static_assert(sizeof(scalars) / sizeof(scalars[0]) == sizeof(vals) / sizeof(vals[0]),
                "every plan field named once");
  for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); ++i) d[scalars[i]] = vals[i];
  d["embed"] = mat_dict(pl.embed);
  d["head"] = mat_dict(pl.head);
  py::list layers;
  for (const cp::LayerOffsets& l : pl.layers)
    layers.append(py::dict("in_norm"_a = l.in_norm, "wqkv"_a = mat_dict(l.wqkv),
                           "q_norm"_a = l.q_norm, "k_norm"_a = l.k_norm, "wo"_a = mat_dict(l.wo),
                           "post_norm"_a = l.post_norm, "wg"_a = mat_dict(l.wg),
                           "wu"_a = mat_dict(l.wu), "wd"_a = mat_dict(l.wd)));
  d["layers"] = layers;
  for (const auto& mv : {std::make_pair("qkv_mv", &pl.qkv_mv), std::make_pair("o_mv", &pl.o_mv),
                         std::make_pair("gateup_mv", &pl.gateup_mv),
                         std::make_pair("down_mv", &pl.down_mv),
                         std::make_pair("head_mv", &pl.head_mv)})
    d[mv.first] = matvec_dict(*mv.second);
  py::list launches;  // decode_launches at n_keys = 1..capacity would be long; sample it
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(32), int64_t(1000), pl.capacity})
    launches.append(py::make_tuple(n, cp::decode_launches(pl, c, n)));
  d["decode_launches"] = launches;
  return d;
}

}  // namespace

void bind_session_cuda(py::module_& s) {
  s.def(
      "cuda_backend",
      [] {
        const algenta::residentk::CudaBackend& b = algenta::residentk::cuda_backend();
        return py::dict("kind"_a = b.kind, "usable"_a = b.usable, "device_name"_a = b.device_name,
                        "why"_a = b.why, "driver_version"_a = b.driver_version,
                        "runtime_version"_a = b.runtime_version);
      },
      "Which CUDA backend this build has ('device', 'emulator' or 'none'), whether it can run "
      "here, and why not.");

  algenta::residentk::def_flat_shape(
      s, "cuda_session", &cuda_session, py::arg("rms_eps"), py::arg("rope_theta"),
      py::arg("tie_word_embeddings"), py::arg("max_ctx"), py::arg("weights") = "f32",
      py::arg("kv") = "f32", py::arg("family") = py::dict(), py::arg("slots") = 1,
      "A CUDA session holding its weight matrices in `weights` and its KV cache in `kv` (the CPU "
      "session's formats), and `slots` sequences (604 without a CUDA backend, 605 without a "
      "usable device).");

  s.def("cuda_emulator_fail_after", &algenta::residentk::cuda_emulator_fail_after, py::arg("n"),
        "Test hook: on the CUDA emulator, the n-th next fallible CUDA call fails (0: off). "
        "False in any other build.");
  s.def("cuda_emulator_pdl_launches", &algenta::residentk::cuda_emulator_pdl_launches,
        "Test hook: programmatic dependent launches the CUDA emulator has run (-1 in any other "
        "build).");
  s.def("cuda_emulator_pdl_probe", &algenta::residentk::cuda_emulator_pdl_probe, py::arg("mode"),
        "Test hook: a PDL-launched probe kernel on the CUDA emulator that waits (0), reads before "
        "waiting (1) or never waits (2); the emulator aborts the process on 1 and 2. False in any "
        "other build.");
  s.def(
      "cuda_emulator_traffic",
      [](bool start) -> py::object {
        std::vector<algenta::residentk::KernelTraffic> ks;
        if (!algenta::residentk::cuda_emulator_traffic(start, &ks)) return py::none();
        if (start) return py::bool_(true);
        py::dict out;
        const char* keys[] = {"requests", "sectors", "ideal_sectors", "bytes"};
        for (const auto& k : ks) {
          py::dict load, store;
          for (int i = 0; i < 4; ++i) load[keys[i]] = k.load[i], store[keys[i]] = k.store[i];
          py::dict d;
          d["load"] = load;
          d["store"] = store;
          out[py::str(k.kernel)] = d;
        }
        return out;
      },
      py::arg("start"),
      "Measurement hook of the emulation build: start=True clears and starts counting global-"
      "memory traffic; start=False stops and returns {kernel: {'load': {...}, 'store': {...}}} "
      "(warp instructions, 32-byte sectors touched, ideal sectors, bytes needed). None in any "
      "other build.");

  s.def("cuda_copy_bandwidth", &algenta::residentk::cuda_copy_bandwidth, py::arg("bytes"),
        py::arg("reps") = 10, py::call_guard<py::gil_scoped_release>(),
        "Best device-to-device copy bandwidth (bytes/s, read + write) of the current CUDA "
        "device.");

  py::module_ p = s.def_submodule("cuda_plan", "host-side launch plan of the CUDA session");
  {
    using namespace cp;
    algenta::residentk::set_constants(
        p, {ALGENTA_CONSTANT(MATVEC_THREADS), ALGENTA_CONSTANT(MATVEC_LOADS),
            ALGENTA_CONSTANT(MATVEC_WARPS), ALGENTA_CONSTANT(MATVEC_BLOCKS_PER_SM),
            ALGENTA_CONSTANT(ATTN_THREADS), ALGENTA_CONSTANT(ATTN_WARPS),
            ALGENTA_CONSTANT(ALIGN_FLOATS), ALGENTA_CONSTANT(ALIGN_BYTES),
            ALGENTA_CONSTANT(PREFILL_BLOCK), ALGENTA_CONSTANT(GEMM_BM), ALGENTA_CONSTANT(GEMM_BN),
            ALGENTA_CONSTANT(FALLBACK_SMS)});
  }

  p.def("matvec_launch",
        [](int64_t rows, int64_t sms) { return matvec_dict(cp::matvec_launch(rows, sms)); },
        py::arg("rows"), py::arg("sms"));
  p.def(
      "decode_matvec_launch",
      [](int64_t rows, int64_t K, const std::string& weights, int64_t sms) {
        return matvec_dict(cp::decode_matvec_launch(
            rows, K, algenta::residentk::weight_format(weights), sms));
      },
      py::arg("rows"), py::arg("K"), py::arg("weights"), py::arg("sms"));
  p.def(
      "matvec_min_slice",
      [](const std::string& weights) {
        return cp::matvec_min_slice(algenta::residentk::weight_format(weights));
      },
      py::arg("weights"));
  p.def(
      "stage_stride",
      [](int64_t K, const std::string& weights) {
        return cp::stage_stride(K, algenta::residentk::weight_format(weights));
      },
      py::arg("K"), py::arg("weights"));
  p.def("matvec_pass_rows", &cp::matvec_pass_rows, py::arg("stride"), py::arg("optin_bytes"));
  p.def("splitk_plan",
        [](int64_t n_keys, int64_t sms, int64_t h_q) {
          const cp::SplitPlan sp = cp::splitk_plan(n_keys, sms, h_q);
          return py::dict("split"_a = sp.split, "n_splits"_a = sp.n_splits,
                          "launches"_a = sp.launches);
        },
        py::arg("n_keys"), py::arg("sms"), py::arg("h_q"));
  p.def("splitk_range",
        [](int64_t n, int64_t S, int64_t s) {
          int64_t k0 = 0, k1 = 0;
          cp::splitk_range(n, S, s, &k0, &k1);
          return py::make_tuple(k0, k1);
        },
        py::arg("n_keys"), py::arg("n_splits"), py::arg("split"));
  p.def("prefill_gemm_grid",
        [](int64_t m, int64_t n, int64_t sms) {
          const cp::GemmGrid g = cp::prefill_gemm_grid(m, n, sms);
          return py::dict("narrow"_a = g.narrow, "gx"_a = g.gx, "gy"_a = g.gy,
                          "rows_per_block"_a = g.rows_per_block);
        },
        py::arg("m_rows"), py::arg("n_cols"), py::arg("sms"));
  algenta::residentk::def_flat_shape(
      p, "make_plan", &plan, py::arg("rms_eps"), py::arg("rope_theta"),
      py::arg("tie_word_embeddings"), py::arg("max_ctx"), py::arg("sms"),
      py::arg("weights") = "f32", py::arg("kv") = "f32", py::arg("slots") = 1,
      "Every buffer size, offset and launch shape the CUDA session would use (a dict), or the "
      "contract's refusal (status, why).");
}

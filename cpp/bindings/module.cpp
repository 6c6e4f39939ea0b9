// algenta._core: argument conversion and nothing else. Each family binds itself in its own file.
#include <pybind11/pybind11.h>

#include "algenta/dtype.hpp"
#include "algenta/kernels.hpp"
#include "algenta/status_error.hpp"

namespace py = pybind11;

void bind_lossk(py::module_& m);
void bind_residentk(py::module_& m);
void bind_session(py::module_& m);

PYBIND11_MODULE(_core, m) {
  m.doc() = "algenta's C++/OpenMP core (private: use the algenta package)";
  m.attr("__version__") = ALGENTA_VERSION;

  // StatusError -> algenta.errors.<family error>(message, status). Imported lazily, at the first
  // refusal, so importing _core stays free of Python-level dependencies.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const algenta::StatusError& e) {
      py::gil_scoped_acquire gil;
      py::object errors = py::module_::import("algenta.errors");
      py::object exc = errors.attr("from_status")(
          e.family == algenta::Family::Loss ? "lossk" : "residentk", e.status, e.what());
      PyErr_SetObject(py::type::handle_of(exc).ptr(), exc.ptr());
    }
  });

  m.def("isa_name", [] { return std::string(algenta::kern::isa_name()); },
        "Instruction set of the active CPU kernels (or why ALGENTA_ISA was refused).");
  m.def("isa_names", [] { return std::string(algenta::kern::isa_names()); },
        "The instruction sets compiled in, best first, comma-separated (ALGENTA_ISA's names).");
  m.def("isa_note", [] { return std::string(algenta::kern::isa_note()); },
        "Why a better instruction set the CPU reports was passed over (AMX's tile state "
        "refused by the kernel), or '' when none was.");
  m.def("bf16_path", [] {
        const auto& dp = algenta::kern::ops<float>().bf16dot;
        return std::string(dp.gemm_papb ? dp.path : "widen");
      },
        "How lossk multiplies bfloat16 inputs on this host: 'amx' (AMX tiles) or 'vdpbf16ps' "
        "(bf16 dot products; both round d_logits to bf16 for the gradient products) or 'widen' "
        "(to float32, FMA).");

  // The one dtype vocabulary (dtype.hpp): (name, long name, bytes per element or block, values
  // per block), in enum order.
  py::tuple dtypes(algenta::kNumDtypes);
  for (int i = 0; i < algenta::kNumDtypes; ++i) {
    const algenta::DtypeInfo& d = algenta::kDtypes[i];
    dtypes[i] = py::make_tuple(d.name, d.long_name, d.bytes, d.block);
  }
  m.attr("DTYPES") = dtypes;

  bind_lossk(m);
  bind_residentk(m);
  bind_session(m);
}

// pybind11 bindings of the residentk family (filled in by the residentk contract work).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_residentk(py::module_& m) { m.def_submodule("residentk", "residentk contract and probe"); }

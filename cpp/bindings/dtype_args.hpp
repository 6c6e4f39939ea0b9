// A dtype name passed by the Python layer -> Dtype, for an argument that takes only some of the
// vocabulary (dtype.hpp); any other name is a TypeError listing the ones it takes (these names
// come from algenta's own Python code, never from a user's free text).
#pragma once
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>

#include "algenta/dtype.hpp"

namespace algenta {

template <std::size_t N>
Dtype dtype_arg(const std::string& name, const Dtype (&allowed)[N], const char* what) {
  for (Dtype d : allowed)
    if (name == dtype_name(d)) return d;
  std::string known;
  for (std::size_t i = 0; i < N; ++i)
    known += std::string(i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + dtype_name(allowed[i]) + "'";
  throw pybind11::type_error(std::string(what) + " must be " + known + ", got '" + name + "'");
}

}  // namespace algenta

// A dtype name passed by the Python layer -> Dtype, for an argument that takes only some of the
// vocabulary (dtype.hpp): the one lookup of a name within a set, and the one spelling of a set
// in a message, for every binding (session_args.hpp's format names refuse with their own code).
// dtype_arg refuses any other name as a TypeError listing the ones it takes (these names come
// from algenta's own Python code, never from a user's free text).
#pragma once
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>

#include "algenta/dtype.hpp"

namespace algenta {

// The Dtype of `allowed` that `name` spells; false when it spells none of them.
template <std::size_t N>
bool dtype_in(const std::string& name, const Dtype (&allowed)[N], Dtype* out) {
  for (Dtype d : allowed)
    if (name == dtype_name(d)) {
      *out = d;
      return true;
    }
  return false;
}

// "'f32', 'bf16' or 'f16'"
template <std::size_t N>
std::string dtype_names(const Dtype (&allowed)[N]) {
  std::string known;
  for (std::size_t i = 0; i < N; ++i)
    known += std::string(i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + dtype_name(allowed[i]) +
             "'";
  return known;
}

template <std::size_t N>
Dtype dtype_arg(const std::string& name, const Dtype (&allowed)[N], const char* what) {
  Dtype d;
  if (dtype_in(name, allowed, &d)) return d;
  throw pybind11::type_error(std::string(what) + " must be " + dtype_names(allowed) + ", got '" +
                             name + "'");
}

}  // namespace algenta

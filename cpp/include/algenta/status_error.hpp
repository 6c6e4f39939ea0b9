// The one exception type the core and the bindings throw for a refused request. The module
// translates it to the Python exception of its family (algenta.errors), carrying the code.
#pragma once
#include <stdexcept>
#include <string>

namespace algenta {

enum class Family { Loss, Resident };

struct StatusError : std::runtime_error {
  Family family;
  int status;
  StatusError(Family f, int code, const std::string& msg)
      : std::runtime_error(msg), family(f), status(code) {}
};

}  // namespace algenta

"""residentk.probe: could a resident session run here, and what would it cost.

Three facts, none of which needs a GPU to ask:

- :func:`resident_gpu_kernels_compiled`: a build fact, true only in a build configured with
  ``-Ccmake.define.ALGENTA_GPU=ON``; the same on every host the binary is copied to.
- :func:`resident_available`: a host fact on top of it: the kernels are compiled AND the current
  CUDA device can run them. Any CUDA error (no driver, no device, a device older than the
  compiled architectures) reads as "no device"; it never raises.
- :func:`resident_session_probe`: both combined with :mod:`algenta.residentk.contract`'s
  arithmetic for one model shape.
"""

from __future__ import annotations

from .. import _core
from .._records import record_type
from .contract import _model

_c = _core.residentk

ResidentProbe = record_type(
    "ResidentProbe",
    ("kernels_compiled", "device_present", "session_possible", "dispatch_budget",
     "resident_f32_elems", "status"),
    """The full answer of :func:`resident_session_probe` for one model shape.

    ``kernels_compiled`` (build fact), ``device_present`` (a usable CUDA device; not asked, so
    False, when the shape is refused), ``session_possible`` (``status == 600``),
    ``dispatch_budget`` (dispatches per decode token, ``n_layers * 6 + 3``),
    ``resident_f32_elems`` (weights plus the KV cache at 512 positions; 0 for a refused shape),
    ``status``.""",
)
ResidentProbe.__module__ = __name__  # so records pickle by reference to this module


def resident_gpu_kernels_compiled() -> bool:
    """True when this binary was built with ``ALGENTA_GPU=ON`` (CUDA kernels compiled in)."""
    return bool(_c.resident_gpu_kernels_compiled())


def resident_available() -> bool:
    """True when a resident session can open here: kernels compiled and a usable CUDA device.
    Asked of the CUDA runtime once per process (its initialization result is fixed for the
    process anyway); any CUDA error reads as False."""
    return bool(_c.resident_available())


def resident_session_probe(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab) -> ResidentProbe:
    """Shape support, cost and whether a session could run here, as one :class:`ResidentProbe`.

    Status order: a shape refusal (601-603) first, on every build and host, without asking the
    device; then 604 (built without GPU kernels), 605 (kernels but no usable device), else 600.

    >>> resident_session_probe(1024, 16, 8, 128, 3072, 28, 151936)   # default (CPU) build
    {'kernels_compiled': False, 'device_present': False, 'session_possible': False, 'dispatch_budget': 171, 'resident_f32_elems': 625410048, 'status': 604}
    """
    r = _c.resident_session_probe(*_model(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab))
    return ResidentProbe(
        kernels_compiled=bool(r["kernels_compiled"]), device_present=bool(r["device_present"]),
        session_possible=bool(r["session_possible"]), dispatch_budget=int(r["dispatch_budget"]),
        resident_f32_elems=int(r["resident_f32_elems"]), status=int(r["status"]),
    )


__all__ = ["ResidentProbe", "resident_gpu_kernels_compiled", "resident_available",
           "resident_session_probe"]

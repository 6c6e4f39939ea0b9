"""algenta: capacity questions answered before expensive work runs, and that work done fast.

- ``algenta.lossk``: exact, chunked cross-entropy (and distillation) fused with the output
  projection.
- ``algenta.residentk``: resident GPU decode sessions, sized by host arithmetic.
- ``algenta.Runtime``: the seed's ``execute(module, function, args)`` dispatcher.
- ``algenta.torch``: PyTorch autograd ops (imported only when used; torch is optional).
"""

from __future__ import annotations

from . import _core
from .errors import (AlgentaError, LossError, LossUnavailableError, ResidentError,
                     ResidentUnavailableError)
from . import lossk, residentk
from .lossk.cross_entropy import linear_cross_entropy
from .lossk.distillation import linear_distillation
from .runtime import MojoRuntime, Runtime

__version__ = _core.__version__

__all__ = [
    "__version__", "AlgentaError", "LossError", "LossUnavailableError", "ResidentError",
    "ResidentUnavailableError",
    "lossk", "residentk", "linear_cross_entropy", "linear_distillation", "Runtime", "MojoRuntime",
]


def __getattr__(name):
    # `algenta.torch` imports torch: only on first access, so `import algenta` never does.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'algenta' has no attribute {name!r}")

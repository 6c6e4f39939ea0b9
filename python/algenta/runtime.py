"""The seed's dispatcher: ``Runtime(mode="local").execute(module, function, args)``.

A thin layer over ``algenta.<module>.<function>(*args)``. It returns
``{"result": <plain Python data>, "status": code}``; a status-carrying refusal returns
``{"result": None, "status": code, "error": message}`` instead of raising. The status of a
successful call is the record's own ``status`` when the result has one, else the family's ok
code (580 lossk, 600 residentk). An unknown module or function raises ``ValueError``; wrong
argument types raise ``TypeError`` as the function itself would.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import numpy as np

from .errors import AlgentaError

_MODULES = {
    "lossk.contract": ("algenta.lossk.contract", 580),
    "lossk.cross_entropy": ("algenta.lossk.cross_entropy", 580),
    "residentk.contract": ("algenta.residentk.contract", 600),
    "residentk.probe": ("algenta.residentk.probe", 600),
}


def to_plain(value):
    """Records, dicts, NumPy arrays and scalars -> plain Python data."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


class Runtime:
    """Dispatches ``execute(module, function, args)`` to algenta's Python API."""

    def __init__(self, mode: str = "local"):
        if mode != "local":
            raise ValueError(f"unsupported runtime mode {mode!r}: only 'local' exists")
        self.mode = mode

    @staticmethod
    def modules() -> list:
        return sorted(_MODULES)

    def _resolve(self, module: str, function: str):
        if module not in _MODULES:
            raise ValueError(f"unknown module {module!r}; known: {', '.join(sorted(_MODULES))}")
        path, ok = _MODULES[module]
        mod = importlib.import_module(path)
        public = getattr(mod, "__all__", ())
        if function not in public or not callable(getattr(mod, function, None)):
            raise ValueError(f"unknown function {function!r} in {module}; known: {', '.join(sorted(n for n in public if callable(getattr(mod, n))))}")
        return getattr(mod, function), ok

    def execute(self, module: str, function: str, args=()) -> dict:
        fn, ok = self._resolve(module, function)
        try:
            result = fn(*list(args))
        except AlgentaError as e:
            return {"result": None, "status": e.status, "error": str(e)}
        status = result.get("status", ok) if isinstance(result, Mapping) else ok
        return {"result": to_plain(result), "status": status}


MojoRuntime = Runtime

"""Argument conversion shared by the Python layer: types first, then lengths, then arrays.

Lengths are checked on the caller's object before it is converted, so a short list is refused
(582 / 607) without copying it.
"""

from __future__ import annotations

import numbers
import operator

import numpy as np


def as_int(value, name: str) -> int:
    """An integer argument: Python or NumPy integers, never bool or float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    return operator.index(value)


I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def as_i64_clamped(value, name: str) -> int:
    """An integer argument for a pure check: a Python int beyond int64 is clamped to the int64
    end it lies past, which every check treats exactly like the out-of-range value it stands
    for (refused, never wrapped)."""
    return min(max(as_int(value, name), I64_MIN), I64_MAX)


def as_float(value, name: str) -> float:
    """A real scalar argument (int or float, never bool or str)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def length_of(x, name: str) -> int:
    if isinstance(x, np.ndarray):
        return int(x.size)
    if isinstance(x, (list, tuple)):
        return len(x)
    if hasattr(x, "__array__"):
        return int(_asarray(x, name).size)
    raise TypeError(f"{name} must be a list, tuple or NumPy array, got {type(x).__name__}")


def _asarray(x, name: str) -> np.ndarray:
    # NumPy refuses a ragged nest of lists with a bare ValueError; that is a wrong argument
    # type (not a flat sequence of numbers), not a refused value, so it is a TypeError here.
    try:
        return np.asarray(x)
    except ValueError as e:
        raise TypeError(f"{name} must be a flat sequence of numbers ({e})") from None


def float_array(x, name: str, dtype=np.float64) -> np.ndarray:
    """A flat, C-contiguous float array (a copy only where needed). Only real numbers: complex
    data would lose its imaginary part and bool/object/string/datetime data is no number."""
    arr = _asarray(x, name)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype).reshape(-1)


def int_array(x, name: str, *, error) -> np.ndarray:
    """A flat int64 target array. Non-integer data is a TypeError; a value beyond int64 is
    refused through `error(message)` (a status-carrying exception from the caller's family)."""
    arr = _asarray(x, name)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise error(f"{name} holds a value beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)

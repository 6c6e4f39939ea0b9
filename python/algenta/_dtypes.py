"""The one dtype vocabulary on the Python side, read from the core's table
(``algenta._core.DTYPES``, cpp/include/algenta/dtype.hpp): the short names every API takes
("f32", "f64", "bf16", "f16", "int8"), NumPy's and PyTorch's long names, and the one wrapper for
16-bit data NumPy cannot name (bfloat16) or that crosses the core as bit patterns."""

from __future__ import annotations

import numpy as np

from . import _core

#: short name -> (long name, bytes per element), in the core's order; llama.cpp's block types
#: (GGUF sources only) are in BLOCKS instead
DTYPES = {name: (long_name, nbytes) for name, long_name, nbytes, block in _core.DTYPES
          if block == 1}
#: ggml block type short name ("q8_0", ...) -> (GGUF name, bytes per block, values per block)
BLOCKS = {name: (long_name, nbytes, block) for name, long_name, nbytes, block in _core.DTYPES
          if block > 1}
#: long name ("float32", "bfloat16", ...) -> short name
SHORT = {long_name: name for name, (long_name, _) in DTYPES.items()}


class HalfBits:
    """A bfloat16 or float16 array given by its 16-bit patterns (a uint16 or int16 array): how
    bfloat16 data reaches the core without ``ml_dtypes`` (a checkpoint's BF16 tensors, lossk's
    inputs), and how ``algenta.torch`` hands over half tensors without a copy. Gradients of HalfBits
    inputs come back as HalfBits."""

    __slots__ = ("bits", "dtype")

    def __init__(self, bits, dtype: str):
        if dtype not in ("bfloat16", "float16"):
            raise TypeError(f"HalfBits dtype must be 'bfloat16' or 'float16', got {dtype!r}")
        b = np.asarray(bits)
        if b.dtype not in (np.uint16, np.int16):
            raise TypeError(f"{type(self).__name__} holds 16-bit patterns, got dtype {b.dtype}")
        self.bits, self.dtype = b, dtype

    shape = property(lambda self: self.bits.shape)
    ndim = property(lambda self: self.bits.ndim)

    @property
    def name(self) -> str:
        """The core's short name: "bf16" or "f16"."""
        return SHORT[self.dtype]

    def __repr__(self):
        return f"HalfBits(shape={self.shape}, dtype={self.dtype!r})"


def Bf16Bits(bits) -> HalfBits:
    """A bfloat16 tensor as its uint16 bit patterns (what safetensors stores for BF16)."""
    return HalfBits(bits, "bfloat16")


def short_name(a) -> str | None:
    """The core's short name of an array's elements (HalfBits, NumPy, ``ml_dtypes.bfloat16``),
    or None for a dtype outside the vocabulary."""
    if isinstance(a, HalfBits):
        return a.name
    n = (a if isinstance(a, np.ndarray) else np.asarray(a)).dtype.name
    return SHORT.get(n) if n != "int8" else None  # int8 is a block format, not an array dtype


def torch_short_name(dtype) -> str | None:
    """The core's short name of a ``torch.dtype`` (torch.bfloat16 -> "bf16"), or None."""
    n = str(dtype).removeprefix("torch.")
    return SHORT.get(n) if n != "int8" else None


__all__ = ["DTYPES", "BLOCKS", "SHORT", "HalfBits", "Bf16Bits", "short_name", "torch_short_name"]

"""The tensors of a resident Qwen3 session: the engines' own table of names and shapes, a
reproducible random model, and the conversion of a tensor on its way into an engine.

A tensor reaches an engine as its stored elements, float32, float16 or bfloat16, and the engine
widens it to float32 itself (exactly: every half and bfloat16 value is a float32), straight into
its resident buffer, checking each value is finite. So a memory-mapped checkpoint tensor is
never copied on the host. NumPy has no bfloat16: a bf16 tensor arrives as :class:`Bf16Bits`
(its uint16 bit patterns), as a torch ``bfloat16`` tensor, or as an ``ml_dtypes.bfloat16`` array.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import _core
from .config import make_config


class Bf16Bits:
    """A bfloat16 tensor as its uint16 bit patterns (what safetensors stores for BF16)."""

    __slots__ = ("bits",)

    def __init__(self, bits):
        b = np.asarray(bits)
        if b.dtype not in (np.uint16, np.int16):
            raise TypeError(f"Bf16Bits holds 16-bit patterns, got dtype {b.dtype}")
        self.bits = b

    @property
    def shape(self):
        return self.bits.shape


def tensor_table(config) -> list:
    """(name, shape, layer, field) of every tensor a session with this config holds, in a
    checkpoint's order: the table the engines themselves check against."""
    c = make_config(config)
    return _core.session.tensor_table(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers,
                                      c.vocab, c.tie_word_embeddings)


def expected_shapes(config) -> dict:
    """HF tensor name -> shape of every tensor a session with this config holds. Lets a loader
    compare a checkpoint with its config before the session allocates anything."""
    return {name: tuple(shape) for name, shape, _, _ in tensor_table(config)}


def random_weights(config, seed: int = 0) -> Iterator:
    """(HF name, float32 array) pairs of a reproducible random Qwen3 model, one tensor at a time
    (so a multi-GB benchmark model is never held twice). Projections are N(0, 1/fan_in), the
    embedding N(0, 1), norm weights 1 + N(0, 0.01): activations stay O(1) at any depth."""
    rng = np.random.default_rng(seed)
    for name, shape, _, field in tensor_table(config):
        if field == "embed":
            yield name, rng.standard_normal(shape, dtype=np.float32)
        elif len(shape) == 1:
            yield name, (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= np.float32(1.0 / math.sqrt(shape[1]))
            yield name, a


def engine_tensor(x) -> tuple:
    """(C-contiguous ndarray, source) for Session.set_weight: source 'f32', 'f16' or 'bf16'
    (uint16 bit patterns). float32, float16 and bfloat16 data go through unconverted; other real
    data (float64, integers) is cast to float32. torch tensors of any device are accepted."""
    if isinstance(x, Bf16Bits):
        return np.ascontiguousarray(x.bits).view(np.uint16), "bf16"
    if hasattr(x, "detach") and hasattr(x, "dtype") and hasattr(x, "cpu"):  # a torch tensor
        import torch

        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype not in (torch.float32, torch.float16):
            t = t.float()
        x = t.numpy()
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":  # ml_dtypes
        return np.ascontiguousarray(a).view(np.uint16), "bf16"
    if a.dtype == np.float32:
        return np.ascontiguousarray(a), "f32"
    if a.dtype == np.float16:
        return np.ascontiguousarray(a), "f16"
    if a.dtype.kind not in "fiu":
        raise TypeError(f"weights must hold real numbers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32), "f32"


__all__ = ["Bf16Bits", "tensor_table", "expected_shapes", "random_weights", "engine_tensor"]

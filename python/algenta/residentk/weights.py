"""The tensors of a resident session: the engines' own table of names and shapes (one per model
family, built by the session core), a reproducible random model, the bytes a family holds
beyond Qwen3's table, and the conversion of a tensor on its way into an engine.

A tensor reaches an engine as its stored elements, float32, float16 or bfloat16, and the engine
widens it to float32 itself (exactly: every half and bfloat16 value is a float32), straight into
its resident buffer, checking each value is finite. So a memory-mapped checkpoint tensor is
never copied on the host. NumPy has no bfloat16: a bf16 tensor arrives as
:class:`~algenta._dtypes.HalfBits` (its uint16 bit patterns; ``Bf16Bits(bits)`` makes one), as a
torch ``bfloat16`` tensor, or as an ``ml_dtypes.bfloat16`` array.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import _core
from .._dtypes import Bf16Bits, HalfBits
from .config import ARCHS, make_config


def tensor_table(config) -> list:
    """(name, shape, layer, field) of every tensor a session with this config holds, in a
    checkpoint's order: the table the engines themselves check against."""
    c = make_config(config)
    return _core.session.tensor_table(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers,
                                      c.vocab, c.tie_word_embeddings, family=dict(c.family))


# Fields of the vectors a family may add, by the footprint term they count in; the column-split
# ones (q, k, v, gate, up biases: one per output row) shrink with tensor parallelism, the norms
# and the o/down biases are replicated on every GPU.
_TERM_OF = {"q_bias": "attn", "k_bias": "attn", "v_bias": "attn", "o_bias": "attn",
            "gate_bias": "mlp", "up_bias": "mlp", "down_bias": "mlp"}
_SPLIT = {"q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"}


def family_vector_elems(config, tp: int = 1) -> dict:
    """Float32 elements per footprint term (``attn``, ``mlp``, ``norms``) that this config's
    family holds beyond a Qwen3 table of the same sizes, per GPU at ``tp``: biases (attn, mlp),
    the sandwich norms (norms), minus q_norm and k_norm where the family has none. Read off the
    two tensor tables, so planning counts exactly what the engines hold. Every matrix is the
    same in every family; only these float32 vectors differ."""
    c = make_config(config)
    out = dict.fromkeys(("attn", "mlp", "norms"), 0)
    for sign, fam in ((1, dict(c.family)), (-1, {})):
        table = _core.session.tensor_table(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff,
                                           c.n_layers, c.vocab, c.tie_word_embeddings,
                                           family=fam)
        for _, shape, _, field in table:
            if len(shape) != 1:
                continue
            n = shape[0] // tp if field in _SPLIT else shape[0]
            out[_TERM_OF.get(field, "norms")] += sign * n
    return out


def expected_shapes(config) -> dict:
    """HF tensor name -> shape of every tensor a session with this config holds. Lets a loader
    compare a checkpoint with its config before the session allocates anything."""
    return {name: tuple(shape) for name, shape, _, _ in tensor_table(config)}


def random_weights(config, seed: int = 0) -> Iterator:
    """(HF name, float32 array) pairs of a reproducible random model of the config's family, one
    tensor at a time (so a multi-GB benchmark model is never held twice). Projections are
    N(0, 1/fan_in), the embedding N(0, 1), biases N(0, 0.01), norm weights 1 + N(0, 0.01)
    (N(0, 0.01) where the family scales by 1 + w): activations stay O(1) at any depth."""
    rng = np.random.default_rng(seed)
    c = make_config(config)
    plus_one = ARCHS[c.family.get("arch", "qwen3")]["norm_plus_one"]
    for name, shape, _, field in tensor_table(c):
        if field == "embed":
            yield name, rng.standard_normal(shape, dtype=np.float32)
        elif field.endswith("_bias"):
            yield name, (0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        elif len(shape) == 1 and plus_one:
            yield name, (0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        elif len(shape) == 1:
            yield name, (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= np.float32(1.0 / math.sqrt(shape[1]))
            yield name, a


class BlockTensor:
    """A tensor in one of llama.cpp's block types (a GGUF file's Q8_0, Q4_0, Q4_K, Q6_K): its
    raw bytes ``data`` (rows, bytes per row) uint8, ``dtype`` (the short name, "q8_0" ...) and
    ``shape`` (rows, cols). The engine widens each row exactly (ggml_blocks.hpp) and stores it in
    its own format."""

    def __init__(self, data, dtype: str, shape):
        self.data, self.dtype, self.shape = data, dtype, tuple(int(d) for d in shape)

    def __repr__(self):
        return f"BlockTensor({self.dtype}, {list(self.shape)})"


def engine_tensor(x, name: str = "weights") -> tuple:
    """(C-contiguous ndarray, source[, shape]) for Session.set_weight: source 'f32', 'f16' or
    'bf16' (uint16 bit patterns), or a BlockTensor's type with its raw bytes and shape. float32, float16 and bfloat16 data go through unconverted; float64 is
    rounded to float32. torch tensors of any device are accepted. Anything else (integers, bool,
    complex, objects) is refused: an integer tensor is most likely a packed quantized format,
    whose values are not the weights, and a complex one would lose its imaginary part."""
    if isinstance(x, HalfBits):
        return np.ascontiguousarray(x.bits).view(np.uint16), x.name
    if isinstance(x, BlockTensor):
        return np.ascontiguousarray(x.data, dtype=np.uint8), x.dtype, list(x.shape)
    if hasattr(x, "detach") and hasattr(x, "dtype") and hasattr(x, "cpu"):  # a torch tensor
        import torch

        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must hold floating-point values, got {x.dtype}")
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
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must hold floating-point values, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32), "f32"


def _rows_f32(a: np.ndarray, source: str, lo: int, hi: int) -> np.ndarray:
    block = np.asarray(a[lo:hi])
    if source == "bf16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32, copy=False)


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def warn_untied_head(holder: str, stacklevel: int) -> None:
    """transformers (5.x) keeps a shipped lm_head.weight that differs from the embedding table
    apart from it even when the config ties them, and warns; the session computes that same
    model (a separate head, counted in the resident bytes) and says so."""
    import warnings

    from ..errors import ResidentWarning

    warnings.warn(
        f"the config ties the word embeddings (tie_word_embeddings: true) but {holder} an "
        f"{HEAD} that differs from {EMBED}: the session keeps the two apart, as transformers "
        "does; set tie_word_embeddings false to silence this", ResidentWarning,
        stacklevel=stacklevel + 1)


def head_differs(head, embed) -> bool:
    """Whether a shipped lm_head.weight holds other values than the embedding table (any
    tensors engine_tensor takes, memory maps included), so a tie would drop it."""
    return not _same_values(engine_tensor(head, HEAD), engine_tensor(embed, EMBED))


def _same_values(a: tuple, b: tuple, rows_per_block: int = 4096) -> bool:
    """Whether two engine_tensor results hold the same values (compared as float32, which
    every source type widens to exactly), a block of rows at a time so two memory-mapped
    embedding tables are never copied whole."""
    if len(a) != 2 or len(b) != 2:
        raise TypeError("a tied head is compared as float data, not as ggml blocks")
    (x, sx), (y, sy) = a, b
    if x.shape != y.shape:
        return False
    if sx == sy and x.ctypes.data == y.ctypes.data:  # one buffer (a tied state_dict's pair)
        return True
    if x.ndim == 0:
        x, y = x.reshape(1), y.reshape(1)
    return all(np.array_equal(_rows_f32(x, sx, lo, lo + rows_per_block),
                              _rows_f32(y, sy, lo, lo + rows_per_block))
               for lo in range(0, x.shape[0], rows_per_block))


__all__ = ["Bf16Bits", "BlockTensor", "tensor_table", "expected_shapes", "family_vector_elems",
           "random_weights", "engine_tensor",
           "head_differs", "warn_untied_head", "HEAD", "EMBED"]

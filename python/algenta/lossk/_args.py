"""lossk's arguments, checked once for every front end (the NumPy API ``linear_cross_entropy`` and
``linear_distillation``, ``algenta.torch`` on CPU and CUDA tensors).

The scalar options of a loss are one record, built here and passed whole down to the core:
``CrossEntropyOptions`` and ``DistillOptions`` are the Python side of lossk.hpp's records of the
same field names (``CrossEntropyOptions``, ``DistillOptions``), which the binding reads field by
field in one place; ``algenta.torch``'s op schema is derived from their annotations. A new option
is a field here and in lossk.hpp, a line of the binding's reader, and its math.

Only what Python must know before the core sees the data is checked here: the types of the
options, and the shapes compared with each other. Every value refusal the core makes itself
(NaN/inf, target range, the ranges of label smoothing, soft cap, temperature, z-loss, beta and the
weights, an unknown objective, the chunk budget, an impossible shift) is left to it, so its status
codes are the core's whatever the front end."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, get_type_hints

from .._convert import I64_MAX, I64_MIN, as_float, as_i64_clamped, as_int
from ..errors import LossError

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOptions(NamedTuple):
    """The cross-entropy's options (lossk.hpp: CrossEntropyOptions)."""

    reduction: str = "mean"
    ignore_index: Optional[int] = None  # None: every target counts
    label_smoothing: float = 0.0
    softcap: Optional[float] = None
    temperature: float = 1.0  # divides the (biased, capped) logits; 1: not a bit changed
    lse_square_scale: float = 0.0
    shift: int = 0
    chunk: Optional[int] = None  # None: the largest the logit budget admits
    entropy: bool = False  # compute the entropy of the (tempered) softmax
    grad_scale: float = 1.0  # the upstream gradient of a mean/sum loss
    entropy_grad_scale: float = 0.0  # the entropy's, for mean/sum


class DistillOptions(NamedTuple):
    """Distillation's options (lossk.hpp: DistillOptions)."""

    objective: str = "kl"
    reduction: str = "mean"
    ignore_index: Optional[int] = None
    temperature: float = 1.0  # divides both heads' logits
    chunk: Optional[int] = None
    beta: float = 0.5
    hard_weight: float = 0.0
    soft_weight: float = 1.0
    grad_scale: float = 1.0


def _reduction(v, name):
    if not isinstance(v, str) or v not in REDUCTIONS:
        raise LossError(f"reduction must be one of {REDUCTIONS}, got {v!r}", 588)
    return v


def _ignore_index(v, name):
    if v is None:
        return None
    ii = as_int(v, name)
    if not I64_MIN <= ii <= I64_MAX:
        raise LossError(f"{name}={ii} is beyond int64", 586)
    return ii


def _objective(v, name):
    if not isinstance(v, str):
        raise TypeError(f"objective must be a string, got {type(v).__name__}")
    return v  # its name is the core's to refuse (588)


def _optional(convert):
    return lambda v, name: None if v is None else convert(v, name)


# How each field is converted: by name where the field has a rule of its own, else by type. A
# Python int past int64 in chunk is clamped (the core then refuses it as the value it stands for,
# 583/587, never wrapped).
_BY_NAME = {"reduction": _reduction, "ignore_index": _ignore_index, "objective": _objective,
            "chunk": _optional(as_i64_clamped)}
_BY_TYPE = {float: as_float, Optional[float]: _optional(as_float), int: as_int,
            bool: lambda v, name: bool(v)}


def _converters(cls) -> tuple:
    """(name, converter, default) of each of cls's fields, in field order."""
    return tuple((name, _BY_NAME.get(name) or _BY_TYPE[typ], cls._field_defaults[name])
                 for name, typ in get_type_hints(cls).items())


# Worked out once (torch.compile traces _record, not the typing machinery).
_FIELDS = {cls: _converters(cls) for cls in (CrossEntropyOptions, DistillOptions)}


def _record(cls, given: dict):
    """cls built from the caller's values (defaults for the rest), each converted in field
    order: a wrong type is a TypeError, a reduction that is none of mean/sum/none 588, an
    ignore_index beyond int64 586."""
    for name in given:
        if name not in cls._fields:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
    return cls(*(convert(given.get(name, default), name)
                 for name, convert, default in _FIELDS[cls]))


def options(**given) -> CrossEntropyOptions:
    """The cross-entropy's options record from a front end's keyword values."""
    return _record(CrossEntropyOptions, given)


def distill_options(**given) -> DistillOptions:
    """Distillation's options record from a front end's keyword values."""
    return _record(DistillOptions, given)


def schema(cls) -> str:
    """cls's fields as a torch.library schema fragment ("str reduction, int? ignore_index, ...")."""
    kinds = {str: "str", int: "int", float: "float", bool: "bool", Optional[int]: "int?",
             Optional[float]: "float?"}
    return ", ".join(f"{kinds[t]} {n}" for n, t in get_type_hints(cls).items())


def shapes(hidden_shape, weight_shape, target_shape, *, shift: int, bias_shape=None,
           class_weight_shape=None, token_weight_shape=None, token_axes: int = 1,
           names=("hidden", "weight", "targets", "bias", "class_weight")) -> tuple:
    """(lead, n, d, v): hidden's leading axes, the token count, d_model and the vocabulary, after
    checking hidden [..., d_model] with at least `token_axes` leading axes (the NumPy API wants
    one; PyTorch's loss also takes a single token [d_model]), weight [vocab, d_model], targets of
    hidden's leading shape, a bias and class weights of (vocab,), token weights of the targets'
    shape, and that a shift has a
    sequence axis to shift along. Every mismatch is 582, named as the caller's API names it."""
    h, w, t, b, cw = names
    hidden_shape, weight_shape = tuple(hidden_shape), tuple(weight_shape)
    if len(hidden_shape) < 1 + token_axes or len(weight_shape) != 2:
        axes = " with at least one token axis" if token_axes else ""
        raise LossError(f"{h} must be [..., d_model]{axes} and {w} [vocab, d_model], got shapes "
                        f"{hidden_shape} and {weight_shape}", 582)
    lead, d = hidden_shape[:-1], hidden_shape[-1]
    v = weight_shape[0]
    if weight_shape[1] != d:
        raise LossError(f"{w} has d_model {weight_shape[1]}, {h} has {d}", 582)
    if tuple(target_shape) != lead:
        raise LossError(f"{t} must have shape {lead} ({h}'s leading axes), got "
                        f"{tuple(target_shape)}", 582)
    if shift and not lead:
        raise LossError(f"shift needs {h} [..., seq, d_model]", 582)
    if bias_shape is not None and tuple(bias_shape) != (v,):
        raise LossError(f"{b} must have shape ({v},), got {tuple(bias_shape)}", 582)
    if class_weight_shape is not None and tuple(class_weight_shape) != (v,):
        raise LossError(f"{cw} must have shape ({v},), got {tuple(class_weight_shape)}", 582)
    if token_weight_shape is not None and tuple(token_weight_shape) != lead:
        raise LossError(f"token_weight must have {t}'s shape {lead}, got "
                        f"{tuple(token_weight_shape)}", 582)
    return lead, math.prod(lead), d, v

"""lossk's arguments, checked once for every front end (the NumPy API ``linear_cross_entropy``,
``algenta.torch`` on CPU and CUDA tensors): the scalar options converted to what the core takes,
and the shapes compared with each other. Only what Python must know before the core sees the
data is checked here; every value refusal the core makes itself (NaN/inf, target range, the
ranges of label smoothing, soft cap, temperature and z-loss, the chunk budget, an impossible
shift) is left to it, so its status codes are the core's whatever the front end."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

from .._convert import I64_MAX, I64_MIN, as_float, as_i64_clamped, as_int
from ..errors import LossError
from . import contract as _contract

REDUCTIONS = ("mean", "sum", "none")


class Options(NamedTuple):
    reduction: str
    ignore_index: Optional[int]  # None: every target counts
    label_smoothing: float
    softcap: Optional[float]
    temperature: float  # divides the (biased, capped) logits; 1: untempered, not a bit changed
    lse_square_scale: float
    shift: int
    chunk: Optional[int]  # None: the largest the logit budget admits


def options(reduction, ignore_index, label_smoothing, softcap, lse_square_scale, shift,
            chunk, temperature=1.0) -> Options:
    """The scalar options as the core takes them: types refused with TypeError, a reduction
    that is none of mean/sum/none with 588, an ignore_index beyond int64 with 586, a chunk past
    int64 clamped (the core then refuses it as the value it stands for, 583/587)."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise LossError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}", 588)
    ii = None if ignore_index is None else as_int(ignore_index, "ignore_index")
    if ii is not None and not I64_MIN <= ii <= I64_MAX:
        raise LossError(f"ignore_index={ii} is beyond int64", 586)
    return Options(reduction, ii, as_float(label_smoothing, "label_smoothing"),
                   None if softcap is None else as_float(softcap, "softcap"),
                   as_float(temperature, "temperature"),
                   as_float(lse_square_scale, "lse_square_scale"), as_int(shift, "shift"),
                   None if chunk is None else as_i64_clamped(chunk, "chunk"))


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


def chunk_for(chunk, n_tok: int, vocab: int) -> int:
    """The chunk the core runs: the caller's (clamped to int64: the core refuses what it stands
    for), or for None the largest the logit budget admits (1 where the dimensions are refused
    anyway: the core refuses them first)."""
    if chunk is None:
        return max(_contract.loss_max_chunk(n_tok, vocab), 1)
    return as_i64_clamped(chunk, "chunk")


def core_options(o: Options, seq_len: int) -> dict:
    """The options as the core's keyword arguments, for both of its entry points (host arrays,
    the NumPy API; device pointers, algenta.torch's CUDA tensors): one spelling of each."""
    return {"reduction": o.reduction, "has_ignore": o.ignore_index is not None,
            "ignore_index": 0 if o.ignore_index is None else o.ignore_index,
            "label_smoothing": o.label_smoothing, "softcap": o.softcap,
            "temperature": o.temperature, "z_loss": o.lse_square_scale, "shift": o.shift,
            "seq_len": seq_len if o.shift else 0}

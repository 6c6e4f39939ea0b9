"""lossk.distillation: a student head distilled against a teacher head, fused with both
projections, a chunk of tokens at a time (neither ``[tokens, vocab]`` logit tensor exists).

Division of labour as in ``cross_entropy``: this layer converts types (a wrong one is a
``TypeError``) and compares shapes (582); every value refusal (the objective's name 588, the
temperature, beta and the weights 585, non-finite data 585, targets 586, the chunk budget 587)
is the core's, with its status and message.
"""

from __future__ import annotations

import numpy as np

from .. import _core
from .._convert import _asarray, as_float
from .._dtypes import HalfBits
from .._records import record_type
from ..errors import LossError
from . import _args
from .cross_entropy import (_dtype_name, _elem, _grad_array, _grad_elem, _grad_sets,
                            _targets)

_c = _core.lossk

OBJECTIVES = ("kl", "reverse_kl", "jsd")

LinearDistillation = record_type(
    "LinearDistillation",
    ("loss", "divergence", "ce", "n_valid", "d_hidden", "d_weight", "d_bias"),
    "Result of linear_distillation: the loss (scalar, or per token for reduction='none'), its "
    "divergence and hard cross-entropy terms reduced alike (ce is 0 without a target), the count "
    "of counted tokens and the student's gradients asked for (else None).",
)


def _err(msg: str, status: int) -> LossError:
    return LossError(msg, status)


def linear_distillation(student_input, student_weight, teacher_input, teacher_weight,
                        target=None, *, objective="kl", beta=0.5, temperature=1.0,
                        ignore_index=-100, hard_weight=0.0, soft_weight=1.0, student_bias=None,
                        teacher_bias=None, reduction="mean", chunk=None, with_grad=False,
                        grad_output=None, grad_dtype=None, device="cpu") -> LinearDistillation:
    """The divergence between a teacher's and a student's output distributions, and optionally
    the student's cross-entropy against ``target``, without materializing either head's logits.

    student_input ``[..., d]`` and student_weight ``[vocab, d]``; teacher_input ``[..., d_t]``
    (the same leading axes) and teacher_weight ``[vocab, d_t]``: the teacher may have another
    hidden size, never another vocabulary (582). float32, float64, float16 or bfloat16 arrays
    (``ml_dtypes`` or ``HalfBits``); the two heads may differ in dtype if both compute in one
    precision (float64 with float64 only). With ``s`` and ``t`` the heads' logits (plus their
    biases), ``T = temperature`` dividing both, ``p = softmax(s / T)`` the student's and
    ``q = softmax(t / T)`` the teacher's distribution, per token::

        "kl"          sum_v q_v (log q_v - log p_v)                 KL(teacher || student)
        "reverse_kl"  sum_v p_v (log p_v - log q_v)                 KL(student || teacher)
        "jsd"         beta KL(q || m) + (1 - beta) KL(p || m),   m = beta q + (1 - beta) p

    ``beta`` (in [0, 1]) is Liger-Kernel's: ``jsd`` at ``beta=0`` is "kl" and at ``beta=1``
    "reverse_kl" (where the mixture formula would be identically 0). No ``T**2`` factor: scale
    the loss to have one. The loss of a counted token is
    ``soft_weight * divergence + hard_weight * ce`` with ``ce`` the cross-entropy of the
    untempered student logits against its target (``hard_weight > 0`` needs ``target``).
    ``target`` (the leading shape, integers) counts the tokens whose target is not
    ``ignore_index`` (``None``: every target must be in [0, vocab)); without a target every token
    counts. ``reduction``: "mean" over the counted tokens, "sum", or "none" (per token, 0 where
    not counted).

    ``with_grad=True`` (or any of "hidden", "weight", "bias") also returns the student's
    gradients of the reduced loss, formed from the same chunk of logits; the teacher gets none.
    ``grad_output`` is the upstream gradient (a scalar for mean/sum, per token for none);
    ``grad_dtype="float32"`` gives half inputs float32 gradients. Peak extra memory: one chunk
    of each head's logits plus the gradients. Every output and gradient is bit-identical for
    every ``chunk`` and thread count, and a token's divergence and ce do not depend on the other
    tokens of its batch.

    ``device="cuda"`` runs it on the CUDA backend (host arrays copied to the device and the
    results back): the same results within float rounding, bit-identical across runs and chunk
    sizes there too (half students round ``chunk`` down to a multiple of 16). A build without a
    CUDA backend raises ``LossUnavailableError`` (589), a host without a usable device 590.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    for x, name in ((student_input, "student_input"), (student_weight, "student_weight"),
                    (teacher_input, "teacher_input"), (teacher_weight, "teacher_weight")):
        if not isinstance(x, (np.ndarray, HalfBits)):
            raise TypeError(f"{name} must be a NumPy array (or HalfBits)")
    heads = _heads(student_input, student_weight, teacher_input, teacher_weight, target)
    o = _args.distill_options(objective=objective, beta=beta, temperature=temperature,
                              ignore_index=ignore_index, hard_weight=hard_weight,
                              soft_weight=soft_weight, reduction=reduction, chunk=chunk)
    return _distill(student_input, student_weight, teacher_input, teacher_weight, target, heads,
                    o, student_bias=student_bias, teacher_bias=teacher_bias, with_grad=with_grad,
                    grad_output=grad_output, grad_dtype=grad_dtype, device=device)


def _heads(student_input, student_weight, teacher_input, teacher_weight, target) -> tuple:
    """(elem, h, w, telem, th, tw, t): what the core reads of both heads (NumPy arrays or
    HalfBits) and of the target (int64, flat; None without one), after their dtypes, the weights'
    ranks and the one vocabulary are checked."""
    elem, h = _elem(student_input)
    welem, w = _elem(student_weight)
    telem, th = _elem(teacher_input)
    twelem, tw = _elem(teacher_weight)
    if welem != elem or twelem != telem:
        raise TypeError(f"each head's input and weight must share one dtype; got student "
                        f"{_dtype_name(student_input)}/{_dtype_name(student_weight)}, teacher "
                        f"{_dtype_name(teacher_input)}/{_dtype_name(teacher_weight)}")
    if student_weight.ndim != 2 or teacher_weight.ndim != 2:
        raise _err(f"student_weight and teacher_weight must be [vocab, d], got shapes "
                   f"{student_weight.shape} and {teacher_weight.shape}", 582)
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise _err(f"the teacher's vocabulary ({teacher_weight.shape[0]}) differs from the "
                   f"student's ({student_weight.shape[0]}): distillation compares one vocabulary",
                   582)
    t = None
    if target is not None:
        if not isinstance(target, (np.ndarray, list, tuple)) and not hasattr(target, "__array__"):
            raise TypeError(f"target must be an array of integer class indices, got "
                            f"{type(target).__name__}")
        t = _targets(target)  # a ragged target is refused here (TypeError), before its shape
    return elem, h, w, telem, th, tw, t


def _distill(student_input, student_weight, teacher_input, teacher_weight, target, heads,
             o: _args.DistillOptions, *, student_bias=None, teacher_bias=None, with_grad=False,
             grad_output=None, grad_dtype=None, device="cpu") -> LinearDistillation:
    """linear_distillation once its heads are known (_heads) and its options record o built
    (algenta.torch's CPU tensors come in here as arrays): the shapes checked, the core run."""
    elem, h, w, telem, th, tw, t = heads
    has_target = target is not None
    lead, n, d, v = _args.shapes(
        student_input.shape, student_weight.shape,
        np.shape(target) if has_target else student_input.shape[:-1], shift=0,
        bias_shape=None if student_bias is None else student_bias.shape,
        names=("student_input", "student_weight", "target", "student_bias", "class_weight"))
    _, _, dt, _ = _args.shapes(
        teacher_input.shape, teacher_weight.shape, lead, shift=0,
        bias_shape=None if teacher_bias is None else teacher_bias.shape,
        names=("teacher_input", "teacher_weight", "student_input's leading axes",
               "teacher_bias", "class_weight"))
    want_dh, want_dw, want_db = _grad_sets(with_grad, student_bias is not None)
    want_grad = want_dh or want_dw or want_db
    gelem = _grad_elem(elem, grad_dtype)
    biases = {}
    for b, ref, key, name in ((student_bias, student_weight, "bias", "student_bias"),
                              (teacher_bias, teacher_weight, "t_bias", "teacher_bias")):
        if b is None:
            biases[key] = None
            continue
        if not isinstance(b, (np.ndarray, HalfBits)):
            raise TypeError(f"{name} must be a NumPy array (or HalfBits)")
        if _dtype_name(b) != _dtype_name(ref):
            raise _err(f"a head's bias must have its weight's dtype {_dtype_name(ref)}, got "
                       f"{_dtype_name(b)}", 582)
        biases[key] = np.ascontiguousarray(_elem(b)[1])
    if has_target:
        t = t.reshape(n)
    compute = np.float64 if elem == "f64" else np.float32
    go = None
    if grad_output is not None:
        if not want_grad:
            raise _err("grad_output is only used with with_grad", 582)
        if o.reduction == "none":
            a = _asarray(grad_output, "grad_output")
            if a.dtype.kind not in "fiu":
                raise TypeError(f"grad_output must hold real numbers, got dtype {a.dtype}")
            if a.shape != lead:
                raise _err(f"grad_output must have shape {lead}, got {a.shape}", 582)
            go = np.ascontiguousarray(a, dtype=compute).reshape(n)
        else:
            o = o._replace(grad_scale=as_float(grad_output,
                                               "grad_output (a scalar for mean and sum)"))
    r = _c.fused_linear_distill(
        o, hidden=np.ascontiguousarray(h).reshape(n, d), weight=np.ascontiguousarray(w),
        t_hidden=np.ascontiguousarray(th).reshape(n, dt), t_weight=np.ascontiguousarray(tw),
        targets=t, elem=elem, t_elem=telem, grad_elem=gelem, n_tok=n, d_model=d, t_d_model=dt,
        vocab=v, want_dh=want_dh, want_dw=want_dw, want_db=want_db, grad_output=go,
        device=device, **biases)

    def grad(a, shape):
        return _grad_array(a, shape, gelem, elem, student_input)

    scalar = np.float64 if elem == "f64" else np.float32
    if o.reduction == "none":
        loss, div, ce = (r[k].reshape(lead) for k in ("loss_tok", "div_tok", "ce_tok"))
    else:
        loss, div, ce = (scalar(r[k]) for k in ("loss", "divergence", "ce"))
    return LinearDistillation(
        loss=loss, divergence=div, ce=ce, n_valid=r["n_valid"],
        d_hidden=grad(r["d_hidden"], student_input.shape),
        d_weight=grad(r["d_weight"], student_weight.shape), d_bias=grad(r["d_bias"], (v,)))


DistillShardPass = record_type(
    "DistillShardPass",
    ("stats", "d_hidden", "d_weight", "d_bias"),
    "One pass over a shard of the vocabulary (both heads' same rows): per token (n, 6) the "
    "shard's own lse of s / T, t / T and s, its shares of the divergence and of H (under the "
    "full vocabulary's lses when given), and the target's logit (NaN where another shard holds "
    "the target); with grads, the shard's gradients.",
)


def vocab_shard_distill_pass(student_input, student_weight_shard, teacher_input,
                             teacher_weight_shard, local_target=None, *, objective="kl",
                             beta=0.5, temperature=1.0, hard_weight=0.0, soft_weight=1.0,
                             student_bias=None, teacher_bias=None, chunk=None, shard_lse=None,
                             shard_h=None, shard_coef=None,
                             with_grad=False) -> DistillShardPass:
    """One pass of the core over rows ``[s, s + rows)`` of both heads, for the vocab-parallel
    distillation loss (``algenta.torch.vocab_parallel_linear_distillation_loss``), which combines
    the shards' statistics.

    student_input ``[n, d]``, teacher_input ``[n, d_t]``, the shards ``[rows, d]`` and
    ``[rows, d_t]`` (biases: the shard's parts). local_target ``[n]``: the target's row in this
    shard, any index outside ``[0, rows)`` where another shard (or none) holds it. shard_lse
    ``[n, 3]``: the full vocabulary's lse of ``s / T``, ``t / T`` and ``s`` (None: the shard's
    own). With ``with_grad``, also shard_h ``[n]`` (the full vocabulary's ``H = sum_v p_v h_v``)
    and shard_coef ``[n, 2]`` (each token's soft and hard scales of ``d/ds``).
    """
    o = _args.distill_options(objective=objective, beta=beta, temperature=temperature,
                              hard_weight=hard_weight, soft_weight=soft_weight, reduction="sum",
                              chunk=chunk)
    return _shard_distill_pass(student_input, student_weight_shard, teacher_input,
                               teacher_weight_shard, local_target, o, student_bias=student_bias,
                               teacher_bias=teacher_bias, shard_lse=shard_lse, shard_h=shard_h,
                               shard_coef=shard_coef, with_grad=with_grad)


def _shard_distill_pass(student_input, student_weight_shard, teacher_input, teacher_weight_shard,
                        local_target, o: _args.DistillOptions, *, student_bias=None,
                        teacher_bias=None, shard_lse=None, shard_h=None, shard_coef=None,
                        with_grad=False) -> DistillShardPass:
    """vocab_shard_distill_pass with its options record o (reduction "sum", no ignore_index:
    every token is scored; the caller zeroes the scales of the ones it does not count)."""
    for x, name in ((student_input, "student_input"), (student_weight_shard, "student_weight"),
                    (teacher_input, "teacher_input"), (teacher_weight_shard, "teacher_weight")):
        if not isinstance(x, (np.ndarray, HalfBits)) or len(x.shape) != 2:
            raise _err(f"{name} must be a 2-D NumPy array (or HalfBits)", 582)
    elem, h = _elem(student_input)
    _, w = _elem(student_weight_shard)
    telem, th = _elem(teacher_input)
    _, tw = _elem(teacher_weight_shard)
    n, d = student_input.shape
    dt, v = teacher_input.shape[1], student_weight_shard.shape[0]
    if (teacher_weight_shard.shape[0] != v or student_weight_shard.shape[1] != d
            or teacher_weight_shard.shape[1] != dt or teacher_input.shape[0] != n):
        raise _err(f"shapes disagree: student {student_input.shape} x "
                   f"{student_weight_shard.shape}, teacher {teacher_input.shape} x "
                   f"{teacher_weight_shard.shape}", 582)
    compute = np.float64 if elem == "f64" else np.float32
    per = {k: None if x is None else np.ascontiguousarray(x, dtype=compute)
           for k, x in (("shard_lse", shard_lse), ("shard_h", shard_h),
                        ("shard_coef", shard_coef))}
    want_dh, want_dw, want_db = _grad_sets(with_grad, student_bias is not None)
    r = _c.fused_linear_distill(
        o, hidden=np.ascontiguousarray(h), weight=np.ascontiguousarray(w),
        t_hidden=np.ascontiguousarray(th), t_weight=np.ascontiguousarray(tw),
        targets=None if local_target is None else _targets(local_target).reshape(n),
        elem=elem, t_elem=telem, n_tok=n, d_model=d, t_d_model=dt, vocab=v, want_dh=want_dh,
        want_dw=want_dw, want_db=want_db, want_shard_stats=True, shard=True,
        bias=None if student_bias is None else np.ascontiguousarray(_elem(student_bias)[1]),
        t_bias=None if teacher_bias is None else np.ascontiguousarray(_elem(teacher_bias)[1]),
        **per)
    return DistillShardPass(stats=r["shard_stats"], d_hidden=r["d_hidden"],
                            d_weight=r["d_weight"], d_bias=r["d_bias"])


__all__ = ["linear_distillation", "LinearDistillation", "OBJECTIVES", "vocab_shard_distill_pass",
           "DistillShardPass"]

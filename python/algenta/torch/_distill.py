"""algenta.torch.linear_distillation_loss: fused linear distillation (a student head against a
teacher head) as an autograd function over the NumPy core (``algenta.linear_distillation``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..errors import LossUnavailableError
from ..lossk import _args
from ..lossk.distillation import _distill, _heads
from ._bridge import _core_view, _loss_dtype, _tensor
from ._checks import _float_tensor


class LinearDistillationOutput(NamedTuple):
    loss: Tensor        # the reduced loss (per token for reduction="none")
    divergence: Tensor  # its divergence term, reduced alike (no gradient)
    ce: Tensor          # its hard cross-entropy term, reduced alike (0 without a target)


def _run(si, sw, ti, tw, target, sb, tb, o: _args.DistillOptions, need, grad_output=None):
    """One pass of the core through the NumPy API's body on tensors' data, with the options
    record o; only the student's gradients in `need` are computed."""
    t = None if target is None else target.detach().to(torch.int64).contiguous().numpy()
    go = grad_output
    if isinstance(go, Tensor):
        go = (go.detach().to(torch.float64 if si.dtype == torch.float64 else torch.float32)
              .contiguous().numpy())
    views = (_core_view(si), _core_view(sw), _core_view(ti), _core_view(tw), t)
    return _distill(*views, _heads(*views), o,
                    student_bias=None if sb is None else _core_view(sb),
                    teacher_bias=None if tb is None else _core_view(tb),
                    with_grad=tuple(need) if need else False, grad_output=go)


class _Distill(torch.autograd.Function):
    """Forward computes the student's gradients of the reduced loss in the same pass when any is
    needed (mean and sum); backward hands those buffers out, scaled in place by the upstream
    gradient (not at all for ``loss.backward()``), so a step holds the gradients once. Reduction
    "none", or a second backward through a retained graph, runs another core pass with the
    upstream gradient."""

    @staticmethod
    def forward(ctx, si, sw, sb, ti, tw, tb, target, o, need):
        per_tok = o.reduction == "none"
        r = _run(si, sw, ti, tw, target, sb, tb, o, [] if per_tok else need)
        ld = _loss_dtype(si.dtype)
        ctx.need, ctx.per_tok, ctx.opts = need, per_tok, o
        ctx.dtype = si.dtype
        ctx.save_for_backward(si, sw, sb, ti, tw, tb, target)
        ctx.grads = None if per_tok else _grads(r, si.dtype)
        as_t = lambda x: torch.as_tensor(x).to(ld)
        div, ce = as_t(r.divergence), as_t(r.ce)
        ctx.mark_non_differentiable(div, ce)
        return as_t(r.loss), div, ce

    @staticmethod
    def backward(ctx, g, _g_div, _g_ce):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            si, sw, sb, ti, tw, tb, target = ctx.saved_tensors
            up = g if ctx.per_tok else float(g)
            grads = _grads(_run(si, sw, ti, tw, target, sb, tb, ctx.opts, ctx.need,
                                grad_output=up), ctx.dtype)
        elif not bool((g == 1).all()):
            for x in grads.values():
                if x is not None:
                    x.mul_(g.to(x.dtype))
        return (grads["hidden"], grads["weight"], grads["bias"]) + (None,) * 6


def _grads(r, dtype) -> dict:
    return {n: None if x is None else _tensor(x, dtype)
            for n, x in (("hidden", r.d_hidden), ("weight", r.d_weight), ("bias", r.d_bias))}


def _checked_heads(student_input, student_weight, teacher_input, teacher_weight, target,
                   student_bias, teacher_bias) -> None:
    """Types and devices of a distillation call's tensors (shapes and values are the core's):
    CPU tensors only (CUDA ones 589: see linear_distillation_loss)."""
    if not isinstance(student_input, Tensor):
        raise TypeError(f"student_input must be a torch.Tensor, got "
                        f"{type(student_input).__name__}")
    dev = student_input.device
    if dev.type == "cuda":
        raise LossUnavailableError("algenta.torch's distillation takes CPU tensors; on the CUDA "
                                   "backend distillation runs from host arrays only "
                                   "(algenta.linear_distillation(..., device='cuda'))", 589)
    if dev.type != "cpu":
        raise ValueError(f"student_input is on device {dev}; this function computes on CPU "
                         f"tensors only")
    for x, name in ((student_input, "student_input"), (student_weight, "student_weight"),
                    (teacher_input, "teacher_input"), (teacher_weight, "teacher_weight"),
                    (student_bias, "student_bias"), (teacher_bias, "teacher_bias")):
        if x is not None:
            _float_tensor(x, name, dev)
    if target is not None:
        if not isinstance(target, Tensor):
            raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
        if target.device != dev:
            raise ValueError(f"target is on device {target.device}, the input on {dev}")
        if (target.dtype.is_floating_point or target.dtype.is_complex
                or target.dtype == torch.bool):
            raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if student_weight.dtype != student_input.dtype or teacher_weight.dtype != teacher_input.dtype:
        raise TypeError("each head's input and weight must share one dtype")


def linear_distillation_loss(student_input: Tensor, student_weight: Tensor,
                             teacher_input: Tensor, teacher_weight: Tensor,
                             target: Optional[Tensor] = None, *, objective: str = "kl",
                             beta: float = 0.5, temperature: float = 1.0,
                             ignore_index: int = -100, hard_weight: float = 0.0,
                             soft_weight: float = 1.0, student_bias: Optional[Tensor] = None,
                             teacher_bias: Optional[Tensor] = None, reduction: str = "mean",
                             chunk: Optional[int] = None,
                             return_terms: bool = False):
    """The divergence between a teacher's and a student's output distributions (plus
    ``hard_weight`` times the student's cross-entropy against ``target``), fused with both
    projections a chunk of tokens at a time: neither ``[tokens, vocab]`` logit tensor exists, in
    the forward or the backward. Gradients flow to student_input, student_weight and
    student_bias; the teacher's tensors get none (detach them or not: they are read only).

    Objectives, temperature, weights and reductions as ``algenta.linear_distillation`` (its
    docstring has the formulas): "kl" is KL(teacher || student), "reverse_kl" KL(student ||
    teacher), "jsd" the beta-weighted Jensen-Shannon divergence with Liger-Kernel's ``beta``; no
    ``T**2`` factor. The loss is float32 for half inputs, gradients in the student's dtype.
    ``return_terms=True`` returns ``LinearDistillationOutput(loss, divergence, ce)``. Under
    ``torch.autocast`` both heads are cast to the autocast dtype first, as ``F.linear`` is.

    CPU tensors (CUDA tensors: 589; the CUDA backend's distillation runs from host arrays,
    ``algenta.linear_distillation(..., device="cuda")``).
    """
    _checked_heads(student_input, student_weight, teacher_input, teacher_weight, target,
                   student_bias, teacher_bias)
    if torch.is_autocast_enabled("cpu"):
        # as F.linear under autocast: both heads in the autocast dtype (the casts differentiable)
        at = torch.get_autocast_dtype("cpu")
        student_input, student_weight, teacher_input, teacher_weight = (
            x.to(at) for x in (student_input, student_weight, teacher_input, teacher_weight))
        student_bias, teacher_bias = (None if x is None else x.to(at)
                                      for x in (student_bias, teacher_bias))
    o = _args.distill_options(objective=objective, beta=beta, temperature=temperature,
                              ignore_index=ignore_index, hard_weight=hard_weight,
                              soft_weight=soft_weight, reduction=reduction, chunk=chunk)
    # the student's tensors that want a gradient (none under no_grad: no gradient work at all)
    grad_on = torch.is_grad_enabled()
    need = [n for n, x in (("hidden", student_input), ("weight", student_weight),
                           ("bias", student_bias))
            if grad_on and x is not None and x.requires_grad]
    loss, div, ce = _Distill.apply(student_input, student_weight, student_bias,
                                   teacher_input, teacher_weight, teacher_bias, target, o, need)
    return LinearDistillationOutput(loss, div, ce) if return_terms else loss


__all__ = ["linear_distillation_loss", "LinearDistillationOutput"]

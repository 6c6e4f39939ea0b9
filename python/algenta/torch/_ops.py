"""The fused loss as PyTorch ops: ``algenta::lce_fwd`` and ``algenta::lce_grad`` registered with
torch.library (fake implementations, autograd), ``linear_cross_entropy`` and its module."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._bridge import _cuda_pass, _loss_dtype, _out_shape, _per_token_view, _run, _tensor
from .._convert import as_float, as_int
from ..lossk import _args
from ..lossk._args import CrossEntropyOptions
from ._checks import _REDUCTIONS, _check

class LinearCrossEntropyOutput(NamedTuple):
    """What linear_cross_entropy returns when any return_* flag is set: each field the flag
    asked for (else None). lse and entropy are differentiable; z_loss (already part of loss),
    pred and accuracy are not."""

    loss: Tensor
    lse: Optional[Tensor]
    z_loss: Optional[Tensor]
    pred: Optional[Tensor]
    accuracy: Optional[Tensor]
    entropy: Optional[Tensor] = None



# ---- the ops -------------------------------------------------------------------------------
# Each op takes the options record's fields in its schema, in the record's order (the schema is
# derived from the record, so a new option needs no edit here): K of them after the tensors.

_K = len(CrossEntropyOptions._fields)
_OPTS = _args.schema(CrossEntropyOptions)
_TENSORS = ("Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, "
            "Tensor? token_weight")


def _opts(rest) -> tuple:
    """(the options record, the flags after it) from an op's arguments after its tensors."""
    return CrossEntropyOptions(*rest[:_K]), rest[_K:]


def _lce_fwd_impl(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  class_weight: Optional[Tensor], token_weight: Optional[Tensor], *rest):
    """(loss, lse, z_loss, pred, accuracy, entropy, d_input, d_weight, d_bias): the gradients
    of a mean/sum loss are computed in this same pass (when neither the lse nor the entropy
    needs one of its own). rest: the options record's fields, need_dh, need_dw, need_db,
    want_pred, lse_grad, ent_grad."""
    o, (need_dh, need_dw, need_db, want_pred, lse_grad, ent_grad) = _opts(rest)
    reduction, shift, want_entropy = o.reduction, o.shift, o.entropy
    need = [n for n, f in (("hidden", need_dh), ("weight", need_dw), ("bias", need_db)) if f]
    if reduction == "none" or lse_grad or ent_grad:
        need = []  # the upstream gradients are only known in backward
    ldt = _loss_dtype(input.dtype)
    if input.is_cuda:
        loss, lse, z, pred, acc, ent, dh, dw, db = _cuda_pass(
            input, weight, target, bias, class_weight, o, need, want_pred=want_pred,
            token_weight=token_weight)
        empty = input.new_empty(0)
        if reduction == "none":
            loss, z = _per_token_view(loss, input, shift), _per_token_view(z, input, shift)
            if want_entropy:
                ent = _per_token_view(ent, input, shift)
        return (loss, _per_token_view(lse, input, shift), z,
                _per_token_view(pred, input, shift) if want_pred
                else input.new_empty(0, dtype=torch.int64),
                acc if want_pred else torch.full((), math.nan, device=input.device),
                ent if want_entropy else input.new_empty(0, dtype=ldt),
                dh if dh is not None else empty, dw if dw is not None else empty.clone(),
                db if db is not None else empty.clone())
    r = _run(input, weight, target, bias, class_weight, o, need, want_pred=want_pred,
             token_weight=token_weight)
    empty = torch.empty(0, dtype=input.dtype)
    return (torch.as_tensor(r.loss, dtype=ldt).clone(), _tensor(r.lse, ldt),
            torch.as_tensor(r.z_loss, dtype=ldt).clone(),
            _tensor(r.pred, torch.int64) if want_pred else torch.empty(0, dtype=torch.int64),
            torch.tensor(r.accuracy if want_pred else math.nan, dtype=torch.float32),
            torch.as_tensor(r.entropy, dtype=ldt).clone() if want_entropy
            else torch.empty(0, dtype=ldt),
            _tensor(r.d_hidden, input.dtype) if r.d_hidden is not None else empty,
            _tensor(r.d_weight, input.dtype) if r.d_weight is not None else empty.clone(),
            _tensor(r.d_bias, input.dtype) if r.d_bias is not None else empty.clone())


_lce_fwd = torch.library.custom_op(
    "algenta::lce_fwd", _lce_fwd_impl, mutates_args=(),
    schema=f"({_TENSORS}, {_OPTS}, bool need_dh, bool need_dw, bool need_db, bool want_pred, "
           "bool lse_grad, bool ent_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
           "Tensor, Tensor, Tensor)")


@_lce_fwd.register_fake
def _(input, weight, target, bias, class_weight, token_weight, *rest):
    o, (need_dh, need_dw, need_db, want_pred, lse_grad, ent_grad) = _opts(rest)
    ldt = _loss_dtype(input.dtype)
    per = _out_shape(input, o.shift)
    loss_shape = per if o.reduction == "none" else ()
    pre = o.reduction != "none" and not lse_grad and not ent_grad
    return (input.new_empty(loss_shape, dtype=ldt), input.new_empty(per, dtype=ldt),
            input.new_empty(loss_shape, dtype=ldt),
            input.new_empty(per if want_pred else (0,), dtype=torch.int64),
            input.new_empty((), dtype=torch.float32),
            input.new_empty(loss_shape if o.entropy else (0,), dtype=ldt),
            input.new_empty(input.shape if pre and need_dh else (0,)),
            input.new_empty(weight.shape if pre and need_dw else (0,)),
            input.new_empty(bias.shape if pre and need_db and bias is not None else (0,)))


def _lce_grad_impl(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                   class_weight: Optional[Tensor], token_weight: Optional[Tensor],
                   grad_loss: Tensor, grad_lse: Optional[Tensor], grad_entropy: Optional[Tensor],
                   *rest):
    """The backward's own pass of the core, for what the forward could not precompute: the
    per-token upstream gradient of reduction='none', and the gradients of a used lse or
    entropy (one pass for all of them). rest: the options record's fields, need_dh, need_dw,
    need_db."""
    o, (need_dh, need_dw, need_db) = _opts(rest)
    need = [n for n, f in (("hidden", need_dh), ("weight", need_dw), ("bias", need_db)) if f]
    ldt = _loss_dtype(input.dtype)
    per_tok = o.reduction == "none"
    empty = torch.empty(0, dtype=input.dtype, device=input.device)
    if not need:
        return empty, empty.clone(), empty.clone()
    ge = None
    if grad_entropy is not None:
        ge = grad_entropy.to(ldt) if per_tok else float(grad_entropy)
    # the entropy is computed in this pass only for its gradient
    o = o._replace(entropy=ge is not None)
    go = grad_loss.to(ldt) if per_tok else float(grad_loss)
    gl = None if grad_lse is None else grad_lse.to(ldt)
    if input.is_cuda:
        _, _, _, _, _, _, dh, dw, db = _cuda_pass(
            input, weight, target, bias, class_weight, o, need, grad_output=go, grad_lse=gl,
            token_weight=token_weight, grad_entropy=ge)
        e = input.new_empty(0)
        return (dh if need_dh else e, dw if need_dw else e.clone(), db if need_db else e.clone())
    r = _run(input, weight, target, bias, class_weight, o, need, grad_output=go, grad_lse=gl,
             token_weight=token_weight, grad_entropy=ge)
    return (_tensor(r.d_hidden, input.dtype) if need_dh else empty,
            _tensor(r.d_weight, input.dtype) if need_dw else empty.clone(),
            _tensor(r.d_bias, input.dtype) if need_db else empty.clone())


_lce_grad = torch.library.custom_op(
    "algenta::lce_grad", _lce_grad_impl, mutates_args=(),
    schema=f"({_TENSORS}, Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, {_OPTS}, "
           "bool need_dh, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)")


@_lce_grad.register_fake
def _(input, weight, target, bias, class_weight, token_weight, grad_loss, grad_lse, grad_entropy,
      *rest):
    _, (need_dh, need_dw, need_db) = _opts(rest)
    return (input.new_empty(input.shape if need_dh else (0,)),
            input.new_empty(weight.shape if need_dw else (0,)),
            input.new_empty(bias.shape if need_db and bias is not None else (0,)))


def _setup_fwd(ctx, inputs, output):
    input, weight, target, bias, class_weight, token_weight = inputs[:6]
    o, (need_dh, need_dw, need_db, _, lse_grad, ent_grad) = _opts(inputs[6:])
    loss, lse, z, pred, acc, ent, dh, dw, db = output
    # One call: each call of mark_non_differentiable replaces the set the previous one marked.
    ctx.mark_non_differentiable(z, pred, acc, dh, dw, db, *(() if lse_grad else (lse,)),
                                *(() if ent_grad else (ent,)))
    # Unmaterialized: autograd would otherwise hand backward a zero tensor for every output
    # without a gradient, d_weight's shape among them (a zero-filled copy of the weight).
    ctx.set_materialize_grads(False)
    ctx.loss_shape = loss.shape
    ctx.opts = o
    ctx.n_inputs = len(inputs)
    ctx.precomputed = o.reduction != "none" and not lse_grad and not ent_grad
    ctx.lse_grad, ctx.ent_grad = lse_grad, ent_grad
    # The forward's gradients are as large as the weight. Eager: held as a plain attribute, so
    # the first backward can take them, scale them in place and hand them on as the gradients
    # themselves (no second and third copy of d_weight); a later backward of a retained graph
    # finds them gone and makes its own pass. Compiled: saved tensors, scaled out of place, and
    # the compiler plans the memory.
    ctx.eager = not torch.compiler.is_compiling()
    ctx.grads = [dh, dw, db] if ctx.precomputed and ctx.eager else None
    if ctx.eager:
        ctx.save_for_backward(input, weight, target, bias, class_weight, token_weight)
    else:
        ctx.save_for_backward(input, weight, target, bias, class_weight, token_weight, dh, dw, db)


def _scaled(g: Tensor, by: Tensor) -> Tensor:
    """g * by, in place (g is the forward's own buffer, referenced by nothing else). An upstream
    gradient of exactly 1 (loss.backward()) skips the pass over g. A non-finite one (a sum
    divided by num_items_in_batch = 0) keeps g's exact zeros zero, as autograd's own chain does
    for ignored tokens (their gradient is a zero, not upstream * 0 = NaN). On CUDA, reading the
    scalar waits for the stream once per backward of the loss."""
    b = float(by)
    if b == 1.0:
        return g
    if math.isfinite(b):
        return g.mul_(by)  # the same type promotion, hence the same bits, as g * by
    return torch.where(g == 0, g, g * by)


def _backward_fwd(ctx, g_loss, g_lse, g_z, g_pred, g_acc, g_ent, *_unused):
    input, weight, target, bias, class_weight, token_weight = ctx.saved_tensors[:6]
    if g_loss is None:  # only the lse was used: the loss's upstream gradient is zero
        g_loss = torch.zeros(ctx.loss_shape, dtype=_loss_dtype(input.dtype), device=input.device)
    need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if ctx.precomputed and not ctx.eager:
        dh, dw, db = ctx.saved_tensors[6:]
        return (dh * g_loss if need_dh else None, dw * g_loss if need_dw else None, None,
                db * g_loss if need_db else None) + (None,) * (ctx.n_inputs - 4)
    if ctx.precomputed:
        if ctx.grads is not None:  # the first backward: the forward's gradients, taken
            (dh, dw, db), ctx.grads = ctx.grads, None
        else:  # a retained graph's next backward: the forward's pass again, the same bits
            one = torch.ones((), dtype=_loss_dtype(input.dtype), device=input.device)
            dh, dw, db = _lce_grad(input, weight, target, bias, class_weight, token_weight, one,
                                   None, None, *ctx.opts, need_dh, need_dw, need_db)
        return (_scaled(dh, g_loss) if need_dh else None, _scaled(dw, g_loss) if need_dw else None,
                None, _scaled(db, g_loss) if need_db else None) + (None,) * (ctx.n_inputs - 4)
    gdh, gdw, gdb = _lce_grad(input, weight, target, bias, class_weight, token_weight, g_loss,
                              g_lse if ctx.lse_grad else None, g_ent if ctx.ent_grad else None,
                              *ctx.opts, need_dh, need_dw, need_db)
    return (gdh if need_dh else None, gdw if need_dw else None, None,
            gdb if need_db else None) + (None,) * (ctx.n_inputs - 4)


_lce_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None,
                         reduction="mean", ignore_index=None, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0, shift=0, return_lse=False, return_z_loss=False,
                         return_accuracy=False, chunk=None, token_weight=None, temperature=1.0,
                         return_entropy=False):
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    ...)`` without the logits; the signature of PyTorch's ``F.linear_cross_entropy``.

    input ``[..., d_model]`` and linear_weight ``[vocab, d_model]``: CPU tensors of one dtype
    (float32, float64, bfloat16, float16; any strides). target ``[...]``: integer class indices,
    ``ignore_index`` (default -100, as PyTorch maps None) marking tokens that count for nothing.
    ``linear_bias [vocab]`` (linear_weight's dtype) and ``weight [vocab]`` (class weights,
    PyTorch's semantics: the mean divides by the counted targets' weights) are optional.
    ``reduction="none"`` returns the per-token losses with target's shape (minus ``shift``
    positions of the last axis). Keyword-only extras: ``softcap=c`` caps each logit to
    ``c * tanh(z / c)``; ``lse_square_scale=s`` adds ``s * lse**2`` per counted token (the
    z-loss, averaged over counted tokens for "mean"); ``shift=k`` scores ``input[..., t, :]``
    against ``target[..., t + k]`` within each sequence (the second-to-last axis), nothing
    copied. ``return_lse`` / ``return_z_loss`` / ``return_accuracy`` make the result a
    :class:`LinearCrossEntropyOutput` (the per-token lse is differentiable). ``chunk`` (tokens per
    pass, default the largest the logit budget admits) changes no result by a single bit.
    ``token_weight`` (target's shape, finite and >= 0; no gradient) multiplies each counted
    token's loss: u_t (ce_t + z_t); "mean" then divides by sum_t u_t w_{y_t} (w the class weights,
    ones without) and averages the z-loss with weights u. With ``reduction="none"`` and neither
    label smoothing, class weights nor z-loss, ``-loss`` is each token's log-probability of its
    target (times u_t), differentiable: what policy-gradient losses need.
    ``temperature=T`` (finite, > 0) divides the (biased, capped) logits before the softmax,
    gradients through it: the loss, lse and argmax are of ``z / T``, so ``-loss`` with
    ``reduction="none"`` is the log-probability a sampler at temperature T gave each target.
    ``return_entropy=True`` adds the (tempered) softmax's entropy ``H_t = lse_t - sum_v p_v z_v``,
    differentiable, reduced as the z-loss term (over counted tokens, weighted by token_weight;
    per token for "none"): ``loss - c * out.entropy`` trains with one backward pass of the core.

    For "mean"/"sum" the gradients are computed in the forward pass, in the same sweep as the
    loss, and scaled by the upstream gradient in backward; only the inputs that require grad
    (with grad mode on) get one. For "none", or when the lse is returned, the backward makes its
    own pass with the upstream gradients. Loss, lse and gradients are bit-identical for every
    chunk size and thread count.
    """
    o = _check(input, linear_weight, target, linear_bias, weight, token_weight, dict(
        reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing, softcap=softcap, temperature=temperature,
        lse_square_scale=lse_square_scale, shift=shift, chunk=chunk, entropy=return_entropy))
    reduction = o.reduction
    if torch.is_autocast_enabled(input.device.type):
        # As F.linear under autocast: the projection's operands in the autocast dtype (the
        # casts are part of the graph, so float32 parameters get float32 gradients).
        low = torch.get_autocast_dtype(input.device.type)
        input, linear_weight = input.to(low), linear_weight.to(low)
        if linear_bias is not None:
            linear_bias = linear_bias.to(low)
    unbatched = input.dim() == 1
    if unbatched:
        input, target = input.unsqueeze(0), target.unsqueeze(0)
        if token_weight is not None:
            token_weight = token_weight.unsqueeze(0)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and input.requires_grad
    need_dw = grad_on and linear_weight.requires_grad
    need_db = grad_on and linear_bias is not None and linear_bias.requires_grad
    any_grad = need_dh or need_dw or need_db
    lse_grad = bool(return_lse) and any_grad
    ent_grad = bool(return_entropy) and any_grad
    loss, lse, z, pred, acc, ent, _, _, _ = _lce_fwd(
        input, linear_weight, target, linear_bias, weight, token_weight, *o, need_dh, need_dw,
        need_db, bool(return_accuracy), lse_grad, ent_grad)
    if unbatched:
        lse, pred = lse.squeeze(0), pred.squeeze(0) if return_accuracy else pred
        if reduction == "none":
            loss, z = loss.squeeze(0), z.squeeze(0)
            ent = ent.squeeze(0) if return_entropy else ent
    if not (return_lse or return_z_loss or return_accuracy or return_entropy):
        return loss
    return LinearCrossEntropyOutput(loss, lse if return_lse else None,
                                    z if return_z_loss else None,
                                    pred if return_accuracy else None,
                                    acc if return_accuracy else None,
                                    ent if return_entropy else None)


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`linear_cross_entropy`: ``loss_fn(hidden, linear_weight, target,
    linear_bias=None, token_weight=None)``.

    It holds no parameters: the head's weight is passed in, so it can be tied to an embedding or
    live in another module; class weights (``weight=``) are a buffer."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=None, *,
                 weight=None, softcap=None, lse_square_scale=0.0, shift=0, temperature=1.0):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = as_int(ignore_index, "ignore_index")
        self.reduction = reduction
        self.label_smoothing = as_float(label_smoothing, "label_smoothing")
        self.chunk = None if chunk is None else as_int(chunk, "chunk")
        self.softcap = None if softcap is None else as_float(softcap, "softcap")
        self.lse_square_scale = as_float(lse_square_scale, "lse_square_scale")
        self.temperature = as_float(temperature, "temperature")
        self.shift = as_int(shift, "shift")
        self.register_buffer("weight", weight)

    def forward(self, hidden, linear_weight, target, linear_bias=None, token_weight=None):
        return linear_cross_entropy(hidden, linear_weight, target, linear_bias=linear_bias,
                                    token_weight=token_weight,
                                    weight=self.weight, reduction=self.reduction,
                                    ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, softcap=self.softcap,
                                    lse_square_scale=self.lse_square_scale, shift=self.shift,
                                    chunk=self.chunk, temperature=self.temperature)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, chunk={self.chunk}, "
                f"softcap={self.softcap}, lse_square_scale={self.lse_square_scale}, "
                f"shift={self.shift}, temperature={self.temperature}")

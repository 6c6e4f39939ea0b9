"""algenta.torch: the fused linear + cross-entropy loss as a PyTorch op.

``linear_cross_entropy(input, linear_weight, target)`` takes the keywords of PyTorch's own
``F.linear_cross_entropy`` (``linear_bias``, ``weight`` for class weights, ``reduction``,
``ignore_index``, ``label_smoothing``) and equals ``F.cross_entropy(F.linear(input,
linear_weight, linear_bias), target, ...)`` and its gradients, computed by the C++ core a chunk
of tokens at a time: the ``[n_tok, vocab]`` logits never exist, in the forward or the backward.
Beyond PyTorch's options, keyword-only: ``softcap`` (Gemma 2's logit soft cap), the z-loss
(``lse_square_scale``, its term returned with ``return_z_loss``), next-token ``shift``, the
per-token ``lse`` as a differentiable output (``return_lse``) and token accuracy
(``return_accuracy``). ``vocab_parallel_linear_cross_entropy`` is the same loss when the rows of
the head are sharded over the ranks of a ``torch.distributed`` group.

The op is registered with ``torch.library`` (``algenta::lce_fwd`` and ``algenta::lce_grad``, each
with a fake implementation, autograd registered), so ``torch.compile(fullgraph=True)`` keeps it
in the graph. float32, float64, bfloat16 and float16 tensors are accepted; half precision
computes in float32 (inputs widened as the core packs them, never copied), returns a float32 loss
and gradients in the input dtype. Under ``torch.autocast`` the inputs are cast to the autocast
dtype first, as ``F.linear`` is, and the loss is float32, as ``F.cross_entropy``'s under autocast.

Tensors go to the core as zero-copy NumPy views; a non-contiguous tensor is made contiguous once.
The gradients the core returns become tensors without a copy.

Limits: CPU tensors only (a CUDA tensor is refused, not moved behind the caller's back);
class-index targets only (no probability targets); double backward is not supported. Inputs the
core refuses (NaN/inf, targets out of range, empty or oversized shapes, a negative soft cap) raise
``algenta.LossError`` with its status.

This module imports torch; ``import algenta`` does not import it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _core
from ._convert import I64_MAX, I64_MIN, as_float, as_i64_clamped, as_int
from .errors import LossError
from ._dtypes import HalfBits, torch_short_name
from .lossk.cross_entropy import vocab_shard_pass
from .lossk.cross_entropy import linear_cross_entropy as _np_linear_cross_entropy

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "LinearCrossEntropyOutput",
           "vocab_parallel_linear_cross_entropy", "ce_from_logits", "ce_grad_logits",
           "CEAccumulator"]

_lossk = _core.lossk
_REDUCTIONS = ("mean", "sum", "none")
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
# Tokens per step of the small gathers done next to the core (target rows of the head in the
# vocab-parallel backward): bounds their temporaries at this many rows of d_model.
_GATHER_ROWS = 4096


class LinearCrossEntropyOutput(NamedTuple):
    """What linear_cross_entropy returns when any return_* flag is set: each field the flag
    asked for (else None). lse is differentiable; z_loss (already part of loss), pred and
    accuracy are not."""

    loss: Tensor
    lse: Optional[Tensor]
    z_loss: Optional[Tensor]
    pred: Optional[Tensor]
    accuracy: Optional[Tensor]


# ---- argument checks ----------------------------------------------------------------------------

def _float_tensor(x, name: str, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{name} is on device {x.device}, the input on {device}; every tensor of "
                         "one call must be on one device (nothing is moved behind your back)")
    if x.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, float64, bfloat16 or float16, got {x.dtype}")


def _check(input, weight, target, bias, class_weight, reduction, ignore_index, label_smoothing,
           softcap, lse_square_scale, shift, chunk, cuda_ok=True):
    """Validates what torch-side code must know before the core sees anything (types, devices,
    shapes); returns the options. Value checks the core makes itself (NaN/inf, target range,
    label_smoothing, soft cap and z-loss ranges, chunk budget, shift) are left to it so their
    status codes are the core's."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    dev = input.device
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not cuda_ok):
        where = "CPU and CUDA tensors" if cuda_ok else "CPU tensors"
        raise ValueError(f"input is on device {dev}; this function computes on {where} only")
    _float_tensor(input, "input", dev)
    _float_tensor(weight, "linear_weight", dev)
    if weight.dtype != input.dtype:
        raise TypeError(f"input and linear_weight must share one dtype, got {input.dtype} and "
                        f"{weight.dtype}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.device != dev:
        raise ValueError(f"target is on device {target.device}, the input on {dev}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype} "
                        "(probability targets are not supported)")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise LossError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}", 588)
    ii = -100 if ignore_index is None else as_int(ignore_index, "ignore_index")
    if not I64_MIN <= ii <= I64_MAX:
        raise LossError(f"ignore_index={ii} is beyond int64", 586)
    ls = as_float(label_smoothing, "label_smoothing")
    cap = None if softcap is None else as_float(softcap, "softcap")
    zs = as_float(lse_square_scale, "lse_square_scale")
    k = as_int(shift, "shift")
    if chunk is not None:  # past int64 clamped (the op's schema takes int64): the core's 583
        chunk = as_i64_clamped(chunk, "chunk")
    if input.dim() < 1 or weight.dim() != 2:
        raise LossError(f"input must be [..., d_model] and linear_weight [vocab, d_model], got "
                        f"shapes {tuple(input.shape)} and {tuple(weight.shape)}", 582)
    d = input.shape[-1]
    if weight.shape[1] != d:
        raise LossError(f"linear_weight has d_model {weight.shape[1]}, input has {d}", 582)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise LossError(f"target must have shape {tuple(input.shape[:-1])} (input's leading "
                        f"dimensions), got {tuple(target.shape)}", 582)
    if k and input.dim() < 2:
        raise LossError("shift needs input [..., seq, d_model]", 582)
    if bias is not None:
        _float_tensor(bias, "linear_bias", dev)
        if bias.dtype != weight.dtype:
            raise LossError(f"linear_bias must have linear_weight's dtype {weight.dtype}, got "
                            f"{bias.dtype}", 582)
        if tuple(bias.shape) != (weight.shape[0],):
            raise LossError(f"linear_bias must have shape ({weight.shape[0]},), got "
                            f"{tuple(bias.shape)}", 582)
    if class_weight is not None:
        _float_tensor(class_weight, "weight", dev)
        if tuple(class_weight.shape) != (weight.shape[0],):
            raise LossError(f"weight (class weights) must have shape ({weight.shape[0]},), got "
                            f"{tuple(class_weight.shape)}", 582)
    return reduction, ii, ls, cap, zs, k, chunk


# ---- tensors <-> the NumPy core -----------------------------------------------------------------

def _core_view(x: Tensor):
    """x's data for the core without a copy (contiguous first if it is not): a NumPy array, or
    HalfBits for bfloat16."""
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return HalfBits(x.view(torch.int16).numpy(), "bfloat16")
    return x.numpy()


def _tensor(a, dtype) -> Tensor:
    """A core result as a tensor of `dtype`, without a copy."""
    if isinstance(a, HalfBits):
        return torch.from_numpy(a.bits).view(dtype)
    return torch.from_numpy(np.ascontiguousarray(a))


def _run(input, weight, target, bias, class_weight, reduction, ii, ls, cap, zs, shift, chunk,
         need, grad_output=None, grad_lse=None, want_pred=False):
    """One pass of the core through the NumPy API on tensors' data; only the gradients in
    `need` (a subset of hidden, weight, bias) are computed."""
    t = target.detach()
    t = t.contiguous() if t.dtype == torch.int64 else t.to(torch.int64).contiguous()
    cw = None
    if class_weight is not None:
        cw = class_weight.detach().to(torch.float64 if input.dtype == torch.float64
                                      else torch.float32).contiguous().numpy()
    return _np_linear_cross_entropy(
        _core_view(input), _core_view(weight), t.numpy(),
        bias=None if bias is None else _core_view(bias), class_weight=cw, chunk=chunk,
        reduction=reduction, ignore_index=ii, label_smoothing=ls, softcap=cap,
        lse_square_scale=zs, shift=shift, return_accuracy=want_pred,
        with_grad=tuple(need) if need else False,
        grad_output=grad_output.detach().contiguous().numpy()
        if isinstance(grad_output, Tensor) else grad_output,
        grad_lse=None if grad_lse is None else grad_lse.detach().contiguous().numpy())




def _per_token_full(x: Tensor, input: Tensor, shift: int, dtype) -> Tensor:
    """A per-token upstream gradient of the output's shape as (n_tok,) on the input's device,
    zeros at the positions a shift leaves unscored."""
    lead = tuple(input.shape[:-1])
    x = x.detach().to(dtype)
    if shift:
        full = torch.zeros(lead, dtype=dtype, device=input.device)
        full[..., : lead[-1] - shift] = x
        x = full
    return x.reshape(-1).contiguous()


def _cuda_pass(input, weight, target, bias, class_weight, reduction, ii, ls, cap, zs, shift,
               chunk, need, grad_output=None, grad_lse=None, want_pred=False):
    """One pass of the CUDA backend on the tensors' device and PyTorch's current stream; the
    scratch comes from PyTorch's allocator. Returns (loss, lse, z, pred, accuracy, d_hidden,
    d_weight, d_bias), per-token outputs flat (n_tok,) and unwanted ones None."""
    dev = input.device
    lead = tuple(input.shape[:-1])
    n, d, v = math.prod(lead), input.shape[-1], weight.shape[0]
    ct = torch.float64 if input.dtype == torch.float64 else torch.float32
    per_tok = reduction == "none"
    want = {"loss": not per_tok, "z": not per_tok, "loss_tok": per_tok, "z_tok": per_tok,
            "lse": True, "pred": want_pred, "accuracy": want_pred,
            "d_hidden": "hidden" in need, "d_weight": "weight" in need,
            "d_bias": "bias" in need}
    k = {"n_tok": n, "d_model": d, "vocab": v,
         "chunk": chunk if chunk is not None else max(_lossk.loss_max_chunk(n, v), 1),
         "elem": torch_short_name(input.dtype), "grad_elem": torch_short_name(input.dtype), "reduction": reduction,
         "has_ignore": True, "ignore_index": ii, "label_smoothing": ls, "softcap": cap,
         "z_loss": zs, "shift": shift, "seq_len": lead[-1] if shift else 0,
         "grad_scale": 1.0 if isinstance(grad_output, Tensor) or grad_output is None
         else float(grad_output)}
    # The core's shape refusals come first, before anything is allocated on the device.
    _lossk.cuda_set_device(dev.index if dev.index is not None else torch.cuda.current_device())
    ws_bytes = _lossk.fused_linear_ce_dev_workspace({**k, **{n_: int(f) for n_, f in want.items()}})
    keep = []  # every tensor whose pointer the core reads, alive until the call returns

    def p(x):
        if x is None:
            return 0
        keep.append(x)
        return x.data_ptr()

    k.update(hidden=p(input.detach().contiguous()), weight=p(weight.detach().contiguous()),
             targets=p(target.detach().reshape(n).to(torch.int64).contiguous()))
    if bias is not None:
        k["bias"] = p(bias.detach().contiguous())
    if class_weight is not None:
        k["class_weight"] = p(class_weight.detach().to(ct).contiguous())
    if isinstance(grad_output, Tensor):
        k["grad_output"] = p(_per_token_full(grad_output, input, shift, ct))
    if grad_lse is not None:
        k["grad_lse"] = p(_per_token_full(grad_lse, input, shift, ct))
    shapes = {"loss": (), "z": (), "loss_tok": (n,), "z_tok": (n,), "lse": (n,), "pred": (n,),
              "accuracy": (), "d_hidden": tuple(input.shape), "d_weight": tuple(weight.shape),
              "d_bias": (v,)}
    dtypes = {"pred": torch.int64, "accuracy": torch.float32, "d_hidden": input.dtype,
              "d_weight": input.dtype, "d_bias": input.dtype}
    out = {}
    for name, wanted in want.items():
        if wanted:
            out[name] = torch.empty(shapes[name], dtype=dtypes.get(name, ct), device=dev)
            k[name] = p(out[name])
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    _lossk.fused_linear_ce_dev(k, ws.data_ptr(), ws_bytes,
                               torch.cuda.current_stream(dev).cuda_stream)
    loss = out["loss_tok"] if per_tok else out["loss"]
    z = out["z_tok"] if per_tok else out["z"]
    return (loss, out["lse"], z, out.get("pred"), out.get("accuracy"), out.get("d_hidden"),
            out.get("d_weight"), out.get("d_bias"))


def _per_token_view(x: Tensor, input: Tensor, shift: int) -> Tensor:
    """(n_tok,) per-token values as the output's shape (input's leading axes, minus the shift)."""
    lead = tuple(input.shape[:-1])
    x = x.view(lead)
    return x[..., : lead[-1] - shift].contiguous() if shift else x


def _loss_dtype(dtype):
    return torch.float32 if dtype in _HALF else dtype


def _out_shape(input: Tensor, shift: int):
    lead = tuple(input.shape[:-1])
    return lead[:-1] + (lead[-1] - shift,) if shift else lead


# ---- the ops --------------------------------------------------------------------------------------

@torch.library.custom_op("algenta::lce_fwd", mutates_args=())
def _lce_fwd(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
             class_weight: Optional[Tensor], reduction: str, ignore_index: int,
             label_smoothing: float, softcap: Optional[float], lse_square_scale: float,
             shift: int, chunk: Optional[int], need_dh: bool, need_dw: bool, need_db: bool,
             want_pred: bool, lse_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                       Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss, pred, accuracy, d_input, d_weight, d_bias): the gradients of a
    mean/sum loss are computed in this same pass (when the lse needs none of its own)."""
    need = [n for n, f in (("hidden", need_dh), ("weight", need_dw), ("bias", need_db)) if f]
    if reduction == "none" or lse_grad:
        need = []  # the upstream gradients are only known in backward
    if input.is_cuda:
        loss, lse, z, pred, acc, dh, dw, db = _cuda_pass(
            input, weight, target, bias, class_weight, reduction, ignore_index, label_smoothing,
            softcap, lse_square_scale, shift, chunk, need, want_pred=want_pred)
        empty = input.new_empty(0)
        if reduction == "none":
            loss, z = _per_token_view(loss, input, shift), _per_token_view(z, input, shift)
        return (loss, _per_token_view(lse, input, shift), z,
                _per_token_view(pred, input, shift) if want_pred
                else input.new_empty(0, dtype=torch.int64),
                acc if want_pred else torch.full((), math.nan, device=input.device),
                dh if dh is not None else empty, dw if dw is not None else empty.clone(),
                db if db is not None else empty.clone())
    r = _run(input, weight, target, bias, class_weight, reduction, ignore_index,
             label_smoothing, softcap, lse_square_scale, shift, chunk, need, want_pred=want_pred)
    ldt = _loss_dtype(input.dtype)
    empty = torch.empty(0, dtype=input.dtype)
    return (torch.as_tensor(r.loss, dtype=ldt).clone(), _tensor(r.lse, ldt),
            torch.as_tensor(r.z_loss, dtype=ldt).clone(),
            _tensor(r.pred, torch.int64) if want_pred else torch.empty(0, dtype=torch.int64),
            torch.tensor(r.accuracy if want_pred else math.nan, dtype=torch.float32),
            _tensor(r.d_hidden, input.dtype) if r.d_hidden is not None else empty,
            _tensor(r.d_weight, input.dtype) if r.d_weight is not None else empty.clone(),
            _tensor(r.d_bias, input.dtype) if r.d_bias is not None else empty.clone())


@_lce_fwd.register_fake
def _(input, weight, target, bias, class_weight, reduction, ignore_index, label_smoothing,
      softcap, lse_square_scale, shift, chunk, need_dh, need_dw, need_db, want_pred, lse_grad):
    ldt = _loss_dtype(input.dtype)
    per = _out_shape(input, shift)
    loss_shape = per if reduction == "none" else ()
    pre = reduction != "none" and not lse_grad
    return (input.new_empty(loss_shape, dtype=ldt), input.new_empty(per, dtype=ldt),
            input.new_empty(loss_shape, dtype=ldt),
            input.new_empty(per if want_pred else (0,), dtype=torch.int64),
            input.new_empty((), dtype=torch.float32),
            input.new_empty(input.shape if pre and need_dh else (0,)),
            input.new_empty(weight.shape if pre and need_dw else (0,)),
            input.new_empty(bias.shape if pre and need_db and bias is not None else (0,)))


@torch.library.custom_op("algenta::lce_grad", mutates_args=())
def _lce_grad(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
              class_weight: Optional[Tensor], grad_loss: Tensor, grad_lse: Optional[Tensor],
              reduction: str, ignore_index: int, label_smoothing: float,
              softcap: Optional[float], lse_square_scale: float, shift: int,
              chunk: Optional[int], need_dh: bool, need_dw: bool,
              need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's own pass of the core, for what the forward could not precompute: the
    per-token upstream gradient of reduction='none', and the gradient of a used lse."""
    need = [n for n, f in (("hidden", need_dh), ("weight", need_dw), ("bias", need_db)) if f]
    ldt = _loss_dtype(input.dtype)
    go = grad_loss.to(ldt) if reduction == "none" else float(grad_loss)
    empty = torch.empty(0, dtype=input.dtype, device=input.device)
    if not need:
        return empty, empty.clone(), empty.clone()
    if input.is_cuda:
        _, _, _, _, _, dh, dw, db = _cuda_pass(
            input, weight, target, bias, class_weight, reduction, ignore_index, label_smoothing,
            softcap, lse_square_scale, shift, chunk, need,
            grad_output=grad_loss.to(ldt) if reduction == "none" else float(grad_loss),
            grad_lse=None if grad_lse is None else grad_lse.to(ldt))
        e = input.new_empty(0)
        return (dh if need_dh else e, dw if need_dw else e.clone(), db if need_db else e.clone())
    r = _run(input, weight, target, bias, class_weight, reduction, ignore_index,
             label_smoothing, softcap, lse_square_scale, shift, chunk, need, grad_output=go,
             grad_lse=None if grad_lse is None else grad_lse.to(ldt))
    return (_tensor(r.d_hidden, input.dtype) if need_dh else empty,
            _tensor(r.d_weight, input.dtype) if need_dw else empty.clone(),
            _tensor(r.d_bias, input.dtype) if need_db else empty.clone())


@_lce_grad.register_fake
def _(input, weight, target, bias, class_weight, grad_loss, grad_lse, reduction, ignore_index,
      label_smoothing, softcap, lse_square_scale, shift, chunk, need_dh, need_dw, need_db):
    return (input.new_empty(input.shape if need_dh else (0,)),
            input.new_empty(weight.shape if need_dw else (0,)),
            input.new_empty(bias.shape if need_db and bias is not None else (0,)))


def _setup_fwd(ctx, inputs, output):
    (input, weight, target, bias, class_weight, reduction, ii, ls, cap, zs, shift, chunk,
     need_dh, need_dw, need_db, want_pred, lse_grad) = inputs
    loss, lse, z, pred, acc, dh, dw, db = output
    ctx.mark_non_differentiable(z, pred, acc, dh, dw, db)
    if not lse_grad:
        ctx.mark_non_differentiable(lse)
    # Unmaterialized: autograd would otherwise hand backward a zero tensor for every output
    # without a gradient, d_weight's shape among them (a zero-filled copy of the weight).
    ctx.set_materialize_grads(False)
    ctx.loss_shape = loss.shape
    ctx.opts = (reduction, ii, ls, cap, zs, shift, chunk)
    ctx.precomputed = reduction != "none" and not lse_grad
    ctx.lse_grad = lse_grad
    # The forward's gradients are as large as the weight. Eager: held as a plain attribute, so
    # the first backward can take them, scale them in place and hand them on as the gradients
    # themselves (no second and third copy of d_weight); a later backward of a retained graph
    # finds them gone and makes its own pass. Compiled: saved tensors, scaled out of place, and
    # the compiler plans the memory.
    ctx.eager = not torch.compiler.is_compiling()
    ctx.grads = [dh, dw, db] if ctx.precomputed and ctx.eager else None
    if ctx.eager:
        ctx.save_for_backward(input, weight, target, bias, class_weight)
    else:
        ctx.save_for_backward(input, weight, target, bias, class_weight, dh, dw, db)


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


def _backward_fwd(ctx, g_loss, g_lse, *_unused):
    input, weight, target, bias, class_weight = ctx.saved_tensors[:5]
    if g_loss is None:  # only the lse was used: the loss's upstream gradient is zero
        g_loss = torch.zeros(ctx.loss_shape, dtype=_loss_dtype(input.dtype), device=input.device)
    need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if ctx.precomputed and not ctx.eager:
        dh, dw, db = ctx.saved_tensors[5:]
        return (dh * g_loss if need_dh else None, dw * g_loss if need_dw else None, None,
                db * g_loss if need_db else None) + (None,) * 13
    if ctx.precomputed:
        if ctx.grads is not None:  # the first backward: the forward's gradients, taken
            (dh, dw, db), ctx.grads = ctx.grads, None
        else:  # a retained graph's next backward: the forward's pass again, the same bits
            one = torch.ones((), dtype=_loss_dtype(input.dtype), device=input.device)
            dh, dw, db = _lce_grad(input, weight, target, bias, class_weight, one, None,
                                   *ctx.opts, need_dh, need_dw, need_db)
        return (_scaled(dh, g_loss) if need_dh else None, _scaled(dw, g_loss) if need_dw else None,
                None, _scaled(db, g_loss) if need_db else None) + (None,) * 13
    gdh, gdw, gdb = _lce_grad(input, weight, target, bias, class_weight, g_loss,
                              g_lse if ctx.lse_grad else None, *ctx.opts, need_dh, need_dw,
                              need_db)
    return (gdh if need_dh else None, gdw if need_dw else None, None,
            gdb if need_db else None) + (None,) * 13


_lce_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None,
                         reduction="mean", ignore_index=None, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0, shift=0, return_lse=False, return_z_loss=False,
                         return_accuracy=False, chunk=None):
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

    For "mean"/"sum" the gradients are computed in the forward pass, in the same sweep as the
    loss, and scaled by the upstream gradient in backward; only the inputs that require grad
    (with grad mode on) get one. For "none", or when the lse is returned, the backward makes its
    own pass with the upstream gradients. Loss, lse and gradients are bit-identical for every
    chunk size and thread count.
    """
    reduction, ii, ls, cap, zs, k, chunk = _check(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
        label_smoothing, softcap, lse_square_scale, shift, chunk)
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
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and input.requires_grad
    need_dw = grad_on and linear_weight.requires_grad
    need_db = grad_on and linear_bias is not None and linear_bias.requires_grad
    lse_grad = bool(return_lse) and (need_dh or need_dw or need_db)
    loss, lse, z, pred, acc, _, _, _ = _lce_fwd(
        input, linear_weight, target, linear_bias, weight, reduction, ii, ls, cap, zs, k, chunk,
        need_dh, need_dw, need_db, bool(return_accuracy), lse_grad)
    if unbatched:
        lse, pred = lse.squeeze(0), pred.squeeze(0) if return_accuracy else pred
        if reduction == "none":
            loss, z = loss.squeeze(0), z.squeeze(0)
    if not (return_lse or return_z_loss or return_accuracy):
        return loss
    return LinearCrossEntropyOutput(loss, lse if return_lse else None,
                                    z if return_z_loss else None,
                                    pred if return_accuracy else None,
                                    acc if return_accuracy else None)


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`linear_cross_entropy`: ``loss_fn(hidden, linear_weight, target,
    linear_bias=None)``.

    It holds no parameters: the head's weight is passed in, so it can be tied to an embedding or
    live in another module; class weights (``weight=``) are a buffer."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=None, *,
                 weight=None, softcap=None, lse_square_scale=0.0, shift=0):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = as_int(ignore_index, "ignore_index")
        self.reduction = reduction
        self.label_smoothing = as_float(label_smoothing, "label_smoothing")
        self.chunk = None if chunk is None else as_int(chunk, "chunk")
        self.softcap = None if softcap is None else as_float(softcap, "softcap")
        self.lse_square_scale = as_float(lse_square_scale, "lse_square_scale")
        self.shift = as_int(shift, "shift")
        self.register_buffer("weight", weight)

    def forward(self, hidden, linear_weight, target, linear_bias=None):
        return linear_cross_entropy(hidden, linear_weight, target, linear_bias=linear_bias,
                                    weight=self.weight, reduction=self.reduction,
                                    ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, softcap=self.softcap,
                                    lse_square_scale=self.lse_square_scale, shift=self.shift,
                                    chunk=self.chunk)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, chunk={self.chunk}, "
                f"softcap={self.softcap}, lse_square_scale={self.lse_square_scale}, "
                f"shift={self.shift}")


# ---- the seed's materialized kernels on tensors --------------------------------------------------

def _logits_args(logits, target):
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("logits and target must be torch.Tensors")
    if logits.dtype != torch.float64:
        raise TypeError(f"logits must be float64 (the seed's reference precision), got "
                        f"{logits.dtype}; convert explicitly with .double()")
    if logits.device.type not in ("cpu", "cuda") or target.device != logits.device:
        raise ValueError(f"logits ({logits.device}) and target ({target.device}) must be on one "
                         "CPU or CUDA device")
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise LossError(f"logits must be [..., vocab] and target its leading shape, got "
                        f"{tuple(logits.shape)} and {tuple(target.shape)}", 582)
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    v = logits.shape[-1]
    n = math.prod(logits.shape[:-1])
    z = logits.detach().reshape(n, v).contiguous() if n and v else logits.detach()
    return z, target.detach().reshape(n).to(torch.int64).contiguous(), n, v


def _stream(t: Tensor) -> int:
    _lossk.cuda_set_device(t.device.index if t.device.index is not None
                           else torch.cuda.current_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def ce_from_logits(logits: Tensor, target: Tensor) -> Tensor:
    """Per-token cross-entropy of materialized float64 ``logits [..., vocab]`` against integer
    ``target [...]``, on the logits' device (CPU, or CUDA on the current stream): the seed's
    reference kernel, ``(max - z_y) + log sum exp(z - max)`` per row (exactly log(vocab) for
    equal logits). Not differentiable (see :func:`ce_grad_logits`)."""
    z, t, n, v = _logits_args(logits, target)
    if not z.is_cuda:
        loss, _ = _lossk.ce_from_logits(z.numpy(), t.numpy(), n, v, _lossk.LossSum(),
                                        per_token=True)
        return torch.from_numpy(loss).view(target.shape)
    loss = torch.empty(n, dtype=torch.float64, device=z.device)
    _lossk.ce_from_logits_dev(z.data_ptr(), t.data_ptr(), n, v, loss.data_ptr(), 0, _stream(z))
    return loss.view(target.shape)


def ce_grad_logits(logits: Tensor, target: Tensor, scale: float = 1.0) -> Tensor:
    """``(softmax(logits) - one_hot(target)) * scale`` of float64 ``logits [..., vocab]``, the
    gradient of the summed per-token cross-entropy times ``scale``, on the logits' device."""
    z, t, n, v = _logits_args(logits, target)
    s = as_float(scale, "scale")
    if not z.is_cuda:
        return torch.from_numpy(_lossk.ce_grad_logits(z.numpy(), t.numpy(), n, v, s)).view(
            logits.shape)
    out = torch.empty((n, v), dtype=torch.float64, device=z.device)
    _lossk.ce_grad_logits_dev(z.data_ptr(), t.data_ptr(), n, v, s, out.data_ptr(), _stream(z))
    return out.view(logits.shape)


class CEAccumulator:
    """Cross-entropy over float64 logits that arrive a piece at a time, summed in token order on
    ``device``: ``add(logits, target)`` per piece; ``total_loss`` and ``mean_loss`` are float64
    0-d tensors on that device, bit-identical to one :func:`ce_from_logits` pass over the
    concatenation summed in token order. On CUDA the running sum stays on the device (no
    synchronization per piece); ``n_tok`` reads it back."""

    def __init__(self, vocab: int, device="cpu"):
        self.vocab = as_int(vocab, "vocab")
        st = _lossk.loss_dims_check(1, 1, self.vocab)
        if st != 580:
            raise LossError(f"vocab={self.vocab} refused", st)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {self.device}")
        if self.device.type == "cuda":  # LossSum's total, first, shifted and count
            self._state = torch.zeros(4, dtype=torch.float64, device=self.device)
        else:
            self._sum = _lossk.LossSum()

    def add(self, logits: Tensor, target: Tensor) -> None:
        if logits.device != self.device:
            raise ValueError(f"logits are on {logits.device}, the accumulator on {self.device}")
        z, t, n, v = _logits_args(logits, target)
        if n == 0:
            return
        if v != self.vocab:
            raise LossError(f"logits have vocab {v}, the accumulator {self.vocab}", 582)
        if not z.is_cuda:
            _lossk.ce_from_logits(z.numpy(), t.numpy(), n, v, self._sum)
            return
        loss = torch.empty(n, dtype=torch.float64, device=z.device)
        stream = _stream(z)
        _lossk.ce_from_logits_dev(z.data_ptr(), t.data_ptr(), n, v, loss.data_ptr(), 0, stream)
        _lossk.loss_sum_add_dev(loss.data_ptr(), n, self._state.data_ptr(), stream)

    @property
    def n_tok(self) -> int:
        return int(self._state[3].item()) if self.device.type == "cuda" else self._sum.count

    @property
    def total_loss(self) -> Tensor:
        if self.device.type != "cuda":
            return torch.tensor(self._sum.total, dtype=torch.float64)
        return self._state[0].clone()

    @property
    def mean_loss(self) -> Tensor:
        """first + sum(l - first) / n, as LossSum (NaN before the first token)."""
        if self.device.type != "cuda":
            return torch.tensor(self._sum.mean, dtype=torch.float64)
        first, shifted, count = self._state[1], self._state[2], self._state[3]
        return torch.where(count > 0, first + shifted / count.clamp(min=1),
                           torch.full_like(first, math.nan))


def _targets_i64(target: torch.Tensor, n: int) -> torch.Tensor:
    t = target.detach().reshape(n)
    return t.contiguous() if t.dtype == torch.int64 else t.to(torch.int64).contiguous()


# ---- vocab-parallel over torch.distributed ------------------------------------------------------
#
# Rank k holds rows [s_k, s_k + V_k) of the head (and of the bias and the class weights) and the
# same hidden and target as every other rank. z' are the biased, soft-capped logits over the full
# vocabulary V, w the class weights (ones without), W = sum_v w_v:
#
#   lse_t = log sum_k exp(lse_t^k)                  lse_t^k: the shard's log-sum-exp
#   ce_t  = (1 - eps) w_y (lse_t - z'_y) + (eps / V) (W lse_t - sum_v w_v z'_v)
#   z_t   = s lse_t^2
#
# One core pass over the shard (lossk.cross_entropy.vocab_shard_pass) gives lse^k, z'_y (right on
# the rank that owns y) and sum_{v in shard} w_v z'_v. With M = max_k lse^k and
# S = sum_k exp(lse^k - M): lse_t - z'_y = log S + (M - z'_y), a sum of non-negative terms, so no
# large logit cancels against another even when one shard holds nearly all the probability.
#
# Backward: d/dz'_v = p_v A_t - B_t w_v - C_t [v == y], p = exp(z' - lse_t), with
#   A_t = s_ce ((1 - eps) w_y + (eps / V) W) + s_z 2 s lse_t,  B_t = s_ce eps / V,
#   C_t = s_ce (1 - eps) w_y on the owner (0 elsewhere),
# s_ce, s_z the reduction's per-token scales. A second core pass over the shard with these
# coefficients (A_t times exp(lse^k - lse_t), turning the shard's softmax into the global one)
# gives the shard's weight and bias gradients and its share of hidden's, which is all-reduced.
# The softmax needs the global lse, known only after the forward's all-reduces, hence the
# second pass.

_INFO = ("vocab_start", "shard_rows", "status", "n_tok", "d_model", "dtype", "need_dh",
         "need_dw", "need_db", "target_checksum", "reduction", "has_bias", "has_weights",
         "label_smoothing", "softcap", "lse_square_scale")


def _checksum(t: torch.Tensor) -> int:
    # int64 arithmetic wraps: a checksum, only compared for equality across ranks.
    w = torch.arange(1, t.numel() + 1, dtype=torch.int64)
    return int((t * w).sum()) ^ int(t.sum())


def _f64_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64))


class _VocabParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, n, d, opts, vocab_start, group,
                need_dh, need_dw, need_db):
        reduction, ii, ls, cap, zs, chunk = opts
        vs = weight.shape[0]
        t = _targets_i64(target, n)
        valid = t != ii
        own = valid & (t >= vocab_start) & (t < vocab_start + vs)
        t_loc = torch.where(own, t - vocab_start, torch.zeros_like(t))
        ldt = _loss_dtype(hidden.dtype)
        cw = None if class_weight is None else class_weight.detach().to(ldt).contiguous()
        h = _core_view(hidden.detach().reshape(n, d))
        w = _core_view(weight)
        b = None if bias is None else _core_view(bias)

        # Local work first, its refusal shared: a rank that raised alone would leave the others
        # waiting in the next collective until the group's timeout.
        err, r = None, None
        try:
            r = vocab_shard_pass(h, w, t_loc.numpy(), bias=b,
                                 class_weight=None if cw is None else cw.numpy(), softcap=cap,
                                 chunk=chunk)
        except LossError as e:
            err = e
        info = torch.tensor([vocab_start, vs, 0 if err is None else err.status, n, d,
                             _FLOATS.index(hidden.dtype), int(need_dh), int(need_dw),
                             int(need_db), _checksum(t), _REDUCTIONS.index(reduction),
                             int(bias is not None), int(cw is not None), _f64_bits(ls),
                             _f64_bits(-1.0 if cap is None else cap), _f64_bits(zs)],
                            dtype=torch.int64)
        world = dist.get_world_size(group)
        allinfo = [torch.empty_like(info) for _ in range(world)]
        dist.all_gather(allinfo, info, group=group)
        allinfo = torch.stack(allinfo)
        bad = allinfo[:, 2].nonzero().flatten().tolist()
        if bad:
            if err is not None:
                raise err
            k = bad[0]
            st = int(allinfo[k, 2])
            raise LossError(f"rank {k} of the group refused its shard with status {st} (see "
                            "that rank's error)", st)
        for j, name in enumerate(_INFO):
            if j in (0, 1, 2):
                continue
            if not bool((allinfo[:, j] == info[j]).all()):
                raise LossError(f"ranks disagree on {name}: every rank must pass the same hidden "
                                "shape, target, dtype, options and requires_grad", 582)
        starts, rows = allinfo[:, 0].tolist(), allinfo[:, 1].tolist()
        vocab = 0
        for s_, k in sorted(zip(starts, rows)):
            if s_ != vocab:
                raise LossError(f"the shards [vocab_start, vocab_start + rows) of the group "
                                f"{sorted(zip(starts, rows))} do not tile [0, vocab) without gap "
                                "or overlap", 582)
            vocab += k
        bad_t = valid & ((t < 0) | (t >= vocab))
        if bool(bad_t.any()):
            i = int(bad_t.nonzero()[0, 0])
            raise LossError(f"target {int(t[i])} at token {i} is outside [0, {vocab})", 586)

        f64 = torch.float64
        lse_k = torch.from_numpy(r.lse).to(f64)
        m = lse_k.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        zy = torch.from_numpy(r.target_logit).to(f64)
        pack = torch.zeros(4 * n + 1, dtype=f64)
        pack[:n] = torch.exp(lse_k - m)
        pack[n:2 * n] = torch.where(own, m - zy, torch.zeros_like(m))
        pack[2 * n:3 * n] = torch.from_numpy(r.logit_sum).to(f64)
        pack[3 * n:4 * n] = torch.where(own, cw.to(f64)[t_loc] if cw is not None
                                        else torch.ones_like(m), torch.zeros_like(m))
        pack[4 * n] = float(cw.to(f64).sum()) if cw is not None else float(vs)
        dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=group)
        log_s = torch.log(pack[:n])
        lse = m + log_s
        w_y, w_all = pack[3 * n:4 * n], float(pack[4 * n])
        ce = (1.0 - ls) * w_y * (log_s + pack[n:2 * n])
        if ls > 0.0:
            ce = ce + (ls / vocab) * (w_all * log_s + (w_all * m - pack[2 * n:3 * n]))
        zero = torch.zeros_like(ce)
        ce = torch.where(valid, ce, zero)
        zl = torch.where(valid, zs * lse * lse, zero)
        n_valid = int(valid.sum())
        w_tot = float(torch.where(valid, w_y, zero).sum())

        ctx.save_for_backward(hidden, weight, bias, class_weight, t_loc, valid, own, lse_k, lse,
                              w_y)
        ctx.meta = (hidden.shape, n, d, opts, vocab, n_valid, w_tot, w_all, group, need_dh,
                    need_dw, need_db)
        if reduction == "none":
            return (ce + zl).to(ldt).reshape(target.shape)
        if reduction == "sum":
            return torch.tensor(float(ce.sum() + zl.sum()), dtype=ldt)
        if not n_valid:
            return torch.tensor(math.nan, dtype=ldt)
        mean = float(ce.sum()) / w_tot if w_tot else math.nan
        return torch.tensor(mean + float(zl.sum()) / n_valid, dtype=ldt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (shape, n, d, opts, vocab, n_valid, w_tot, w_all, group, need_dh, need_dw,
         need_db) = ctx.meta
        reduction, ii, ls, cap, zs, chunk = opts
        hidden, weight, bias, class_weight, t_loc, valid, own, lse_k, lse, w_y = ctx.saved_tensors
        if not (need_dh or need_dw or need_db):
            return (None,) * 13
        f64 = torch.float64
        up = grad_out.detach().to(f64)
        zero = torch.zeros(n, dtype=f64)
        if reduction == "none":
            s_ce = s_z = up.reshape(n)
        elif reduction == "sum":
            s_ce = s_z = up.expand(n)
        else:
            s_ce = up.expand(n) / w_tot if w_tot else zero
            s_z = up.expand(n) / n_valid if n_valid else zero
        s_ce, s_z = torch.where(valid, s_ce, zero), torch.where(valid, s_z, zero)
        a = s_ce * ((1.0 - ls) * w_y + (ls / vocab) * w_all) + s_z * 2.0 * zs * lse
        coef = torch.stack([a * torch.exp(lse_k - lse), s_ce * (ls / vocab),
                            torch.where(own, s_ce * (1.0 - ls) * w_y, zero)], dim=1)
        ldt = _loss_dtype(hidden.dtype)
        need = tuple(nm for nm, f in (("hidden", need_dh), ("weight", need_dw), ("bias", need_db))
                     if f)
        r = vocab_shard_pass(
            _core_view(hidden.detach().reshape(n, d)), _core_view(weight), t_loc.numpy(),
            bias=None if bias is None else _core_view(bias),
            class_weight=None if class_weight is None
            else class_weight.detach().to(ldt).contiguous().numpy(),
            softcap=cap, chunk=chunk, grad_coef=coef.to(ldt).numpy(), with_grad=need)
        dh = dw = db = None
        if need_dh:
            dh = _tensor(r.d_hidden, hidden.dtype)
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)
            dh = dh.reshape(shape)
        if need_dw:
            dw = _tensor(r.d_weight, hidden.dtype)
        if need_db:
            db = _tensor(r.d_bias, hidden.dtype)
        return dh, dw, None, db, None, None, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden, weight_shard, target, *, vocab_start, group=None,
                                        linear_bias=None, weight=None, reduction="mean",
                                        ignore_index=None, label_smoothing=0.0, softcap=None,
                                        lse_square_scale=0.0, chunk=None):
    """The loss of :func:`linear_cross_entropy` with the head's rows sharded over ranks.

    Each rank of ``group`` (default: the world) passes the same ``hidden [..., d_model]`` and
    ``target [...]`` and its own ``weight_shard``, rows ``[vocab_start, vocab_start +
    weight_shard.shape[0])`` of the head, with the same rows of the bias (``linear_bias``) and
    of the class weights (``weight``) when given; the shards must tile ``[0, vocab)``. Per-token
    log-sum-exp, target logit, class weight and (for label smoothing) weighted logit sum are
    combined with ``torch.distributed`` all-reduces, so every rank gets the unsharded loss (to
    rounding) without any rank holding full-vocabulary logits. ``softcap`` and
    ``lse_square_scale`` act as in :func:`linear_cross_entropy`. The backward gives each rank the
    gradient of its shard (weight, bias) and the full (all-reduced) gradient of ``hidden``; every
    rank must call backward.

    Collectives per call: an all_gather of a few integers (the ranks' shapes, options and
    statuses: a refusal on one rank raises on all, and mismatched shards, targets or options
    are refused instead of hanging or returning a wrong loss), two all-reduces of n_tok-sized
    vectors, and in backward one all-reduce of the hidden gradient. The backward makes a second
    core pass over the shard. Works with any backend that supports all_gather and MAX/SUM
    all-reduce (gloo on CPU).
    """
    reduction, ii, ls, cap, zs, k, chunk = _check(
        hidden, weight_shard, target, linear_bias, weight, reduction, ignore_index,
        label_smoothing, softcap, lse_square_scale, 0, chunk, cuda_ok=False)
    vocab_start = as_int(vocab_start, "vocab_start")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs an initialized "
                           "torch.distributed process group (dist.init_process_group)")
    n, d = math.prod(hidden.shape[:-1]), hidden.shape[-1]
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight_shard.requires_grad
    need_db = grad_on and linear_bias is not None and linear_bias.requires_grad
    return _VocabParallelFn.apply(hidden, weight_shard, target, linear_bias, weight, n, d,
                                  (reduction, ii, ls, cap, zs, chunk), vocab_start, group,
                                  need_dh, need_dw, need_db)

"""Tensors to and from the core: zero-copy NumPy views of CPU tensors for the NumPy API, device
pointers for the CUDA entry points, and the core's results back as tensors without a copy."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .._dtypes import HalfBits, torch_short_name
from ..lossk import _args
from ..lossk.cross_entropy import _elem, _lce
from ._checks import _HALF, _lossk

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


def _numpy(x, dtype=None):
    """A tensor argument as a NumPy array of `dtype` (its own by default), or a scalar as it is."""
    if not isinstance(x, Tensor):
        return x
    x = x.detach()
    return (x if dtype is None else x.to(dtype)).contiguous().numpy()


def _run(input, weight, target, bias, class_weight, o: _args.CrossEntropyOptions, need,
         grad_output=None, grad_lse=None, want_pred=False, token_weight=None,
         grad_entropy=None):
    """One pass of the core through the NumPy API's body on tensors' data, with the options
    record `o`; only the gradients in `need` (a subset of hidden, weight, bias) are computed.
    grad_output and grad_entropy: per-token tensors for reduction "none", else scalars."""
    ct = torch.float64 if input.dtype == torch.float64 else torch.float32
    hv, wv = _core_view(input), _core_view(weight)
    t = _numpy(target, torch.int64)
    elem, h = _elem(hv)
    want = tuple(n in need for n in ("hidden", "weight", "bias"))
    return _lce(hv, wv, t.shape, (elem, h, _elem(wv)[1], t.reshape(-1)), o, want,
                bias=None if bias is None else _core_view(bias),
                class_weight=_numpy(class_weight, ct), token_weight=_numpy(token_weight, ct),
                grad_output=_numpy(grad_output), grad_lse=_numpy(grad_lse), grad_dtype=None,
                return_accuracy=want_pred, grad_entropy=_numpy(grad_entropy), device="cpu")


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


def _cuda_pass(input, weight, target, bias, class_weight, o: _args.CrossEntropyOptions, need,
               grad_output=None, grad_lse=None, want_pred=False, token_weight=None,
               grad_entropy=None):
    """One pass of the CUDA backend on the tensors' device and PyTorch's current stream, with the
    options record `o`; the scratch comes from PyTorch's allocator. Returns (loss, lse, z, pred,
    accuracy, entropy, d_hidden, d_weight, d_bias), per-token outputs flat (n_tok,) and unwanted
    ones None. grad_output and grad_entropy: per-token tensors for reduction "none", else
    scalars."""
    dev = input.device
    lead = tuple(input.shape[:-1])
    n, d, v = math.prod(lead), input.shape[-1], weight.shape[0]
    ct = torch.float64 if input.dtype == torch.float64 else torch.float32
    per_tok = o.reduction == "none"
    def scale(g, otherwise):  # a mean/sum loss's upstream scalar; a per-token tensor goes apart
        return otherwise if isinstance(g, Tensor) or g is None else float(g)

    o = o._replace(grad_scale=scale(grad_output, 1.0),
                   entropy_grad_scale=scale(grad_entropy, 0.0))
    want = {"loss": not per_tok, "z": not per_tok, "loss_tok": per_tok, "z_tok": per_tok,
            "lse": True, "pred": want_pred, "accuracy": want_pred,
            "entropy": o.entropy and not per_tok, "entropy_tok": o.entropy and per_tok,
            "d_hidden": "hidden" in need, "d_weight": "weight" in need,
            "d_bias": "bias" in need}
    k = {"n_tok": n, "d_model": d, "vocab": v, "seq_len": lead[-1],
         "elem": torch_short_name(input.dtype), "grad_elem": torch_short_name(input.dtype)}
    # The core's shape refusals come first, before anything is allocated on the device.
    _lossk.cuda_set_device(dev.index if dev.index is not None else torch.cuda.current_device())
    ws_bytes = _lossk.fused_linear_ce_dev_workspace(o, {**k, **{x: int(f)
                                                                for x, f in want.items()}})
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
    if token_weight is not None:
        k["token_weight"] = p(token_weight.detach().reshape(n).to(ct).contiguous())
    if isinstance(grad_output, Tensor):
        k["grad_output"] = p(_per_token_full(grad_output, input, o.shift, ct))
    if grad_lse is not None:
        k["grad_lse"] = p(_per_token_full(grad_lse, input, o.shift, ct))
    if isinstance(grad_entropy, Tensor):
        k["grad_entropy"] = p(_per_token_full(grad_entropy, input, o.shift, ct))
    shapes = {"loss": (), "z": (), "loss_tok": (n,), "z_tok": (n,), "lse": (n,), "pred": (n,),
              "entropy": (), "entropy_tok": (n,),
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
    _lossk.fused_linear_ce_dev(o, k, ws.data_ptr(), ws_bytes,
                               torch.cuda.current_stream(dev).cuda_stream)
    loss = out["loss_tok"] if per_tok else out["loss"]
    z = out["z_tok"] if per_tok else out["z"]
    ent = out.get("entropy_tok" if per_tok else "entropy")
    return (loss, out["lse"], z, out.get("pred"), out.get("accuracy"), ent, out.get("d_hidden"),
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

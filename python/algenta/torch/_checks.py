"""Argument checks of algenta.torch: what torch-side code must know before the core sees
anything (types, devices, shapes). Value checks the core makes itself (NaN/inf, target range,
option ranges, the chunk budget) are left to it, so their status codes are the core's."""

from __future__ import annotations

import torch

from .. import _core
from ..errors import LossError
from ..lossk import _args

_lossk = _core.lossk
_REDUCTIONS = _args.REDUCTIONS
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


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


def _check(input, weight, target, bias, class_weight, token_weight, options: dict,
           cuda_ok=True) -> _args.CrossEntropyOptions:
    """Validates what torch-side code must know before the core sees anything (types, devices,
    shapes); returns the options record built from `options` (the face's keyword values). Value
    checks the core makes itself (NaN/inf, target range, label_smoothing, soft cap, temperature
    and z-loss ranges, chunk budget, shift) are left to it so their status codes are the
    core's."""
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
    o = _args.options(**options)
    if bias is not None:
        _float_tensor(bias, "linear_bias", dev)
        if bias.dtype != weight.dtype:
            raise LossError(f"linear_bias must have linear_weight's dtype {weight.dtype}, got "
                            f"{bias.dtype}", 582)
    if class_weight is not None:
        _float_tensor(class_weight, "weight", dev)
    if token_weight is not None:
        _float_tensor(token_weight, "token_weight", dev)
    _args.shapes(input.shape, weight.shape, target.shape, shift=o.shift, token_axes=0,
                 bias_shape=None if bias is None else bias.shape,
                 class_weight_shape=None if class_weight is None else class_weight.shape,
                 token_weight_shape=None if token_weight is None else token_weight.shape,
                 names=("input", "linear_weight", "target", "linear_bias",
                        "weight (class weights)"))
    return o

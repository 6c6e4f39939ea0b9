"""The seed's materialized cross-entropy kernels (ce_from_logits, its gradient, a running
accumulator) on tensors."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._convert import as_float, as_int
from ..errors import LossError
from ._checks import _lossk

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
            # "cuda" names the current device; its tensors say which (cuda:0), and add()
            # compares against that
            self.device = self._state.device
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

"""algenta.torch: the fused linear + cross-entropy loss as a PyTorch autograd op.

``linear_cross_entropy(input, linear_weight, target)`` equals
``F.cross_entropy(F.linear(input, linear_weight), target)`` (every reduction, ``ignore_index``,
``label_smoothing``) and its gradients with respect to ``input`` and ``linear_weight``, computed
by the C++ core a chunk of tokens at a time: the ``[n_tok, vocab]`` logits never exist, in the
forward or the backward. ``vocab_parallel_linear_cross_entropy`` is the same loss when the rows of
the head are sharded over the ranks of a ``torch.distributed`` group.

Tensors go to the core as zero-copy NumPy views (``tensor.detach().numpy()``); a non-contiguous
tensor is made contiguous once. The gradients the core returns become tensors without a copy.

Limits: CPU tensors of float32 or float64 only (a CUDA tensor or another dtype is refused, not
moved or cast behind the caller's back); class-index targets only (no probability targets, no
per-class ``weight``); double backward is not supported. Inputs the core refuses (NaN/inf,
targets out of range, empty or oversized shapes) raise ``algenta.LossError`` with its status.

This module imports torch; ``import algenta`` does not import it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._convert import I64_MAX, I64_MIN, as_float, as_int
from .errors import LossError
from .lossk.cross_entropy import linear_cross_entropy as _np_linear_cross_entropy

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "vocab_parallel_linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")
_FLOATS = (torch.float32, torch.float64)
# Tokens per step of the small gathers done next to the core (target rows of the head in the
# vocab-parallel backward): bounds their temporaries at this many rows of d_model.
_GATHER_ROWS = 4096


# ---- argument checks ----------------------------------------------------------------------------

def _float_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on device {x.device}; algenta.torch computes on CPU tensors "
                         "only (move it with .cpu())")
    if x.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")


def _check(input, weight, target, reduction, ignore_index, label_smoothing, chunk):
    """Validates what torch-side code must know before the core sees anything; returns
    (n_tok, d_model, vocab, options). Value checks the core makes itself (NaN/inf, target range,
    label_smoothing range, chunk budget) are left to it so their status codes are the core's."""
    _float_tensor(input, "input")
    _float_tensor(weight, "linear_weight")
    if weight.dtype != input.dtype:
        raise TypeError(f"input and linear_weight must share one dtype, got {input.dtype} and "
                        f"{weight.dtype}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.device.type != "cpu":
        raise ValueError(f"target is on device {target.device}; algenta.torch computes on CPU only")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype} "
                        "(probability targets are not supported)")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise LossError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}", 588)
    ii = as_int(ignore_index, "ignore_index")
    if not I64_MIN <= ii <= I64_MAX:
        raise LossError(f"ignore_index={ii} is beyond int64", 586)
    ls = as_float(label_smoothing, "label_smoothing")
    if chunk is not None:
        chunk = as_int(chunk, "chunk")
    if input.dim() < 1 or weight.dim() != 2:
        raise LossError(f"input must be [..., d_model] and linear_weight [vocab, d_model], got "
                        f"shapes {tuple(input.shape)} and {tuple(weight.shape)}", 582)
    d = input.shape[-1]
    if weight.shape[1] != d:
        raise LossError(f"linear_weight has d_model {weight.shape[1]}, input has {d}", 582)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise LossError(f"target must have shape {tuple(input.shape[:-1])} (input's leading "
                        f"dimensions), got {tuple(target.shape)}", 582)
    n = math.prod(input.shape[:-1])
    v = weight.shape[0]
    return n, d, v, (reduction, ii, ls, chunk)


def _np2d(x: torch.Tensor, n: int, d: int) -> np.ndarray:
    """(n, d) C-contiguous NumPy view of x's data: a copy only when x is not contiguous."""
    x = x.detach().reshape(n, d)
    if not x.is_contiguous():
        x = x.contiguous()
    return x.numpy()


def _targets_i64(target: torch.Tensor, n: int) -> torch.Tensor:
    t = target.detach().reshape(n)
    return t.contiguous() if t.dtype == torch.int64 else t.to(torch.int64).contiguous()


def _fused(h: np.ndarray, w: np.ndarray, t: np.ndarray, *, chunk, reduction, ignore_index,
           label_smoothing, want_dh=False, want_dw=False, grad_output=None):
    """One pass of the core through the NumPy API; only the gradients asked for are computed
    (a frozen head or trunk saves a third of the work)."""
    with_grad = (want_dh and want_dw) or ("hidden" if want_dh else "weight" if want_dw else False)
    return _np_linear_cross_entropy(h, w, t, chunk=chunk, reduction=reduction,
                                    ignore_index=ignore_index, label_smoothing=label_smoothing,
                                    with_grad=with_grad, grad_output=grad_output)


def _scale(g: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor | None:
    if g is None:
        return None
    # An upstream gradient of exactly 1 (loss.backward()) returns the forward's gradient as is;
    # autograd copies it before accumulating because ctx still holds a reference.
    return g if bool(up == 1) else g * up.to(g.dtype)


# ---- single process -----------------------------------------------------------------------------

class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, target, n, d, opts, need_dh, need_dw):
        reduction, ii, ls, chunk = opts
        h, w = _np2d(input, n, d), _np2d(weight, weight.shape[0], d)
        t = _targets_i64(target, n)
        ctx.shape, ctx.opts, ctx.n, ctx.d = input.shape, opts, n, d
        if reduction == "none":
            r = _fused(h, w, t.numpy(), chunk=chunk, reduction="none", ignore_index=ii,
                       label_smoothing=ls)
            # The per-token upstream gradient is only known in backward: keep the inputs (not
            # their contiguous copies) and run the core again there with grad_output.
            if need_dh or need_dw:
                ctx.save_for_backward(input, weight, t)
            return torch.from_numpy(r.loss).reshape(target.shape)
        r = _fused(h, w, t.numpy(), chunk=chunk, reduction=reduction, ignore_index=ii,
                   label_smoothing=ls, want_dh=need_dh, want_dw=need_dw)
        # Gradients of the reduced loss come out of the same pass as the loss; backward only
        # scales them by the upstream scalar.
        dh = torch.from_numpy(r.d_hidden).reshape(input.shape) if need_dh else None
        dw = torch.from_numpy(r.d_weight) if need_dw else None
        ctx.save_for_backward(dh, dw)
        return torch.tensor(r.loss, dtype=input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        reduction, ii, ls, chunk = ctx.opts
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if reduction != "none":
            dh, dw = ctx.saved_tensors
            return (_scale(dh, grad_out) if need_dh else None,
                    _scale(dw, grad_out) if need_dw else None, None, None, None, None, None, None)
        input, weight, t = ctx.saved_tensors
        n, d = ctx.n, ctx.d
        go = grad_out.detach().reshape(n).to(input.dtype).contiguous().numpy()
        r = _fused(_np2d(input, n, d), _np2d(weight, weight.shape[0], d), t.numpy(), chunk=chunk,
                   reduction="none", ignore_index=ii, label_smoothing=ls, want_dh=need_dh,
                   want_dw=need_dw, grad_output=go)
        dh = torch.from_numpy(r.d_hidden).reshape(ctx.shape) if need_dh else None
        dw = torch.from_numpy(r.d_weight) if need_dw else None
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(input, linear_weight, target, *, reduction="mean", ignore_index=-100,
                         label_smoothing=0.0, chunk=None):
    """``F.cross_entropy(F.linear(input, linear_weight), target, ...)`` without the logits.

    input ``[..., d_model]`` and linear_weight ``[vocab, d_model]``: CPU tensors of one dtype,
    float32 or float64 (any strides). target ``[...]``: integer class indices, ``ignore_index``
    marking tokens that count for nothing ("mean" divides by the other tokens; NaN with zero
    gradients when every token is ignored, as in PyTorch). ``reduction="none"`` returns the
    per-token losses with target's shape. ``chunk`` (tokens per pass, default the largest the
    logit budget admits) changes neither the loss nor the gradients by a single bit.

    Gradients for "mean"/"sum" are computed in the forward pass, in the same sweep as the loss,
    and scaled by the upstream gradient in backward; only the inputs that require grad (with grad
    mode on) get one. For "none" the backward makes a second pass with the per-token upstream
    gradient. The loss is bit-identical for every chunk size and thread count.
    """
    n, d, _, opts = _check(input, linear_weight, target, reduction, ignore_index,
                           label_smoothing, chunk)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and input.requires_grad
    need_dw = grad_on and linear_weight.requires_grad
    return _LinearCrossEntropyFn.apply(input, linear_weight, target, n, d, opts, need_dh, need_dw)


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`linear_cross_entropy`: ``loss_fn(hidden, weight, target)``.

    It holds no parameters: the head's weight is passed in, so it can be tied to an embedding or
    live in another module."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=None):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = as_int(ignore_index, "ignore_index")
        self.reduction = reduction
        self.label_smoothing = as_float(label_smoothing, "label_smoothing")
        self.chunk = None if chunk is None else as_int(chunk, "chunk")

    def forward(self, hidden, weight, target):
        return linear_cross_entropy(hidden, weight, target, reduction=self.reduction,
                                    ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, chunk=self.chunk)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, chunk={self.chunk}")


# ---- vocab-parallel over torch.distributed ------------------------------------------------------
#
# Rank k holds rows [s_k, s_k + V_k) of the head and the same hidden and target as every other
# rank. With z = h @ W^T over the full vocabulary V:
#
#   lse_t  = log sum_k exp(lse_t^k)            lse_t^k: the shard's log-sum-exp (the core's .lse)
#   loss_t = (1 - eps) (lse_t - z_t,y) + eps (lse_t - sum_v z_t,v / V)
#
# The core on the shard, with targets outside the shard replaced by local id 0, gives lse^k and
# loss_tok^k = lse^k - z_y for the rank that owns y. So with M = max_k lse^k and
# S = sum_k exp(lse^k - M):  lse_t - z_y = log S + (loss_tok^owner + M - lse^owner), a sum of
# non-negative terms: no large logit cancels against another, even when one shard holds nearly
# all the probability. sum_v z_v = h . sum_v W_v needs only a d_model vector per shard.
#
# Backward: d z_t,v = g_t (p_t,v - (1 - eps) [v == y] - eps / V) with p = exp(z - lse_t). The core
# with per-token grad_output g_t r_t, r_t = exp(lse^k - lse_t), and eps = 0 gives
# g_t r_t (exp(z - lse^k) - [v == y_local]) = g_t (p_t,v) - g_t r_t [v == y_local]; the one-hot
# and uniform terms are then corrected with n_tok rows of the shard (never the logits). The
# softmax needs the global lse, known only after the forward's all-reduces, so the backward makes
# a second pass of the core over the shard.

_INFO = ("vocab_start", "shard_rows", "status", "n_tok", "d_model", "dtype", "need_dh",
         "need_dw", "target_checksum", "reduction")


def _checksum(t: torch.Tensor) -> int:
    # int64 arithmetic wraps: a checksum, only compared for equality across ranks.
    w = torch.arange(1, t.numel() + 1, dtype=torch.int64)
    return int((t * w).sum()) ^ int(t.sum())


class _VocabParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, n, d, opts, vocab_start, group, need_dh, need_dw):
        reduction, ii, ls, chunk = opts
        vs = weight.shape[0]
        t = _targets_i64(target, n)
        valid = t != ii
        own = valid & (t >= vocab_start) & (t < vocab_start + vs)
        t_loc = torch.where(own, t - vocab_start, torch.zeros_like(t))
        h, w = _np2d(hidden, n, d), _np2d(weight, vs, d)

        # Local work first, its refusal shared: a rank that raised alone would leave the others
        # waiting in the next collective until the group's timeout.
        err, r = None, None
        try:
            r = _fused(h, w, t_loc.numpy(), chunk=chunk, reduction="none", ignore_index=None,
                       label_smoothing=0.0)
        except LossError as e:
            err = e
        info = torch.tensor([vocab_start, vs, 0 if err is None else err.status, n, d,
                             _FLOATS.index(hidden.dtype), int(need_dh), int(need_dw),
                             _checksum(t), _REDUCTIONS.index(reduction)], dtype=torch.int64)
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
                                "shape, target, dtype, reduction and requires_grad", 582)
        starts, rows = allinfo[:, 0].tolist(), allinfo[:, 1].tolist()
        vocab = 0
        for s, k in sorted(zip(starts, rows)):
            if s != vocab:
                raise LossError(f"the shards [vocab_start, vocab_start + rows) of the group "
                                f"{sorted(zip(starts, rows))} do not tile [0, vocab) without gap "
                                "or overlap", 582)
            vocab += k
        bad_t = valid & ((t < 0) | (t >= vocab))
        if bool(bad_t.any()):
            i = int(bad_t.nonzero()[0, 0])
            raise LossError(f"target {int(t[i])} at token {i} is outside [0, {vocab})", 586)

        lse_k = torch.from_numpy(r.lse).to(torch.float64)
        m = lse_k.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        loss_tok = torch.from_numpy(r.loss).to(torch.float64)
        pack = torch.zeros(3, n, dtype=torch.float64)
        pack[0] = torch.exp(lse_k - m)
        pack[1] = torch.where(own, loss_tok + (m - lse_k), torch.zeros_like(m))
        if ls > 0.0:
            wsum = weight.detach().sum(0, dtype=torch.float64)
            pack[2] = torch.mv(torch.from_numpy(h), wsum.to(hidden.dtype)).to(torch.float64)
        dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=group)
        log_s = torch.log(pack[0])
        lse = m + log_s
        ce = log_s + pack[1]
        if ls > 0.0:
            ce = (1.0 - ls) * ce + ls * (lse - pack[2] / vocab)
        ce = torch.where(valid, ce, torch.zeros_like(ce))
        n_valid = int(valid.sum())

        ctx.save_for_backward(hidden, weight, t_loc, valid, own, lse_k, lse)
        ctx.meta = (hidden.shape, n, d, opts, vocab, n_valid, group, need_dh, need_dw)
        if reduction == "none":
            return ce.to(hidden.dtype).reshape(target.shape)
        total = float(ce.sum())
        if reduction == "sum":
            return torch.tensor(total, dtype=hidden.dtype)
        return torch.tensor(total / n_valid if n_valid else math.nan, dtype=hidden.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        shape, n, d, opts, vocab, n_valid, group, need_dh, need_dw = ctx.meta
        reduction, ii, ls, chunk = opts
        hidden, weight, t_loc, valid, own, lse_k, lse = ctx.saved_tensors
        if not (need_dh or need_dw):
            return (None,) * 10
        dtype = hidden.dtype
        up = grad_out.detach().to(torch.float64)
        if reduction == "none":
            g = up.reshape(n)
        else:
            g = up.expand(n) / (n_valid if reduction == "mean" and n_valid else 1)
        g = torch.where(valid, g, torch.zeros_like(g))
        go = (g * torch.exp(lse_k - lse)).to(dtype).contiguous()
        vs = weight.shape[0]
        h, w = _np2d(hidden, n, d), _np2d(weight, vs, d)
        r = _fused(h, w, t_loc.numpy(), chunk=chunk, reduction="none", ignore_index=None,
                   label_smoothing=0.0, want_dh=need_dh, want_dw=need_dw, grad_output=go.numpy())
        # The core subtracted its (rounded) grad_output at y_local; the loss wants g (1 - eps)
        # there for the owner and nothing for everyone else.
        c = (go.to(torch.float64) - torch.where(own, g * (1.0 - ls), torch.zeros_like(g))).to(dtype)
        u = (g * (ls / vocab)).to(dtype)
        ht, wt = torch.from_numpy(h), torch.from_numpy(w)
        dh = dw = None
        if need_dh:
            dh = torch.from_numpy(r.d_hidden)
            for s in range(0, n, _GATHER_ROWS):
                e = min(n, s + _GATHER_ROWS)
                dh[s:e].addcmul_(wt.index_select(0, t_loc[s:e]), c[s:e, None])
            if ls > 0.0:
                wsum = wt.sum(0, dtype=torch.float64).to(dtype)
                dh.sub_(torch.outer(u, wsum))
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)
            dh = dh.reshape(shape)
        if need_dw:
            dw = torch.from_numpy(r.d_weight)
            for s in range(0, n, _GATHER_ROWS):
                e = min(n, s + _GATHER_ROWS)
                dw.index_add_(0, t_loc[s:e], ht[s:e] * c[s:e, None])
            if ls > 0.0:
                dw.sub_((g.to(dtype) @ ht) * (ls / vocab))
        return dh, dw, None, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden, weight_shard, target, *, vocab_start, group=None,
                                        reduction="mean", ignore_index=-100, label_smoothing=0.0,
                                        chunk=None):
    """The loss of :func:`linear_cross_entropy` with the head's rows sharded over ranks.

    Each rank of ``group`` (default: the world) passes the same ``hidden [..., d_model]`` and
    ``target [...]`` and its own ``weight_shard``, rows ``[vocab_start, vocab_start +
    weight_shard.shape[0])`` of the head; the shards must tile ``[0, vocab)``. Per-token
    log-sum-exp, target logit and (for label smoothing) logit sum are combined with
    ``torch.distributed`` all-reduces, so every rank gets the unsharded loss (to rounding) without
    any rank holding full-vocabulary logits. The backward gives each rank the gradient of its
    shard and the full (all-reduced) gradient of ``hidden``; every rank must call backward.

    Collectives per call: an all_gather of a few integers (the ranks' shapes and statuses: a
    refusal on one rank raises on all, and mismatched shards or targets are refused instead of
    hanging or returning a wrong loss), two all-reduces of n_tok-sized vectors, and in backward
    one all-reduce of the hidden gradient. The backward makes a second core pass over the shard.
    Works with any backend that supports all_gather and MAX/SUM all-reduce (gloo on CPU).
    """
    n, d, _, opts = _check(hidden, weight_shard, target, reduction, ignore_index,
                           label_smoothing, chunk)
    vocab_start = as_int(vocab_start, "vocab_start")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs an initialized "
                           "torch.distributed process group (dist.init_process_group)")
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight_shard.requires_grad
    return _VocabParallelFn.apply(hidden, weight_shard, target, n, d, opts, vocab_start, group,
                                  need_dh, need_dw)

"""The fused loss with the head's rows sharded over the ranks of a torch.distributed group."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..errors import LossError
from ..lossk.cross_entropy import vocab_shard_pass
from .._convert import as_int
from ._bridge import _core_view, _loss_dtype, _tensor
from ._checks import _FLOATS, _REDUCTIONS, _check
from ._seed import _targets_i64

# ---- vocab-parallel over torch.distributed ------------------------------------------------------
#
# Rank k holds rows [s_k, s_k + V_k) of the head (and of the bias and the class weights) and the
# same hidden and target as every other rank. z' are the biased, soft-capped logits over the
# temperature, over the full vocabulary V, w the class weights (ones without), W = sum_v w_v:
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
# second pass. The coefficients are of d/dz'; the core applies dz'/dz (the cap's slope and 1/T).

_INFO = ("vocab_start", "shard_rows", "status", "n_tok", "d_model", "dtype", "need_dh",
         "need_dw", "need_db", "target_checksum", "reduction", "has_bias", "has_weights",
         "label_smoothing", "softcap", "temperature", "lse_square_scale")


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
        reduction, ii, ls, cap, temp, zs, chunk = opts
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
                                 temperature=temp, chunk=chunk)
        except LossError as e:
            err = e
        info = torch.tensor([vocab_start, vs, 0 if err is None else err.status, n, d,
                             _FLOATS.index(hidden.dtype), int(need_dh), int(need_dw),
                             int(need_db), _checksum(t), _REDUCTIONS.index(reduction),
                             int(bias is not None), int(cw is not None), _f64_bits(ls),
                             _f64_bits(-1.0 if cap is None else cap), _f64_bits(temp),
                             _f64_bits(zs)],
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
        reduction, ii, ls, cap, temp, zs, chunk = opts
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
            softcap=cap, temperature=temp, chunk=chunk, grad_coef=coef.to(ldt).numpy(),
            with_grad=need)
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
                                        lse_square_scale=0.0, chunk=None, temperature=1.0):
    """The loss of :func:`linear_cross_entropy` with the head's rows sharded over ranks.

    Each rank of ``group`` (default: the world) passes the same ``hidden [..., d_model]`` and
    ``target [...]`` and its own ``weight_shard``, rows ``[vocab_start, vocab_start +
    weight_shard.shape[0])`` of the head, with the same rows of the bias (``linear_bias``) and
    of the class weights (``weight``) when given; the shards must tile ``[0, vocab)``. Per-token
    log-sum-exp, target logit, class weight and (for label smoothing) weighted logit sum are
    combined with ``torch.distributed`` all-reduces, so every rank gets the unsharded loss (to
    rounding) without any rank holding full-vocabulary logits. ``softcap``, ``temperature`` and
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
    o = _check(hidden, weight_shard, target, linear_bias, weight, reduction, ignore_index,
               label_smoothing, softcap, lse_square_scale, 0, chunk, cuda_ok=False,
               temperature=temperature)
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
                                  (o.reduction, o.ignore_index, o.label_smoothing, o.softcap,
                                   o.temperature, o.lse_square_scale, o.chunk), vocab_start, group,
                                  need_dh, need_dw, need_db)

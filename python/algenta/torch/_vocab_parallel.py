"""The fused loss with the head's rows sharded over the ranks of a torch.distributed group."""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..errors import LossError
from ..lossk.cross_entropy import _shard_pass
from ..lossk.distillation import _shard_distill_pass
from .._convert import as_int
from ..lossk import _args
from ._bridge import _core_view, _loss_dtype, _tensor
from ._checks import _FLOATS, _check
from ._distill import LinearDistillationOutput, _checked_heads
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
         "need_dw", "need_db", "target_checksum", "has_bias", "has_weights")


def _checksum(t: torch.Tensor) -> int:
    # int64 arithmetic wraps: a checksum, only compared for equality across ranks.
    w = torch.arange(1, t.numel() + 1, dtype=torch.int64)
    return int((t * w).sum()) ^ int(t.sum())


def _f64_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64))


def _options_info(o) -> tuple:
    """(int64s, their names) of the options record's fields every rank must pass alike: each
    field as (is None, its bits); chunk may differ (it changes no bit)."""
    info, names = [], []
    for name, x in zip(o._fields, o):
        if name == "chunk":
            continue
        bits = (0 if x is None else zlib.crc32(x.encode()) if isinstance(x, str)
                else _f64_bits(x) if isinstance(x, float) else int(x))
        info += [int(x is None), bits]
        names += [name, name]
    return info, tuple(names)


def _shard_options(o: _args.CrossEntropyOptions) -> _args.CrossEntropyOptions:
    """The options of one core pass over a shard: per token ("none"), every target scored (the
    caller masks the ignored), label smoothing and the z-loss left to the combination."""
    return o._replace(reduction="none", ignore_index=None, label_smoothing=0.0,
                      lse_square_scale=0.0)


def _agree(info: list, names: tuple, err, group) -> int:
    """Every rank's (vocab_start, rows, status, the rest of `names`) gathered: a refusal on any
    rank raises on all (err on the rank that made it), ranks that disagree on anything but their
    shard raise 582, and shards that do not tile [0, vocab) raise 582. Returns the vocabulary.
    A rank that raised alone would leave the others waiting in the next collective until the
    group's timeout, hence one collective that every rank reaches."""
    mine = torch.tensor(info, dtype=torch.int64)
    world = dist.get_world_size(group)
    allinfo = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allinfo, mine, group=group)
    allinfo = torch.stack(allinfo)
    bad = allinfo[:, 2].nonzero().flatten().tolist()
    if bad:
        if err is not None:
            raise err
        k = bad[0]
        st = int(allinfo[k, 2])
        raise LossError(f"rank {k} of the group refused its shard with status {st} (see "
                        "that rank's error)", st)
    for j, name in enumerate(names):
        if j in (0, 1, 2):
            continue
        if not bool((allinfo[:, j] == mine[j]).all()):
            raise LossError(f"ranks disagree on {name}: every rank must pass the same shapes, "
                            "target, dtype, options and requires_grad", 582)
    starts, rows = allinfo[:, 0].tolist(), allinfo[:, 1].tolist()
    vocab = 0
    for s_, k in sorted(zip(starts, rows)):
        if s_ != vocab:
            raise LossError(f"the shards [vocab_start, vocab_start + rows) of the group "
                            f"{sorted(zip(starts, rows))} do not tile [0, vocab) without gap "
                            "or overlap", 582)
        vocab += k
    return vocab


class _VocabParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, n, d, o, vocab_start, group,
                need_dh, need_dw, need_db):
        reduction, ii, ls, zs = o.reduction, o.ignore_index, o.label_smoothing, o.lse_square_scale
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
            r = _shard_pass(h, w, t_loc.numpy(), _shard_options(o), bias=b,
                            class_weight=None if cw is None else cw.numpy())
        except LossError as e:
            err = e
        opt_info, opt_names = _options_info(o)
        info = [vocab_start, vs, 0 if err is None else err.status, n, d,
                _FLOATS.index(hidden.dtype), int(need_dh), int(need_dw), int(need_db),
                _checksum(t), int(bias is not None), int(cw is not None), *opt_info]
        vocab = _agree(info, _INFO + opt_names, err, group)
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
        ctx.meta = (hidden.shape, n, d, o, vocab, n_valid, w_tot, w_all, group, need_dh,
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
        (shape, n, d, o, vocab, n_valid, w_tot, w_all, group, need_dh, need_dw,
         need_db) = ctx.meta
        reduction, ls, zs = o.reduction, o.label_smoothing, o.lse_square_scale
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
        r = _shard_pass(
            _core_view(hidden.detach().reshape(n, d)), _core_view(weight), t_loc.numpy(),
            _shard_options(o), bias=None if bias is None else _core_view(bias),
            class_weight=None if class_weight is None
            else class_weight.detach().to(ldt).contiguous().numpy(),
            grad_coef=coef.to(ldt).numpy(), with_grad=need)
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
    o = _check(hidden, weight_shard, target, linear_bias, weight, None, dict(
        reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing, softcap=softcap, temperature=temperature,
        lse_square_scale=lse_square_scale, chunk=chunk), cuda_ok=False)
    vocab_start = as_int(vocab_start, "vocab_start")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs an initialized "
                           "torch.distributed process group (dist.init_process_group)")
    n, d = math.prod(hidden.shape[:-1]), hidden.shape[-1]
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight_shard.requires_grad
    need_db = grad_on and linear_bias is not None and linear_bias.requires_grad
    return _VocabParallelFn.apply(hidden, weight_shard, target, linear_bias, weight, n, d, o,
                                  vocab_start, group, need_dh, need_dw, need_db)


# ---- distillation with both heads' rows sharded -------------------------------------------------
#
# Rank k holds the same rows [s_k, s_k + V_k) of the student's and the teacher's heads. With the
# full vocabulary's L_s = lse(s / T), L_t = lse(t / T), L_1 = lse(s), per token:
#   pass 1 (forward): each shard's own three lses and the target's logit (on its owner); the
#                     full ones by MAX and SUM all-reduces, as for the cross-entropy
#   pass 2 (forward): each shard's share of the divergence and of H = sum_v p_v h_v under the
#                     full normalizers, SUM all-reduced; ce = L_1 - s_y
#   pass 3 (backward): the shard's gradients from the full lses, H and each token's scales;
#                     hidden's all-reduced.
# Each pass projects both heads' shards once; no rank holds full-vocabulary logits.

_DISTILL_INFO = ("vocab_start", "shard_rows", "status", "n_tok", "d_model", "d_teacher",
                 "dtype", "teacher_dtype", "need_dh", "need_dw", "need_db", "target_checksum",
                 "has_bias", "has_teacher_bias", "has_target")


def _distill_shard_options(o: _args.DistillOptions) -> _args.DistillOptions:
    """The options of one core pass over both heads' shards: every token scored, summed (the
    caller masks the ignored and reduces)."""
    return o._replace(reduction="sum", ignore_index=None)


class _VocabParallelDistillFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, si, sw, sb, ti, tw, tb, target, n, o, vocab_start, group, need):
        ii, hw, sw_, reduction = o.ignore_index, o.hard_weight, o.soft_weight, o.reduction
        vs = sw.shape[0]
        has_t = target is not None
        t = _targets_i64(target, n) if has_t else torch.zeros(n, dtype=torch.int64)
        valid = (t != ii) if has_t and ii is not None else torch.ones(n, dtype=torch.bool)
        own = valid & (t >= vocab_start) & (t < vocab_start + vs)
        t_loc = torch.where(own, t - vocab_start, torch.full_like(t, -1))
        views = (_core_view(si.detach().reshape(n, -1)), _core_view(sw),
                 _core_view(ti.detach().reshape(n, -1)), _core_view(tw))
        kw = dict(student_bias=None if sb is None else _core_view(sb),
                  teacher_bias=None if tb is None else _core_view(tb))
        tl = t_loc.numpy() if has_t else None
        shard_o = _distill_shard_options(o)
        err, r = None, None
        try:
            r = _shard_distill_pass(*views, tl, shard_o, **kw)
        except LossError as e:
            err = e
        opt_info, opt_names = _options_info(o)
        info = [vocab_start, vs, 0 if err is None else err.status, n, si.shape[-1],
                ti.shape[-1], _FLOATS.index(si.dtype), _FLOATS.index(ti.dtype), *map(int, need),
                _checksum(t), int(sb is not None), int(tb is not None), int(has_t), *opt_info]
        vocab = _agree(info, _DISTILL_INFO + opt_names, err, group)
        bad_t = valid & ((t < 0) | (t >= vocab)) if has_t else torch.zeros(n, dtype=torch.bool)
        if bool(bad_t.any()):
            i = int(bad_t.nonzero()[0, 0])
            raise LossError(f"target {int(t[i])} at token {i} is outside [0, {vocab})", 586)

        f64 = torch.float64
        st = torch.from_numpy(r.stats).to(f64)
        m = st[:, :3].clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        pack = torch.zeros(n, 4, dtype=f64)
        pack[:, :3] = torch.exp(st[:, :3] - m)
        pack[:, 3] = torch.where(own, m[:, 2] - st[:, 5], torch.zeros(n, dtype=f64))
        dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=group)
        log_s = torch.log(pack[:, :3])
        lse = m + log_s
        ldt = _loss_dtype(si.dtype)
        r2 = _shard_distill_pass(*views, tl, shard_o, shard_lse=lse.to(ldt).numpy(), **kw)
        dh = torch.from_numpy(r2.stats[:, 3:5]).to(f64).contiguous()
        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)
        zero = torch.zeros(n, dtype=f64)
        div = torch.where(valid, dh[:, 0], zero)
        # L_1 - s_y as log S_1 + (M_1 - s_y): no large logit cancels against another
        ce = torch.where(valid, log_s[:, 2] + pack[:, 3], zero) if has_t else zero
        per = sw_ * div + hw * ce
        n_valid = int(valid.sum())
        ctx.save_for_backward(si, sw, sb, ti, tw, tb, t_loc, valid, lse, dh[:, 1].clone())
        ctx.meta = (si.shape, n, o, n_valid, group, need, has_t)
        if reduction == "none":
            out = per
        elif reduction == "sum":
            out = per.sum()
        else:
            out = per.sum() / n_valid if n_valid else torch.tensor(math.nan, dtype=f64)
        shape = tuple(si.shape[:-1])
        red = {"none": lambda x: x.reshape(shape), "sum": lambda x: x.sum(),
               "mean": lambda x: x.sum() / n_valid if n_valid else x.sum() * math.nan}[reduction]
        terms = (red(div).to(ldt), red(ce).to(ldt))
        ctx.mark_non_differentiable(*terms)
        return (out.reshape(shape) if reduction == "none" else out).to(ldt), *terms

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _g_div, _g_ce):
        shape, n, o, n_valid, group, need, has_t = ctx.meta
        hw, sw_, temp, reduction = o.hard_weight, o.soft_weight, o.temperature, o.reduction
        si, sw, sb, ti, tw, tb, t_loc, valid, lse, H = ctx.saved_tensors
        none = (None,) * 12
        if not any(need):
            return none
        f64 = torch.float64
        up = grad_out.detach().to(f64)
        zero = torch.zeros(n, dtype=f64)
        if reduction == "none":
            sc = up.reshape(n)
        elif reduction == "sum":
            sc = up.expand(n)
        else:
            sc = up.expand(n) / n_valid if n_valid else zero
        sc = torch.where(valid, sc, zero)
        coef = torch.stack([sc * (sw_ / temp), sc * hw], dim=1)
        ldt = _loss_dtype(si.dtype)
        names = tuple(nm for nm, f in zip(("hidden", "weight", "bias"), need) if f)
        r = _shard_distill_pass(
            _core_view(si.detach().reshape(n, -1)), _core_view(sw),
            _core_view(ti.detach().reshape(n, -1)), _core_view(tw),
            t_loc.numpy() if has_t else None, _distill_shard_options(o),
            student_bias=None if sb is None else _core_view(sb),
            teacher_bias=None if tb is None else _core_view(tb),
            shard_lse=lse.to(ldt).numpy(), shard_h=H.to(ldt).numpy(),
            shard_coef=coef.to(ldt).numpy(), with_grad=names)
        dh = dw = db = None
        if need[0]:
            dh = _tensor(r.d_hidden, si.dtype)
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)
            dh = dh.reshape(shape)
        if need[1]:
            dw = _tensor(r.d_weight, si.dtype)
        if need[2]:
            db = _tensor(r.d_bias, si.dtype)
        return (dh, dw, db) + (None,) * 9


def vocab_parallel_linear_distillation_loss(student_input, student_weight_shard, teacher_input,
                                            teacher_weight_shard, target=None, *, vocab_start,
                                            group=None, objective="kl", beta=0.5,
                                            temperature=1.0, ignore_index=-100, hard_weight=0.0,
                                            soft_weight=1.0, student_bias=None,
                                            teacher_bias=None, reduction="mean", chunk=None,
                                            return_terms=False):
    """:func:`linear_distillation_loss` with the vocabulary sharded over the ranks of ``group``
    (default: the world): each rank passes the same ``student_input``, ``teacher_input`` and
    ``target`` and its own rows ``[vocab_start, vocab_start + rows)`` of both heads (and of
    their biases); the shards must tile ``[0, vocab)``. Every rank gets the unsharded loss (to
    rounding) and the gradients of its student shard, and the full (all-reduced) gradient of
    ``student_input``; every rank must call backward.

    Collectives per call: one all_gather of a few integers (shapes, options, statuses: a refusal
    on one rank raises on all), three all-reduces of per-token vectors in the forward and one of
    the input gradient in backward. Three core passes over the shards (two forward, one
    backward), each projecting both heads' rows once. CPU tensors, gloo or any backend with
    all_gather and MAX/SUM all-reduce.
    """
    _checked_heads(student_input, student_weight_shard, teacher_input, teacher_weight_shard,
                   target, student_bias, teacher_bias)
    vocab_start = as_int(vocab_start, "vocab_start")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_distillation_loss needs an initialized "
                           "torch.distributed process group (dist.init_process_group)")
    o = _args.distill_options(objective=objective, beta=beta, temperature=temperature,
                              ignore_index=ignore_index, hard_weight=hard_weight,
                              soft_weight=soft_weight, reduction=reduction, chunk=chunk)
    lead = tuple(student_input.shape[:-1])
    if (tuple(teacher_input.shape[:-1]) != lead
            or (target is not None and tuple(target.shape) != lead)
            or student_weight_shard.ndim != 2 or teacher_weight_shard.ndim != 2
            or student_weight_shard.shape[0] != teacher_weight_shard.shape[0]
            or student_weight_shard.shape[1] != student_input.shape[-1]
            or teacher_weight_shard.shape[1] != teacher_input.shape[-1]):
        raise LossError(f"shapes disagree: student {tuple(student_input.shape)} x "
                        f"{tuple(student_weight_shard.shape)}, teacher "
                        f"{tuple(teacher_input.shape)} x {tuple(teacher_weight_shard.shape)}, "
                        f"target {None if target is None else tuple(target.shape)}", 582)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and student_input.requires_grad, grad_on and student_weight_shard.requires_grad,
            grad_on and student_bias is not None and student_bias.requires_grad)
    loss, div, ce = _VocabParallelDistillFn.apply(
        student_input, student_weight_shard, student_bias, teacher_input, teacher_weight_shard,
        teacher_bias, target, math.prod(lead), o, vocab_start, group, need)
    return LinearDistillationOutput(loss, div, ce) if return_terms else loss

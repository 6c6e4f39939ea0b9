"""An independent NumPy float64 reference for cross-entropy over a linear head, written from the
textbook definitions (and PyTorch's documented F.cross_entropy semantics), sharing no code with
algenta."""

import numpy as np


def reference(hidden, weight, targets, reduction="mean", ignore_index=None, label_smoothing=0.0,
              grad_output=None):
    h = np.asarray(hidden, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    t = np.asarray(targets, dtype=np.int64)
    n, v = h.shape[0], w.shape[0]
    z = h @ w.T
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    valid = np.ones(n, bool) if ignore_index is None else t != ignore_index
    safe_t = np.where(valid, t, 0)
    logp = z - lse[:, None]
    nll = -logp[np.arange(n), safe_t]
    smooth = -logp.mean(axis=1)
    per = np.where(valid, (1 - label_smoothing) * nll + label_smoothing * smooth, 0.0)
    nv = int(valid.sum())
    if reduction == "mean":
        loss = per.sum() / nv if nv else np.nan
        scale = np.where(valid, 1.0 / nv if nv else 0.0, 0.0)
    elif reduction == "sum":
        loss = per.sum()
        scale = valid.astype(np.float64)
    else:
        loss = per
        go = np.ones(n) if grad_output is None else np.asarray(grad_output, np.float64)
        scale = np.where(valid, go, 0.0)
    g = np.exp(logp) - label_smoothing / v
    g[np.arange(n), safe_t] -= 1 - label_smoothing
    g *= scale[:, None]
    return {"loss": loss, "lse": lse, "n_valid": nv, "d_hidden": g @ w, "d_weight": g.T @ h, "per": per}


def reference_full(hidden, weight, targets, *, bias=None, class_weight=None, reduction="mean",
                   ignore_index=None, label_smoothing=0.0, softcap=None, z_scale=0.0, shift=0,
                   grad_output=None, grad_lse=None, token_weight=None, temperature=1.0,
                   grad_entropy=None):
    """Every option of the fused loss, written out on materialized float64 logits.

    hidden [..., S, D], targets [..., S]; with shift k, position t scores target t + k within each
    sequence (the last k positions are not scored). Per counted token, z' the (biased, capped)
    logits divided by the temperature T, w the class weights (ones without), eps the smoothing:
        ce = (1 - eps) w_y (lse - z'_y) + (eps / V) sum_v w_v (lse - z'_v),  zl = s lse^2
    mean = sum ce / sum w_y + sum zl / n_counted (PyTorch's weighted mean; Liger's z-loss mean).
    Token weights u (targets' shape, shifted with them) multiply ce and zl; the mean then divides
    by sum u w_y and sum u. The entropy H = lse - sum_v p_v z'_v is weighted by u and reduced as
    the z-loss (mean over sum u); grad_entropy (scalar, or per token for "none") is its upstream
    gradient, added to the loss's.
    Returns loss, lse, z, entropy (each reduced like the loss), per-token values over scored
    positions, the argmax, and the gradients (d_hidden in hidden's full shape)."""
    h = np.asarray(hidden, np.float64)
    w = np.asarray(weight, np.float64)
    t = np.asarray(targets, np.int64)
    D, V = h.shape[-1], w.shape[0]
    if shift:
        hs, ts = h[..., : h.shape[-2] - shift, :], t[..., shift:]
    else:
        hs, ts = h, t
    out_shape = ts.shape
    x = hs.reshape(-1, D)
    y = ts.reshape(-1)
    n = x.shape[0]
    z = x @ w.T + (0.0 if bias is None else np.asarray(bias, np.float64))
    zc = (softcap * np.tanh(z / softcap) if softcap else z) / temperature
    m = zc.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(zc - m).sum(axis=1))
    valid = np.ones(n, bool) if ignore_index is None else y != ignore_index
    ys = np.where(valid, y, 0)
    cw = np.ones(V) if class_weight is None else np.asarray(class_weight, np.float64)
    wy = cw[ys]
    w_all = cw.sum()
    eps = label_smoothing
    logp = zc - lse[:, None]
    ce = (1 - eps) * wy * (-logp[np.arange(n), ys]) + (eps / V) * (-(logp * cw).sum(axis=1))
    if token_weight is None:
        u = np.ones(n)
    else:
        tw = np.asarray(token_weight, np.float64)
        u = (tw[..., shift:] if shift else tw).reshape(-1)
    ce = np.where(valid, u * ce, 0.0)
    zl = np.where(valid, u * z_scale * lse * lse, 0.0)
    nv = int(valid.sum())
    wsum = float((u * wy)[valid].sum())
    usum = float(u[valid].sum())
    if reduction == "mean":
        loss = (ce.sum() / wsum if wsum else np.nan) + (zl.sum() / usum if usum else np.nan) \
            if nv else np.nan
        zred = zl.sum() / usum if usum else np.nan
        s_ce = np.where(valid, u / wsum if wsum else 0.0, 0.0)
        s_z = np.where(valid, u / usum if usum else 0.0, 0.0)
        if grad_output is not None:
            s_ce, s_z = s_ce * grad_output, s_z * grad_output
    elif reduction == "sum":
        loss, zred = ce.sum() + zl.sum(), zl.sum()
        g0 = 1.0 if grad_output is None else float(grad_output)
        s_ce = s_z = np.where(valid, g0 * u, 0.0)
    else:
        loss, zred = (ce + zl).reshape(out_shape), zl.reshape(out_shape)
        go = np.ones(n) if grad_output is None else np.asarray(grad_output, np.float64).reshape(-1)
        s_ce = s_z = np.where(valid, go * u, 0.0)
    gl = np.zeros(n) if grad_lse is None else np.asarray(grad_lse, np.float64).reshape(-1)
    p = np.exp(logp)
    a = s_ce * ((1 - eps) * wy + (eps / V) * w_all) + s_z * 2.0 * z_scale * lse + gl
    ez = (p * zc).sum(axis=1)
    ent = np.where(valid, u * (lse - ez), 0.0)
    if reduction == "mean":
        ered = ent.sum() / usum if usum else np.nan
    elif reduction == "sum":
        ered = ent.sum()
    else:
        ered = ent.reshape(out_shape)
    s_h = np.zeros(n)
    if grad_entropy is not None:
        if reduction == "none":
            s_h = np.where(valid, u * np.asarray(grad_entropy, np.float64).reshape(-1), 0.0)
        elif reduction == "sum":
            s_h = np.where(valid, u * float(grad_entropy), 0.0)
        else:
            s_h = np.where(valid, u * float(grad_entropy) / usum if usum else 0.0, 0.0)
    dzc = p * a[:, None] - (s_ce * eps / V)[:, None] * cw[None, :]
    dzc += s_h[:, None] * p * (ez[:, None] - zc)
    dzc[np.arange(n), ys] -= s_ce * (1 - eps) * wy
    dz = (dzc * (1.0 - np.tanh(z / softcap) ** 2) if softcap else dzc) / temperature
    dhs = (dz @ w).reshape(hs.shape)
    dh = np.zeros_like(h)
    if shift:
        dh[..., : h.shape[-2] - shift, :] = dhs
    else:
        dh = dhs
    pred = zc.argmax(axis=1)
    return {"loss": loss, "lse": lse.reshape(out_shape), "z": zred, "n_valid": nv,
            "entropy": ered,
            "per": (ce + zl).reshape(out_shape), "pred": pred.reshape(out_shape),
            "accuracy": float((pred == y)[valid].mean()) if nv else np.nan,
            "d_hidden": dh, "d_weight": dz.T @ x, "d_bias": dz.sum(axis=0), "d_logits": dz,
            "x": x}


# bfloat16's unit roundoff: round to nearest moves a value by at most 2^-8 of itself.
BF16_U = 2.0 ** -8


def bf16_dot_path() -> bool:
    """Whether bfloat16 inputs take a bf16 dot-product path here (vdpbf16ps or AMX tiles), whose
    gradient products take d_logits rounded to bfloat16 (the CUDA backend's rounding)."""
    import algenta

    return algenta._core.bf16_path() != "widen"


def bf16_gradient_bounds(ref, weight):
    """(d_hidden, d_weight) bounds of what rounding d_logits to bfloat16 can add: each
    coefficient moves by at most BF16_U of itself, so a gradient cell by at most BF16_U times
    the sum of |coefficient x operand| over its reduction (V for d_hidden, tokens for
    d_weight). Zero where the path multiplies float32 d_logits (widening)."""
    if not bf16_dot_path():
        return 0.0, 0.0
    dz, x = np.abs(ref["d_logits"]), np.abs(ref["x"])
    return BF16_U * (dz @ np.abs(np.asarray(weight, np.float64))), BF16_U * (dz.T @ x)

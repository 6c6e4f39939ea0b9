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

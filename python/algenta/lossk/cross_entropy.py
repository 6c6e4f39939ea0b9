"""lossk.cross_entropy: cross-entropy fused with the output projection, a chunk at a time.

``linear_cross_entropy`` is the NumPy-native entry point (float32/float64, PyTorch's
``F.cross_entropy`` options). The ``*_flat`` functions are the seed's flat-list API; they are
thin callers of the same C++ core and compute in float64.

Division of labour: this layer converts types (a wrong one is a ``TypeError``) and array shapes;
every value refusal (sizes, lengths, chunk budget, non-finite data, targets, reduction) is the
core's, with the core's status and message.

Numerics: the loss, the per-token log-sum-exp and both gradients are bit-identical for every
chunk size and every OpenMP thread count (per-token losses summed in token order, log-sum-exp
merged over fixed 256-class blocks in block order, GEMM cells accumulated in a fixed order).
The mean is ``first + sum(l - first) / n`` over the valid tokens, which returns the exact loss
when every token has the same one (uniform logits give exactly ``log(vocab)``).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _core
from .._convert import (I64_MAX, I64_MIN, _asarray, as_float, as_i64_clamped, as_int,
                        float_array, int_array, length_of)
from .._records import record_type
from ..errors import LossError
from . import contract as _contract

_c = _core.lossk

CELoss = record_type("CELoss", ("mean_loss", "total_loss", "status"), "Loss of a logits tensor.")
FusedCELoss = record_type(
    "FusedCELoss",
    ("mean_loss", "total_loss", "chunk", "n_chunks", "status"),
    "Loss of the fused projection + cross-entropy, computed `chunk` tokens at a time.",
)
FusedCEGrad = record_type(
    "FusedCEGrad",
    ("d_hidden", "d_weight", "mean_loss", "status"),
    "Gradients of the mean loss: d_hidden (n_tok*d_model) and d_weight (vocab*d_model), flat.",
)
PeakLogitCells = record_type(
    "PeakLogitCells",
    ("chunked_cells", "materialized_cells", "ratio", "n_chunks", "status"),
    "Logit cells a chunked call holds at once against the materialized (n_tok, vocab) tensor.",
)
ChunkInvariance = record_type(
    "ChunkInvariance",
    ("total_chunk_1", "total_chunk_n", "chunk_n", "max_abs_delta", "status"),
    "Totals at chunk=1 and chunk=n (n_tok, or the largest chunk the logit budget admits).",
)
LinearCrossEntropy = record_type(
    "LinearCrossEntropy",
    ("loss", "lse", "n_valid", "d_hidden", "d_weight"),
    "Result of linear_cross_entropy: loss (scalar, or per token for reduction='none'), per-token "
    "log-sum-exp, the count of non-ignored tokens, and the gradients when with_grad=True.",
)

_OK = _contract.LOSS_OK


def _err(msg: str, status: int) -> LossError:
    return LossError(msg, status)


def _dims(*pairs) -> tuple:
    """Integer arguments for the core: a Python int past int64 is clamped to the end it lies
    past (the core then refuses it as the out-of-range value it stands for, never wrapped)."""
    return tuple(as_i64_clamped(v, name) for v, name in pairs)


def _chunk(chunk, n_tok: int, vocab: int) -> int:
    """The chunk to run: chunk=None means the largest the logit budget admits (1 where the
    dimensions are refused anyway: the core refuses them first)."""
    if chunk is None:
        return max(_contract.loss_max_chunk(n_tok, vocab), 1)
    return as_i64_clamped(chunk, "chunk")


def _targets(t) -> np.ndarray:
    return int_array(t, "targets", error=lambda m: _err(m, 586))


def _run(hidden, weight, targets, n, d, v, chunk, *, reduction="mean", ignore_index=None,
         label_smoothing=0.0, want_dh=False, want_dw=False, grad_output=None, want_loss_tok=False):
    fn = _c.fused_linear_ce_f32 if hidden.dtype == np.float32 else _c.fused_linear_ce_f64
    return fn(hidden, weight, targets, n, d, v, chunk, reduction, ignore_index is not None,
              0 if ignore_index is None else ignore_index, label_smoothing, want_dh, want_dw,
              grad_output, want_loss_tok)


# ---- the seed's flat API ----------------------------------------------------------------------

def ce_from_logits_flat(logits, targets, n_tok, vocab) -> CELoss:
    """Cross-entropy of an already-materialized row-major [n_tok][vocab] float64 logit tensor:
    the reference the fused kernel is measured against. Uniform logits give exactly log(vocab)."""
    n, v = _dims((n_tok, "n_tok"), (vocab, "vocab"))
    t = _targets(targets)
    z = float_array(logits, "logits")
    s = _c.LossSum()
    _c.ce_from_logits(z, t, n, v, s)
    return CELoss(mean_loss=s.mean, total_loss=s.total, status=_OK)


def fused_linear_ce_flat(hidden, weight, targets, n_tok, d_model, vocab, chunk) -> FusedCELoss:
    """Projects hidden [n_tok][d_model] through weight [vocab][d_model] (row-major) and reduces to
    cross-entropy `chunk` tokens at a time; the [n_tok][vocab] logits never exist."""
    n, d, v = _dims((n_tok, "n_tok"), (d_model, "d_model"), (vocab, "vocab"))
    t = _targets(targets)
    c = _chunk(chunk, n, v)
    r = _run(float_array(hidden, "hidden"), float_array(weight, "weight"), t, n, d, v, c)
    return FusedCELoss(mean_loss=r["mean"], total_loss=r["total"], chunk=c,
                       n_chunks=-(-n // c), status=_OK)


def fused_linear_ce_bwd_flat(hidden, weight, targets, n_tok, d_model, vocab, chunk=None) -> FusedCEGrad:
    """Gradients of the mean fused loss with respect to hidden and weight (flat float64 arrays),
    chunked like the forward: peak extra memory is the gradients plus one chunk of logits.
    ``chunk=None`` takes the largest chunk the logit budget admits."""
    n, d, v = _dims((n_tok, "n_tok"), (d_model, "d_model"), (vocab, "vocab"))
    t = _targets(targets)
    c = _chunk(chunk, n, v)
    r = _run(float_array(hidden, "hidden"), float_array(weight, "weight"), t, n, d, v, c,
             want_dh=True, want_dw=True)
    return FusedCEGrad(d_hidden=r["d_hidden"].reshape(-1), d_weight=r["d_weight"].reshape(-1),
                       mean_loss=r["mean"], status=_OK)


def ce_peak_logit_cells(n_tok, vocab, chunk) -> PeakLogitCells:
    """What a chunked call holds at once against the materialized form. Never raises for
    out-of-range sizes: the status says why (581/583 with cells -1.0, or 587 for a chunk over the
    logit budget, whose numbers are still reported). A chunk larger than n_tok holds n_tok rows."""
    n, v, c = as_int(n_tok, "n_tok"), as_int(vocab, "vocab"), as_int(chunk, "chunk")
    bad = None
    if min(n, v, c) < 1:
        bad = 581
    elif n > _contract.LOSS_MAX_TOKENS or v > _contract.LOSS_MAX_VOCAB or c > _contract.LOSS_MAX_TOKENS:
        bad = 583
    if bad is not None:
        return PeakLogitCells(chunked_cells=-1.0, materialized_cells=-1.0, ratio=0.0, n_chunks=0,
                              status=bad)
    held = min(c, n)
    chunked = _contract.loss_logit_cells(held, v)
    materialized = _contract.loss_logit_cells(n, v)
    return PeakLogitCells(chunked_cells=chunked, materialized_cells=materialized,
                          ratio=materialized / chunked, n_chunks=-(-n // c),
                          status=_contract.loss_chunk_check(held, v))


def ce_chunk_invariance_flat(hidden, weight, targets, n_tok, d_model, vocab) -> ChunkInvariance:
    """Runs the fused loss at chunk=1 and chunk=n_tok (or the largest chunk the logit budget
    admits) and reports how far apart they land. The contract is max_abs_delta == 0.0: the
    accumulation order does not depend on the chunk size."""
    n, d, v = _dims((n_tok, "n_tok"), (d_model, "d_model"), (vocab, "vocab"))
    t = _targets(targets)
    big = _chunk(None, n, v)
    h, w = float_array(hidden, "hidden"), float_array(weight, "weight")
    a = _run(h, w, t, n, d, v, 1, want_loss_tok=True)
    b = _run(h, w, t, n, d, v, big, want_loss_tok=True)
    delta = max(abs(a["total"] - b["total"]), abs(a["mean"] - b["mean"]),
                float(np.max(np.abs(a["loss_tok"] - b["loss_tok"]))),
                float(np.max(np.abs(a["lse"] - b["lse"]))))
    return ChunkInvariance(total_chunk_1=a["total"], total_chunk_n=b["total"], chunk_n=big,
                           max_abs_delta=delta, status=_OK)


def ce_grad_logits_flat(logits, targets, n_tok, vocab, scale=1.0) -> np.ndarray:
    """(softmax(logits) - one_hot(target)) * scale for row-major [n_tok][vocab] float64 logits,
    returned flat: the backward of cross-entropy with respect to its logits."""
    n, v = _dims((n_tok, "n_tok"), (vocab, "vocab"))
    s = as_float(scale, "scale")
    t = _targets(targets)
    return _c.ce_grad_logits(float_array(logits, "logits"), t, n, v, s)


class CEAccumulator:
    """Cross-entropy over logits that arrive a piece at a time.

    ``add(logits, targets)`` takes a row-major [n][vocab] float64 piece (n = len(targets)); the
    ``mean_loss`` and ``total_loss`` read at the end are bit-identical to one
    ``ce_from_logits_flat`` over the concatenation (the same token-order sum)."""

    def __init__(self, vocab):
        # No core call happens here, so the vocabulary is judged by the contract's own check.
        v = as_i64_clamped(vocab, "vocab")
        st = _contract.loss_dims_check(1, 1, v)
        if st != _OK:
            raise _err(f"vocab={v} refused", st)
        self.vocab = v
        self._sum = _c.LossSum()

    def add(self, logits, targets) -> None:
        n = length_of(targets, "targets")
        if n == 0:
            return
        t = _targets(targets)
        _c.ce_from_logits(float_array(logits, "logits"), t, n, self.vocab, self._sum)

    @property
    def n_tok(self) -> int:
        return self._sum.count

    @property
    def total_loss(self) -> float:
        return self._sum.total

    @property
    def mean_loss(self) -> float:
        """Mean over every token added so far (NaN before the first)."""
        return self._sum.mean


def release_scratch() -> int:
    """Free the logit-chunk buffer the fused backward keeps for its next call (at most one
    block, at most 1 GiB: the largest chunk of a recent ``with_grad`` call). Returns its bytes.

    Keeping it spares every training step a fresh page-faulted, zero-filled (chunk, vocab)
    allocation; peak memory during a call is unchanged."""
    return _c.release_scratch()


# ---- the NumPy-native entry point ------------------------------------------------------------

def linear_cross_entropy(hidden, weight, targets, *, chunk=None, reduction="mean",
                         ignore_index=None, label_smoothing=0.0, with_grad=False,
                         grad_output=None) -> LinearCrossEntropy:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without materializing the logits.

    hidden (n_tok, d_model) and weight (vocab, d_model): 2-D arrays of one dtype, float32 or
    float64. targets (n_tok,): integers. ``chunk=None`` picks the largest chunk the logit budget
    (2**27 cells) admits. ``reduction``, ``ignore_index`` and ``label_smoothing`` follow PyTorch's
    ``F.cross_entropy``: "mean" averages over non-ignored tokens (NaN when every token is ignored,
    as in PyTorch, with zero gradients), "sum" adds them, "none" returns the per-token losses (0
    for ignored tokens). With ``ignore_index=None`` every target must be in [0, vocab): a negative
    target is refused (586), never read as a mask.

    ``with_grad=True`` also returns ``d_hidden`` and ``d_weight`` (input dtype) of the reduced
    loss, computed in the same pass; ``with_grad="hidden"`` or ``"weight"`` computes only that one
    (the other is None), saving a third of the work for a frozen head or trunk. For "none",
    ``grad_output`` (n_tok,) weights each token (default all ones). Peak extra memory is the
    gradients plus one chunk of logits.
    """
    if not isinstance(hidden, np.ndarray) or not isinstance(weight, np.ndarray):
        raise TypeError("hidden and weight must be NumPy arrays")
    if hidden.dtype not in (np.float32, np.float64) or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype, float32 or float64; got "
                        f"{hidden.dtype} and {weight.dtype}")
    # Any other reduction is the core's refusal (588), a non-string one named by its repr.
    reduction = reduction if isinstance(reduction, str) else repr(reduction)
    if isinstance(with_grad, (bool, np.bool_)):
        want_dh = want_dw = bool(with_grad)
    elif with_grad in ("hidden", "weight"):
        want_dh, want_dw = with_grad == "hidden", with_grad == "weight"
    else:
        raise TypeError(f"with_grad must be a bool, 'hidden' or 'weight', got {with_grad!r}")
    if targets is None or not isinstance(targets, (np.ndarray, list, tuple)) and \
            not hasattr(targets, "__array__"):
        raise TypeError(f"targets must be an array of integer class indices, got "
                        f"{type(targets).__name__}")
    t = _targets(targets)
    if hidden.ndim != 2 or weight.ndim != 2:
        raise _err(f"hidden and weight must be 2-D, got shapes {hidden.shape} and {weight.shape}", 582)
    n, d = hidden.shape
    v = weight.shape[0]
    if weight.shape[1] != d:
        raise _err(f"weight has d_model {weight.shape[1]}, hidden has {d}", 582)
    if np.ndim(targets) != 1 or t.shape[0] != n:
        raise _err(f"targets must have shape ({n},), got {np.shape(targets)}", 582)
    c = _chunk(chunk, n, v)
    ii = None if ignore_index is None else as_int(ignore_index, "ignore_index")
    if ii is not None and not I64_MIN <= ii <= I64_MAX:
        raise _err(f"ignore_index={ii} is beyond int64", 586)
    ls = as_float(label_smoothing, "label_smoothing")
    go = None
    if grad_output is not None:
        if not with_grad or reduction != "none":
            raise _err("grad_output is only used with with_grad=True and reduction='none'", 582)
        go = _asarray(grad_output, "grad_output")
        if go.dtype.kind not in "fiu":
            raise TypeError(f"grad_output must hold real numbers, got dtype {go.dtype}")
        if go.shape != (n,):
            raise _err(f"grad_output must have shape ({n},), got {go.shape}", 582)
        go = np.ascontiguousarray(go, dtype=hidden.dtype)
    h = np.ascontiguousarray(hidden)
    w = np.ascontiguousarray(weight)
    r = _run(h, w, t, n, d, v, c, reduction=reduction, ignore_index=ii, label_smoothing=ls,
             want_dh=want_dh, want_dw=want_dw, grad_output=go,
             want_loss_tok=reduction == "none")
    if reduction == "none":
        loss = r["loss_tok"]
    else:
        loss = hidden.dtype.type(r["mean"] if reduction == "mean" else r["total"])
    return LinearCrossEntropy(loss=loss, lse=r["lse"], n_valid=r["n_valid"],
                              d_hidden=r["d_hidden"], d_weight=r["d_weight"])


__all__ = [
    "ce_from_logits_flat", "fused_linear_ce_flat", "fused_linear_ce_bwd_flat", "ce_peak_logit_cells",
    "ce_chunk_invariance_flat", "ce_grad_logits_flat", "CEAccumulator", "linear_cross_entropy",
    "release_scratch",
]

"""lossk.cross_entropy: cross-entropy fused with the output projection, a chunk at a time.

``linear_cross_entropy`` is the NumPy-native entry point: float32, float64, float16 and bfloat16
(``ml_dtypes``) inputs, PyTorch's ``F.cross_entropy`` options (reduction, ignore_index,
label_smoothing, class weights), a bias, a soft cap, the z-loss, next-token shift and token
accuracy. The ``*_flat`` functions are the seed's flat-list API; they are thin callers of the
same C++ core and compute in float64.

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
from .._dtypes import HalfBits, short_name  # HalfBits: re-exported, its historical home
from .._convert import (_asarray, as_float, as_i64_clamped, as_int,
                        float_array, int_array, length_of)
from .._records import record_type
from ..errors import LossError
from . import _args
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
    ("loss", "lse", "n_valid", "d_hidden", "d_weight", "d_bias", "z_loss", "pred", "accuracy",
     "entropy"),
    "Result of linear_cross_entropy: loss (scalar, or per token for reduction='none'), per-token "
    "log-sum-exp, the count of counted tokens, the gradients asked for (else None), the z-loss "
    "term reduced like the loss, with return_accuracy the per-token argmax and the accuracy "
    "over counted tokens, with return_entropy the entropy reduced as the z-loss term (else None).",
)

_OK = _contract.LOSS_OK


def _err(msg: str, status: int) -> LossError:
    return LossError(msg, status)


def _dims(*pairs) -> tuple:
    """Integer arguments for the core: a Python int past int64 is clamped to the end it lies
    past (the core then refuses it as the out-of-range value it stands for, never wrapped)."""
    return tuple(as_i64_clamped(v, name) for v, name in pairs)


def _targets(t) -> np.ndarray:
    return int_array(t, "targets", error=lambda m: _err(m, 586))


def _flat(hidden, weight, targets, n_tok, d_model, vocab, chunk, **want) -> dict:
    """One float64 pass of the core for the flat API, with the default options (mean loss) and
    `chunk` (None: the largest the logit budget admits; the result's "chunk" is the one run)."""
    n, d, v = _dims((n_tok, "n_tok"), (d_model, "d_model"), (vocab, "vocab"))
    t = _targets(targets)
    o = _args.options(chunk=chunk)
    return _c.fused_linear_ce(o, hidden=float_array(hidden, "hidden"),
                              weight=float_array(weight, "weight"), targets=t, n_tok=n,
                              d_model=d, vocab=v, elem="f64", **want)


# ---- the seed's flat API ----------------------------------------------------------------------

def _device(device) -> str:
    """"cpu" or "cuda": where the core computes (host arrays in and out either way)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return device


def ce_from_logits_flat(logits, targets, n_tok, vocab, *, device="cpu") -> CELoss:
    """Cross-entropy of an already-materialized row-major [n_tok][vocab] float64 logit tensor:
    the reference the fused kernel is measured against. Uniform logits give exactly log(vocab).
    ``device="cuda"`` computes the per-token losses on the CUDA backend and sums them there in
    token order."""
    dev = _device(device)
    n, v = _dims((n_tok, "n_tok"), (vocab, "vocab"))
    t = _targets(targets)
    z = float_array(logits, "logits")
    s = _c.LossSum()
    _c.ce_from_logits(z, t, n, v, s, device=dev)
    return CELoss(mean_loss=s.mean, total_loss=s.total, status=_OK)


def fused_linear_ce_flat(hidden, weight, targets, n_tok, d_model, vocab, chunk) -> FusedCELoss:
    """Projects hidden [n_tok][d_model] through weight [vocab][d_model] (row-major) and reduces to
    cross-entropy `chunk` tokens at a time; the [n_tok][vocab] logits never exist."""
    r = _flat(hidden, weight, targets, n_tok, d_model, vocab, chunk)
    c = r["chunk"]
    return FusedCELoss(mean_loss=r["mean"], total_loss=r["total"], chunk=c,
                       n_chunks=-(-r["lse"].size // c), status=_OK)


def fused_linear_ce_bwd_flat(hidden, weight, targets, n_tok, d_model, vocab, chunk=None) -> FusedCEGrad:
    """Gradients of the mean fused loss with respect to hidden and weight (flat float64 arrays),
    chunked like the forward: peak extra memory is the gradients plus one chunk of logits.
    ``chunk=None`` takes the largest chunk the logit budget admits."""
    r = _flat(hidden, weight, targets, n_tok, d_model, vocab, chunk, want_dh=True, want_dw=True)
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
    a, b = (_flat(hidden, weight, targets, n_tok, d_model, vocab, c, want_loss_tok=True)
            for c in (1, None))
    delta = max(abs(a["total"] - b["total"]), abs(a["mean"] - b["mean"]),
                float(np.max(np.abs(a["loss_tok"] - b["loss_tok"]))),
                float(np.max(np.abs(a["lse"] - b["lse"]))))
    return ChunkInvariance(total_chunk_1=a["total"], total_chunk_n=b["total"], chunk_n=b["chunk"],
                           max_abs_delta=delta, status=_OK)


def ce_grad_logits_flat(logits, targets, n_tok, vocab, scale=1.0, *, device="cpu") -> np.ndarray:
    """(softmax(logits) - one_hot(target)) * scale for row-major [n_tok][vocab] float64 logits,
    returned flat: the backward of cross-entropy with respect to its logits (``device="cuda"``:
    computed on the CUDA backend)."""
    dev = _device(device)
    n, v = _dims((n_tok, "n_tok"), (vocab, "vocab"))
    s = as_float(scale, "scale")
    t = _targets(targets)
    return _c.ce_grad_logits(float_array(logits, "logits"), t, n, v, s, device=dev)


class CEAccumulator:
    """Cross-entropy over logits that arrive a piece at a time.

    ``add(logits, targets)`` takes a row-major [n][vocab] float64 piece (n = len(targets)); the
    ``mean_loss`` and ``total_loss`` read at the end are bit-identical to one
    ``ce_from_logits_flat`` over the concatenation (the same token-order sum) on the same
    ``device`` ("cuda": each piece's losses and the running sum computed on the CUDA backend)."""

    def __init__(self, vocab, *, device="cpu"):
        self.device = _device(device)
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
        _c.ce_from_logits(float_array(logits, "logits"), t, n, self.vocab, self._sum,
                          device=self.device)

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

def _elem(a) -> tuple:
    """(core element name, the array the core reads): bfloat16 goes as its bits."""
    if isinstance(a, HalfBits):
        return a.name, a.bits.view(np.uint16)
    e = short_name(a)
    if e in ("f32", "f64", "f16"):
        return e, a
    if e == "bf16" and a.dtype.itemsize == 2:  # ml_dtypes
        return "bf16", a.view(np.uint16)
    raise TypeError(f"expected float32, float64, float16 or bfloat16 data (ml_dtypes or "
                    f"HalfBits), got dtype {a.dtype}")


def _dtype_name(a) -> str:
    return a.dtype if isinstance(a, HalfBits) else a.dtype.name


def _grad_sets(with_grad, has_bias):
    if isinstance(with_grad, (bool, np.bool_)):
        return bool(with_grad), bool(with_grad), bool(with_grad) and has_bias
    names = ({with_grad} if isinstance(with_grad, str) else set(with_grad)
             if isinstance(with_grad, (list, tuple, set, frozenset)) else None)
    if (not names or not names <= {"hidden", "weight", "bias"}
            or not all(isinstance(x, str) for x in names)):
        raise TypeError(f"with_grad must be a bool or any of 'hidden', 'weight', 'bias', got "
                        f"{with_grad!r}")
    if "bias" in names and not has_bias:
        raise TypeError("with_grad asks for the bias gradient, but no bias was given")
    return "hidden" in names, "weight" in names, "bias" in names


def _grad_elem(elem: str, grad_dtype) -> str:
    """The core's gradient element for inputs of `elem`: theirs, or float32 for half inputs
    with grad_dtype=float32; anything else a TypeError."""
    if (grad_dtype is None or (elem == "f32" and np.dtype(grad_dtype) == np.float32)
            or (elem == "f64" and np.dtype(grad_dtype) == np.float64)):
        return elem
    if elem in ("f16", "bf16") and np.dtype(grad_dtype) == np.float32:
        return "f32"
    raise TypeError(f"grad_dtype must be None, the input dtype or float32 (for half inputs), "
                    f"got {grad_dtype!r}")


def _grad_array(a, shape, gelem: str, elem: str, like):
    """A gradient from the core in its caller's form: shaped, and half bits viewed as the input's
    half dtype (HalfBits for HalfBits inputs); None stays None."""
    if a is None:
        return None
    a = a.reshape(shape)
    if gelem != elem or elem in ("f32", "f64"):
        return a
    if isinstance(like, HalfBits):
        return HalfBits(a, like.dtype)
    return a.view(like.dtype)


def linear_cross_entropy(hidden, weight, targets, *, bias=None, class_weight=None, chunk=None,
                         reduction="mean", ignore_index=None, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0, shift=0, return_accuracy=False, with_grad=False,
                         grad_output=None, grad_lse=None, grad_dtype=None, token_weight=None,
                         temperature=1.0, return_entropy=False, grad_entropy=None,
                         device="cpu") -> LinearCrossEntropy:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` without materializing the
    logits.

    hidden ``[..., d_model]`` and weight ``[vocab, d_model]``: arrays of one dtype, float32,
    float64, float16 or bfloat16 (``ml_dtypes``; half inputs compute in float32 and are widened as
    they are packed, never copied). targets ``hidden.shape[:-1]``: integers. ``chunk=None`` picks
    the largest chunk the logit budget (2**27 cells) admits. With ``z = hidden @ weight.T + bias``
    capped to ``softcap * tanh(z / softcap)`` when ``softcap`` is given and divided by
    ``temperature`` (default 1: nothing), per counted token::

        ce_t = (1 - eps) w[y] (lse - z_y) + (eps / V) sum_v w[v] (lse - z_v)
        z_t  = lse_square_scale * lse**2

    (``eps = label_smoothing``, ``w = class_weight`` or ones). ``reduction``: "mean" is
    ``sum_t ce_t / sum_t w[y_t] + sum_t z_t / n_counted`` (PyTorch's weighted mean; NaN with zero
    gradients when nothing is counted), "sum" adds ``ce_t + z_t``, "none" returns them per token.
    ``ignore_index`` marks tokens that count for nothing; with ``ignore_index=None`` every target
    must be in [0, vocab) (a negative one is refused, 586, never read as a mask). ``shift=k``
    scores ``hidden[..., t, :]`` against ``targets[..., t + k]`` within each sequence (the
    second-to-last axis; the whole array for 2-D hidden): the per-token outputs then have
    ``seq - k`` positions, nothing is copied.

    ``temperature=T`` (finite, > 0; else 585) divides the logits before the softmax, gradients
    through it: the loss, ``lse``, the argmax and every per-token output are of ``z / T``, and
    with ``reduction="none"`` ``-loss`` is the log-probability of each target at sampling
    temperature T. With a cap, ``(softcap / T) * tanh(z / softcap)`` (a cap of the raw logit,
    then the division, as a sampler tempers capped logits).

    ``return_entropy=True`` adds ``entropy``: per counted token ``H_t = lse_t - sum_v p_v z_v``
    of the (tempered) softmax, formed as ``(max_v z_v - E[z]) + log sum_v exp(z_v - max)`` (sums
    of non-negative terms, no cancellation for a peaked distribution), reduced as the z-loss term
    is: "mean" ``sum_t u_t H_t / sum_t u_t`` (u the token weights, ones without; class weights do
    not enter), "sum" ``sum_t u_t H_t``, "none" per token (0 where not counted). Its gradient
    ``dH_t/dz_v = p_v (E[z] - z_v)`` is formed in the same sweep as the loss's: ``grad_entropy``
    (a scalar for "mean"/"sum", one per token for "none") is its upstream gradient, so
    ``loss - c * entropy`` is ``with_grad=True, return_entropy=True, grad_entropy=-c``.

    ``token_weight`` (the targets' shape, finite and >= 0, aligned with the targets: with a shift
    the loss scored against ``targets[..., t + k]`` takes ``token_weight[..., t + k]``) multiplies
    each counted token's loss, ``u_t (ce_t + z_t)``; "mean" becomes
    ``sum_t u_t ce_t / sum_t u_t w[y_t] + sum_t u_t z_t / sum_t u_t`` (the token's weight times
    its class's, as PyTorch weighs a class), "sum" ``sum_t u_t (ce_t + z_t)``. A negative or
    non-finite weight is refused (585) before any work. With ``reduction="none"``, no label
    smoothing, class weights or z-loss, ``-loss`` is each token's log-probability of its target.

    ``with_grad=True`` also returns ``d_hidden``, ``d_weight`` and (with a bias) ``d_bias`` of the
    reduced loss, computed in the same pass; ``with_grad="hidden"`` (or "weight", "bias", or a
    tuple of them) computes only those. Gradients come in the input dtype, or float32 for half
    inputs with ``grad_dtype="float32"``. ``grad_output`` is the loss's upstream gradient: a
    scalar for "mean"/"sum" (default 1), one per token (the loss's shape) for "none".
    ``grad_lse`` (the per-token lse's shape) adds the gradient of ``sum_t grad_lse[t] * lse_t``.
    ``return_accuracy=True`` adds the per-token argmax of the (capped) logits (ties
    to the lowest index) and the accuracy over counted tokens, from the forward's running maximum.
    Peak extra memory is the gradients plus one chunk of logits.

    ``device="cuda"`` runs the same computation on the CUDA backend (``-Ccmake.define.ALGENTA_GPU=ON``,
    or the emulation build): the arrays are copied to the device and the results back. Results
    agree with the CPU backend's within float rounding, not bit for bit (another reduction order),
    and are bit-identical across runs and chunk sizes there too; half inputs round ``chunk`` down
    to a multiple of 16. A build without a CUDA backend raises ``LossUnavailableError`` (589), a
    host without a usable device 590.
    """
    dev = _device(device)
    if (not isinstance(hidden, (np.ndarray, HalfBits))
            or not isinstance(weight, (np.ndarray, HalfBits))):
        raise TypeError("hidden and weight must be NumPy arrays (or HalfBits)")
    elem, h = _elem(hidden)
    welem, w = _elem(weight)
    if welem != elem:
        raise TypeError(f"hidden and weight must share one dtype; got {_dtype_name(hidden)} and "
                        f"{_dtype_name(weight)}")
    want = _grad_sets(with_grad, bias is not None)
    if targets is None or (not isinstance(targets, (np.ndarray, list, tuple))
                           and not hasattr(targets, "__array__")):
        raise TypeError(f"targets must be an array of integer class indices, got "
                        f"{type(targets).__name__}")
    t = _targets(targets)
    o = _args.options(reduction=reduction, ignore_index=ignore_index,
                      label_smoothing=label_smoothing, softcap=softcap, temperature=temperature,
                      lse_square_scale=lse_square_scale, shift=shift, chunk=chunk,
                      entropy=return_entropy)
    return _lce(hidden, weight, np.shape(targets), (elem, h, w, t), o, want, bias=bias,
                class_weight=class_weight, token_weight=token_weight, grad_output=grad_output,
                grad_lse=grad_lse, grad_dtype=grad_dtype, return_accuracy=return_accuracy,
                grad_entropy=grad_entropy, device=dev)


def _lce(hidden, weight, target_shape, core_in, o: _args.CrossEntropyOptions, want, *, bias,
         class_weight, token_weight, grad_output, grad_lse, grad_dtype, return_accuracy,
         grad_entropy, device) -> LinearCrossEntropy:
    """linear_cross_entropy once its inputs' types are known (algenta.torch's CPU tensors come in
    here): hidden and weight the caller's arrays (their shapes and dtypes), core_in (elem, h, w,
    t) what the core reads of them and of the targets (int64, flat), o the options record, want
    the gradients (d_hidden, d_weight, d_bias) to compute."""
    elem, h, w, t = core_in
    want_dh, want_dw, want_db = want
    want_grad = want_dh or want_dw or want_db
    reduction, k = o.reduction, o.shift
    compute = np.float64 if elem == "f64" else np.float32
    gelem = _grad_elem(elem, grad_dtype)
    if bias is not None:
        if not isinstance(bias, (np.ndarray, HalfBits)):
            raise TypeError("linear_bias must be a NumPy array (or HalfBits)")
        if _dtype_name(bias) != _dtype_name(weight):
            raise _err(f"linear_bias must have weight's dtype {_dtype_name(weight)}, got "
                       f"{_dtype_name(bias)}", 582)
    cw = None
    if class_weight is not None:
        cw = _asarray(class_weight, "class_weight")
        if cw.dtype.kind not in "fiu":
            raise TypeError(f"class_weight must hold real numbers, got dtype {cw.dtype}")
    tw = None
    if token_weight is not None:
        tw = _asarray(token_weight, "token_weight")
        if tw.dtype.kind not in "fiu":
            raise TypeError(f"token_weight must hold real numbers, got dtype {tw.dtype}")
    lead, n, d, v = _args.shapes(
        hidden.shape, weight.shape, target_shape, shift=k,
        bias_shape=None if bias is None else bias.shape,
        class_weight_shape=None if cw is None else cw.shape,
        token_weight_shape=None if tw is None else tw.shape,
        names=("hidden", "weight", "targets", "linear_bias", "class_weight"))
    if tw is not None:
        tw = np.ascontiguousarray(tw, dtype=compute).reshape(n)
    seq = lead[-1]
    b = None if bias is None else np.ascontiguousarray(_elem(bias)[1])
    if cw is not None:
        cw = np.ascontiguousarray(cw, dtype=compute)
    out_shape = lead[:-1] + (seq - k,) if 0 < k < seq else lead

    def per_token_in(x, name):
        """A per-token upstream gradient of the output's shape, as (n,) for the core (zeros at the
        positions a shift leaves unscored)."""
        if not want_grad:
            raise _err(f"{name} is only used with with_grad", 582)
        a = _asarray(x, name)
        if a.dtype.kind not in "fiu":
            raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
        if a.shape != out_shape:
            raise _err(f"{name} must have shape {out_shape}, got {a.shape}", 582)
        if out_shape != lead:
            full = np.zeros(lead, dtype=compute)
            full[..., : seq - k] = a
            a = full
        return np.ascontiguousarray(a, dtype=compute).reshape(n)

    go, gscale = None, 1.0
    if grad_output is not None:
        if reduction == "none":
            go = per_token_in(grad_output, "grad_output")
        elif not want_grad:
            raise _err("grad_output is only used with with_grad", 582)
        else:
            gscale = as_float(grad_output, "grad_output (a scalar for mean and sum)")
    gl = None if grad_lse is None else per_token_in(grad_lse, "grad_lse")
    ge, escale = None, 0.0
    if grad_entropy is not None:
        if not o.entropy:
            raise _err("grad_entropy needs return_entropy=True", 582)
        if reduction == "none":
            ge = per_token_in(grad_entropy, "grad_entropy")
        elif not want_grad:
            raise _err("grad_entropy is only used with with_grad", 582)
        else:
            escale = as_float(grad_entropy, "grad_entropy (a scalar for mean and sum)")
    r = _c.fused_linear_ce(
        o._replace(grad_scale=gscale, entropy_grad_scale=escale),
        hidden=np.ascontiguousarray(h).reshape(n, d), weight=np.ascontiguousarray(w), targets=t,
        n_tok=n, d_model=d, vocab=v, seq_len=seq, elem=elem, grad_elem=gelem, bias=b,
        class_weight=cw, token_weight=tw, grad_output=go, grad_lse=gl, grad_entropy=ge,
        want_dh=want_dh, want_dw=want_dw, want_db=want_db, want_loss_tok=reduction == "none",
        want_z_tok=reduction == "none" and o.lse_square_scale != 0.0,
        want_pred=bool(return_accuracy), device=device)

    def per_token(a):
        a = a.reshape(lead)
        return a[..., : seq - k] if out_shape != lead else a

    def grad(a, shape):
        return _grad_array(a, shape, gelem, elem, hidden)

    scalar = np.float64 if elem == "f64" else np.float32
    if reduction == "none":
        loss = per_token(r["loss_tok"])
        zl = per_token(r["z_tok"]) if r["z_tok"] is not None else np.zeros(out_shape, scalar)
    else:
        loss = scalar(r["mean"] if reduction == "mean" else r["total"])
        zl = scalar(r["z_mean"] if reduction == "mean" else r["z_total"])
    ent = None
    if o.entropy:
        ent = (per_token(r["entropy_tok"]) if reduction == "none" else
               scalar(r["entropy_mean"] if reduction == "mean" else r["entropy_total"]))
    pred = acc = None
    if return_accuracy:
        pred = per_token(r["pred"])
        acc = r["n_correct"] / r["n_valid"] if r["n_valid"] else math.nan
    return LinearCrossEntropy(
        loss=loss, lse=per_token(r["lse"]), n_valid=r["n_valid"],
        d_hidden=grad(r["d_hidden"], hidden.shape), d_weight=grad(r["d_weight"], weight.shape),
        d_bias=grad(r["d_bias"], (v,)), z_loss=zl, pred=pred, accuracy=acc, entropy=ent)


ShardPass = record_type(
    "ShardPass",
    ("lse", "target_logit", "logit_sum", "d_hidden", "d_weight", "d_bias"),
    "One pass over a shard of the vocabulary: per-token lse of the shard's (biased, capped) "
    "logits, the target's logit and the class-weighted logit sum; with grad_coef, gradients.",
)


def vocab_shard_pass(hidden, weight_shard, local_targets, *, bias=None, class_weight=None,
                     softcap=None, temperature=1.0, chunk=None, grad_coef=None,
                     with_grad=False) -> ShardPass:
    """One pass of the core over rows ``[s, s + rows)`` of the head, for losses that combine
    shards of the vocabulary (``algenta.torch.vocab_parallel_linear_cross_entropy``).

    hidden ``[n, d_model]`` and weight_shard ``[rows, d_model]`` of one dtype (bias and
    class_weight the shard's parts, ``[rows]``); local_targets ``[n]`` in ``[0, rows)`` (the
    caller knows which tokens the shard owns and puts any in-range index for the others).
    Returns per token the lse of the shard's logits ``z'`` (biased, soft-capped, over the
    temperature), ``z'`` at the
    local target, and ``sum_v w_v z'_v`` (w the class weights, or ones). With ``grad_coef``
    ``[n, 3]`` per-token ``(a, b, c)`` and ``with_grad``, also the gradients of the scalar whose
    derivative is ``d/dz'_v = a softmax_v - b w_v - c [v == target]`` (the softmax over this
    shard: a carries ``exp(lse_shard - lse)`` to make it the global one).
    """
    o = _args.options(reduction="none", softcap=softcap, temperature=temperature, chunk=chunk)
    return _shard_pass(hidden, weight_shard, local_targets, o, bias=bias,
                       class_weight=class_weight, grad_coef=grad_coef, with_grad=with_grad)


def _shard_pass(hidden, weight_shard, local_targets, o: _args.CrossEntropyOptions, *, bias=None,
                class_weight=None, grad_coef=None, with_grad=False) -> ShardPass:
    """vocab_shard_pass with its options record o (reduction "none"; the options the combination
    of the shards applies itself, label smoothing, ignore_index and the z-loss, at their
    defaults)."""
    if (not isinstance(hidden, (np.ndarray, HalfBits))
            or not isinstance(weight_shard, (np.ndarray, HalfBits))):
        raise TypeError("hidden and weight_shard must be NumPy arrays (or HalfBits)")
    elem, h = _elem(hidden)
    welem, w = _elem(weight_shard)
    if (welem != elem or hidden.ndim != 2 or weight_shard.ndim != 2
            or hidden.shape[1] != weight_shard.shape[1]):
        raise _err(f"hidden [n, d_model] and weight_shard [rows, d_model] of one dtype, got "
                   f"{hidden.shape} and {weight_shard.shape}", 582)
    n, d = hidden.shape
    v = weight_shard.shape[0]
    t = _targets(local_targets)
    if t.shape != (n,):
        raise _err(f"local_targets must have shape ({n},), got {t.shape}", 582)
    want_dh, want_dw, want_db = _grad_sets(with_grad, bias is not None)
    compute = np.float64 if elem == "f64" else np.float32
    cw = None if class_weight is None else np.ascontiguousarray(class_weight, dtype=compute)
    gc = None
    if grad_coef is not None:
        gc = np.ascontiguousarray(grad_coef, dtype=compute)
        if gc.shape != (n, 3):
            raise _err(f"grad_coef must have shape ({n}, 3), got {gc.shape}", 582)
    r = _c.fused_linear_ce(
        o, hidden=np.ascontiguousarray(h), weight=np.ascontiguousarray(w), targets=t, n_tok=n,
        d_model=d, vocab=v, elem=elem,
        bias=None if bias is None else np.ascontiguousarray(_elem(bias)[1]), class_weight=cw,
        grad_coef=gc, want_dh=want_dh, want_dw=want_dw, want_db=want_db, want_shard_stats=True)
    return ShardPass(lse=r["lse"], target_logit=r["target_logit"], logit_sum=r["logit_sum"],
                     d_hidden=r["d_hidden"], d_weight=r["d_weight"], d_bias=r["d_bias"])


__all__ = [
    "ce_from_logits_flat", "fused_linear_ce_flat", "fused_linear_ce_bwd_flat", "ce_peak_logit_cells",
    "ce_chunk_invariance_flat", "ce_grad_logits_flat", "CEAccumulator", "linear_cross_entropy",
    "HalfBits", "vocab_shard_pass", "release_scratch",
]

"""lossk.contract: the status vocabulary (580-599), ceilings and budget checks.

Pure arithmetic, implemented in the C++ core. Checks return status codes and never raise for
out-of-range numbers; wrong Python types raise ``TypeError``.

Ceilings (documented in ``cpp/include/algenta/lossk.hpp``):

=========================  =======================  ==========================================
``LOSS_MAX_WORK_CELLS``    2**46                    n_tok * d_model * vocab of one call
``LOSS_MAX_LOGIT_CELLS``   2**27                    chunk * vocab held at once (1 GiB float64)
``LOSS_MAX_TOKENS``        2**26 (67,108,864)       tokens in one call, and the largest chunk
``LOSS_MAX_D_MODEL``       2**17 (131,072)          model width
``LOSS_MAX_VOCAB``         2**22 (4,194,304)        classes (Gemma-3's 262,144 fits 16x over)
=========================  =======================  ==========================================
"""

from __future__ import annotations

from .. import _core
from .._convert import (I64_MAX, I64_MIN, as_float, as_i64_clamped, as_int, int_array,
                       length_of)
from ..errors import LossError

_c = _core.lossk

LOSS_OK = _c.LOSS_OK
LOSS_ERR_EMPTY_DIMENSION = _c.LOSS_ERR_EMPTY_DIMENSION
LOSS_ERR_LENGTH_MISMATCH = _c.LOSS_ERR_LENGTH_MISMATCH
LOSS_ERR_DIMENSION_TOO_LARGE = _c.LOSS_ERR_DIMENSION_TOO_LARGE
LOSS_ERR_WORK_BUDGET = _c.LOSS_ERR_WORK_BUDGET
LOSS_ERR_NON_FINITE = _c.LOSS_ERR_NON_FINITE
LOSS_ERR_TARGET_OUT_OF_RANGE = _c.LOSS_ERR_TARGET_OUT_OF_RANGE
LOSS_ERR_BAD_CHUNK = _c.LOSS_ERR_BAD_CHUNK
LOSS_ERR_UNKNOWN_OBJECTIVE = _c.LOSS_ERR_UNKNOWN_OBJECTIVE
LOSS_ERR_NO_CUDA_BACKEND = _c.LOSS_ERR_NO_CUDA_BACKEND
LOSS_ERR_NO_DEVICE = _c.LOSS_ERR_NO_DEVICE
LOSS_ERR_DEVICE_FAILED = _c.LOSS_ERR_DEVICE_FAILED
LOSS_MAX_WORK_CELLS = _c.LOSS_MAX_WORK_CELLS
LOSS_MAX_LOGIT_CELLS = _c.LOSS_MAX_LOGIT_CELLS
LOSS_MAX_TOKENS = _c.LOSS_MAX_TOKENS
LOSS_MAX_D_MODEL = _c.LOSS_MAX_D_MODEL
LOSS_MAX_VOCAB = _c.LOSS_MAX_VOCAB
LOSS_TRANSCENDENTAL_FLOOR = _c.LOSS_TRANSCENDENTAL_FLOOR
LOSS_VOCAB_BLOCK = _c.LOSS_VOCAB_BLOCK

_i64 = as_i64_clamped


def loss_status_name(code) -> str:
    """Name of a lossk status code; ``"unknown_status"`` for anything outside 580-591."""
    c = as_int(code, "code")
    if not I64_MIN <= c <= I64_MAX:
        return "unknown_status"
    return _c.loss_status_name(c)


def loss_dims_check(n_tok, d_model, vocab) -> int:
    """581 if a dimension is < 1, 583 past its ceiling, 584 if n_tok*d_model*vocab > 2**46, else 580."""
    return _c.loss_dims_check(_i64(n_tok, "n_tok"), _i64(d_model, "d_model"), _i64(vocab, "vocab"))


def loss_chunk_check(chunk, vocab) -> int:
    """587 when chunk*vocab would exceed LOSS_MAX_LOGIT_CELLS (never clamped); 581/583 for a
    malformed chunk or vocab; else 580."""
    return _c.loss_chunk_check(_i64(chunk, "chunk"), _i64(vocab, "vocab"))


def loss_logit_cells(chunk, vocab) -> float:
    """chunk*vocab as a float: what one chunk materializes. -1.0 on a malformed request (a
    dimension < 1 or past its ceiling), so a wrapped count never reads as small."""
    return _c.loss_logit_cells(_i64(chunk, "chunk"), _i64(vocab, "vocab"))


def loss_work_fits(n_tok, d_model, vocab, ceiling) -> bool:
    """True when n_tok*d_model*vocab <= ceiling, by successive division (no product, no overflow)."""
    return _c.loss_work_fits(
        _i64(n_tok, "n_tok"), _i64(d_model, "d_model"), _i64(vocab, "vocab"), _i64(ceiling, "ceiling")
    )


def loss_max_chunk(n_tok, vocab) -> int:
    """Largest chunk whose logits fit LOSS_MAX_LOGIT_CELLS, at most n_tok; 0 when malformed."""
    return _c.loss_max_chunk(_i64(n_tok, "n_tok"), _i64(vocab, "vocab"))


def loss_targets_in_range(targets, n_tok, vocab) -> bool:
    """True when each of the first n_tok targets is in [0, vocab). A negative target is out of
    range (never a mask); a list shorter than n_tok is False."""
    n = _i64(n_tok, "n_tok")
    v = _i64(vocab, "vocab")
    if n < 0 or length_of(targets, "targets") < n:
        return False
    try:
        arr = int_array(targets, "targets", error=lambda m: LossError(m, LOSS_ERR_TARGET_OUT_OF_RANGE))
    except (LossError, OverflowError):
        return False
    return _c.loss_targets_in_range(arr[:n], n, v)


def loss_scalars_ok(value) -> bool:
    """True when the scalar is finite."""
    return _c.loss_scalars_ok(as_float(value, "value"))


def loss_tol_for(magnitude, reduction_width) -> float:
    """Tolerance between two spellings of a float32 loss of size ``magnitude`` reduced over
    ``reduction_width`` terms: ``8 * FLT_EPSILON * max(1, |magnitude|) * sqrt(max(1, width))``.

    Rounding error of a float32 reduction grows like sqrt(width) ulps on real data; 8 ulps of
    headroom covers exp/log rounding. It grows with both arguments; NaN in gives NaN out (which
    fails every comparison)."""
    return _c.loss_tol_for(as_float(magnitude, "magnitude"), as_float(reduction_width, "reduction_width"))


__all__ = [n for n in dir() if n.startswith(("loss_", "LOSS_"))]

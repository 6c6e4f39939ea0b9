"""residentk.contract: would a resident decode session hold this shape, and what would it cost.

Pure host arithmetic, implemented in the C++ core (``cpp/src/residentk_contract.cpp``); no GPU
and no CUDA toolkit are needed to ask. Checks return status codes (600-619) and never raise for
out-of-range numbers; sizes are 0 for a shape the checks refuse; wrong Python types raise
``TypeError``. Python integers beyond int64 are clamped to the int64 end they lie past, which
every function treats exactly like the out-of-range value it stands for.

Dimension legend: D d_model, Hq query heads, Hkv key/value heads, Dh head_dim, F d_ff, L layers,
V vocab, T max_ctx (KV positions a session is opened at).

Ceilings (documented in ``cpp/include/algenta/residentk.hpp``):

================================  ===================  =========================================
``RESIDENT_MAX_CONTEXT``          65,536               KV positions; a refusal ceiling, not a size
``RESIDENT_DEFAULT_CONTEXT``      512                  default capacity, floor of the ctx bucket
``RESIDENT_MAX_SLOTS``            1,024                sequences one session holds
``RESIDENT_MAX_D_MODEL``          2**16 (65,536)       D
``RESIDENT_MAX_HEADS``            1,024                Hq and Hkv each
``RESIDENT_MAX_D_HEAD``           1,024                Dh (also a power of two)
``RESIDENT_MAX_D_FF``             2**18 (262,144)      F
``RESIDENT_MAX_LAYERS``           1,024                L
``RESIDENT_MAX_VOCAB``            2**22 (4,194,304)    V
``RESIDENT_MAX_STAGED_FLOATS``    tier / 4             max(D, F, Hq*Dh); the tier is the CMake
                                                       cache variable ``ALGENTA_SMEM_TIER_BYTES``
                                                       (default 49,152), see
                                                       :func:`residentk_smem_tier_bytes`
================================  ===================  =========================================

Within these ceilings the largest product formed (the KV cache) stays below 2**47, and every
product is still overflow-checked in the core.

Weight formats (``format=`` on :func:`residentk_matrix_bytes`, :func:`residentk_footprint` and
:func:`residentk_max_ctx_fitting`; the names are ``RESIDENT_WEIGHT_FORMATS``): how a session holds
its weight matrices (q, k, v, o, gate, up, down, the embedding and the lm_head). Element counts
never change with the format; only bytes do::

    f32    4 bytes an element (the default)
    bf16   2 bytes an element
    f16    2 bytes an element
    int8   1 byte an element + one float32 scale (4 bytes) per block of RESIDENT_INT8_BLOCK (32)
           along each row: rows * (cols + 4 * ceil(cols / 32)) bytes for a (rows, cols) matrix
    q4_0   llama.cpp's Q4_0: 18 bytes per block of 32 along each row (16 of 4-bit codes and a
           float16 scale): rows * 18 * ceil(cols / 32) bytes

The norms are float32 in every format. A format name that is none of the five is refused with
``ResidentError`` (a ``ValueError``, status 601); a format that is not a ``str`` raises
``TypeError``.

KV cache formats (``kv_format=`` on :func:`residentk_footprint` and
:func:`residentk_max_ctx_fitting`; the names are ``RESIDENT_KV_FORMATS``): ``"f32"`` (4 bytes an
element, the default), ``"bf16"`` or ``"f16"`` (2 bytes: each key and value rounded once when its
position is written; attention accumulates in float32). The KV element counts
(:func:`residentk_cache_elements`, ``kv_cache``) are the same in every format.

Split-K attention (one SDPA dispatch split over the key axis, then merged)::

    M(n_cores, Hq) = clamp(ceil(32 * n_cores / Hq), 1, 256)      # occupancy ceiling
                     80 when n_cores <= 0 (unprobeable: the last-known-good fixed value)
    policy(n_keys, n_cores, Hq) = 1                                when n_keys < 32
                                = clamp(round(M/2 * (1 + ln(n_keys/128) / ln(1000/128))), 1, M)

32 is the number of blocks one Ampere/Hopper SM keeps resident, so ``Hq * M`` blocks fill every
SM. The policy spends half the ceiling at 128 keys and all of it from 1000 keys on, log-linear in
between: on the reference GPU (40 SMs, Hq = 16) that is ``policy(128, 40, 16) == 40`` and
``policy(1000, 40, 16) == 80``, the two calibrated anchors, and at 32 keys it gives 13. Other
GPUs and head counts keep the same fraction of their own ceiling. The policy never decreases as
n_keys grows.
"""

from __future__ import annotations

from .. import _core
from .._convert import I64_MAX, I64_MIN, as_float, as_i64_clamped, as_int

_c = _core.residentk

RESIDENT_OK = _c.RESIDENT_OK
RESIDENT_ERR_EMPTY_DIMENSION = _c.RESIDENT_ERR_EMPTY_DIMENSION
RESIDENT_ERR_DIMENSION_TOO_LARGE = _c.RESIDENT_ERR_DIMENSION_TOO_LARGE
RESIDENT_ERR_HEAD_GEOMETRY = _c.RESIDENT_ERR_HEAD_GEOMETRY
RESIDENT_ERR_NO_KERNELS = _c.RESIDENT_ERR_NO_KERNELS
RESIDENT_ERR_NO_ACCELERATOR = _c.RESIDENT_ERR_NO_ACCELERATOR
RESIDENT_ERR_CONTEXT_FULL = _c.RESIDENT_ERR_CONTEXT_FULL
RESIDENT_ERR_WEIGHT_LENGTH = _c.RESIDENT_ERR_WEIGHT_LENGTH
RESIDENT_ERR_LAUNCH_FAILED = _c.RESIDENT_ERR_LAUNCH_FAILED
RESIDENT_ERR_NON_FINITE = _c.RESIDENT_ERR_NON_FINITE
RESIDENT_CODE_OUT_OF_RANGE = _c.RESIDENT_CODE_OUT_OF_RANGE
RESIDENT_MAX_CONTEXT = _c.RESIDENT_MAX_CONTEXT
RESIDENT_MAX_SLOTS = _c.RESIDENT_MAX_SLOTS
RESIDENT_DEFAULT_CONTEXT = _c.RESIDENT_DEFAULT_CONTEXT
RESIDENT_MAX_D_MODEL = _c.RESIDENT_MAX_D_MODEL
RESIDENT_MAX_HEADS = _c.RESIDENT_MAX_HEADS
RESIDENT_MAX_D_HEAD = _c.RESIDENT_MAX_D_HEAD
RESIDENT_MAX_D_FF = _c.RESIDENT_MAX_D_FF
RESIDENT_MAX_LAYERS = _c.RESIDENT_MAX_LAYERS
RESIDENT_MAX_VOCAB = _c.RESIDENT_MAX_VOCAB
RESIDENT_MAX_STAGED_FLOATS = _c.RESIDENT_MAX_STAGED_FLOATS
RESIDENT_SPLITK_MIN_KEYS = _c.RESIDENT_SPLITK_MIN_KEYS
RESIDENT_SPLITK_BLOCKS_PER_CORE = _c.RESIDENT_SPLITK_BLOCKS_PER_CORE
RESIDENT_SPLITK_FALLBACK_SPLITS = _c.RESIDENT_SPLITK_FALLBACK_SPLITS
RESIDENT_SPLITK_MAX_SPLITS = _c.RESIDENT_SPLITK_MAX_SPLITS
RESIDENT_PREFILL_NARROW_BELOW_ROWS = _c.RESIDENT_PREFILL_NARROW_BELOW_ROWS
RESIDENT_INT8_BLOCK = _c.RESIDENT_INT8_BLOCK
RESIDENT_WEIGHT_FORMATS = _c.RESIDENT_WEIGHT_FORMATS  # ("f32", "bf16", "f16", "int8", "q4_0")
RESIDENT_KV_FORMATS = _c.RESIDENT_KV_FORMATS  # ("f32", "bf16", "f16")

_i64 = as_i64_clamped


def _format(format, what="format", names=RESIDENT_WEIGHT_FORMATS) -> str:
    """A weight- or KV-format name: a str (the core refuses a name it does not know, with
    601)."""
    if not isinstance(format, str):
        raise TypeError(f"{what} must be a str ({', '.join(map(repr, names))}), "
                        f"got {type(format).__name__}")
    return format


def _kv_format(kv_format) -> str:
    return _format(kv_format, "kv_format", RESIDENT_KV_FORMATS)


def _shape(d_model, h_q, h_kv, d_head, d_ff) -> tuple:
    return (_i64(d_model, "d_model"), _i64(h_q, "h_q"), _i64(h_kv, "h_kv"),
            _i64(d_head, "d_head"), _i64(d_ff, "d_ff"))


def _model(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab) -> tuple:
    """The seed's seven flat integers of a model shape, converted; the binding makes them the
    core's one ModelShape record."""
    return (*_shape(d_model, h_q, h_kv, d_head, d_ff), _i64(n_layers, "n_layers"),
            _i64(vocab, "vocab"))


def residentk_status_name(code) -> str:
    """Name of a residentk status code; ``"resident_code_out_of_range"`` for anything that is
    not one of 600-609."""
    c = as_int(code, "code")
    if not I64_MIN <= c <= I64_MAX:
        return "resident_code_out_of_range"
    return _c.residentk_status_name(c)


def residentk_smem_tier_bytes() -> int:
    """Shared-memory bytes per block this binary's resident kernels were compiled to stage
    vectors in (CMake ``-Ccmake.define.ALGENTA_SMEM_TIER_BYTES=N``, default 49,152)."""
    return _c.residentk_smem_tier_bytes()


def residentk_dims_check(d_model, h_q, h_kv, d_head, d_ff) -> int:
    """Can a session hold this layer shape: 601 a dimension < 1; 602 past its ceiling; 603 when
    h_q is not a multiple of h_kv or d_head is not a power of two; 602 when the largest staged
    vector ``max(d_model, d_ff, h_q*d_head)`` floats exceeds the compiled shared-memory tier;
    else 600. ``h_q * d_head == d_model`` is not assumed (Qwen3-0.6B: 2048 vs 1024 passes)."""
    return _c.residentk_dims_check(*_shape(d_model, h_q, h_kv, d_head, d_ff))


def residentk_shape_check(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab) -> int:
    """:func:`residentk_dims_check` over a whole model: n_layers and vocab join the emptiness
    (601) and ceiling (602) checks, which all run before the geometry (603) and shared-memory
    tier (602) checks."""
    return residentk_shape_reason(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab)[0]


def residentk_shape_reason(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab) -> tuple:
    """``(status, reason)`` of :func:`residentk_shape_check`; the reason is ``""`` for 600."""
    st, why = _c.residentk_shape_check(*_model(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab))
    return int(st), str(why)


def residentk_context_check(n_prompt, n_new, max_ctx) -> int:
    """Does ``n_prompt + n_new`` fit a session opened at ``max_ctx`` positions: 601 when n_prompt
    < 1, n_new < 0 or max_ctx < 1; 602 when max_ctx > RESIDENT_MAX_CONTEXT; 606 when the run
    needs more positions than max_ctx; else 600. Asked once, before the first token: the cache
    is fixed-capacity and written in place."""
    return _c.residentk_context_check(_i64(n_prompt, "n_prompt"), _i64(n_new, "n_new"),
                                      _i64(max_ctx, "max_ctx"))


def residentk_cache_elements(n_layers, h_kv, d_head, max_ctx) -> int:
    """Float32 elements of the KV cache: ``n_layers * 2 * max_ctx * h_kv * d_head`` (one K and
    one V buffer per layer); 0 when an argument is < 1 or past its ceiling."""
    return _c.residentk_cache_elements(_i64(n_layers, "n_layers"), _i64(h_kv, "h_kv"),
                                       _i64(d_head, "d_head"), _i64(max_ctx, "max_ctx"))


def residentk_dispatch_budget(n_layers) -> int:
    """GPU dispatches per decode token on the standard path: ``n_layers * 6 + 3``; 0 when
    n_layers is < 1 or past RESIDENT_MAX_LAYERS."""
    return _c.residentk_dispatch_budget(_i64(n_layers, "n_layers"))


def residentk_dispatch_budget_deep(n_layers) -> int:
    """Dispatches per decode token with split-K attention (SDPA becomes partial + merge):
    ``1 + n_layers * 7 + 2``; 0 when n_layers is < 1 or past RESIDENT_MAX_LAYERS."""
    return _c.residentk_dispatch_budget_deep(_i64(n_layers, "n_layers"))


def residentk_weight_elems(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, max_ctx=512, *,
                           tied=True) -> int:
    """Total resident float32 elements: per layer q/k/v/o, gate/up/down, the input and
    post-attention RMSNorms, q_norm and k_norm; the embedding (counted once when ``tied``, twice
    with a separate lm_head when ``tied=False``); the final norm; and the KV cache at
    ``max_ctx``. 0 for a shape :func:`residentk_shape_check` refuses or a max_ctx outside
    ``[1, RESIDENT_MAX_CONTEXT]``. Qwen3-0.6B at 512 positions: 625,410,048."""
    if not isinstance(tied, bool):
        raise TypeError(f"tied must be a bool, got {type(tied).__name__}")
    return _c.residentk_weight_elems(*_model(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab),
                                     _i64(max_ctx, "max_ctx"), tied)


def residentk_matrix_bytes(rows, cols, format="f32") -> int:
    """Bytes of one ``(rows, cols)`` row-major weight matrix held in ``format``: ``4``, ``2``,
    ``2`` bytes an element for f32, bf16, f16; for int8 one byte an element plus a float32 scale
    per block of 32 along each row, ``rows * (cols + 4 * ceil(cols / 32))``. 0 when rows or cols
    is < 1 or the size overflows int64. An unknown format name raises ``ResidentError`` (601)."""
    return _c.residentk_matrix_bytes(_i64(rows, "rows"), _i64(cols, "cols"), _format(format))


def residentk_footprint(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, max_ctx=512, *,
                        tied=True, tp=1, check_tier=True, format="f32", kv_format="f32",
                        family=None) -> dict:
    """The terms behind :func:`residentk_weight_elems`, per GPU when the heads and the MLP are
    split ``tp`` ways (norms and embeddings replicated): ``attn``, ``mlp``, ``norms``,
    ``embed``, ``lm_head``, ``weights``, ``kv_cache``, ``kv_per_pos``, ``total`` (float32
    elements, the same in every format), then ``weight_bytes`` (every matrix by
    :func:`residentk_matrix_bytes` in ``format``, the norms in float32), ``kv_bytes``
    (``kv_cache`` elements of ``kv_format``: 4 bytes for f32, 2 for bf16 and f16) and
    ``total_bytes`` (``weight_bytes + kv_bytes``), with ``status`` and ``reason``. A ``tp`` that
    does not divide h_q, h_kv and d_ff is refused with 603; every size is 0 when the status is
    not 600. ``check_tier=False`` skips only the shared-memory tier check: the sizes a build
    with a larger tier would hold. An unknown ``format`` or ``kv_format`` name raises
    ``ResidentError`` (601). ``family`` (a ResidentConfig's family dict; None or {} for Qwen3)
    adds what that family holds beyond Qwen3's table, all float32 vectors: its biases to
    ``attn`` and ``mlp``, its extra norms (less q_norm and k_norm where it has none) to
    ``norms``, and their sum to the weight and total terms."""
    if not isinstance(tied, bool) or not isinstance(check_tier, bool):
        raise TypeError("tied and check_tier must be bools")
    fp = dict(_c.residentk_footprint(*_model(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab),
                                     _i64(max_ctx, "max_ctx"), tied, _i64(tp, "tp"), check_tier,
                                     _format(format), _kv_format(kv_format)))
    if family and fp["status"] == RESIDENT_OK:
        from .weights import family_vector_elems

        extra = family_vector_elems(dict(d_model=d_model, h_q=h_q, h_kv=h_kv, d_head=d_head,
                                         d_ff=d_ff, n_layers=n_layers, vocab=vocab,
                                         tie_word_embeddings=tied, family=family), tp)
        n = sum(extra.values())
        for k, v in extra.items():
            fp[k] += v
        fp["weights"] += n
        fp["total"] += n
        fp["weight_bytes"] += 4 * n
        fp["total_bytes"] += 4 * n
    return fp


def residentk_max_ctx_fitting(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, budget_bytes, *,
                              tied=True, tp=1, check_tier=True, format="f32",
                              kv_format="f32") -> int:
    """Largest bucketed capacity (a power of two in 512..65536, what a session allocates) whose
    per-GPU resident footprint, ``total_bytes`` of :func:`residentk_footprint` with the weights
    in ``format`` and the KV cache in ``kv_format``, fits ``budget_bytes``; 0 when not even 512
    positions fit or the shape is refused (``check_tier`` as in :func:`residentk_footprint`). A
    smaller format leaves more of the budget to the KV cache: the answer never shrinks from f32
    to bf16/f16, nor from those to int8 while every matrix row holds at least 4 elements (a
    shorter row's int8 scale costs more than the byte it saves)."""
    if not isinstance(tied, bool) or not isinstance(check_tier, bool):
        raise TypeError("tied and check_tier must be bools")
    return _c.residentk_max_ctx_fitting(*_model(d_model, h_q, h_kv, d_head, d_ff, n_layers,
                                               vocab),
                                        tied, _i64(tp, "tp"), _i64(budget_bytes, "budget_bytes"),
                                        check_tier, _format(format), _kv_format(kv_format))


def residentk_slots_fitting(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, max_ctx,
                            budget_bytes, *, tied=True, tp=1, check_tier=True, format="f32",
                            kv_format="f32", family=None) -> int:
    """Most sequences (slots) of ``max_ctx`` positions one session holds within
    ``budget_bytes``: the weights once, in ``format``, and one KV cache per slot at the bucketed
    capacity ``resident_bucket_ctx(max_ctx)`` (what a session allocates), in ``kv_format``; per
    GPU at ``tp``. 0 when the weights and one slot do not fit or the shape is refused; at most
    ``RESIDENT_MAX_SLOTS``. The arithmetic ``ResidentSession(slots=N).resident_bytes`` and
    ``algenta serve`` use. ``family`` as in :func:`residentk_footprint`."""
    fp = residentk_footprint(d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab,
                             resident_bucket_ctx(max_ctx), tied=tied, tp=tp,
                             check_tier=check_tier, format=format, kv_format=kv_format,
                             family=family)
    budget = _i64(budget_bytes, "budget_bytes")
    if fp["status"] != RESIDENT_OK or fp["kv_bytes"] <= 0:
        return 0
    room = budget - fp["weight_bytes"]
    return int(max(0, min(room // fp["kv_bytes"], RESIDENT_MAX_SLOTS)))


def residentk_scalars_ok(eps, scale) -> bool:
    """True when both the RMSNorm eps and the attention scale are finite and strictly positive."""
    return _c.residentk_scalars_ok(as_float(eps, "eps"), as_float(scale, "scale"))


def residentk_splitk_should_split(n_keys) -> bool:
    """True from 32 keys on: the measured depth at which splitting SDPA pays for its merge."""
    return _c.residentk_splitk_should_split(_i64(n_keys, "n_keys"))


def residentk_splitk_max_n_splits(n_cores, h_q) -> int:
    """Occupancy ceiling of :func:`residentk_splitk_policy`: ``ceil(32 * n_cores / h_q)``
    clamped to [1, 256]; 80 (the last-known-good fixed value) when n_cores <= 0; 1 when h_q < 1.
    What a caller sizes split-K scratch to, once, before any step's n_keys is known."""
    return _c.residentk_splitk_max_n_splits(_i64(n_cores, "n_cores"), _i64(h_q, "h_q"))


def residentk_splitk_policy(n_keys, n_cores, h_q) -> int:
    """Split count for an SDPA over ``n_keys`` keys (formula in the module docstring): 1 below
    32 keys, else log-linear in n_keys through ``policy(128, 40, 16) == 40`` and
    ``policy(1000, 40, 16) == 80``, clamped to [1, max_n_splits(n_cores, h_q)]; never decreasing
    as n_keys grows."""
    return _c.residentk_splitk_policy(_i64(n_keys, "n_keys"), _i64(n_cores, "n_cores"),
                                      _i64(h_q, "h_q"))


def residentk_prefill_gemm_use_narrow_tile(m_rows) -> bool:
    """True below 32 rows: use the narrow-tile GEMM for this prefill (measured: narrow wins at 5
    rows, wide at 256)."""
    return _c.residentk_prefill_gemm_use_narrow_tile(_i64(m_rows, "m_rows"))


def resident_bucket_ctx(max_ctx) -> int:
    """The capacity a session opened at ``max_ctx`` allocates: the next power of two, floored at
    RESIDENT_DEFAULT_CONTEXT (512) and capped at RESIDENT_MAX_CONTEXT (65536), so requests in one
    power-of-two band reuse the same resident buffers. The cap is not a fit check:
    :func:`residentk_context_check` refuses a max_ctx past it."""
    return _c.resident_bucket_ctx(_i64(max_ctx, "max_ctx"))


__all__ = [n for n in dir() if n.startswith(("residentk_", "resident_", "RESIDENT_"))]

"""Property tests (hypothesis) for the lossk and residentk contracts.

Each check is held against an independent model written here in Python integers, which cannot
overflow: a contract function that wraps a 64-bit product, or misplaces a boundary by one, reads
differently from the model at some input. Inputs range over all of int64 (and past it, where the
Python layer clamps), with the interesting edges (0, 1, the ceilings, the exact budget boundary)
drawn on purpose rather than hoped for.

Runs are derandomized so CI sees the same examples every time; ALGENTA_PROPERTY_SCALE=10 (say)
multiplies the example counts for a longer local hunt.
"""

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from algenta import linear_cross_entropy
from algenta.lossk import contract as L
from algenta.residentk import contract as R

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
_SCALE = max(1, int(os.environ.get("ALGENTA_PROPERTY_SCALE", "1")))


def cfg(n):
    return settings(max_examples=n * _SCALE, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


# Any int64, with the values where arithmetic goes wrong drawn often: the ends, zero and one,
# powers of two and their neighbours (ceilings are powers of two).
_edges = [I64_MIN, I64_MIN + 1, -1, 0, 1, 2, I64_MAX - 1, I64_MAX]
_pow2 = [2**k + e for k in range(63) for e in (-1, 0, 1)]
i64 = st.one_of(st.integers(I64_MIN, I64_MAX), st.sampled_from(_edges), st.sampled_from(_pow2))
# Past int64 too: the Python layer clamps to the end it lies past (documented), never wraps.
wide = st.one_of(i64, st.integers(-(2**80), 2**80))


def clamp64(x):
    return min(max(x, I64_MIN), I64_MAX)


# ---- lossk -------------------------------------------------------------------------------------

def model_work_fits(n, d, v, ceiling):
    return min(n, d, v, ceiling) >= 1 and n * d * v <= ceiling


def model_dims(n, d, v):
    if min(n, d, v) < 1:
        return 581
    if n > L.LOSS_MAX_TOKENS or d > L.LOSS_MAX_D_MODEL or v > L.LOSS_MAX_VOCAB:
        return 583
    if n * d * v > L.LOSS_MAX_WORK_CELLS:
        return 584
    return 580


def model_chunk(c, v):
    if c < 1 or v < 1:
        return 581
    if c > L.LOSS_MAX_TOKENS or v > L.LOSS_MAX_VOCAB:
        return 583
    if c * v > L.LOSS_MAX_LOGIT_CELLS:
        return 587
    return 580


@pytest.mark.slow
@cfg(600)
@given(wide, wide, wide, wide)
@example(2**21, 2**21, 2**21, I64_MAX)         # product 2^63: one past int64
@example(I64_MAX, I64_MAX, I64_MAX, I64_MAX)
@example(3, 5, 7, 105)
def test_work_fits_never_overflows(n, d, v, ceiling):
    assert L.loss_work_fits(n, d, v, ceiling) == model_work_fits(*map(clamp64, (n, d, v, ceiling)))


@cfg(400)
@given(st.integers(1, 2**21), st.integers(1, 2**21), st.integers(1, 2**21),
       st.sampled_from([-1, 0, 1]))
def test_work_fits_exact_at_the_boundary(n, d, v, delta):
    # The ceiling placed exactly at, one below and one above the product: the answer flips
    # precisely there, never a cell early or late (a float or rounded division would).
    ceiling = n * d * v + delta
    assume(1 <= ceiling <= I64_MAX)
    assert L.loss_work_fits(n, d, v, ceiling) == (delta >= 0)


@cfg(500)
@given(wide, wide, wide)
@example(2**12, 2**12, 2**22)
@example(2**12 + 1, 2**12, 2**22)
def test_dims_check_matches_model(n, d, v):
    assert L.loss_dims_check(n, d, v) == model_dims(*map(clamp64, (n, d, v)))


@cfg(300)
@given(st.integers(1, L.LOSS_MAX_TOKENS), st.integers(1, L.LOSS_MAX_D_MODEL),
       st.integers(1, L.LOSS_MAX_VOCAB), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3))
def test_dims_budget_monotone(n, d, v, dn, dd, dv):
    # Shrinking any dimension never turns an accepted shape into a refused one (and growing one
    # never turns a refusal into an acceptance): the budget is a down-set.
    small = L.loss_dims_check(max(1, n >> dn), max(1, d >> dd), max(1, v >> dv))
    big = L.loss_dims_check(n, d, v)
    if big == 580:
        assert small == 580
    if small != 580:
        assert big != 580


@cfg(500)
@given(wide, wide)
@example(2**25, 4)
@example(2**25 + 1, 4)
def test_chunk_check_and_logit_cells(c, v):
    c64, v64 = clamp64(c), clamp64(v)
    assert L.loss_chunk_check(c, v) == model_chunk(c64, v64)
    cells = L.loss_logit_cells(c, v)
    if min(c64, v64) < 1 or c64 > L.LOSS_MAX_TOKENS or v64 > L.LOSS_MAX_VOCAB:
        assert cells == -1.0
    else:
        assert cells == float(c64 * v64) and int(cells) == c64 * v64  # exact, never wrapped


@cfg(400)
@given(st.one_of(wide, st.integers(1, L.LOSS_MAX_TOKENS)), wide)
def test_max_chunk_is_the_largest_fitting(n, v):
    n64, v64 = clamp64(n), clamp64(v)
    c = L.loss_max_chunk(n, v)
    if n64 < 1 or v64 < 1 or v64 > L.LOSS_MAX_VOCAB:
        assert c == 0
        return
    assert 1 <= c <= min(n64, L.LOSS_MAX_TOKENS)
    assert L.loss_chunk_check(c, v64) == 580
    if c < min(n64, L.LOSS_MAX_TOKENS):
        assert L.loss_chunk_check(c + 1, v64) == 587  # the logit budget is what stopped it
    elif c < n64:
        assert L.loss_chunk_check(c + 1, v64) == 583  # the token ceiling is what stopped it


def test_max_chunk_is_a_chunk_the_check_admits_past_the_token_ceiling():
    c = L.loss_max_chunk(2**27, 1)
    assert L.loss_chunk_check(c, 1) == 580


@cfg(300)
@given(st.integers(1, 2**30), st.integers(1, L.LOSS_MAX_VOCAB), st.integers(0, 2**20))
def test_max_chunk_monotone(n, v, grow):
    assert L.loss_max_chunk(n + grow, v) >= L.loss_max_chunk(n, v)  # more tokens: never smaller
    if v + grow <= L.LOSS_MAX_VOCAB:
        assert L.loss_max_chunk(n, v + grow) <= L.loss_max_chunk(n, v)  # wider vocab: never larger


@cfg(300)
@given(st.floats(-1e300, 1e300), st.floats(0, 1e12), st.floats(0, 1e300), st.floats(0, 1e12))
def test_tolerance_monotone(m, w, dm, dw):
    a = L.loss_tol_for(m, w)
    assert a > 0 and math.isfinite(a)
    bigger_m = math.copysign(abs(m) + dm, m) if math.isfinite(abs(m) + dm) else m
    assert L.loss_tol_for(bigger_m, w + dw) >= a


# ---- residentk ---------------------------------------------------------------------------------

_CEIL = {"d_model": R.RESIDENT_MAX_D_MODEL, "h_q": R.RESIDENT_MAX_HEADS, "h_kv": R.RESIDENT_MAX_HEADS,
         "d_head": R.RESIDENT_MAX_D_HEAD, "d_ff": R.RESIDENT_MAX_D_FF,
         "n_layers": R.RESIDENT_MAX_LAYERS, "vocab": R.RESIDENT_MAX_VOCAB}


def model_shape(D, Hq, Hkv, Dh, F, Lyr, V, tier=True):
    dims = [D, Hq, Hkv, Dh, F, Lyr, V]
    if min(dims) < 1:
        return 601
    if any(x > c for x, c in zip(dims, _CEIL.values())):
        return 602
    if Hq % Hkv or Dh & (Dh - 1):
        return 603
    if tier and max(D, F, Hq * Dh) > R.RESIDENT_MAX_STAGED_FLOATS:
        return 602
    return 600


def model_footprint(D, Hq, Hkv, Dh, F, Lyr, V, T, tied, tp):
    hq, hkv, ff = Hq // tp, Hkv // tp, F // tp
    attn = Lyr * (2 * D * hq * Dh + 2 * D * hkv * Dh)
    mlp = Lyr * 3 * D * ff
    norms = Lyr * (2 * D + 2 * Dh) + D
    embed = V * D
    head = 0 if tied else embed
    weights = attn + mlp + norms + embed + head
    kv_per_pos = Lyr * 2 * hkv * Dh
    kv = kv_per_pos * T
    return dict(attn=attn, mlp=mlp, norms=norms, embed=embed, lm_head=head, weights=weights,
                kv_cache=kv, kv_per_pos=kv_per_pos, total=weights + kv)


pow2 = st.integers(0, 11).map(lambda k: 2**k)
# Shapes near and past the ceilings, and plausible ones, in one stream.
dim = st.one_of(st.integers(-2, 2**17), st.sampled_from([1, 2, 3, 64, 128, 1024, 1025, 2**16, 2**18,
                                                          2**18 + 1, 2**22, 2**22 + 1]), i64)


@pytest.mark.slow
@cfg(500)
@given(dim, dim, dim, st.one_of(pow2, dim), dim, dim, dim, st.one_of(dim, st.integers(1, 2**17)),
       st.booleans(), st.one_of(st.integers(1, 8), dim), st.booleans())
def test_footprint_exact_and_never_wrapped(D, Hq, Hkv, Dh, F, Lyr, V, T, tied, tp, tier):
    f = R.residentk_footprint(D, Hq, Hkv, Dh, F, Lyr, V, T, tied=tied, tp=tp, check_tier=tier)
    st_ = model_shape(D, Hq, Hkv, Dh, F, Lyr, V, tier)
    if st_ == 600 and not 1 <= T <= R.RESIDENT_MAX_CONTEXT:
        st_ = 601 if T < 1 else 602
    if st_ == 600 and (tp < 1 or Hq % tp or Hkv % tp or F % tp):
        st_ = 603
    assert f["status"] == st_
    sizes = {k: v for k, v in f.items() if k not in ("status", "reason")}
    if st_ != 600:
        assert set(sizes.values()) == {0} and f["reason"]
    else:
        assert sizes == model_footprint(D, Hq, Hkv, Dh, F, Lyr, V, T, tied, tp)
        assert f["total"] < 2**50  # the header's claim about the ceilings
    # weight_elems is the footprint at tp=1 with the tier checked, or 0 for a refusal.
    one = model_shape(D, Hq, Hkv, Dh, F, Lyr, V) == 600 and 1 <= T <= R.RESIDENT_MAX_CONTEXT
    want = model_footprint(D, Hq, Hkv, Dh, F, Lyr, V, T, tied, 1)["total"] if one else 0
    assert R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr, V, T, tied=tied) == want


@cfg(300)
@given(st.integers(1, 4096), st.integers(0, 3), st.integers(0, 3), st.integers(0, 7),
       st.integers(1, 8192), st.integers(1, 64), st.integers(1, 200_000),
       st.integers(1, R.RESIDENT_MAX_CONTEXT), st.integers(0, R.RESIDENT_MAX_CONTEXT),
       st.booleans())
def test_resident_budget_monotone(D, gq, kvk, dhk, F, Lyr, V, T, dT, tied):
    Hkv = 2**kvk
    Hq, Dh = Hkv * 2**gq, 2**dhk
    base = R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr, V, T, tied=tied)
    assume(base > 0)
    # More context, more layers, a wider vocab or an untied head never cost less.
    if T + dT <= R.RESIDENT_MAX_CONTEXT:
        assert R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr, V, T + dT, tied=tied) >= base
    assert R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr + 1, V, T, tied=tied) > base
    assert R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr, V + 1, T, tied=tied) > base
    assert R.residentk_weight_elems(D, Hq, Hkv, Dh, F, Lyr, V, T, tied=False) >= base
    assert R.residentk_cache_elements(Lyr, Hkv, Dh, T) == Lyr * 2 * T * Hkv * Dh


@cfg(400)
@given(wide, wide, wide, wide)
def test_cache_elements_any_int64(Lyr, Hkv, Dh, T):
    Lyr, Hkv, Dh, T = map(clamp64, (Lyr, Hkv, Dh, T))
    got = R.residentk_cache_elements(Lyr, Hkv, Dh, T)
    ok = (min(Lyr, Hkv, Dh, T) >= 1 and Lyr <= R.RESIDENT_MAX_LAYERS and Hkv <= R.RESIDENT_MAX_HEADS
          and Dh <= R.RESIDENT_MAX_D_HEAD and T <= R.RESIDENT_MAX_CONTEXT)
    assert got == (Lyr * 2 * T * Hkv * Dh if ok else 0)


@cfg(300)
@given(st.integers(1, 2048), st.integers(0, 3), st.integers(0, 3), st.integers(3, 7),
       st.integers(1, 4096), st.integers(1, 48), st.integers(1, 200_000), st.booleans(),
       st.sampled_from([1, 2]), st.one_of(wide, st.integers(1, 2**36)), st.integers(0, 2**34))
def test_max_ctx_fitting_is_the_largest_and_monotone(D, kvk, gq, dhk, F, Lyr, V, tied, tp, budget,
                                                     more):
    Hkv = 2**kvk
    Hq, Dh = Hkv * 2**gq, 2**dhk
    F = F * tp
    cap = R.residentk_max_ctx_fitting(D, Hq, Hkv, Dh, F, Lyr, V, budget, tied=tied, tp=tp)
    b64 = clamp64(budget)

    def fits(T):
        f = R.residentk_footprint(D, Hq, Hkv, Dh, F, Lyr, V, T, tied=tied, tp=tp)
        return f["status"] == 600 and 4 * f["total"] <= b64 - b64 % 4

    if cap:
        assert cap in [2**k for k in range(9, 17)] and fits(cap)
        if cap < R.RESIDENT_MAX_CONTEXT:
            assert not fits(cap * 2)
    else:
        assert not fits(R.RESIDENT_DEFAULT_CONTEXT)
    if b64 + more <= I64_MAX:  # a bigger budget never fits less
        assert R.residentk_max_ctx_fitting(D, Hq, Hkv, Dh, F, Lyr, V, b64 + more, tied=tied,
                                           tp=tp) >= cap


@cfg(400)
@given(wide, wide, wide)
def test_context_check_matches_model(p, n, T):
    p, n, T = map(clamp64, (p, n, T))
    want = (601 if p < 1 or n < 0 or T < 1 else 602 if T > R.RESIDENT_MAX_CONTEXT
            else 606 if p + n > T else 600)
    assert R.residentk_context_check(p, n, T) == want


@pytest.mark.slow
@cfg(600)
@given(wide, wide, wide)
@example(128, 40, 16)
@example(1000, 40, 16)
@example(I64_MAX, I64_MAX, 1)
def test_splitk_policy_within_bounds(n_keys, n_cores, h_q):
    m = R.residentk_splitk_max_n_splits(n_cores, h_q)
    assert 1 <= m <= R.RESIDENT_SPLITK_MAX_SPLITS
    k, c, h = map(clamp64, (n_keys, n_cores, h_q))
    if h < 1:
        assert m == 1
    elif c <= 0:
        assert m == R.RESIDENT_SPLITK_FALLBACK_SPLITS
    else:
        assert m == min(R.RESIDENT_SPLITK_MAX_SPLITS, max(1, -(-32 * min(c, 2**20) // h)))
    p = R.residentk_splitk_policy(n_keys, n_cores, h_q)
    assert 1 <= p <= m
    if k < R.RESIDENT_SPLITK_MIN_KEYS:
        assert p == 1
    else:
        assert R.residentk_splitk_should_split(k)


@cfg(600)
@given(st.one_of(st.integers(-10, 5000), wide), st.one_of(st.integers(0, 10**6), wide),
       st.one_of(st.integers(-4, 300), wide), st.one_of(st.integers(1, 64), wide))
def test_splitk_policy_monotone_in_keys(n_keys, more, n_cores, h_q):
    a = clamp64(n_keys)
    b = clamp64(a + abs(more))
    assert R.residentk_splitk_policy(b, n_cores, h_q) >= R.residentk_splitk_policy(a, n_cores, h_q)


@cfg(300)
@given(st.integers(1, 2**20), st.integers(0, 2**20), st.integers(1, 4096), st.integers(0, 4096))
def test_splitk_ceiling_monotone_in_cores_and_heads(cores, more_cores, h_q, more_heads):
    m = R.residentk_splitk_max_n_splits(cores, h_q)
    assert R.residentk_splitk_max_n_splits(cores + more_cores, h_q) >= m
    assert R.residentk_splitk_max_n_splits(cores, h_q + more_heads) <= m


@cfg(300)
@given(wide, st.integers(0, 2**20))
def test_bucket_ctx_power_of_two_and_monotone(T, more):
    b = R.resident_bucket_ctx(T)
    assert b in [2**k for k in range(9, 17)]
    T64 = clamp64(T)
    assert b >= min(T64, R.RESIDENT_MAX_CONTEXT)
    if T64 > R.RESIDENT_DEFAULT_CONTEXT and b < R.RESIDENT_MAX_CONTEXT:
        assert b // 2 < T64  # the next power of two, not a larger one
    assert R.resident_bucket_ctx(clamp64(T64 + more)) >= b


@cfg(200)
@given(wide)
def test_dispatch_budgets(n_layers):
    Lyr = clamp64(n_layers)
    ok = 1 <= Lyr <= R.RESIDENT_MAX_LAYERS
    assert R.residentk_dispatch_budget(n_layers) == (6 * Lyr + 3 if ok else 0)
    assert R.residentk_dispatch_budget_deep(n_layers) == (7 * Lyr + 3 if ok else 0)


# ---- chunk invariance of the fused loss ------------------------------------------------------

@cfg(40)
@given(n=st.integers(1, 40), d=st.integers(1, 24), v=st.one_of(st.integers(1, 40),
                                                                    st.integers(250, 600)),
       chunk=st.integers(1, 48), dtype=st.sampled_from([np.float32, np.float64]),
       reduction=st.sampled_from(["mean", "sum", "none"]), ignore=st.booleans(),
       smoothing=st.sampled_from([0.0, 0.1]), with_grad=st.sampled_from([False, True, "hidden", "weight"]),
       seed=st.integers(0, 2**32 - 1))
def test_loss_bits_do_not_depend_on_the_chunk(n, d, v, chunk, dtype, reduction, ignore, smoothing,
                                              with_grad, seed):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d)).astype(dtype)
    w = (rng.standard_normal((v, d)) * 2).astype(dtype)
    t = rng.integers(0, v, n)
    kw = dict(reduction=reduction, label_smoothing=smoothing, with_grad=with_grad)
    if ignore:
        t[rng.random(n) < 0.3] = -100
        kw["ignore_index"] = -100
    ref = linear_cross_entropy(h, w, t, chunk=n, **kw)
    got = linear_cross_entropy(h, w, t, chunk=chunk, **kw)
    for field in ("loss", "lse", "d_hidden", "d_weight"):
        a, b = getattr(ref, field), getattr(got, field)
        if a is None:
            assert b is None
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == dtype
        # Bit equality (NaN only where every token is ignored under "mean", and then in both).
        assert a.tobytes() == b.tobytes(), field
    assert ref.n_valid == got.n_valid

"""The fused loss's options through the NumPy API, against the independent float64 reference
(tests/lossk_reference.py reference_full) and, where installed, PyTorch on materialized logits:
bias, soft cap, z-loss, class weights (with label smoothing), next-token shift, half-precision
inputs, token accuracy, the lse's own upstream gradient; their refusals; and the exactness
sweep (every chunk size, several thread counts, SHA-256 of every output) with options on."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import algenta
from algenta import LossError
from algenta.lossk import contract as C
from algenta.lossk import cross_entropy as ce
from algenta.lossk.cross_entropy import HalfBits

from lossk_reference import bf16_gradient_bounds, reference_full

pytestmark = pytest.mark.kernels

HERE = os.path.dirname(os.path.abspath(__file__))
lce = algenta.linear_cross_entropy


def problem(shape, d, v, dtype=np.float64, seed=0, scale=2.0, ignore=None):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal(shape + (d,)) * scale).astype(dtype)
    w = (rng.standard_normal((v, d)) * scale / math.sqrt(d)).astype(dtype)
    t = rng.integers(0, v, shape)
    if ignore is not None:
        t.reshape(-1)[1::5] = ignore
    b = rng.standard_normal(v).astype(dtype)
    cw = rng.uniform(0.2, 3.0, v)
    return h, w, t, b, cw


OPTION_SETS = {
    "bias": dict(bias=True),
    "softcap": dict(softcap=3.0),
    "zloss": dict(lse_square_scale=1e-2),
    "weights": dict(class_weight=True),
    "weights_smooth": dict(class_weight=True, label_smoothing=0.15),
    "shift": dict(shift=1),
    "shift2_ignore": dict(shift=2, ignore_index=-100),
    "all": dict(bias=True, softcap=2.5, lse_square_scale=3e-3, class_weight=True,
                label_smoothing=0.1, shift=1, ignore_index=-100),
    "token_weight": dict(token_weight=True),
    "token_weight_all": dict(token_weight=True, bias=True, softcap=2.5, lse_square_scale=3e-3,
                             class_weight=True, label_smoothing=0.1, shift=1, ignore_index=-100),
    "temperature": dict(temperature=0.6),
    "temperature_all": dict(temperature=1.7, token_weight=True, bias=True, softcap=2.5,
                            lse_square_scale=3e-3, class_weight=True, label_smoothing=0.1,
                            shift=1, ignore_index=-100),
}


def token_weights(shape, seed=7):
    """Per-token loss weights in [0, 2) with exact zeros every 7th token (a masked token)."""
    u = np.random.default_rng(seed).uniform(0.0, 2.0, shape)
    u.reshape(-1)[::7] = 0.0
    return u


def call(h, w, t, b, cw, opts, **kw):
    o = dict(opts)
    use_b, use_cw = o.pop("bias", False), o.pop("class_weight", False)
    tw = token_weights(np.shape(t)).astype(cw.dtype) if o.pop("token_weight", False) else None
    r = lce(h, w, t, bias=b if use_b else None, class_weight=cw if use_cw else None,
            token_weight=tw, **o, **kw)
    ref = reference_full(h, w, t, bias=b if use_b else None, class_weight=cw if use_cw else None,
                         reduction=kw.get("reduction", "mean"), ignore_index=o.get("ignore_index"),
                         label_smoothing=o.get("label_smoothing", 0.0), softcap=o.get("softcap"),
                         z_scale=o.get("lse_square_scale", 0.0), shift=o.get("shift", 0),
                         grad_output=kw.get("grad_output"), grad_lse=kw.get("grad_lse"),
                         token_weight=tw, temperature=o.get("temperature", 1.0),
                         grad_entropy=kw.get("grad_entropy"))
    return r, ref


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    both_nan = np.isnan(a) & np.isnan(b)
    err = np.max(np.where(both_nan, 0.0, np.abs(a - b)), initial=0.0)
    assert err <= tol, f"{what}: max deviation {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_options_match_the_reference(name, reduction, dtype):
    opts = OPTION_SETS[name]
    h, w, t, b, cw = problem((3, 11), 24, 1031, dtype=dtype, seed=hash(name) % 1000,
                             ignore=opts.get("ignore_index"))
    rng = np.random.default_rng(5)
    k = opts.get("shift", 0)
    go = rng.standard_normal((3, 11 - k)) if reduction == "none" else None
    r, ref = call(h, w, t, b, cw.astype(dtype), opts, reduction=reduction, chunk=7,
                  with_grad=True, grad_output=go, return_accuracy=True)
    if dtype == np.float64:
        tol, gtol = 1e-11, 1e-12
    else:
        tol = C.loss_tol_for(float(np.max(np.abs(ref["lse"]))), 24) * 4
        gtol = C.loss_tol_for(1.0, 1031) * 4 * (1 if go is None else float(np.abs(go).max()))
        if reduction != "mean":
            gtol *= 10
    n_scored = 3 * (11 - k)
    close(r.loss, ref["loss"], tol * (n_scored if reduction == "sum" else 1), "loss")
    close(r.lse, ref["lse"], tol, "lse")
    close(r.z_loss, ref["z"], tol * (n_scored if reduction == "sum" else 1), "z_loss")
    assert r.n_valid == ref["n_valid"]
    close(r.d_hidden, ref["d_hidden"], gtol, "d_hidden")
    close(r.d_weight, ref["d_weight"], gtol * 3, "d_weight")
    if opts.get("bias"):
        close(r.d_bias, ref["d_bias"], gtol * 3, "d_bias")
    else:
        assert r.d_bias is None
    assert np.array_equal(r.pred, ref["pred"]) or dtype == np.float32
    assert r.accuracy == pytest.approx(ref["accuracy"], abs=0.1 if dtype == np.float32 else 0,
                                       nan_ok=True)


@pytest.mark.parametrize("name", ["bias", "shift2_ignore", "token_weight_all", "temperature_all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_entropy_and_its_gradient_match_the_reference(name, reduction, dtype):
    opts = OPTION_SETS[name]
    h, w, t, b, cw = problem((3, 11), 24, 1031, dtype=dtype, seed=hash(name) % 1000,
                             ignore=opts.get("ignore_index"))
    k = opts.get("shift", 0)
    rng = np.random.default_rng(6)
    go = rng.standard_normal((3, 11 - k)) if reduction == "none" else None
    ge = rng.standard_normal((3, 11 - k)) if reduction == "none" else -0.4
    r, ref = call(h, w, t, b, cw.astype(dtype), opts, reduction=reduction, chunk=7,
                  with_grad=True, grad_output=go, return_entropy=True, grad_entropy=ge)
    if dtype == np.float64:
        tol, gtol = 1e-11, 1e-12
    else:
        tol = C.loss_tol_for(float(np.max(np.abs(ref["lse"]))), 24) * 4
        gtol = C.loss_tol_for(1.0, 1031) * 4 * (1 if go is None else 3.0)
        if reduction != "mean":
            gtol *= 10
    close(r.entropy, ref["entropy"], tol * (33 if reduction == "sum" else 1), "entropy")
    close(r.loss, ref["loss"], tol * (33 if reduction == "sum" else 1), "loss")
    close(r.d_hidden, ref["d_hidden"], gtol, "d_hidden")
    close(r.d_weight, ref["d_weight"], gtol * 3, "d_weight")
    if opts.get("bias"):
        close(r.d_bias, ref["d_bias"], gtol * 3, "d_bias")
    # The entropy asked for changes nothing else by a bit; without an upstream gradient of its
    # own it changes no gradient either.
    plain = call(h, w, t, b, cw.astype(dtype), opts, reduction=reduction, chunk=7,
                 with_grad=True, grad_output=go)[0]
    same = call(h, w, t, b, cw.astype(dtype), opts, reduction=reduction, chunk=7,
                with_grad=True, grad_output=go, return_entropy=True)[0]
    for f in ("loss", "lse", "z_loss", "d_hidden", "d_weight", "d_bias"):
        assert np.array_equal(getattr(plain, f), getattr(same, f)), f
    assert plain.entropy is None


def test_entropy_by_central_differences():
    # d entropy / d input alone: the loss's upstream gradient zero, the entropy's one.
    h, w, t, b, cw = problem((2, 5), 6, 45, seed=9, ignore=-100)
    tw = token_weights((2, 5))
    kw = dict(bias=b, softcap=2.0, temperature=0.6, ignore_index=-100, token_weight=tw,
              return_entropy=True)
    r = lce(h, w, t, with_grad=True, grad_output=0.0, grad_entropy=1.0, **kw)
    eps = 1e-6
    for arr, grad in ((h, r.d_hidden), (w, r.d_weight), (b, r.d_bias)):
        flat, gflat = arr.reshape(-1), grad.reshape(-1)
        for i in range(0, flat.size, max(1, flat.size // 9)):
            keep = flat[i]
            flat[i] = keep + eps
            up = lce(h, w, t, **kw).entropy
            flat[i] = keep - eps
            dn = lce(h, w, t, **kw).entropy
            flat[i] = keep
            assert (up - dn) / (2 * eps) == pytest.approx(gflat[i], abs=1e-8), (arr.shape, i)


def test_entropy_of_peaked_and_uniform_distributions():
    # Uniform logits: exactly log V (max - E[z] is 0, log sum exp is log V). A near-one-hot
    # distribution keeps its tiny entropy (9e-14) to a few parts in 1e3, where lse - E[z] would
    # cancel: both are ~40 with an ulp of 7e-15. (What is left is sum exp = 1 + 2e-15 rounded.)
    v = 513
    h = np.zeros((2, 4))
    w = np.zeros((v, 4))
    r = lce(h, w, np.array([0, 1]), reduction="none", return_entropy=True)
    assert np.array_equal(r.entropy, np.full(2, math.log(v)))
    h = np.array([[40.0, 0.0, 0.0, 0.0]])
    w = np.zeros((v, 4))
    w[3, 0] = 1.0
    r = lce(h, w, np.array([3]), reduction="none", return_entropy=True)
    z = h @ w.T
    p = np.exp(z - z.max())
    p /= p.sum()
    # H = -sum p log p with log p_v = -40 - log(1 + 512 e^-40) off the target
    lp = z - z.max() - np.log1p((v - 1) * math.exp(-40.0))
    want = -(p * lp).sum()
    assert r.entropy[0] == pytest.approx(want, rel=1e-2) and want < 1e-13


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batch_invariance_of_per_token_outputs(dtype):
    # A token's log-prob, lse and entropy are the same bits whichever other tokens share its
    # batch: rows reordered, a sub-batch alone, another chunk size.
    h, w, t, b, cw = problem((12,), 20, 700, dtype=dtype, seed=12, ignore=-100)
    tw = token_weights((12,))
    kw = dict(bias=b, class_weight=cw, softcap=3.0, temperature=0.8, label_smoothing=0.05,
              ignore_index=-100, reduction="none", return_entropy=True)
    full = lce(h, w, t, token_weight=tw, chunk=5, **kw)
    perm = np.random.default_rng(3).permutation(12)
    mixed = lce(h[perm], w, t[perm], token_weight=tw[perm], chunk=12, **kw)
    part = lce(h[3:8], w, t[3:8], token_weight=tw[3:8], chunk=2, **kw)
    for f in ("loss", "lse", "entropy"):
        a = getattr(full, f)
        assert np.array_equal(getattr(mixed, f), a[perm]), f
        assert np.array_equal(getattr(part, f), a[3:8]), f


def test_gradient_of_the_lse_and_upstream_scalar():
    h, w, t, b, cw = problem((2, 9), 16, 300, seed=3, ignore=-100)
    gl = np.random.default_rng(1).standard_normal((2, 9))
    for red, go in (("mean", 0.7), ("sum", -1.5), ("none", np.arange(18.0).reshape(2, 9))):
        r, ref = call(h, w, t, b, cw, dict(bias=True, softcap=4.0, lse_square_scale=1e-3,
                                           ignore_index=-100),
                      reduction=red, with_grad=True, grad_output=go, grad_lse=gl)
        close(r.d_hidden, ref["d_hidden"], 1e-12, f"d_hidden {red}")
        close(r.d_weight, ref["d_weight"], 1e-12, f"d_weight {red}")
        close(r.d_bias, ref["d_bias"], 1e-12, f"d_bias {red}")


@pytest.mark.parametrize("temperature", [1.0, 0.45])
def test_central_differences_through_softcap_bias_weights_and_zloss(temperature):
    h, w, t, b, cw = problem((1, 6), 5, 40, seed=4)
    kw = dict(bias=b, class_weight=cw, softcap=1.5, lse_square_scale=0.05, label_smoothing=0.2,
              shift=1, temperature=temperature)
    r = lce(h, w, t, with_grad=True, **kw)
    eps = 1e-6
    for arr, grad in ((h, r.d_hidden), (w, r.d_weight), (b, r.d_bias)):
        flat, gflat = arr.reshape(-1), grad.reshape(-1)
        for i in range(0, flat.size, max(1, flat.size // 7)):
            keep = flat[i]
            flat[i] = keep + eps
            up = lce(h, w, t, **kw).loss
            flat[i] = keep - eps
            dn = lce(h, w, t, **kw).loss
            flat[i] = keep
            assert (up - dn) / (2 * eps) == pytest.approx(gflat[i], abs=1e-7), (arr.shape, i)


def test_shift_copies_nothing_and_scores_within_sequences():
    h, w, t, _, _ = problem((4, 8), 12, 97, seed=6)
    r = lce(h, w, t, shift=1, reduction="none", with_grad=True)
    assert r.loss.shape == r.lse.shape == (4, 7)
    # the same as shifting by hand (what transformers does to logits and labels)
    manual = lce(np.ascontiguousarray(h[:, :-1]), w, np.ascontiguousarray(t[:, 1:]),
                 reduction="none", with_grad=True)
    close(r.loss, manual.loss, 1e-13, "per token")
    assert not r.d_hidden[:, -1].any()
    close(r.d_hidden[:, :-1], manual.d_hidden, 1e-13, "d_hidden")
    # 2-D hidden is one sequence
    r2 = lce(h[0], w, t[0], shift=3, reduction="none")
    assert r2.loss.shape == (5,)


def test_token_accuracy_and_first_maximum():
    h, w, t, _, _ = problem((30,), 8, 50, seed=7, ignore=-100)
    w[17] = w[3]  # rows 3 and 17 tie on every token: argmax must say 3
    r = lce(h, w, t, ignore_index=-100, return_accuracy=True)
    z = h.astype(np.float64) @ w.T
    assert np.array_equal(r.pred, z.argmax(axis=1))
    assert 17 not in set(r.pred.tolist())
    valid = t != -100
    assert r.accuracy == (r.pred == t)[valid].mean()
    t[:] = -100
    assert math.isnan(lce(h, w, t, ignore_index=-100, return_accuracy=True).accuracy)


def test_class_weights_all_ignored_and_zero_weight_targets():
    h, w, t, _, cw = problem((6,), 4, 20, seed=8)
    t[:] = -100
    r = lce(h, w, t, class_weight=cw, ignore_index=-100, with_grad=True)
    assert math.isnan(r.loss) and not r.d_hidden.any()
    t[:] = 3
    cw[3] = 0.0  # every counted target weighs nothing: PyTorch's 0/0
    r = lce(h, w, t, class_weight=cw, with_grad=True)
    assert math.isnan(r.loss) and not r.d_hidden.any()


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_half_inputs_against_float64_of_the_same_values(kind):
    h64, w64, t, b64, cw = problem((5, 13), 32, 777, seed=9, scale=1.0)
    if kind == "f16":
        h, w, b = h64.astype(np.float16), w64.astype(np.float16), b64.astype(np.float16)
        exact = [a.astype(np.float64) for a in (h, w, b)]
    else:
        def bits(a):
            u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

        hb, wb, bb = bits(h64), bits(w64), bits(b64)
        h, w, b = HalfBits(hb, "bfloat16"), HalfBits(wb, "bfloat16"), HalfBits(bb, "bfloat16")
        exact = [(x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
                 for x in (hb, wb, bb)]
    opts = dict(softcap=20.0, lse_square_scale=1e-4, label_smoothing=0.05)
    r = lce(h, w, t, bias=b, class_weight=cw, with_grad=True, chunk=16, **opts)
    ref = reference_full(*exact[:2], t, bias=exact[2], class_weight=cw,
                         label_smoothing=0.05, softcap=20.0, z_scale=1e-4)
    # float32 accumulation of exactly the half values: float32 rounding, nothing more
    assert np.asarray(r.loss).dtype == np.float32 and r.lse.dtype == np.float32
    close(r.loss, ref["loss"], 2e-5, "loss")
    close(r.lse, ref["lse"], 2e-5, "lse")
    g = r.d_hidden.bits if kind == "bf16" else r.d_hidden
    assert g.dtype == (np.uint16 if kind == "bf16" else np.float16) and g.shape == h64.shape
    widen = (lambda x: (x.bits.astype(np.uint32) << 16).view(np.float32)) if kind == "bf16" \
        else (lambda x: x.astype(np.float32))
    # the gradient rounded once to the half format; on the bf16 dot-product path d_logits is
    # rounded to bf16 first too, which moves a cell by at most the bound of that rounding
    half_ulp = 2.0 ** (-8 if kind == "bf16" else -11)
    coef_h, coef_w = bf16_gradient_bounds(ref, exact[1]) if kind == "bf16" else (0.0, 0.0)
    coef_h = np.reshape(coef_h, ref["d_hidden"].shape) if np.ndim(coef_h) else coef_h
    for got, want, coef in ((r.d_hidden, ref["d_hidden"], coef_h),
                            (r.d_weight, ref["d_weight"], coef_w), (r.d_bias, ref["d_bias"], 0.0)):
        got = widen(got).astype(np.float64)
        bound = half_ulp * np.abs(want) + (1 + half_ulp) * coef + 1e-6
        assert np.all(np.abs(got - want) <= bound), kind
    # float32 gradients on request: the accumulator itself, unrounded
    r32 = lce(h, w, t, bias=b, class_weight=cw, with_grad=True, chunk=16, grad_dtype="float32",
              **opts)
    assert r32.d_weight.dtype == np.float32
    assert np.all(np.abs(r32.d_weight - ref["d_weight"]) <= coef_w + 1e-5), "d_weight f32"
    assert np.all(np.abs(r32.d_hidden - ref["d_hidden"]) <= coef_h + 1e-5), "d_hidden f32"


def test_half_gradients_own_exactly_their_memory():
    h, w, t, _, _ = problem((8,), 16, 600, dtype=np.float16, seed=10)
    r = lce(h, w, t, with_grad=True)
    # the float32 accumulator was narrowed in place and shrunk: the array owns 2 bytes a value
    base = r.d_weight if r.d_weight.base is None else r.d_weight.base
    assert r.d_weight.dtype == np.float16 and r.d_weight.shape == (600, 16)
    assert getattr(base, "nbytes", r.d_weight.nbytes) <= 600 * 16 * 2 + 64 or \
        not isinstance(base, np.ndarray)


def test_ml_dtypes_bfloat16_when_installed():
    ml = pytest.importorskip("ml_dtypes")
    h, w, t, _, _ = problem((6,), 8, 100, seed=11)
    hb, wb = h.astype(ml.bfloat16), w.astype(ml.bfloat16)
    r = lce(hb, wb, t, with_grad=True)
    bits = lce(HalfBits(hb.view(np.uint16), "bfloat16"), HalfBits(wb.view(np.uint16), "bfloat16"),
               t, with_grad=True)
    assert r.loss == bits.loss and r.d_hidden.dtype == ml.bfloat16
    assert np.array_equal(r.d_hidden.view(np.uint16), bits.d_hidden.bits)


def test_only_requested_gradients_are_computed(monkeypatch):
    calls = []
    real = ce._c.fused_linear_ce

    def spy(opts, **kw):
        calls.append({k: kw.get(k) for k in ("want_dh", "want_dw", "want_db")})
        return real(opts, **kw)

    monkeypatch.setattr(ce._c, "fused_linear_ce", spy)
    h, w, t, b, _ = problem((5,), 6, 50, seed=12)
    full = lce(h, w, t, bias=b, with_grad=True)
    only_b = lce(h, w, t, bias=b, with_grad="bias")
    hw = lce(h, w, t, bias=b, with_grad=("hidden", "weight"))
    assert calls == [dict(want_dh=True, want_dw=True, want_db=True),
                     dict(want_dh=False, want_dw=False, want_db=True),
                     dict(want_dh=True, want_dw=True, want_db=False)]
    assert np.array_equal(only_b.d_bias, full.d_bias) and only_b.d_hidden is None
    assert np.array_equal(hw.d_hidden, full.d_hidden) and hw.d_bias is None
    with pytest.raises(TypeError):
        lce(h, w, t, with_grad="bias")  # no bias given


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,status", [
    (dict(softcap=-1.0), 585), (dict(softcap=0.0), 585), (dict(softcap=float("nan")), 585),
    (dict(softcap=float("inf")), 585), (dict(lse_square_scale=-1e-4), 585),
    (dict(lse_square_scale=float("nan")), 585), (dict(class_weight=np.ones(49)), 582),
    (dict(class_weight=np.r_[np.ones(49), np.nan]), 585), (dict(bias=np.ones(50, np.float32)), 582),
    (dict(bias=np.ones(49)), 582), (dict(bias=np.r_[np.ones(49), np.inf]), 585),
    (dict(shift=6), 582), (dict(shift=-1), 582), (dict(grad_lse=np.ones((2, 6))), 582),
    (dict(token_weight=-np.ones((2, 6))), 585), (dict(token_weight=np.r_[np.ones(11), np.nan]
                                                      .reshape(2, 6)), 585),
    (dict(token_weight=np.r_[np.ones(11), np.inf].reshape(2, 6)), 585),
    (dict(token_weight=np.ones(12)), 582), (dict(token_weight=np.ones((2, 5))), 582),
    (dict(temperature=0.0), 585), (dict(temperature=-0.5), 585),
    (dict(temperature=float("nan")), 585), (dict(temperature=float("inf")), 585),
    (dict(temperature=1e-39, dtype=np.float32), 585),  # below float32's normal range
    (dict(grad_entropy=1.0, with_grad=True), 582),  # without return_entropy
    (dict(return_entropy=True, grad_entropy=np.nan, with_grad=True), 585),
    (dict(return_entropy=True, grad_entropy=np.r_[np.ones(11), np.inf].reshape(2, 6),
          with_grad=True, reduction="none"), 585),
    (dict(return_entropy=True, grad_entropy=np.ones(12), with_grad=True, reduction="none"), 582),
])
def test_bad_option_values_are_refused_before_work(kw, status):
    kw = dict(kw)
    h, w, t, _, _ = problem((2, 6), 4, 50, seed=13, dtype=kw.pop("dtype", np.float64))
    if "grad_lse" in kw:
        kw = dict(kw, with_grad=False)
    with pytest.raises(LossError) as e:
        lce(h, w, t, **kw)
    assert e.value.status == status, e.value


def test_option_types_are_type_errors():
    h, w, t, _, _ = problem((4,), 4, 10, seed=14)
    for kw in (dict(softcap="1"), dict(lse_square_scale=None), dict(shift=1.0),
               dict(class_weight=np.array(["a"] * 10)), dict(grad_dtype=np.int32),
               dict(bias=[0.0] * 10), dict(token_weight=np.array(["a"] * 4)),
               dict(temperature="1"), dict(temperature=None)):
        with pytest.raises(TypeError):
            lce(h, w, t, **kw)


# ---- PyTorch on the materialized logits, where installed -----------------------------------

def test_against_pytorch_materialized():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    h, w, t, b, cw = problem((3, 10), 20, 401, seed=15, ignore=-100)
    for ls in (0.0, 0.1):
        for red in ("mean", "sum", "none"):
            r = lce(h, w, t, bias=b, class_weight=cw, label_smoothing=ls, ignore_index=-100,
                    reduction=red, softcap=6.0, with_grad=True,
                    grad_output=np.ones((3, 10)) if red == "none" else None)
            H = torch.tensor(h, requires_grad=True)
            W = torch.tensor(w, requires_grad=True)
            B = torch.tensor(b, requires_grad=True)
            z = F.linear(H, W, B)
            z = 6.0 * torch.tanh(z / 6.0)
            loss = F.cross_entropy(z.reshape(-1, 401), torch.tensor(t).reshape(-1),
                                   weight=torch.tensor(cw), ignore_index=-100, reduction=red,
                                   label_smoothing=ls)
            loss.sum().backward()
            close(r.loss, loss.detach().numpy().reshape(np.shape(r.loss)), 1e-11, f"loss {red}")
            close(r.d_hidden, H.grad.numpy(), 1e-12, "d_hidden")
            close(r.d_weight, W.grad.numpy(), 1e-12, "d_weight")
            close(r.d_bias, B.grad.numpy(), 1e-12, "d_bias")


def test_token_weights_against_pytorch_materialized():
    # PyTorch has no per-token weight: weigh its per-token losses by hand. "mean" divides by the
    # sum of u_t w_{y_t} over counted tokens; with reduction "none" and no other option, -loss is
    # u_t log p(y_t), the per-token log-probability RL losses take.
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    h, w, t, b, cw = problem((3, 10), 20, 401, seed=16, ignore=-100)
    u = token_weights((3, 10))
    for use_cw in (False, True):
        for red in ("mean", "sum", "none"):
            r = lce(h, w, t, class_weight=cw if use_cw else None, ignore_index=-100,
                    reduction=red, token_weight=u, with_grad=True,
                    grad_output=np.ones((3, 10)) if red == "none" else None)
            H = torch.tensor(h, requires_grad=True)
            W = torch.tensor(w, requires_grad=True)
            T, U = torch.tensor(t).reshape(-1), torch.tensor(u).reshape(-1)
            CW = torch.tensor(cw) if use_cw else None
            z = F.linear(H, W).reshape(-1, 401)
            per = F.cross_entropy(z, T, weight=CW, ignore_index=-100, reduction="none") * U
            if red == "mean":
                wy = CW[T.clamp(min=0)] if use_cw else torch.ones_like(U)
                loss = per.sum() / (U * wy * (T != -100)).sum()
            elif red == "sum":
                loss = per.sum()
            else:
                loss = per.reshape(3, 10)
                if not use_cw:
                    logp = torch.log_softmax(z, dim=-1).gather(1, T.clamp(min=0)[:, None])[:, 0]
                    want = torch.where(T != -100, U * logp, 0.0).reshape(3, 10)
                    close(-r.loss, want.detach().numpy(), 1e-11, "per-token log-probs")
            loss.sum().backward()
            close(r.loss, loss.detach().numpy().reshape(np.shape(r.loss)), 1e-11, f"loss {red}")
            close(r.d_hidden, H.grad.numpy(), 1e-12, "d_hidden")
            close(r.d_weight, W.grad.numpy(), 1e-12, "d_weight")


def test_tempered_log_probs_against_pytorch_materialized():
    # What an RL loss takes: log p(y_t) at the sampling temperature, -loss with reduction "none",
    # and its gradient; with a soft cap, the cap of the raw logit comes first.
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    h, w, t, b, _ = problem((3, 10), 20, 401, seed=18, ignore=-100)
    go = np.random.default_rng(2).standard_normal((3, 10))
    for temp, cap in ((0.7, None), (1.3, None), (0.5, 4.0)):
        for red in ("mean", "none"):
            r = lce(h, w, t, bias=b, ignore_index=-100, reduction=red, softcap=cap,
                    temperature=temp, with_grad=True, grad_output=go if red == "none" else None,
                    return_accuracy=True)
            H = torch.tensor(h, requires_grad=True)
            W = torch.tensor(w, requires_grad=True)
            B = torch.tensor(b, requires_grad=True)
            T = torch.tensor(t).reshape(-1)
            z = F.linear(H, W, B)
            if cap:
                z = cap * torch.tanh(z / cap)
            z = (z / temp).reshape(-1, 401)
            logp = torch.log_softmax(z, dim=-1).gather(1, T.clamp(min=0)[:, None])[:, 0]
            per = torch.where(T != -100, -logp, 0.0)
            loss = per.sum() / (T != -100).sum() if red == "mean" else per.reshape(3, 10)
            (loss * (torch.tensor(go) if red == "none" else 1.0)).sum().backward()
            close(r.loss, loss.detach().numpy(), 1e-11, f"loss {temp} {red}")
            close(r.lse, torch.logsumexp(z, -1).detach().numpy().reshape(3, 10), 1e-11, "lse")
            assert np.array_equal(r.pred, z.argmax(-1).numpy().reshape(3, 10))
            close(r.d_hidden, H.grad.numpy(), 1e-12, "d_hidden")
            close(r.d_weight, W.grad.numpy(), 1e-12, "d_weight")
            close(r.d_bias, B.grad.numpy(), 1e-12, "d_bias")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_temperature_two_is_exactly_half_the_inputs(dtype):
    # Without a cap z / 2 = (h / 2) W^T + b / 2 exactly (halving commutes with every rounding),
    # so T = 2 is the untempered loss of halved inputs to the bit, and its gradients are exactly
    # scaled: d_weight the same bits, d_hidden and d_bias halved.
    h, w, t, b, cw = problem((2, 9), 16, 300, dtype=dtype, seed=19, ignore=-100)
    kw = dict(class_weight=cw, label_smoothing=0.1, ignore_index=-100, with_grad=True,
              token_weight=token_weights((2, 9)), chunk=5)
    for red in ("sum", "none"):
        a = lce(h, w, t, bias=b, temperature=2.0, reduction=red, **kw)
        g = lce(h * dtype(0.5), w, t, bias=b * dtype(0.5), reduction=red, **kw)
        for name in ("loss", "lse", "pred", "d_weight"):
            assert np.array_equal(getattr(a, name), getattr(g, name)), (red, name)
        assert np.array_equal(a.d_hidden, g.d_hidden * dtype(0.5)), red
        assert np.array_equal(a.d_bias, g.d_bias * dtype(0.5)), red


def test_unit_token_weights_change_no_bit():
    # u = 1 everywhere is the unweighted loss to the bit in every reduction (its products are
    # exact), except that "mean" then divides by the sum of weights instead of LossSum's mean.
    h, w, t, b, cw = problem((2, 9), 12, 97, seed=17, ignore=-100)
    for red in ("sum", "none"):
        a = lce(h, w, t, bias=b, class_weight=cw, lse_square_scale=1e-3, ignore_index=-100,
                reduction=red, with_grad=True)
        g = lce(h, w, t, bias=b, class_weight=cw, lse_square_scale=1e-3, ignore_index=-100,
                reduction=red, with_grad=True, token_weight=np.ones((2, 9)))
        for name in ("loss", "lse", "z_loss", "d_hidden", "d_weight", "d_bias"):
            assert np.array_equal(getattr(a, name), getattr(g, name)), (red, name)


# ---- exactness: every chunk size and thread count, options on ---------------------------------

_SWEEP = textwrap.dedent("""
    import sys, hashlib, numpy as np
    sys.path.insert(0, {here!r})
    from test_lossk_options import problem, token_weights
    import algenta
    from algenta.lossk.cross_entropy import HalfBits
    out = []
    def bf16(a):  # bit patterns of the nearest bfloat16
        u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return HalfBits(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16), "bfloat16")
    # the bf16 dot-product path where the host has it takes tokens in groups (a pair for
    # vdpbf16ps, 32 for AMX tiles): "bf16 long" has chunks that split inside and across groups
    for dtype in (np.float64, np.float32, np.float16, "bf16", "bf16 long"):
        shape, d, chunks = ((3, 7), 10, {chunks}) if dtype != "bf16 long" else ((3, 25), 40, {long_chunks})
        h, w, t, b, cw = problem(shape, d, 600, dtype=np.float32 if "bf16" in str(dtype) else dtype,
                                 seed=21, ignore=-100)
        if "bf16" in str(dtype):
            h, w, b = bf16(h), bf16(w), bf16(b)
        for chunk in chunks:
            r = algenta.linear_cross_entropy(
                h, w, t, bias=b, class_weight=cw, softcap=3.0, lse_square_scale=1e-3,
                label_smoothing=0.1, shift=1, ignore_index=-100, chunk=chunk, with_grad=True,
                return_accuracy=True, reduction="none", grad_output=np.ones((shape[0], shape[1] - 1)),
                token_weight=token_weights(shape), temperature=0.7, return_entropy=True,
                grad_entropy=np.linspace(-1, 1, shape[0] * (shape[1] - 1)).reshape(shape[0], -1))
            m = hashlib.sha256()
            for a in (r.loss, r.lse, r.z_loss, r.pred, r.entropy, r.d_hidden, r.d_weight,
                      r.d_bias):
                m.update(np.ascontiguousarray(getattr(a, "bits", a)).tobytes())
            out.append(m.hexdigest())
    print(" ".join(out))
""")


@pytest.mark.slow
def test_bit_identical_for_every_chunk_and_thread_count_with_options():
    digests = set()
    for threads in ("1", "2", "3"):
        long_chunks = [1, 2, 31, 32, 33, 45, 64, 75]
        code = _SWEEP.format(here=HERE, chunks=list(range(1, 22)), long_chunks=long_chunks)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, OMP_NUM_THREADS=threads))
        assert r.returncode == 0, r.stderr
        per = r.stdout.split()
        assert len(per) == 4 * 21 + len(long_chunks)
        groups = [per[21 * k: 21 * (k + 1)] for k in range(4)] + [per[84:]]
        for k, g in enumerate(groups):  # within each dtype, every chunk gives the same digest
            assert len(set(g)) == 1, (threads, k)
        digests.add(tuple(g[0] for g in groups))
    assert len(digests) == 1  # and every thread count the same bits


def test_a_keyword_the_core_does_not_read_is_refused_by_name(monkeypatch):
    # The binding takes its arrays and output flags as keywords: a misspelt or retired one must
    # fail the call, never be dropped (the result would silently lack what it asked for).
    real = ce._c.fused_linear_ce
    monkeypatch.setattr(ce._c, "fused_linear_ce",
                        lambda opts, **k: real(opts, want_entropy_tok=True, **k))
    h, w, t, _, _ = problem((4,), 8, 11)
    with pytest.raises(TypeError, match="unexpected argument 'want_entropy_tok'"):
        ce.linear_cross_entropy(h, w, t)

"""Distillation on lossk's CUDA backend (cuda/lossk_distill.cu) through the NumPy API's
device="cuda": every objective against the float64 reference, bit-identical across runs and chunk
sizes, half students within their rounding, the refusals found on the device, and 589 without a
backend. In CI on the CPU emulator in three thread orders."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import algenta
from algenta import LossError, LossUnavailableError
from algenta.lossk.cross_entropy import HalfBits

from conftest import CUDA, need_cuda
from test_lossk_distillation import OBJECTIVES, _bf16, _heads, reference

pytestmark = pytest.mark.cuda

ld = algenta.linear_distillation


@pytest.fixture
def cuda():
    need_cuda()


@pytest.mark.parametrize("objective,beta", OBJECTIVES)
def test_matches_the_float64_reference(cuda, objective, beta):
    rng = np.random.default_rng(31)
    si, sw, ti, tw = _heads(rng, n=11, d=9, dt=6, v=600)
    sb = rng.standard_normal(600)
    y = rng.integers(0, 600, 11)
    y[[0, 5]] = -100
    for reduction, temp, hard, target in (("mean", 1.0, 0.0, None), ("sum", 0.7, 0.4, y),
                                          ("none", 2.0, 1.0, y)):
        go = rng.standard_normal(11) if reduction == "none" else 1.3
        kw = dict(objective=objective, beta=beta, temperature=temp, hard_weight=hard,
                  soft_weight=0.6, reduction=reduction)
        r = ld(si, sw, ti, tw, target, student_bias=sb, with_grad=True, grad_output=go,
               chunk=4, device="cuda", **kw)
        ref = reference(si, sw, ti, tw, target, s_b=sb, grad_output=go, **kw)
        g = 1.0 if reduction == "none" else go
        for k in ("loss", "divergence", "ce"):
            np.testing.assert_allclose(getattr(r, k), ref[k], rtol=1e-11, atol=1e-13)
        for k in ("d_hidden", "d_weight", "d_bias"):
            np.testing.assert_allclose(getattr(r, k), g * ref[k], rtol=1e-10, atol=1e-13)


def _digest(r):
    m = hashlib.sha256()
    for x in (r.loss, r.divergence, r.ce, r.d_hidden, r.d_weight, r.d_bias):
        if x is not None:
            m.update(np.ascontiguousarray(x.bits if isinstance(x, HalfBits) else x).tobytes())
    return m.hexdigest()


def test_bit_identical_across_runs_and_chunks(cuda):
    rng = np.random.default_rng(37)
    si, sw, ti, tw = _heads(rng, n=40, d=24, dt=16, v=700, dtype=np.float32, scale=0.5)
    y = rng.integers(0, 700, 40)
    for student in ("f32", "bf16"):
        s_in, s_w = (si, sw) if student == "f32" else (_bf16(si), _bf16(sw))
        kw = dict(objective="jsd", temperature=1.5, hard_weight=0.3, with_grad=True,
                  grad_dtype=np.float32 if student == "bf16" else None, device="cuda")
        chunks = (1, 7, 40) if student == "f32" else (16, 32, 40)
        got = {_digest(ld(s_in, s_w, ti, tw, y, chunk=c, **kw)) for c in chunks}
        got.add(_digest(ld(s_in, s_w, ti, tw, y, chunk=chunks[0], **kw)))
        assert len(got) == 1, student


def test_batch_invariant(cuda):
    rng = np.random.default_rng(53)
    si, sw, ti, tw = _heads(rng, n=24, d=16, dt=8, v=500, dtype=np.float32)
    y = rng.integers(0, 500, 24)
    kw = dict(objective="reverse_kl", temperature=0.8, hard_weight=0.5, reduction="none",
              with_grad="hidden", device="cuda")
    whole = ld(si, sw, ti, tw, y, **kw)
    idx = rng.permutation(24)[:9]
    part = ld(si[idx], sw, ti[idx], tw, y[idx], **kw)
    for k in ("loss", "divergence", "ce"):
        assert np.array_equal(getattr(part, k), getattr(whole, k)[idx]), k
    assert np.array_equal(part.d_hidden, whole.d_hidden[idx])


def test_half_student_within_its_rounding(cuda):
    rng = np.random.default_rng(41)
    si, sw, ti, tw = _heads(rng, n=20, d=32, dt=16, v=300, dtype=np.float32, scale=0.5)
    y = rng.integers(0, 300, 20)
    hs, hw_ = _bf16(si), _bf16(sw)
    r = ld(hs, hw_, ti, tw, y, objective="kl", hard_weight=0.5, with_grad=True,
           grad_dtype=np.float32, device="cuda")
    wide = lambda a: (a.bits.astype(np.uint32) << 16).view(np.float32)
    ref = reference(wide(hs), wide(hw_), ti, tw, y, objective="kl", hard_weight=0.5)
    np.testing.assert_allclose(r.loss, ref["loss"], rtol=1e-5)
    scale = np.abs(ref["d_weight"]).max()
    assert np.abs(r.d_weight - ref["d_weight"]).max() <= 2 ** -7 * scale


def test_refusals_found_on_the_device(cuda):
    rng = np.random.default_rng(43)
    si, sw, ti, tw = _heads(rng, n=5, d=4, dt=3, v=40)
    bad = tw.copy()
    bad[2, 1] = np.nan
    with pytest.raises(LossError) as e:
        ld(si, sw, ti, bad, device="cuda")
    assert e.value.status == 585 and "teacher_weight" in str(e.value)
    with pytest.raises(LossError) as e:
        ld(si, sw, ti, tw, np.array([1, 2, 40, 3, 4]), device="cuda")
    assert e.value.status == 586 and "token 2" in str(e.value)
    with pytest.raises(LossError) as e:  # the host's refusals come first
        ld(si, sw, ti, tw, objective="js", device="cuda")
    assert e.value.status == 588


def test_without_a_cuda_backend_refuses_with_589():
    if CUDA["kind"] != "none":
        pytest.skip("this build has a CUDA backend")
    rng = np.random.default_rng(47)
    si, sw, ti, tw = _heads(rng, n=3, d=4, dt=3, v=20)
    with pytest.raises(LossUnavailableError) as e:
        ld(si, sw, ti, tw, device="cuda")
    assert e.value.status == 589
    with pytest.raises(LossError) as e:
        ld(si, sw, ti, tw, device="cuda", beta=2.0)
    assert e.value.status == 585

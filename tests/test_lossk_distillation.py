"""Fused linear distillation (algenta.linear_distillation, algenta.torch.linear_distillation_loss)
against a float64 NumPy reference written from the definitions, PyTorch on materialized logits
(F.kl_div, log_softmax), central differences, and itself: bit-identical over chunk sizes, thread
counts and batch splits; refusals with their status codes."""

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import algenta
from algenta import LossError
from algenta.lossk.cross_entropy import HalfBits

pytestmark = pytest.mark.kernels

OBJECTIVES = [("kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.5), ("jsd", 1.0),
              ("jsd", 0.25)]


def _log_softmax(z):
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def reference(s_in, s_w, t_in, t_w, target=None, *, objective="kl", beta=0.5, temperature=1.0,
              ignore_index=-100, hard_weight=0.0, soft_weight=1.0, s_b=None, t_b=None,
              reduction="mean", grad_output=None):
    """float64, from the definitions: KL(q || p), KL(p || q), beta KL(q || m) + (1 - beta)
    KL(p || m) with m = beta q + (1 - beta) p (Liger's endpoints: beta 0 forward, 1 reverse), plus
    hard_weight times the untempered cross-entropy; the student's gradients by the chain rule on
    the materialized logits."""
    f = lambda a: np.asarray(a, np.float64)
    h, w = f(s_in).reshape(-1, s_w.shape[1]), f(s_w)
    s = h @ w.T + (0 if s_b is None else f(s_b))
    t = f(t_in).reshape(-1, t_w.shape[1]) @ f(t_w).T + (0 if t_b is None else f(t_b))
    n, v = s.shape
    T = temperature
    lp, lq = _log_softmax(s / T), _log_softmax(t / T)
    p, q = np.exp(lp), np.exp(lq)
    if objective == "jsd" and beta == 0.0:
        objective = "kl"
    if objective == "jsd" and beta == 1.0:
        objective = "reverse_kl"
    if objective == "kl":
        div = (q * (lq - lp)).sum(1)
        gdiv = p - q
    elif objective == "reverse_kl":
        hh = lp - lq
        div = (p * hh).sum(1)
        gdiv = p * (hh - div[:, None])
    else:
        lm = np.log(beta * q + (1 - beta) * p)
        div = beta * (q * (lq - lm)).sum(1) + (1 - beta) * (p * (lp - lm)).sum(1)
        hh = lp - lm
        gdiv = (1 - beta) * p * (hh - (p * hh).sum(1, keepdims=True))
    valid = np.ones(n, bool)
    ce = np.zeros(n)
    g1 = np.zeros_like(s)
    if target is not None:
        y = np.asarray(target).reshape(n)
        valid = y != ignore_index
        ys = np.where(valid, y, 0)
        l1 = _log_softmax(s)
        ce = np.where(valid, -l1[np.arange(n), ys], 0.0)
        g1 = np.exp(l1)
        g1[np.arange(n), ys] -= 1
    div = np.where(valid, div, 0.0)
    per = soft_weight * div + hard_weight * ce
    nv = valid.sum()
    if reduction == "mean":
        red = lambda x: x.sum() / nv if nv else np.nan
        scale = np.where(valid, 1.0 / nv if nv else 0.0, 0.0)
    elif reduction == "sum":
        red = lambda x: x.sum()
        scale = valid.astype(np.float64)
    else:
        red = lambda x: x
        scale = valid * (1.0 if grad_output is None else f(grad_output).reshape(n))
    g = (soft_weight / T * gdiv + hard_weight * g1) * scale[:, None]
    return {"loss": red(per), "divergence": red(div), "ce": red(ce), "d_hidden": g @ w,
            "d_weight": g.T @ h, "d_bias": g.sum(0), "n_valid": nv}


def _heads(rng, n=13, d=9, dt=14, v=517, dtype=np.float64, scale=1.0):
    return (rng.standard_normal((n, d)).astype(dtype) * scale,
            rng.standard_normal((v, d)).astype(dtype) * scale,
            rng.standard_normal((n, dt)).astype(dtype) * scale,
            rng.standard_normal((v, dt)).astype(dtype) * scale)


@pytest.mark.parametrize("objective,beta", OBJECTIVES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_the_float64_reference(objective, beta, reduction):
    rng = np.random.default_rng(3)
    si, sw, ti, tw = _heads(rng)
    sb, tb = rng.standard_normal(517), rng.standard_normal(517)
    y = rng.integers(0, 517, 13)
    y[[2, 7]] = -100
    go = rng.standard_normal(13) if reduction == "none" else 0.7
    for temp, hard, target in ((1.0, 0.0, None), (0.6, 0.3, y), (2.5, 1.0, y)):
        kw = dict(objective=objective, beta=beta, temperature=temp, hard_weight=hard,
                  soft_weight=0.8, reduction=reduction)
        r = algenta.linear_distillation(si, sw, ti, tw, target, student_bias=sb, teacher_bias=tb,
                                        with_grad=True, grad_output=go, chunk=4, **kw)
        ref = reference(si, sw, ti, tw, target, s_b=sb, t_b=tb, grad_output=go, **kw)
        for k in ("loss", "divergence", "ce"):
            np.testing.assert_allclose(getattr(r, k), ref[k], rtol=1e-11, atol=1e-13)
        g = go if reduction != "none" else 1.0
        for k in ("d_hidden", "d_weight", "d_bias"):
            np.testing.assert_allclose(getattr(r, k), g * ref[k] if reduction != "none" else
                                       ref[k], rtol=1e-10, atol=1e-13)
        assert r.n_valid == ref["n_valid"]


def test_gradients_by_central_differences():
    rng = np.random.default_rng(5)
    si, sw, ti, tw = _heads(rng, n=3, d=4, dt=5, v=37)
    sb = rng.standard_normal(37)
    y = np.array([4, -100, 30])
    for objective, beta in OBJECTIVES:
        kw = dict(objective=objective, beta=beta, temperature=1.3, hard_weight=0.5,
                  student_bias=sb)
        r = algenta.linear_distillation(si, sw, ti, tw, y, with_grad=True, **kw)
        for name, x, g in (("si", si, r.d_hidden), ("sw", sw, r.d_weight), ("sb", sb, r.d_bias)):
            def f(arr):
                return algenta.linear_distillation(
                    arr if name == "si" else si, arr if name == "sw" else sw, ti, tw, y,
                    **{**kw, "student_bias": arr if name == "sb" else sb}).loss

            num = np.zeros_like(x)
            for i in np.ndindex(x.shape):
                xp, xm = x.copy(), x.copy()
                xp[i] += 1e-6
                xm[i] -= 1e-6
                num[i] = (f(xp) - f(xm)) / 2e-6
            np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=f"{objective} {name}")


def test_matches_torch_on_materialized_logits():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    import algenta.torch as at
    g = torch.Generator().manual_seed(0)
    n, d, dt, v = 11, 16, 24, 300
    si = torch.randn(n, d, generator=g, requires_grad=True)
    sw = torch.randn(v, d, generator=g, requires_grad=True)
    sb = torch.randn(v, generator=g, requires_grad=True)
    ti = torch.randn(n, dt, generator=g, requires_grad=True)
    tw = torch.randn(v, dt, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[4] = -100
    for objective, beta in OBJECTIVES:
        for reduction in ("mean", "none"):
            T = 1.5
            loss = at.linear_distillation_loss(si, sw, ti, tw, y, objective=objective, beta=beta,
                                               temperature=T, hard_weight=0.25, student_bias=sb,
                                               reduction=reduction, chunk=5)
            up = torch.randn(loss.shape, generator=g) if reduction == "none" else torch.tensor(2.0)
            got = torch.autograd.grad(loss, (si, sw, sb), up)
            s = F.linear(si.double(), sw.double(), sb.double())
            t = F.linear(ti.double(), tw.double()).detach()
            lp, lq = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
            obj = {0.0: "kl", 1.0: "reverse_kl"}.get(beta, objective) \
                if objective == "jsd" else objective
            if obj == "kl":
                div = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
            elif obj == "reverse_kl":
                div = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
            else:
                lm = torch.log(beta * lq.exp() + (1 - beta) * lp.exp())
                div = beta * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1) + \
                    (1 - beta) * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1)
            ce = F.cross_entropy(s, y, reduction="none", ignore_index=-100)
            m = (y != -100).double()
            per = (div + 0.25 * ce) * m
            ref = per.sum() / m.sum() if reduction == "mean" else per
            want = torch.autograd.grad(ref, (si, sw, sb), up.double())
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=2e-6)
            for a, b in zip(got, want):
                torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=2e-6)
    assert ti.grad is None  # the teacher is read, never differentiated


@pytest.mark.smoke
def test_hard_term_alone_is_the_cross_entropy():
    rng = np.random.default_rng(8)
    si, sw, ti, tw = _heads(rng, dtype=np.float32)
    y = rng.integers(0, 517, 13)
    y[0] = -100
    r = algenta.linear_distillation(si, sw, ti, tw, y, hard_weight=1.0, soft_weight=0.0,
                                    with_grad=True, temperature=3.0)
    c = algenta.linear_cross_entropy(si, sw, y, ignore_index=-100, with_grad=True)
    np.testing.assert_allclose(r.loss, c.loss, rtol=1e-6)
    np.testing.assert_allclose(r.d_weight, c.d_weight, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r.d_hidden, c.d_hidden, rtol=1e-5, atol=1e-7)


def _bits(r):
    h = hashlib.sha256()
    for x in (r.loss, r.divergence, r.ce, r.d_hidden, r.d_weight, r.d_bias):
        if x is not None:
            x = x.bits if isinstance(x, HalfBits) else np.asarray(x)
            h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def _bf16(a):
    return HalfBits((a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "bfloat16")


@pytest.mark.parametrize("dtype", ["f32", "f64", "bf16"])
def test_bit_identical_for_every_chunk(dtype):
    rng = np.random.default_rng(11)
    n = 70
    si, sw, ti, tw = _heads(rng, n=n, d=40, dt=24, v=700, dtype=np.float64, scale=0.5)
    if dtype == "f32":
        si, sw, ti, tw = (x.astype(np.float32) for x in (si, sw, ti, tw))
    elif dtype == "bf16":
        si, sw = _bf16(si), _bf16(sw)
        ti, tw = ti.astype(np.float32), tw.astype(np.float32)  # heads of two dtypes
    y = rng.integers(0, 700, n)
    y[::9] = -100
    for objective, beta in (("kl", 0.5), ("jsd", 0.5), ("reverse_kl", 0.5)):
        kw = dict(objective=objective, beta=beta, temperature=0.8, hard_weight=0.2,
                  with_grad=True, grad_dtype=np.float32 if dtype == "bf16" else None)
        digests = {c: _bits(algenta.linear_distillation(si, sw, ti, tw, y, chunk=c, **kw))
                   for c in (1, 3, 32, 64, n)}
        assert len(set(digests.values())) == 1, (objective, digests)


_THREADS = textwrap.dedent("""
    import hashlib, numpy as np, algenta
    rng = np.random.default_rng(2)
    si, sw = rng.standard_normal((90, 48)).astype(np.float32), rng.standard_normal((1300, 48)).astype(np.float32)
    ti, tw = rng.standard_normal((90, 20)).astype(np.float32), rng.standard_normal((1300, 20)).astype(np.float32)
    y = rng.integers(0, 1300, 90)
    out = hashlib.sha256()
    for objective in ("kl", "reverse_kl", "jsd"):
        for chunk in (7, 90):
            r = algenta.linear_distillation(si, sw, ti, tw, y, objective=objective, chunk=chunk,
                                            hard_weight=0.5, temperature=2.0, with_grad=True,
                                            reduction="none")
            for a in (r.loss, r.divergence, r.ce, r.d_hidden, r.d_weight):
                out.update(np.ascontiguousarray(a).tobytes())
    print(out.hexdigest())
""")


def test_bit_identical_for_every_thread_count():
    got = set()
    for k in (1, 2, 3):
        res = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(k)), timeout=300)
        assert res.returncode == 0, res.stderr
        got.add(res.stdout.strip())
    assert len(got) == 1, got


def test_batch_invariant():
    """A token's loss terms and its row of d_hidden do not depend on the other tokens."""
    rng = np.random.default_rng(13)
    si, sw, ti, tw = _heads(rng, n=40, d=24, dt=16, v=600, dtype=np.float32)
    y = rng.integers(0, 600, 40)
    kw = dict(objective="jsd", beta=0.3, temperature=1.7, hard_weight=0.5, reduction="none",
              with_grad="hidden")
    whole = algenta.linear_distillation(si, sw, ti, tw, y, **kw)
    perm = rng.permutation(40)
    for idx in (perm[:17], perm[17:], perm[::-1], np.array([5])):
        part = algenta.linear_distillation(si[idx], sw, ti[idx], tw, y[idx], **kw)
        for k in ("loss", "divergence", "ce"):
            assert np.array_equal(getattr(part, k), getattr(whole, k)[idx]), k
        assert np.array_equal(part.d_hidden, whole.d_hidden[idx])


def test_half_heads_within_their_rounding():
    rng = np.random.default_rng(17)
    si, sw, ti, tw = _heads(rng, n=20, d=32, dt=16, v=400, dtype=np.float32, scale=0.5)
    y = rng.integers(0, 400, 20)
    for conv in (_bf16, lambda a: a.astype(np.float16)):
        hs, hw_ = conv(si), conv(sw)
        r = algenta.linear_distillation(hs, hw_, ti, tw, y, objective="jsd", hard_weight=0.5,
                                        with_grad=True, grad_dtype=np.float32)
        wide = lambda a: (a.bits.astype(np.uint32) << 16).view(np.float32) \
            if isinstance(a, HalfBits) else np.asarray(a, np.float32)
        ref = reference(wide(hs), wide(hw_), ti, tw, y, objective="jsd", hard_weight=0.5)
        np.testing.assert_allclose(r.loss, ref["loss"], rtol=2e-3)
        np.testing.assert_allclose(r.d_hidden, ref["d_hidden"], rtol=0.02, atol=2e-4)


def test_no_target_counts_every_token_and_mean_of_nothing_is_nan():
    rng = np.random.default_rng(19)
    si, sw, ti, tw = _heads(rng, n=6, d=5, dt=5, v=50)
    r = algenta.linear_distillation(si, sw, ti, tw, reduction="none")
    assert r.n_valid == 6 and np.all(r.loss > 0) and np.all(r.ce == 0)
    r = algenta.linear_distillation(si, sw, ti, tw, np.full(6, -100), with_grad=True)
    assert r.n_valid == 0 and np.isnan(r.loss)
    assert not r.d_weight.any() and not r.d_hidden.any()
    # identical heads: every divergence is 0 (to rounding)
    r = algenta.linear_distillation(si, sw, si, sw, objective="jsd", reduction="none")
    assert np.abs(r.loss).max() < 1e-15


def test_refusals():
    rng = np.random.default_rng(23)
    si, sw, ti, tw = _heads(rng, n=4, d=3, dt=5, v=20)
    y = np.array([1, 2, 3, 4])
    cases = [
        (dict(objective="forward_kl"), 588),
        (dict(beta=-0.1), 585), (dict(beta=1.5), 585), (dict(beta=float("nan")), 585),
        (dict(temperature=0.0), 585), (dict(temperature=float("inf")), 585),
        (dict(hard_weight=-1.0, target=y), 585), (dict(soft_weight=float("nan")), 585),
        (dict(hard_weight=0.5), 582),
        (dict(target=np.array([1, 2, 20, 3])), 586),
        (dict(target=np.array([1, 2, -100, 3]), ignore_index=None), 586),
        (dict(chunk=0), 581),
        (dict(reduction="avg"), 588),
    ]
    for kw, status in cases:
        target = kw.pop("target", None)
        with pytest.raises(LossError) as e:
            algenta.linear_distillation(si, sw, ti, tw, target, **kw)
        assert e.value.status == status, (kw, e.value)
    with pytest.raises(LossError) as e:
        algenta.linear_distillation(si, sw, ti, tw[:19])
    assert e.value.status == 582 and "vocabulary" in str(e.value)
    with pytest.raises(LossError) as e:
        algenta.linear_distillation(si, sw, ti[:3], tw)
    assert e.value.status == 582
    bad = si.copy()
    bad[1, 1] = np.nan
    with pytest.raises(LossError) as e:
        algenta.linear_distillation(bad, sw, ti, tw)
    assert e.value.status == 585 and "student_input" in str(e.value)
    bad = tw.copy()
    bad[0, 0] = np.inf
    with pytest.raises(LossError) as e:
        algenta.linear_distillation(si, sw, ti, bad)
    assert e.value.status == 585 and "teacher_weight" in str(e.value)
    with pytest.raises(LossError) as e:  # float64 with float32 does not compute in one precision
        algenta.linear_distillation(si, sw, ti.astype(np.float32), tw.astype(np.float32))
    assert e.value.status == 582
    with pytest.raises(TypeError):
        algenta.linear_distillation(si, sw.astype(np.float32), ti, tw)
    with pytest.raises(TypeError):
        algenta.linear_distillation(si, sw, ti, tw, objective=None)


def test_torch_half_student_and_autocast():
    torch = pytest.importorskip("torch")
    import algenta.torch as at
    g = torch.Generator().manual_seed(1)
    si = torch.randn(6, 32, generator=g).bfloat16().requires_grad_()
    sw = torch.randn(128, 32, generator=g).bfloat16().requires_grad_()
    ti, tw = torch.randn(6, 8, generator=g), torch.randn(128, 8, generator=g)
    loss = at.linear_distillation_loss(si, sw, ti, tw, objective="reverse_kl")
    assert loss.dtype == torch.float32
    loss.backward()
    assert si.grad.dtype == torch.bfloat16 and sw.grad.dtype == torch.bfloat16
    f32 = [x.detach().float().requires_grad_() for x in (si, sw)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la = at.linear_distillation_loss(f32[0], f32[1], ti, tw, objective="reverse_kl")
    la.backward()
    assert la.dtype == torch.float32 and f32[0].grad.dtype == torch.float32
    # autocast casts both heads, as F.linear would
    both = at.linear_distillation_loss(si, sw, ti.bfloat16(), tw.bfloat16(),
                                       objective="reverse_kl")
    assert torch.equal(la, both)
    out = at.linear_distillation_loss(si, sw, ti, tw, torch.arange(6), hard_weight=1.0,
                                      return_terms=True)
    assert out.ce > 0 and not out.divergence.requires_grad


MEM_CHILD = r"""
import json, torch, algenta.torch as at
torch.manual_seed(0)
N, D, DT, V, C = 256, 256, 128, 65536, 128
si = torch.randn(N, D, requires_grad=True); sw = (torch.randn(V, D) / 16).requires_grad_(True)
ti, tw = torch.randn(N, DT), torch.randn(V, DT) / 16
x = torch.zeros(2, D, requires_grad=True)  # warm up: libtorch's pages are not the call's
at.linear_distillation_loss(x, torch.zeros(300, D, requires_grad=True), ti[:2], tw[:300]).backward()
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS:")
at.linear_distillation_loss(si, sw, ti, tw, objective="jsd", chunk=C).backward()
print(json.dumps({"extra": rss("VmHWM:") - base,
                  "need": (N * D + V * D) * 4 + 2 * C * V * 4 + 4 * V * 8 * torch.get_num_threads()}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_training_step_holds_the_gradients_and_one_chunk_of_each_head():
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", MEM_CHILD], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    m = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert m["extra"] <= 1.2 * m["need"], m


def test_torch_second_backward_and_upstream_scale():
    torch = pytest.importorskip("torch")
    import algenta.torch as at
    g = torch.Generator().manual_seed(3)
    si = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    sw = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ti, tw = torch.randn(5, 4, generator=g, dtype=torch.float64), \
        torch.randn(40, 4, generator=g, dtype=torch.float64)
    loss = at.linear_distillation_loss(si, sw, ti, tw, objective="jsd")
    g1 = torch.autograd.grad(3.0 * loss, (si, sw), retain_graph=True)
    g2 = torch.autograd.grad(loss, (si, sw))  # the retained graph: another core pass
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, 3.0 * b, rtol=1e-14, atol=0)


def test_leading_axes_and_nested_targets():
    rng = np.random.default_rng(59)
    si, sw, ti, tw = _heads(rng, n=10, d=4, dt=3, v=30)
    y = rng.integers(0, 30, 10)
    flat = algenta.linear_distillation(si, sw, ti, tw, y, hard_weight=0.5, reduction="none")
    r = algenta.linear_distillation(si.reshape(2, 5, 4), sw, ti.reshape(2, 5, 3), tw,
                                    y.reshape(2, 5).tolist(), hard_weight=0.5, reduction="none")
    assert r.loss.shape == (2, 5) and np.array_equal(r.loss.ravel(), flat.loss)
    with pytest.raises(TypeError):  # a ragged target
        algenta.linear_distillation(si, sw, ti, tw, [[1, 2], [3]] * 5)

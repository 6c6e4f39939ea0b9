"""algenta.torch against PyTorch's own F.cross_entropy(F.linear(...)): loss and both gradients."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import algenta  # noqa: E402
from algenta import LossError  # noqa: E402
from algenta.lossk import cross_entropy as _ce  # noqa: E402

at = algenta.torch

V = 263  # prime, and more than one 256-class block of the core's log-sum-exp
D = 24


def _ref(x, w, t, **kw):
    """PyTorch's materialized loss of x [..., D] through w [V, D], leading dims flattened."""
    z = F.linear(x, w)
    out = F.cross_entropy(z.reshape(-1, w.shape[0]), t.reshape(-1), **kw)
    return out.reshape(t.shape) if kw.get("reduction") == "none" else out


def _data(dtype, shape=(3, 5), vocab=V, d=D, seed=0, n_ignored=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    t = torch.randint(0, vocab, shape, generator=g)
    t.view(-1)[:n_ignored] = -100
    return x, w, t


def _upstream(loss, seed=1):
    g = torch.Generator().manual_seed(seed)
    if loss.dim() == 0:
        return torch.tensor(1.75, dtype=loss.dtype)
    return torch.randn(loss.shape, generator=g, dtype=torch.float64).to(loss.dtype)


def _both(fn, x, w, t, gout=None, **kw):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    loss = fn(x, w, t, **kw)
    gout = _upstream(loss) if gout is None else gout
    gx, gw = torch.autograd.grad(loss, (x, w), gout)
    return loss.detach(), gx, gw, gout


def _close(a, b, tol):
    # NaN where the reference is NaN (all tokens ignored), within tol elsewhere.
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    m = ~torch.isnan(b)
    err = (a[m].double() - b[m].double()).abs()
    scale = b[m].double().abs().max() if m.any() else torch.tensor(1.0)
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= tol * max(1.0, float(scale)), (worst, float(scale))


TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
OPTIONS = [
    dict(reduction="mean"),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(reduction="mean", label_smoothing=0.1),
    dict(reduction="sum", label_smoothing=0.3),
    dict(reduction="none", label_smoothing=0.2),
    dict(reduction="mean", ignore_index=7),
    dict(reduction="none", ignore_index=7, label_smoothing=0.05),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_pytorch(dtype, kw):
    x, w, t = _data(dtype)
    if kw.get("ignore_index") == 7:
        t[t == -100] = 7  # a real class id used as the ignore marker
        t.view(-1)[3:6] = 7
    loss, gx, gw, gout = _both(at.linear_cross_entropy, x, w, t, **kw)
    rloss, rgx, rgw, _ = _both(_ref, x, w, t, gout, **kw)
    tol = TOL[dtype]
    _close(loss, rloss, tol)
    _close(gx, rgx, tol)
    _close(gw, rgw, tol)
    if dtype == torch.float32:
        # ...and against the float64 reference on the same float32 data: no worse than PyTorch's
        # own float32 path by more than the same margin.
        floss, fgx, fgw, _ = _both(_ref, x.double(), w.double(), t, gout.double(), **kw)
        _close(loss.double(), floss, tol)
        _close(gx.double(), fgx, tol)
        _close(gw.double(), fgw, tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    x, w, t = _data(torch.float64, n_ignored=15)
    loss, gx, gw, gout = _both(at.linear_cross_entropy, x, w, t, reduction=reduction,
                               label_smoothing=0.1)
    rloss, rgx, rgw, _ = _both(_ref, x, w, t, gout, reduction=reduction, label_smoothing=0.1)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(rloss)
    else:
        assert torch.equal(loss, rloss) and not loss.any()
    assert not gx.any() and not gw.any()
    assert not rgx.any() and not rgw.any()


@pytest.mark.smoke
def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[1, -100, 6], [0, 3, 3]])
    for kw in (dict(reduction="mean"), dict(reduction="sum", label_smoothing=0.2),
               dict(reduction="none", label_smoothing=0.1)):
        fn = lambda a, b: at.linear_cross_entropy(a, b, t, chunk=2, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_bit_identical_across_chunks():
    x, w, t = _data(torch.float32, shape=(37,))
    ref = _both(at.linear_cross_entropy, x, w, t, label_smoothing=0.1)
    for chunk in (1, 5, 36):
        got = _both(at.linear_cross_entropy, x, w, t, label_smoothing=0.1, chunk=chunk)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 2 * D, 3, generator=g, dtype=torch.float64)
    x = base[:, ::2, 1]  # (4, D), strided
    wt = torch.randn(D, V, generator=g, dtype=torch.float64)
    w = wt.t()  # (V, D), column-major
    t = torch.randint(0, V, (8,), generator=g)[::2]
    assert not x.is_contiguous() and not w.is_contiguous() and not t.is_contiguous()
    for red in ("mean", "none"):
        loss, gx, gw, gout = _both(at.linear_cross_entropy, x, w, t, reduction=red)
        rloss, rgx, rgw, _ = _both(_ref, x, w, t, gout, reduction=red)
        _close(loss, rloss, 1e-12)
        _close(gx, rgx, 1e-12)
        _close(gw, rgw, 1e-12)
        assert gx.shape == x.shape and gw.shape == w.shape


def test_one_token_unbatched_and_one_class():
    x, w, t = _data(torch.float64, shape=(), n_ignored=0)  # x (D,), t a 0-d tensor
    for red in ("mean", "none"):
        loss, gx, gw, gout = _both(at.linear_cross_entropy, x, w, t, reduction=red)
        rloss, rgx, rgw, _ = _both(lambda a, b, c, **k: F.cross_entropy(F.linear(a, b), c, **k),
                                   x, w, t, gout, reduction=red)
        assert loss.shape == rloss.shape == ()
        _close(loss, rloss, 1e-12)
        _close(gx, rgx, 1e-12)
        _close(gw, rgw, 1e-12)
    x, w, t = _data(torch.float64, shape=(3,), vocab=1, n_ignored=0)
    loss, gx, gw, _ = _both(at.linear_cross_entropy, x, w, t)
    assert float(loss) == 0.0 and not gx.any() and not gw.any()


def test_int32_targets():
    x, w, t = _data(torch.float64)
    a = at.linear_cross_entropy(x, w, t.to(torch.int32), reduction="none")
    b = at.linear_cross_entropy(x, w, t, reduction="none")
    assert torch.equal(a, b)


def _spy(monkeypatch):
    # Every pass of the core goes through the binding (options record, keyword arguments).
    calls = []
    real = _ce._c.fused_linear_ce

    def spy(opts, **kw):
        calls.append({k: kw.get(k) for k in ("want_dh", "want_dw")}
                     | {"reduction": opts.reduction,
                        "grad_output": kw.get("grad_output") is not None})
        return real(opts, **kw)

    monkeypatch.setattr(_ce._c, "fused_linear_ce", spy)
    return calls


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("rx,rw", [(True, False), (False, True), (False, False)])
def test_requires_grad_combinations(monkeypatch, reduction, rx, rw):
    x, w, t = _data(torch.float64)
    x.requires_grad_(rx)
    w.requires_grad_(rw)
    calls = _spy(monkeypatch)
    loss = at.linear_cross_entropy(x, w, t, reduction=reduction)
    if not (rx or rw):
        assert loss.grad_fn is None and len(calls) == 1
        assert not calls[0]["want_dh"] and not calls[0]["want_dw"]
        return
    loss.sum().backward()
    # The gradient nobody asked for is never computed by the core, in forward or backward.
    assert all(c["want_dh"] in (rx, False) and c["want_dw"] in (rw, False) for c in calls)
    assert any(c["want_dh"] == rx and c["want_dw"] == rw for c in calls)
    assert len(calls) == (2 if reduction == "none" else 1)
    assert (x.grad is not None) == rx and (w.grad is not None) == rw
    x2, w2 = x.detach().requires_grad_(rx), w.detach().requires_grad_(rw)
    _ref(x2, w2, t, reduction=reduction).sum().backward()
    if rx:
        _close(x.grad, x2.grad, 1e-12)
    if rw:
        _close(w.grad, w2.grad, 1e-12)


def test_no_grad_mode_computes_no_gradient(monkeypatch):
    x, w, t = _data(torch.float64)
    x.requires_grad_(True)
    w.requires_grad_(True)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        loss = at.linear_cross_entropy(x, w, t)
    assert loss.grad_fn is None
    assert calls == [{"want_dh": False, "want_dw": False, "reduction": "mean",
                      "grad_output": False}]
    _close(loss, _ref(x.detach(), w.detach(), t), 1e-12)


def test_tied_weights_and_retained_graph():
    # The head reuses the embedding table: autograd must add the loss's weight gradient to the
    # embedding's, and a second backward through a retained graph must add it again (the first
    # backward hands out the forward's gradient itself, so the next one makes its own pass).
    g = torch.Generator().manual_seed(9)
    tok = torch.randint(0, V, (2, 6), generator=g)
    t = torch.randint(0, V, (2, 6), generator=g)
    grads = []
    for fn in (at.linear_cross_entropy, _ref):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(V, D).double()
        h = torch.tanh(emb(tok))
        loss = fn(h, emb.weight, t, label_smoothing=0.1)
        loss.backward(retain_graph=True)
        (2.0 * loss).backward()
        grads.append(emb.weight.grad.clone())
    _close(grads[0], grads[1], 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_backward_scales_the_forwards_gradient_and_a_retained_graph_gives_its_bits(dtype):
    # The first backward takes the forward's gradients and scales them in place; every later
    # backward of a retained graph makes the forward's pass again: the same bits each time, and
    # the same bits as the forward's gradient times the upstream scalar out of place.
    x, w, t = _data(dtype, shape=(4, 7))
    with torch.no_grad():
        opts = algenta.lossk._args.CrossEntropyOptions(ignore_index=-100)
        pre = at._ops._lce_fwd(x, w, t, None, None, None, *opts, True, True, False, False, False,
                               False)
    x.requires_grad_(), w.requires_grad_()
    for scale in (1.0, 1 / 3, 0.0):
        loss = at.linear_cross_entropy(x, w, t)
        runs = []
        for _ in range(3):
            x.grad = w.grad = None
            (loss * scale).backward(retain_graph=True)
            runs.append((x.grad, w.grad))
        g = torch.tensor(scale, dtype=loss.dtype)
        want = (pre[6] * g, pre[7] * g)  # (loss, lse, z, pred, acc, entropy, dh, dw, db)
        for gx, gw in runs:
            assert torch.equal(gx, want[0]) and torch.equal(gw, want[1])


def test_only_the_lse_used_gets_its_gradient():
    # Unmaterialized upstream gradients: the loss's is absent, not a tensor of zeros.
    x, w, t = _data(torch.float64, n_ignored=0)
    x.requires_grad_(), w.requires_grad_()
    for reduction in ("mean", "none"):
        out = at.linear_cross_entropy(x, w, t, return_lse=True, reduction=reduction)
        gx, gw = torch.autograd.grad(out.lse.sum(), (x, w))
        rx, rw = torch.autograd.grad(torch.logsumexp(F.linear(x, w), -1).sum(), (x, w))
        _close(gx, rx, 1e-12)
        _close(gw, rw, 1e-12)


MEM_CHILD = r"""
import json, torch, algenta.torch as at
torch.manual_seed(0)
N, D, V = 256, 256, 65536
h = torch.randn(N, D, requires_grad=True); w = (torch.randn(V, D) / 16).requires_grad_(True)
t = torch.randint(0, V, (N,))
x = torch.zeros(2, D, requires_grad=True)  # warm up: libtorch's pages are not the call's
at.linear_cross_entropy(x, torch.zeros(300, D, requires_grad=True), t[:2] % 300).backward()
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS:")
at.linear_cross_entropy(h, w, t, chunk=N).backward()
print(json.dumps({"extra": rss("VmHWM:") - base, "need": (N * D + V * D + N * V) * 4}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_training_step_holds_the_gradients_and_one_chunk_only():
    # The weight gradient is the forward's own buffer, scaled in place and handed to autograd:
    # no zero-filled upstream gradient for it, no scaled copy beside the saved one. Each extra
    # d_weight-sized buffer would add 64 MiB here (0.5x the reference).
    r = subprocess.run([sys.executable, "-c", MEM_CHILD], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    m = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert m["extra"] <= 1.2 * m["need"], m


def test_module_form():
    x, w, t = _data(torch.float32)
    m = at.LinearCrossEntropyLoss(ignore_index=-100, reduction="sum", label_smoothing=0.1, chunk=4)
    assert isinstance(m, torch.nn.Module) and not list(m.parameters())
    assert "reduction='sum'" in repr(m) and "chunk=4" in repr(m)
    a = m(x, w, t)
    b = at.linear_cross_entropy(x, w, t, reduction="sum", label_smoothing=0.1, chunk=4)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        at.LinearCrossEntropyLoss(reduction="avg")


def test_optimizer_steps_reduce_the_loss_like_pytorch():
    g = torch.Generator().manual_seed(11)
    tok = torch.randint(0, 97, (4, 16), generator=g)
    nxt = torch.roll(tok, -1, dims=1)  # a learnable next-token rule
    curves = []
    for fn in (at.linear_cross_entropy, _ref):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(97, 16).double()
        head = torch.nn.Linear(16, 97, bias=False).double()
        opt = torch.optim.Adam(list(emb.parameters()) + list(head.parameters()), lr=0.05)
        curve = []
        for _ in range(8):
            opt.zero_grad()
            loss = fn(emb(tok), head.weight, nxt)
            loss.backward()
            opt.step()
            curve.append(float(loss.detach()))
        curves.append(curve)
    assert curves[0][-1] < 0.8 * curves[0][0]
    np.testing.assert_allclose(curves[0], curves[1], rtol=1e-10)


# ---- refusals ---------------------------------------------------------------------------------

def test_refusals_types_devices_dtypes():
    x, w, t = _data(torch.float32)
    lce = at.linear_cross_entropy
    with pytest.raises(TypeError):
        lce(x.numpy(), w, t)
    with pytest.raises(TypeError):
        lce(x.to(torch.complex64), w.to(torch.complex64), t)
    with pytest.raises(TypeError):
        lce(x, w.double(), t)
    with pytest.raises(TypeError):
        lce(x, w, t.float())
    with pytest.raises(TypeError):
        lce(x, w, t, ignore_index=1.5)
    with pytest.raises(ValueError, match="device"):
        lce(x.to("meta"), w.to("meta"), t)  # stands in for a CUDA tensor: not CPU, refused
    with pytest.raises(ValueError, match="reduction"):
        lce(x, w, t, reduction="avg")


@pytest.mark.parametrize("case,status", [
    ("shape", 582), ("target_shape", 582), ("nan", 585), ("inf_w", 585), ("target", 586),
    ("negative", 586), ("empty", 581), ("chunk", 581), ("smoothing", 585), ("huge_chunk", 583),
])
def test_refusals_carry_status(case, status):
    x, w, t = _data(torch.float64)
    kw = {}
    if case == "shape":
        w = w[:, :-1]
    elif case == "target_shape":
        t = t[:, :-1]
    elif case == "nan":
        x = x.clone()
        x[1, 2, 3] = float("nan")
    elif case == "inf_w":
        w = w.clone()
        w[4, 0] = float("inf")
    elif case == "target":
        t = t.clone()
        t[0, 4] = V
    elif case == "negative":
        t = t.clone()
        t[0, 4] = -3  # negative but not ignore_index: refused, never read as a mask
    elif case == "empty":
        x, t = x[:0], t[:0]
    elif case == "chunk":
        kw["chunk"] = 0
    elif case == "huge_chunk":
        kw["chunk"] = 2**70  # past int64: the NumPy API's 583, not a schema error
    elif case == "smoothing":
        kw["label_smoothing"] = 1.5
    with pytest.raises(LossError) as e:
        at.linear_cross_entropy(x.requires_grad_(), w, t, **kw)
    assert e.value.status == status and isinstance(e.value, ValueError)
    assert e.value.status_name


@pytest.mark.slow
def test_import_algenta_does_not_import_torch():
    code = "import sys, algenta; assert 'torch' not in sys.modules; algenta.torch; " \
           "assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_contiguous_tensors_reach_the_core_without_a_copy(monkeypatch):
    x, w, t = _data(torch.float32)
    seen = []
    real = _ce._c.fused_linear_ce

    def spy(opts, **kw):
        seen.append((kw["hidden"], kw["weight"], kw["targets"]))
        return real(opts, **kw)

    monkeypatch.setattr(_ce._c, "fused_linear_ce", spy)
    x.requires_grad_(True)
    w.requires_grad_(True)
    at.linear_cross_entropy(x, w, t, reduction="none").sum().backward()
    assert len(seen) == 2  # forward, and the backward's pass with grad_output
    for h, wt, tt in seen:
        assert np.shares_memory(h, x.detach().numpy())
        assert np.shares_memory(wt, w.detach().numpy())
        assert np.shares_memory(tt, t.numpy())

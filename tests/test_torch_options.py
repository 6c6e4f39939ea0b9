"""algenta.torch with every option of F.linear_cross_entropy and the extras, against PyTorch on
the materialized logits: the drop-in signature (linear_bias, weight, reduction, ignore_index,
label_smoothing), soft cap, z-loss, shift, return_lse (a differentiable output), token accuracy,
half-precision inputs next to PyTorch's own bf16 path, autocast, and torch.compile(fullgraph=True)
with ignore_index in the targets."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import algenta.torch as at  # noqa: E402
from lossk_reference import BF16_U, bf16_dot_path  # noqa: E402

V, D = 397, 24


def data(dtype=torch.float64, shape=(3, 9), seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, D, generator=g, dtype=torch.float64) * 2).to(dtype)
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) / math.sqrt(D)).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, V, shape, generator=g)
    if ignore:
        t.view(-1)[2::5] = -100
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.25
    return x, w, b, t, cw


def reference(x, w, t, *, linear_bias=None, weight=None, reduction="mean", ignore_index=-100,
              label_smoothing=0.0, softcap=None, lse_square_scale=0.0, shift=0, temperature=1.0):
    """The materialized loss written with PyTorch ops (z-loss as Liger-Kernel defines it)."""
    if shift:
        x, t = x[..., :-shift, :], t[..., shift:]
    z = F.linear(x, w, linear_bias)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    zf, tf = z.reshape(-1, z.shape[-1]), t.reshape(-1)
    loss = F.cross_entropy(zf, tf, weight=weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if lse_square_scale:
        lse = torch.logsumexp(zf, dim=-1)
        valid = tf != ignore_index
        zl = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
        loss = loss + (zl.sum() / valid.sum() if reduction == "mean" else
                       zl.sum() if reduction == "sum" else zl)
    return loss.reshape(t.shape) if reduction == "none" else loss


def grads(fn, x, w, b, t, **kw):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    loss = fn(x, w, t, linear_bias=b, **kw)
    up = torch.linspace(-1, 1, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
    (loss * up).sum().backward()
    return loss.detach(), x.grad, w.grad, None if b is None else b.grad


CASES = {
    "pytorch_options": dict(label_smoothing=0.1, weight=True),
    "softcap": dict(softcap=4.0),
    "zloss": dict(lse_square_scale=1e-2),
    "shift": dict(shift=1),
    "everything": dict(label_smoothing=0.05, weight=True, softcap=3.0, lse_square_scale=2e-3,
                       shift=2),
    "temperature": dict(temperature=0.65),
    "temperature_everything": dict(temperature=1.4, label_smoothing=0.05, weight=True,
                                   softcap=3.0, lse_square_scale=2e-3, shift=1),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_materialized_pytorch(name, reduction, bias):
    x, w, b, t, cw = data()
    kw = dict(CASES[name], reduction=reduction)
    if kw.pop("weight", False):
        kw["weight"] = cw
    b = b if bias else None
    got = grads(at.linear_cross_entropy, x, w, b, t, **kw)
    want = grads(reference, x, w, b, t, **kw)
    for g, r, what in zip(got, want, ("loss", "d_input", "d_weight", "d_bias")):
        if r is None:
            assert g is None
            continue
        assert g.shape == r.shape and g.dtype == r.dtype, what
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-11, equal_nan=True, msg=what)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_weights_match_materialized_pytorch(reduction):
    # PyTorch has no per-token weight: its per-token losses weighed by hand; "mean" divides by
    # the counted tokens' sum of u_t w_{y_t}, as its class-weighted mean divides by sum w_{y_t}.
    x, w, b, t, cw = data(shape=(3, 8))
    u = torch.rand(t.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    u.view(-1)[::4] = 0.0

    def ref(x, w, t, linear_bias=None, **_):
        z = F.linear(x, w, linear_bias).reshape(-1, V)
        tf, uf = t.reshape(-1), u.reshape(-1)
        per = F.cross_entropy(z, tf, weight=cw, ignore_index=-100, reduction="none",
                              label_smoothing=0.1) * uf
        if reduction == "mean":
            return per.sum() / (uf * cw[tf.clamp(min=0)] * (tf != -100)).sum()
        return per.sum() if reduction == "sum" else per.reshape(t.shape)

    kw = dict(weight=cw, label_smoothing=0.1, reduction=reduction)
    got = grads(at.linear_cross_entropy, x, w, b, t, token_weight=u, **kw)
    want = grads(ref, x, w, b, t)
    for g, r, what in zip(got, want, ("loss", "d_input", "d_weight", "d_bias")):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-11, msg=what)
    # the module form takes them per call
    m = at.LinearCrossEntropyLoss(weight=cw, label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(m(x, w, t, b, token_weight=u), want[0], rtol=1e-10, atol=1e-11)


def test_drop_in_for_torch_linear_cross_entropy():
    # The same call as PyTorch 2.13's F.linear_cross_entropy, keywords and all.
    x, w, b, t, cw = data(torch.float32)
    x, t = x.reshape(-1, D), t.reshape(-1)  # PyTorch's takes 1-D or 2-D input
    kw = dict(linear_bias=b, weight=cw.float(), reduction="mean", ignore_index=-100,
              label_smoothing=0.1)
    ours = at.linear_cross_entropy(x, w, t, **kw)
    theirs = F.linear_cross_entropy(x, w, t, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # ignore_index=None means -100, as in PyTorch
    torch.testing.assert_close(at.linear_cross_entropy(x, w, t, ignore_index=None),
                               F.linear_cross_entropy(x, w, t), rtol=1e-5, atol=1e-6)


def test_return_lse_is_differentiable_and_extras():
    x, w, b, t, cw = data()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = at.linear_cross_entropy(xa, wa, t, linear_bias=b, softcap=5.0, lse_square_scale=1e-3,
                                  return_lse=True, return_z_loss=True, return_accuracy=True)
    assert isinstance(out, at.LinearCrossEntropyOutput)
    (out.loss + 0.3 * (out.lse ** 2).mean()).backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = 5.0 * torch.tanh(F.linear(xr, wr, b) / 5.0)
    lse = torch.logsumexp(z, dim=-1)
    ref = reference(xr, wr, t, linear_bias=b, softcap=5.0, lse_square_scale=1e-3)
    (ref + 0.3 * (lse ** 2).mean()).backward()
    torch.testing.assert_close(out.lse, lse.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(wa.grad, wr.grad, rtol=1e-10, atol=1e-11)
    valid = t != -100
    zl = (1e-3 * lse.detach() ** 2)[valid].mean()
    torch.testing.assert_close(out.z_loss, zl, rtol=1e-12, atol=1e-14)
    pred = z.detach().argmax(-1)
    assert torch.equal(out.pred, pred)
    assert out.accuracy == pytest.approx(float((pred == t)[valid].float().mean()), abs=1e-6)
    assert not out.z_loss.requires_grad and not out.pred.requires_grad
    # without return_lse too (each output that has no gradient is marked so)
    out = at.linear_cross_entropy(xa, wa, t, return_z_loss=True, return_accuracy=True)
    assert not out.z_loss.requires_grad and not out.accuracy.requires_grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_entropy_and_tempered_log_probs_train_like_materialized_pytorch(reduction):
    # An RL-style objective on the fused op: tempered log-probs weighted by a mask, minus an
    # entropy bonus; the same objective on PyTorch's materialized logits.
    x, w, b, t, _ = data()
    mask = (torch.arange(t.numel()).reshape(t.shape) % 4 != 1).to(torch.float64)
    temp, c = 0.8, 0.05
    xa, wa, ba = (v.clone().requires_grad_() for v in (x, w, b))
    out = at.linear_cross_entropy(xa, wa, t, linear_bias=ba, reduction=reduction,
                                  temperature=temp, token_weight=mask, return_entropy=True,
                                  return_z_loss=True)
    up = torch.linspace(-1, 1, out.loss.numel(), dtype=torch.float64).reshape(out.loss.shape)
    ((out.loss - c * out.entropy) * up).sum().backward()
    xr, wr, br = (v.clone().requires_grad_() for v in (x, w, b))
    z = F.linear(xr, wr, br) / temp
    logp = torch.log_softmax(z, -1)
    valid = t != -100
    per = -logp.gather(-1, t.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    u = torch.where(valid, mask, 0.0)
    if reduction == "mean":
        loss, h = (u * per).sum() / u.sum(), (u * ent).sum() / u.sum()
    elif reduction == "sum":
        loss, h = (u * per).sum(), (u * ent).sum()
    else:
        loss, h = u * per, u * ent
    ((loss - c * h) * up).sum().backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(out.entropy, h.detach(), rtol=1e-11, atol=1e-12)
    for got, want in ((xa.grad, xr.grad), (wa.grad, wr.grad), (ba.grad, br.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)
    assert out.entropy.requires_grad and not out.z_loss.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_pytorchs_own_half_path(dtype):
    # Against a float64 reference of the same (rounded) values: ours accumulates in float32 and
    # keeps the logits in float32; PyTorch's half path rounds the logits to the half type.
    x, w, b, t, _ = data(dtype, shape=(4, 32))
    got = grads(at.linear_cross_entropy, x, w, b, t)
    exact = grads(reference, x.double(), w.double(), b.double(), t)
    theirs = grads(reference, x, w, b, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    err = [float((g.double() - r).abs().max()) for g, r in zip(got, exact)]
    err_pt = [float((g.double() - r).abs().max()) for g, r in zip(theirs, exact)]
    assert err[0] < 1e-5 and err[0] <= err_pt[0]  # the loss: float32 accumulation
    half_eps = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    # On the bf16 dot-product path d_logits is rounded to bf16 before the gradient products
    # (each coefficient by at most 2^-8 of itself): a cell moves by at most 2^-8 times the sum
    # of |coefficient x operand| over its reduction.
    coef = [0.0, 0.0, 0.0]
    if dtype == torch.bfloat16 and bf16_dot_path():
        x64, w64 = x.double().reshape(-1, D), w.double()
        z = F.linear(x64, w64, b.double()).requires_grad_()
        up = torch.linspace(-1, 1, 1, dtype=torch.float64)
        dz, = torch.autograd.grad((F.cross_entropy(z, t.reshape(-1)) * up).sum(), z)
        coef = [(BF16_U * dz.abs() @ w64.abs()).reshape(x.shape), BF16_U * dz.abs().T @ x64.abs(),
                0.0]
    for g, r, c, what in zip(got[1:], exact[1:], coef, ("d_input", "d_weight", "d_bias")):
        # each gradient element rounded once to the half format
        bound = (r.abs() * half_eps + (1 + half_eps) * c + 1e-7)
        assert bool(((g.double() - r).abs() <= bound).all()), what
    # and never further from float64 than PyTorch's own half path, on any output
    for e, e_pt, what in zip(err, err_pt, ("loss", "d_input", "d_weight", "d_bias")):
        assert e <= e_pt, (what, e, e_pt)


def test_autocast_does_what_linear_then_cross_entropy_does():
    x, w, b, t, _ = data(torch.float32, shape=(2, 16))
    out = []
    for fn in (at.linear_cross_entropy, reference):
        xa, wa, ba = (a.clone().requires_grad_() for a in (x, w, b))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(xa, wa, t, linear_bias=ba)
        loss.backward()
        out.append((loss, xa.grad, wa.grad, ba.grad))
    (l1, *g1), (l2, *g2) = out
    assert l1.dtype == l2.dtype == torch.float32
    assert all(a.dtype == torch.float32 for a in g1)  # float32 parameters, float32 gradients
    assert abs(float(l1) - float(l2)) < 2e-2 * max(1.0, abs(float(l2)))  # bf16 projection
    for a, b_ in zip(g1, g2):
        assert float((a - b_).abs().max()) < 5e-2 * max(1e-3, float(b_.abs().max()))


@pytest.mark.slow
def test_torch_compile_fullgraph_with_ignored_targets():
    # A compiled training step keeps the op in the graph (fullgraph: no graph break), and with
    # ignore_index in the targets its loss and gradients equal eager's (a peer's compiled path
    # silently returned a wrong loss there).
    x, w, b, t, cw = data(torch.float32, shape=(4, 12))
    t[0] = -100
    head = torch.nn.Linear(D, V).float()
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)

    def loss_fn(xx, tt):
        out = at.linear_cross_entropy(torch.tanh(xx), head.weight, tt, linear_bias=head.bias,
                                      ignore_index=-100, softcap=30.0, lse_square_scale=1e-4,
                                      label_smoothing=0.1, shift=1, return_lse=True)
        return out.loss + 1e-3 * out.lse.mean()

    torch._dynamo.reset()
    # fullgraph=True: an op dynamo could not keep in the graph would raise here, not break it.
    # Inductor, the default backend, generates C++ for the CPU and needs a compiler; where there
    # is none (an installed wheel on a bare machine) aot_eager runs the same dynamo capture and
    # AOTAutograd split of forward and backward (fake kernels, registered autograd) without
    # code generation.
    import shutil

    have_cxx = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    compiled = torch.compile(loss_fn, fullgraph=True,
                             backend="inductor" if have_cxx else "aot_eager")
    results = []
    for fn in (loss_fn, compiled):
        head.zero_grad()
        xa = x.clone().requires_grad_()
        loss = fn(xa, t)
        loss.backward()  # through the compiled backward graph for the compiled forward
        results.append((loss.detach(), xa.grad.clone(), head.weight.grad.clone(),
                        head.bias.grad.clone()))
    # The trunk's tanh is inductor's in the compiled run (its own rounding), so the comparison is
    # to float32 rounding, not to the bit.
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-7)
    xd = torch.tanh(x.double())
    want = reference(xd, w.double(), t, linear_bias=b.double(), softcap=30.0,
                     lse_square_scale=1e-4, label_smoothing=0.1, shift=1)
    lse = torch.logsumexp(30.0 * torch.tanh(F.linear(xd, w.double(), b.double())[:, :-1] / 30.0),
                          -1)
    assert abs(float(results[1][0]) - float(want + 1e-3 * lse.mean())) < 1e-4


def test_torch_compile_with_entropy_and_temperature():
    # The entropy output and its gradient through dynamo and AOTAutograd (fake kernels, the
    # registered autograd): aot_eager, no code generation, so the bits are eager's.
    x, w, b, t, _ = data(torch.float64, shape=(3, 8))

    def objective(xx, ww):
        out = at.linear_cross_entropy(xx, ww, t, linear_bias=b, temperature=0.9,
                                      return_entropy=True, reduction="none")
        return (out.loss - 0.01 * out.entropy).sum()

    torch._dynamo.reset()
    compiled = torch.compile(objective, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (objective, compiled):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xa, wa)
        loss.backward()
        results.append((loss.detach(), xa.grad, wa.grad))
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


def test_refusals():
    x, w, b, t, cw = data(torch.float32)
    lce = at.linear_cross_entropy
    from algenta import LossError

    for kw, status in ((dict(softcap=-2.0), 585), (dict(lse_square_scale=-1.0), 585),
                       (dict(weight=cw[:-1].float()), 582), (dict(linear_bias=b.double()), 582),
                       (dict(linear_bias=b[:-1]), 582), (dict(shift=9), 582),
                       (dict(token_weight=-torch.ones(t.shape)), 585),
                       (dict(token_weight=torch.ones(t.shape[0])), 582),
                       (dict(temperature=0.0), 585), (dict(temperature=float("nan")), 585)):
        with pytest.raises(LossError) as e:
            lce(x, w, t, **kw)
        assert e.value.status == status, kw
    with pytest.raises(TypeError):
        lce(x.to(torch.complex64), w.to(torch.complex64), t)

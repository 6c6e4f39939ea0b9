"""lossk.cross_entropy: the seed's hand-written suite plus NumPy references for the NumPy API."""

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

from lossk_reference import reference

pytestmark = pytest.mark.kernels

RT = algenta.MojoRuntime(mode="local")


def problem(n, d, v, dtype=np.float64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((n, d)) * scale).astype(dtype)
    w = (rng.standard_normal((v, d)) * scale / math.sqrt(d)).astype(dtype)
    t = rng.integers(0, v, n)
    return h, w, t


# ---- the seed's worked examples ---------------------------------------------------------------

def test_uniform_logits_give_exactly_log_vocab():
    logits = [0.25] * (6 * 9)
    out = RT.execute("lossk.cross_entropy", "ce_from_logits_flat", [logits, [0, 3, 6, 0, 3, 6], 6, 9])
    assert out["status"] == 580
    assert out["result"]["mean_loss"] == math.log(9) == 2.1972245773362196
    for v in (2, 3, 7, 9, 1000, 151936 // 64):
        for n in (1, 3, 6, 11):
            r = ce.ce_from_logits_flat(np.full(n * v, -3.5), [i % v for i in range(n)], n, v)
            assert r["mean_loss"] == math.log(v), (n, v)


def test_fused_uniform_logits_give_exactly_log_vocab():
    # zero hidden -> every logit is exactly 0 in the fused float64 path too
    for v in (9, 257, 1000):
        n, d = 7, 5
        r = ce.fused_linear_ce_flat([0.0] * (n * d), np.ones(v * d), [1] * n, n, d, v, 3)
        assert r["mean_loss"] == math.log(v)


def test_peak_logit_cells_seed_example():
    out = RT.execute("lossk.cross_entropy", "ce_peak_logit_cells", [2048, 151936, 256])
    assert out["result"] == {"chunked_cells": 38895616.0, "materialized_cells": 311164928.0,
                             "ratio": 8.0, "n_chunks": 8, "status": 580}
    assert out["status"] == 580
    r = ce.ce_peak_logit_cells(2048, 151936, 256)
    assert dict(r) == out["result"] and r.ratio == 8.0 and r == out["result"]
    assert list(dict(r)) == ["chunked_cells", "materialized_cells", "ratio", "n_chunks", "status"]


def test_peak_logit_cells_reports_refusals():
    assert ce.ce_peak_logit_cells(2048, 151936, 2048)["status"] == 587
    assert ce.ce_peak_logit_cells(0, 10, 1)["status"] == 581
    assert ce.ce_peak_logit_cells(10, C.LOSS_MAX_VOCAB + 1, 1)["chunked_cells"] < 0
    r = ce.ce_peak_logit_cells(100, 50, 1000)  # chunk past n_tok holds n_tok rows
    assert r["chunked_cells"] == 5000.0 and r["n_chunks"] == 1 and r["ratio"] == 1.0


# ---- references -------------------------------------------------------------------------------

def test_from_logits_matches_numpy():
    rng = np.random.default_rng(1)
    n, v = 13, 101
    z = rng.standard_normal((n, v)) * 4
    t = rng.integers(0, v, n)
    m = z.max(1, keepdims=True)
    per = m[:, 0] + np.log(np.exp(z - m).sum(1)) - z[np.arange(n), t]
    r = ce.ce_from_logits_flat(z.ravel().tolist(), t.tolist(), n, v)
    assert r["total_loss"] == pytest.approx(per.sum(), rel=1e-13)
    assert r["mean_loss"] == pytest.approx(per.mean(), rel=1e-13)


@pytest.mark.smoke
def test_fused_flat_matches_materialized():
    n, d, v = 17, 12, 263
    h, w, t = problem(n, d, v)
    ref = ce.ce_from_logits_flat((h @ w.T).ravel(), t, n, v)
    r = ce.fused_linear_ce_flat(h.ravel(), w.ravel(), t, n, d, v, 4)
    assert r["mean_loss"] == pytest.approx(ref["mean_loss"], rel=1e-12)
    assert r["total_loss"] == pytest.approx(ref["total_loss"], rel=1e-12)
    assert r["n_chunks"] == 5 and r["status"] == 580


def test_chunk_sweep_is_bit_identical():
    n, d, v = 23, 16, 531
    h, w, t = problem(n, d, v, seed=2)
    first = ce.fused_linear_ce_flat(h.ravel(), w.ravel(), t, n, d, v, 1)
    for chunk in range(1, n + 1):
        r = ce.fused_linear_ce_flat(h.ravel(), w.ravel(), t, n, d, v, chunk)
        assert r["mean_loss"] == first["mean_loss"] and r["total_loss"] == first["total_loss"], chunk


def test_chunk_invariance_self_check():
    n, d, v = 19, 8, 300
    h, w, t = problem(n, d, v, seed=3)
    out = RT.execute("lossk.cross_entropy", "ce_chunk_invariance_flat",
                     [h.ravel().tolist(), w.ravel().tolist(), t.tolist(), n, d, v])
    assert out["status"] == 580
    assert out["result"]["max_abs_delta"] == 0.0
    assert out["result"]["total_chunk_1"] == out["result"]["total_chunk_n"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_bit_identical_across_chunks(dtype):
    n, d, v = 29, 40, 777
    h, w, t = problem(n, d, v, dtype=dtype, seed=4)
    t[::5] = -100
    base = algenta.linear_cross_entropy(h, w, t, chunk=n, with_grad=True, ignore_index=-100,
                                        label_smoothing=0.1)
    for chunk in (1, 2, 3, 7, 16, 28):
        r = algenta.linear_cross_entropy(h, w, t, chunk=chunk, with_grad=True, ignore_index=-100,
                                         label_smoothing=0.1)
        assert r.loss == base.loss
        assert np.array_equal(r.lse, base.lse)
        assert np.array_equal(r.d_hidden, base.d_hidden)
        assert np.array_equal(r.d_weight, base.d_weight)


def test_backward_central_differences():
    n, d, v = 6, 5, 37
    h, w, t = problem(n, d, v, seed=5)
    g = ce.fused_linear_ce_bwd_flat(h.ravel(), w.ravel(), t, n, d, v)
    assert g["status"] == 580 and g["d_hidden"].shape == (n * d,) and g["d_weight"].shape == (v * d,)
    eps = 1e-6
    num = np.zeros(n * d)
    flat = h.ravel().copy()
    for i in range(n * d):
        up, dn = flat.copy(), flat.copy()
        up[i] += eps
        dn[i] -= eps
        num[i] = (ce.fused_linear_ce_flat(up, w.ravel(), t, n, d, v, n)["mean_loss"]
                  - ce.fused_linear_ce_flat(dn, w.ravel(), t, n, d, v, n)["mean_loss"]) / (2 * eps)
    assert np.max(np.abs(num - g["d_hidden"])) < 1e-8


def test_d_weight_cancels_over_the_vocabulary():
    n, d, v = 9, 7, 151
    h, w, t = problem(n, d, v, seed=6)
    g = ce.fused_linear_ce_bwd_flat(h.ravel(), w.ravel(), t, n, d, v, chunk=4)
    col_sums = g["d_weight"].reshape(v, d).sum(axis=0)
    assert np.max(np.abs(col_sums)) < C.LOSS_TRANSCENDENTAL_FLOOR


def test_bwd_flat_chunk_default_and_invariance():
    n, d, v = 11, 6, 97
    h, w, t = problem(n, d, v, seed=7)
    a = ce.fused_linear_ce_bwd_flat(h.ravel(), w.ravel(), t, n, d, v)
    b = ce.fused_linear_ce_bwd_flat(h.ravel(), w.ravel(), t, n, d, v, 3)
    assert np.array_equal(a["d_hidden"], b["d_hidden"]) and np.array_equal(a["d_weight"], b["d_weight"])
    ref = reference(h, w, t)
    assert np.allclose(a["d_hidden"], ref["d_hidden"].ravel(), rtol=1e-12, atol=1e-15)
    assert np.allclose(a["d_weight"], ref["d_weight"].ravel(), rtol=1e-12, atol=1e-15)


def test_grad_logits_softmax_minus_one_hot():
    rng = np.random.default_rng(8)
    n, v = 5, 11
    z = rng.standard_normal((n, v)) * 3
    t = rng.integers(0, v, n)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(n), t] -= 1
    g = ce.ce_grad_logits_flat(z.ravel(), t, n, v, scale=0.5)
    assert np.allclose(g, 0.5 * p.ravel(), rtol=1e-13, atol=1e-16)
    assert np.abs(g.reshape(n, v).sum(1)).max() < 1e-15
    out = RT.execute("lossk.cross_entropy", "ce_grad_logits_flat", [z.ravel().tolist(), t.tolist(), n, v])
    assert np.allclose(out["result"], p.ravel(), rtol=1e-13, atol=1e-16)


def test_accumulator_is_bit_identical_to_one_call():
    rng = np.random.default_rng(9)
    n, v = 40, 57
    z = rng.standard_normal((n, v)) * 2
    t = rng.integers(0, v, n)
    whole = ce.ce_from_logits_flat(z.ravel(), t, n, v)
    acc = ce.CEAccumulator(v)
    assert math.isnan(acc.mean_loss)
    for a, b in ((0, 1), (1, 9), (9, 9), (9, 31), (31, 40)):
        acc.add(z[a:b].ravel(), t[a:b])
    assert acc.n_tok == n
    assert acc.mean_loss == whole["mean_loss"] and acc.total_loss == whole["total_loss"]
    uni = ce.CEAccumulator(9)
    for _ in range(7):
        uni.add([0.25] * 9, [4])
    assert uni.mean_loss == math.log(9)


# ---- the NumPy API against the reference ----------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index,label_smoothing", [(None, 0.0), (-100, 0.0), (5, 0.2), (None, 1.0)])
def test_linear_cross_entropy_matches_reference(dtype, reduction, ignore_index, label_smoothing):
    n, d, v = 33, 24, 1031  # prime vocab, not a multiple of the 256 block
    h, w, t = problem(n, d, v, dtype=dtype, seed=10, scale=2.0)
    if ignore_index is not None:
        t[1::4] = ignore_index
    go = np.random.default_rng(11).standard_normal(n).astype(dtype) if reduction == "none" else None
    r = algenta.linear_cross_entropy(h, w, t, chunk=8, reduction=reduction, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, with_grad=True, grad_output=go)
    ref = reference(h, w, t, reduction, ignore_index, label_smoothing, go)
    if dtype == np.float64:
        rtol, atol = 1e-12, 1e-13
    else:
        atol = C.loss_tol_for(float(np.max(np.abs(ref["lse"]))), d)
        rtol = 0.0
    assert r.n_valid == ref["n_valid"]
    assert np.asarray(r.loss).dtype == dtype and r.d_hidden.dtype == dtype and r.d_weight.dtype == dtype
    assert np.allclose(r.loss, ref["loss"], rtol=rtol, atol=atol * (n if reduction == "sum" else 1))
    assert np.allclose(r.lse, ref["lse"], rtol=rtol, atol=atol)
    gtol = 1e-13 if dtype == np.float64 else C.loss_tol_for(1.0, v) * max(1.0, float(np.abs(go).max()) if go is not None else 1.0)
    assert np.max(np.abs(r.d_hidden - ref["d_hidden"])) < gtol
    assert np.max(np.abs(r.d_weight - ref["d_weight"])) < gtol


def test_all_ignored_mean_is_nan_with_zero_gradients():
    h, w, t = problem(4, 3, 10)
    t[:] = -100
    r = algenta.linear_cross_entropy(h, w, t, ignore_index=-100, with_grad=True)
    assert math.isnan(r.loss) and r.n_valid == 0
    assert not r.d_hidden.any() and not r.d_weight.any()
    assert algenta.linear_cross_entropy(h, w, t, ignore_index=-100, reduction="sum").loss == 0.0


@pytest.mark.parametrize("n,d,v", [(1, 1, 1), (1, 7, 2), (3, 1, 5), (2, 3, 257), (5, 2, 1), (1, 300, 256)])
def test_awkward_sizes(n, d, v):
    h, w, t = problem(n, d, v, seed=12)
    r = algenta.linear_cross_entropy(h, w, t, with_grad=True, chunk=1)
    ref = reference(h, w, t)
    assert r.loss == pytest.approx(ref["loss"], rel=1e-12, abs=1e-15)
    assert np.allclose(r.d_hidden, ref["d_hidden"], atol=1e-14)
    assert np.allclose(r.d_weight, ref["d_weight"], atol=1e-14)
    if v == 1:
        assert r.loss == 0.0  # one class: the target has probability exactly 1


def test_without_grad_matches_with_grad_forward():
    h, w, t = problem(50, 32, 2000, seed=13)
    a = algenta.linear_cross_entropy(h, w, t, chunk=7)
    b = algenta.linear_cross_entropy(h, w, t, chunk=50, with_grad=True)
    assert a.loss == b.loss and np.array_equal(a.lse, b.lse)
    assert a.d_hidden is None and a.d_weight is None


def test_one_gradient_only():
    h, w, t = problem(21, 9, 300, seed=15)
    both = algenta.linear_cross_entropy(h, w, t, with_grad=True, chunk=4)
    dh = algenta.linear_cross_entropy(h, w, t, with_grad="hidden", chunk=4)
    dw = algenta.linear_cross_entropy(h, w, t, with_grad="weight", chunk=9)
    assert dh.d_weight is None and dw.d_hidden is None
    assert np.array_equal(dh.d_hidden, both.d_hidden) and np.array_equal(dw.d_weight, both.d_weight)
    assert dh.loss == dw.loss == both.loss
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(h, w, t, with_grad="both")


def test_kept_chunk_scratch_is_reused_and_released():
    h, w, t = problem(40, 16, 700, seed=16)
    ce.release_scratch()
    first = algenta.linear_cross_entropy(h, w, t, chunk=8, with_grad=True)
    kept = algenta._core.lossk.scratch_bytes()
    assert kept >= 8 * 700 * 8  # one (chunk, vocab) float64 block stays for the next call
    again = algenta.linear_cross_entropy(h, w, t, chunk=8, with_grad=True)  # reuses it
    assert np.array_equal(again.d_weight, first.d_weight) and again.loss == first.loss
    f32 = algenta.linear_cross_entropy(h.astype(np.float32), w.astype(np.float32), t, chunk=3,
                                       with_grad=True)  # a smaller request in the kept block
    assert np.isfinite(f32.loss)
    assert ce.release_scratch() == kept and algenta._core.lossk.scratch_bytes() == 0
    assert ce.release_scratch() == 0


def test_non_contiguous_inputs():
    h, w, t = problem(12, 10, 40, seed=14)
    hf = np.asfortranarray(h)
    ws = np.stack([w, np.zeros_like(w)], axis=2).reshape(w.shape[0], -1)[:, ::2]
    assert np.array_equal(ws, w)
    a = algenta.linear_cross_entropy(hf, ws, t, with_grad=True)
    b = algenta.linear_cross_entropy(h, w, t, with_grad=True)
    assert a.loss == b.loss and np.array_equal(a.d_weight, b.d_weight)


# ---- invariance across thread counts and instruction sets (fresh processes) ------------------

_DIGEST = textwrap.dedent("""
    import hashlib, numpy as np, algenta
    rng = np.random.default_rng(21)
    out = hashlib.sha256()
    for dtype in (np.float32, np.float64):
        h = rng.standard_normal((45, 70)).astype(dtype)
        w = (rng.standard_normal((1500, 70)) / 8).astype(dtype)
        t = rng.integers(0, 1500, 45)
        for chunk in (1, 13, 45):
            r = algenta.linear_cross_entropy(h, w, t, chunk=chunk, with_grad=True, label_smoothing=0.05)
            for a in (np.asarray(r.loss), r.lse, r.d_hidden, r.d_weight):
                out.update(np.ascontiguousarray(a).tobytes())
    # bfloat16 on this host's path (its dot products, or widened), blocks of rows and columns
    # that two threads split
    from algenta.lossk.cross_entropy import HalfBits
    bits = lambda a: HalfBits((a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "bfloat16")
    h, w = bits(rng.standard_normal((150, 70))), bits(rng.standard_normal((1500, 70)) / 8)
    r = algenta.linear_cross_entropy(h, w, rng.integers(0, 1500, 150), chunk=64, with_grad=True,
                                     grad_dtype="float32")
    for a in (np.asarray(r.loss), r.lse, r.d_hidden, r.d_weight):
        out.update(np.ascontiguousarray(a).tobytes())
    print(algenta._core.isa_name(), out.hexdigest())
""")


def _digest(env_extra):
    env = dict(os.environ, **env_extra)
    res = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


@pytest.mark.slow
def test_bit_identical_for_every_thread_count():
    digests = {k: _digest({"OMP_NUM_THREADS": str(k)})[1] for k in (1, 2, 3, 5)}
    assert len(set(digests.values())) == 1, digests


def _isas():
    names = []
    for isa in algenta._core.isa_names().split(","):
        res = subprocess.run([sys.executable, "-c", "import algenta; print(algenta._core.isa_name())"],
                             env=dict(os.environ, ALGENTA_ISA=isa), capture_output=True, text=True)
        if res.stdout.strip() == isa:
            names.append(isa)
    return names


@pytest.mark.slow
def test_every_instruction_set_agrees_with_the_reference():
    script = textwrap.dedent("""
        import numpy as np, algenta, sys
        sys.path.insert(0, %r)
        from lossk_reference import reference
        rng = np.random.default_rng(3)
        for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
            h = rng.standard_normal((37, 41)).astype(dtype)
            w = (rng.standard_normal((523, 41)) / 6).astype(dtype)
            t = rng.integers(0, 523, 37)
            r = algenta.linear_cross_entropy(h, w, t, chunk=5, with_grad=True)
            q = algenta.linear_cross_entropy(h, w, t, chunk=37, with_grad=True)
            assert np.array_equal(r.d_weight, q.d_weight) and r.loss == q.loss
            ref = reference(h, w, t)
            assert abs(r.loss - ref["loss"]) < tol * 10, (r.loss, ref["loss"])
            assert np.abs(r.d_hidden - ref["d_hidden"]).max() < tol
            assert np.abs(r.d_weight - ref["d_weight"]).max() < tol
        # bfloat16 inputs on this instruction set's path (widened, or bf16 dot products), float32
        # gradients: float32 accumulation, plus the d_logits rounding of the dot-product path
        from algenta.lossk.cross_entropy import HalfBits
        from lossk_reference import bf16_gradient_bounds, reference_full
        u = rng.standard_normal((37, 41)).astype(np.float32).view(np.uint32) >> 16
        hb = u.astype(np.uint16)
        wb = ((rng.standard_normal((523, 41)) / 6).astype(np.float32).view(np.uint32) >> 16
              ).astype(np.uint16)
        h64, w64 = [(b.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for b in (hb, wb)]
        t = rng.integers(0, 523, 37)
        r = algenta.linear_cross_entropy(HalfBits(hb, "bfloat16"), HalfBits(wb, "bfloat16"), t,
                                         chunk=5, with_grad=True, grad_dtype="float32")
        q = algenta.linear_cross_entropy(HalfBits(hb, "bfloat16"), HalfBits(wb, "bfloat16"), t,
                                         chunk=37, with_grad=True, grad_dtype="float32")
        assert np.array_equal(r.d_weight, q.d_weight) and r.loss == q.loss
        ref = reference_full(h64, w64, t)
        ch, cw_ = bf16_gradient_bounds(ref, w64)
        assert abs(r.loss - ref["loss"]) < 2e-4
        assert np.all(np.abs(r.d_hidden - ref["d_hidden"]) <= ch + 2e-5)
        assert np.all(np.abs(r.d_weight - ref["d_weight"]) <= cw_ + 2e-5)
        # past every block edge of the dot-product kernels (k blocks of 512, row blocks of 192,
        # column blocks of 256, tiles of 16 x 32 with ragged tails), chunks of 64 and all 200
        N, D, V = 200, 600, 2100
        hb = (rng.standard_normal((N, D)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        wb = ((rng.standard_normal((V, D)) / 24).astype(np.float32).view(np.uint32) >> 16
              ).astype(np.uint16)
        h64, w64 = [(b.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for b in (hb, wb)]
        t = rng.integers(0, V, N)
        r = algenta.linear_cross_entropy(HalfBits(hb, "bfloat16"), HalfBits(wb, "bfloat16"), t,
                                         chunk=64, with_grad=True, grad_dtype="float32")
        q = algenta.linear_cross_entropy(HalfBits(hb, "bfloat16"), HalfBits(wb, "bfloat16"), t,
                                         with_grad=True, grad_dtype="float32")
        assert np.array_equal(r.d_weight, q.d_weight) and np.array_equal(r.d_hidden, q.d_hidden)
        ref = reference_full(h64, w64, t)
        ch, cw_ = bf16_gradient_bounds(ref, w64)
        assert abs(r.loss - ref["loss"]) < 2e-4
        assert np.all(np.abs(r.d_hidden - ref["d_hidden"]) <= ch + 2e-5)
        assert np.all(np.abs(r.d_weight - ref["d_weight"]) <= cw_ + 2e-5)
        print("ok", algenta._core.isa_name())
    """) % os.path.dirname(__file__)
    for isa in _isas():
        res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ALGENTA_ISA=isa),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.split() == ["ok", isa], (isa, res.stderr)


def test_instruction_sets_are_listed_and_the_bf16_path_follows_the_active_one():
    core = algenta._core
    names = core.isa_names().split(",")
    assert len(set(names)) == len(names) and names[-1] == "generic"
    active = core.isa_name()
    assert active in names
    # the best set the CPU has is chosen, AMX only once the kernel granted its tile state
    # (isa_note says why not)
    note = core.isa_note()
    assert note == "" or note.startswith("amx: "), note
    if "amx" in names and note == "" and not os.environ.get("ALGENTA_ISA"):
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
        if {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"} <= set(flags):
            assert active == "amx"
    assert core.bf16_path() == {"amx": "amx", "avx512bf16": "vdpbf16ps"}.get(active, "widen")


def test_unknown_isa_is_refused_clearly():
    script = "import numpy as np, algenta\ntry:\n    algenta.linear_cross_entropy(np.ones((1,1)), np.ones((1,1)), [0])\nexcept ValueError as e:\n    print('refused', e)\n"
    res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ALGENTA_ISA="sse9"),
                         capture_output=True, text=True, timeout=120)
    assert "refused" in res.stdout and "sse9" in res.stdout, res.stderr


# ---- refusals: every status 581-587, before any work --------------------------------------------

def _status(fn, *a, **k):
    with pytest.raises(LossError) as e:
        fn(*a, **k)
    assert isinstance(e.value, ValueError)
    assert e.value.status_name == C.loss_status_name(e.value.status)
    return e.value.status


def test_every_refusal_is_reachable():
    h, w, t = problem(4, 3, 10)
    f = ce.fused_linear_ce_flat
    assert _status(f, [], [], [], 0, 3, 10, 1) == 581
    assert _status(f, h.ravel()[:-1], w.ravel(), t, 4, 3, 10, 1) == 582
    assert _status(f, h.ravel(), w.ravel()[:5], t, 4, 3, 10, 1) == 582
    assert _status(f, h.ravel(), w.ravel(), t[:3], 4, 3, 10, 1) == 582
    assert _status(f, [], [], [], 4, 3, C.LOSS_MAX_VOCAB + 1, 1) == 583
    # 2^47 work cells, refused before the (absent) data is even looked at
    assert _status(f, [], [], [], 2**20, 2**13, 2**14, 1) == 584
    bad = h.ravel().copy()
    bad[5] = np.nan
    assert _status(f, bad, w.ravel(), t, 4, 3, 10, 1) == 585
    badw = w.ravel().copy()
    badw[-1] = np.inf
    assert _status(f, h.ravel(), badw, t, 4, 3, 10, 1) == 585
    assert _status(f, h.ravel(), w.ravel(), [0, 1, 10, 2], 4, 3, 10, 1) == 586
    assert _status(f, h.ravel(), w.ravel(), [0, -1, 1, 2], 4, 3, 10, 1) == 586
    assert _status(f, h.ravel(), w.ravel(), t, 4, 3, 10, 2**27 // 10 + 1) == 587
    assert _status(f, h.ravel(), w.ravel(), t, 4, 3, 10, 0) == 581
    lce = algenta.linear_cross_entropy
    assert _status(lce, h, w, t, label_smoothing=float("nan")) == 585
    assert _status(lce, h, w, t, label_smoothing=1.5) == 585
    assert _status(lce, h, w, t, reduction="none", with_grad=True, grad_output=np.array([1, np.inf, 1, 1.0])) == 585
    assert _status(lce, h, w, np.array([0, 1, -100, 2])) == 586  # no ignore_index: not a mask
    assert _status(lce, h, w, t[:2]) == 582
    assert _status(lce, h, w[:, :2], t) == 582
    assert _status(lce, h, w, t, chunk=2**27 // 10 + 1) == 587
    assert _status(ce.ce_from_logits_flat, [0.0] * 8, [0, 1], 2, 5) == 582
    assert _status(ce.ce_from_logits_flat, [np.nan] * 10, [0, 1], 2, 5) == 585
    assert _status(ce.ce_from_logits_flat, [0.0] * 10, [0, 5], 2, 5) == 586
    assert _status(ce.ce_grad_logits_flat, [0.0] * 10, [0, 1], 2, 5, float("inf")) == 585
    acc = ce.CEAccumulator(5)
    assert _status(acc.add, [0.0] * 9, [0, 1]) == 582


def test_refusal_through_runtime_returns_status():
    out = RT.execute("lossk.cross_entropy", "fused_linear_ce_flat", [[1.0], [1.0, 2.0], [3], 1, 1, 2, 1])
    assert out["result"] is None and out["status"] == 586 and "target" in out["error"]


def test_type_errors():
    h, w, t = problem(4, 3, 10)
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(h, w.astype(np.float32), t)
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(h.astype(np.int64), w, t)
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(h, w, t.astype(np.float64))
    with pytest.raises(TypeError):
        ce.fused_linear_ce_flat(h.ravel(), w.ravel(), t, 4.0, 3, 10, 1)
    with pytest.raises(TypeError):
        ce.ce_from_logits_flat(["a"] * 10, [0, 1], 2, 5)
    with pytest.raises(ValueError):
        algenta.linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError):
        algenta.linear_cross_entropy(h, w, t, grad_output=np.ones(4))


def test_runtime_rejects_unknown_names_and_modes():
    with pytest.raises(ValueError, match="unknown module"):
        RT.execute("lossk.nope", "f", [])
    with pytest.raises(ValueError, match="unknown function"):
        RT.execute("lossk.cross_entropy", "np", [])
    with pytest.raises(ValueError):
        algenta.Runtime(mode="remote")
    assert algenta.MojoRuntime is algenta.Runtime


def test_import_is_quiet_and_has_a_version():
    res = subprocess.run([sys.executable, "-c", "import algenta, sys; print(algenta.__version__); print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.split() == [algenta.__version__, "False"]

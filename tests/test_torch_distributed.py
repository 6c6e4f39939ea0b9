"""vocab_parallel_linear_cross_entropy and vocab_parallel_linear_distillation_loss over two gloo
processes on 127.0.0.1 against the unsharded losses: same loss on every rank, each rank's shard
gradient, the full hidden gradient."""

import os
import socket
import sys
import time
from datetime import timedelta

import pytest

# Spawns a process group of workers: seconds of start-up.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import algenta  # noqa: E402
from algenta import LossError  # noqa: E402

F = torch.nn.functional
WORLD = 2
D = 12
# (vocab, rows on rank 0): uneven shards, a prime vocab, and shards of more than one
# 256-class block of the core's log-sum-exp.
VOCABS = {"small": (37, 19), "blocks": (601, 300)}
CASES = [
    dict(name="f64-mean", dtype="float64", vocab="small", reduction="mean"),
    dict(name="f64-sum-ls", dtype="float64", vocab="small", reduction="sum", label_smoothing=0.2),
    dict(name="f64-none-ls", dtype="float64", vocab="blocks", reduction="none",
         label_smoothing=0.1),
    dict(name="f64-mean-ii", dtype="float64", vocab="small", reduction="mean", ignore_index=20,
         label_smoothing=0.1),
    dict(name="f32-mean-ls", dtype="float32", vocab="blocks", reduction="mean",
         label_smoothing=0.1),
    dict(name="f32-none", dtype="float32", vocab="small", reduction="none"),
    dict(name="f64-all-ignored", dtype="float64", vocab="small", reduction="mean", all_ignored=True),
    dict(name="f64-weight-only", dtype="float64", vocab="small", reduction="mean", hidden_grad=False),
    # Logits of size ~100: one shard holds nearly all the probability of each token, and the
    # log-sum-exps are large next to the losses.
    dict(name="f32-peaked", dtype="float32", vocab="small", reduction="sum", scale=30.0),
    # The options, each shard holding its rows of the bias and of the class weights.
    dict(name="f64-bias", dtype="float64", vocab="small", reduction="mean", bias=True),
    dict(name="f64-softcap", dtype="float64", vocab="blocks", reduction="sum", softcap=2.0),
    dict(name="f64-zloss", dtype="float64", vocab="small", reduction="mean",
         lse_square_scale=1e-2),
    dict(name="f64-weights-ls", dtype="float64", vocab="blocks", reduction="mean", weights=True,
         label_smoothing=0.1),
    dict(name="f64-everything", dtype="float64", vocab="blocks", reduction="none", bias=True,
         weights=True, softcap=3.0, lse_square_scale=1e-3, label_smoothing=0.2),
    dict(name="f32-everything", dtype="float32", vocab="small", reduction="mean", bias=True,
         weights=True, softcap=3.0, lse_square_scale=1e-3, label_smoothing=0.2),
    dict(name="f64-temperature", dtype="float64", vocab="blocks", reduction="none",
         temperature=0.6),
    dict(name="f64-temperature-everything", dtype="float64", vocab="blocks", reduction="mean",
         bias=True, weights=True, softcap=3.0, lse_square_scale=1e-3, label_smoothing=0.2,
         temperature=1.5),
]


def _inputs(case):
    vocab, _ = VOCABS[case["vocab"]]
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(len(case["name"]))
    h = torch.randn(3, 5, D, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(vocab, D, generator=g, dtype=torch.float64)
    w = (w * case.get("scale", 1.0)).to(dtype)
    t = torch.randint(0, vocab, (3, 5), generator=g)
    ii = case.get("ignore_index", -100)
    t.view(-1)[[2, 9]] = ii
    if case.get("all_ignored"):
        t.fill_(ii)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if case.get("bias") \
        else None
    cw = (torch.rand(vocab, generator=g, dtype=torch.float64) + 0.5).to(dtype) \
        if case.get("weights") else None
    return h, w, t, b, cw


# Distillation: both heads' rows sharded alike (the teacher with another hidden size).
DT = 7
DISTILL_CASES = [
    dict(name="kl-mean", dtype="float64", vocab="small", reduction="mean", objective="kl"),
    dict(name="rkl-none-T", dtype="float64", vocab="blocks", reduction="none",
         objective="reverse_kl", temperature=0.7),
    dict(name="jsd-sum-hard-bias", dtype="float64", vocab="blocks", reduction="sum",
         objective="jsd", beta=0.3, temperature=2.0, hard_weight=0.5, bias=True),
    dict(name="jsd-mean-f32", dtype="float32", vocab="small", reduction="mean", objective="jsd",
         hard_weight=0.2, no_target=False),
    dict(name="kl-notarget", dtype="float64", vocab="small", reduction="mean", objective="kl",
         no_target=True),
]


def _distill_inputs(case):
    vocab, _ = VOCABS[case["vocab"]]
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(7 + len(case["name"]))
    si = torch.randn(3, 5, D, generator=g, dtype=torch.float64).to(dtype)
    sw = torch.randn(vocab, D, generator=g, dtype=torch.float64).to(dtype)
    ti = torch.randn(3, 5, DT, generator=g, dtype=torch.float64).to(dtype)
    tw = torch.randn(vocab, DT, generator=g, dtype=torch.float64).to(dtype)
    t = None if case.get("no_target") else torch.randint(0, vocab, (3, 5), generator=g)
    if t is not None:
        t.view(-1)[[1, 8]] = -100
    sb = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if case.get("bias") \
        else None
    tb = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if case.get("bias") \
        else None
    return si, sw, ti, tw, t, sb, tb


def _distill_kw(case):
    return {k: case[k] for k in ("reduction", "objective", "beta", "temperature",
                                 "hard_weight") if k in case}


def _kw(case):
    return {k: case[k] for k in ("reduction", "ignore_index", "label_smoothing", "softcap",
                                 "lse_square_scale", "temperature") if k in case}


def _upstream(case, loss):
    g = torch.Generator().manual_seed(99)
    if case["reduction"] == "none":
        return torch.randn(loss.shape, generator=g, dtype=torch.float64).to(loss.dtype)
    return torch.tensor(1.5, dtype=loss.dtype)


def _worker(rank, port, outdir):
    if sys.platform.startswith("linux"):
        # Gloo picks its interface from the hostname, which a sandbox may not resolve.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    out = {}
    try:
        for case in CASES:
            h, w, t, b, cw = _inputs(case)
            vocab, rows0 = VOCABS[case["vocab"]]
            lo, hi = (0, rows0) if rank == 0 else (rows0, vocab)
            h = h.requires_grad_(case.get("hidden_grad", True))
            ws = w[lo:hi].clone().requires_grad_(True)
            bs = None if b is None else b[lo:hi].clone().requires_grad_(True)
            loss = algenta.torch.vocab_parallel_linear_cross_entropy(
                h, ws, t, vocab_start=lo, linear_bias=bs,
                weight=None if cw is None else cw[lo:hi], **_kw(case))
            loss.backward(_upstream(case, loss))
            out[case["name"]] = (loss.detach(), None if h.grad is None else h.grad, ws.grad,
                                 None if bs is None else bs.grad)
        for case in DISTILL_CASES:
            si, sw, ti, tw, t, sb, tb = _distill_inputs(case)
            vocab, rows0 = VOCABS[case["vocab"]]
            lo, hi = (0, rows0) if rank == 0 else (rows0, vocab)
            si = si.requires_grad_(True)
            sws = sw[lo:hi].clone().requires_grad_(True)
            sbs = None if sb is None else sb[lo:hi].clone().requires_grad_(True)
            loss = algenta.torch.vocab_parallel_linear_distillation_loss(
                si, sws, ti, tw[lo:hi], t, vocab_start=lo, student_bias=sbs,
                teacher_bias=None if tb is None else tb[lo:hi], **_distill_kw(case))
            loss.backward(_upstream(case, loss))
            out["distill-" + case["name"]] = (loss.detach(), si.grad, sws.grad,
                                              None if sbs is None else sbs.grad)
        si, sw, ti, tw, t, _, _ = _distill_inputs(DISTILL_CASES[0])
        for name, kw in (("distill-objective", dict(objective="kl" if rank else "forward")),
                         ("distill-hard", dict(hard_weight=1.0, target=None))):
            try:
                algenta.torch.vocab_parallel_linear_distillation_loss(
                    si, sw[:19] if rank == 0 else sw[19:], ti, tw[:19] if rank == 0 else tw[19:],
                    kw.pop("target", t), vocab_start=0 if rank == 0 else 19, **kw)
                out[name] = None
            except LossError as e:
                out[name] = e.status
        # Refusals raise on every rank (none waits for a collective the other skipped).
        h, w, t, _, _ = _inputs(CASES[0])
        for name, start, bad_rows in (("gap", 0 if rank == 0 else 20, False),
                                      ("nan", 0 if rank == 0 else 19, True)):
            ws = w[:19] if rank == 0 else w[19:].clone()
            if bad_rows and rank == 1:
                ws[3, 2] = float("nan")
            try:
                algenta.torch.vocab_parallel_linear_cross_entropy(h, ws, t, vocab_start=start)
                out[name] = None
            except LossError as e:
                out[name] = e.status
        # A target beyond the combined vocabulary, which no single shard could tell.
        t2 = t.clone()
        t2[0, 0] = 37
        try:
            algenta.torch.vocab_parallel_linear_cross_entropy(
                h, w[:19] if rank == 0 else w[19:], t2, vocab_start=0 if rank == 0 else 19)
            out["beyond"] = None
        except LossError as e:
            out["beyond"] = e.status
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    outdir = str(tmp_path_factory.mktemp("vp"))
    mp_env = pytest.MonkeyPatch()
    # Children inherit this before they load the core's OpenMP runtime: one thread each on a
    # shared machine.
    mp_env.setenv("OMP_NUM_THREADS", "1")
    try:
        ctx = mp.start_processes(_worker, args=(_free_port(), outdir), nprocs=WORLD, join=False,
                                 start_method="spawn")
    finally:
        mp_env.undo()
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("the two-process vocab-parallel run did not finish in 180 s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(WORLD)]


def _close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    m = ~torch.isnan(b)
    if m.any():
        err = float((a[m].double() - b[m].double()).abs().max())
        assert err <= tol * max(1.0, float(b[m].double().abs().max())), err


def _reference(case, h, w, t, b, cw):
    vocab, _ = VOCABS[case["vocab"]]
    ii = case.get("ignore_index", -100)
    z = F.linear(h, w, b).reshape(-1, vocab)
    cap = case.get("softcap")
    if cap:
        z = cap * torch.tanh(z / cap)
    z = z / case.get("temperature", 1.0)
    tf = t.reshape(-1)
    red = case["reduction"]
    ref = F.cross_entropy(z, tf, weight=cw, ignore_index=ii, reduction=red,
                          label_smoothing=case.get("label_smoothing", 0.0))
    zs = case.get("lse_square_scale", 0.0)
    if zs:
        lse = torch.logsumexp(z, -1)
        valid = tf != ii
        zl = torch.where(valid, zs * lse * lse, torch.zeros_like(lse))
        ref = ref + (zl.sum() / valid.sum() if red == "mean" else zl.sum() if red == "sum"
                     else zl)
    return ref.reshape(t.shape) if red == "none" else ref


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_unsharded(results, case):
    h, w, t, b, cw = _inputs(case)
    vocab, rows0 = VOCABS[case["vocab"]]
    h = h.requires_grad_(True)
    w = w.requires_grad_(True)
    if b is not None:
        b = b.requires_grad_(True)
    ref = _reference(case, h, w, t, b, cw)
    ref.backward(_upstream(case, ref))
    tol = 1e-12 if case["dtype"] == "float64" else 3e-5
    (l0, dh0, dw0, db0), (l1, dh1, dw1, db1) = results[0][case["name"]], results[1][case["name"]]
    if b is not None:
        _close(db0, b.grad[:rows0], tol)
        _close(db1, b.grad[rows0:], tol)
    # Every rank holds the same loss, to the bit.
    torch.testing.assert_close(l0, l1, rtol=0, atol=0, equal_nan=True)
    _close(l0, ref.detach(), tol)
    if case.get("hidden_grad", True):
        assert torch.equal(dh0, dh1)
        _close(dh0, h.grad, tol)
    else:
        assert dh0 is None and dh1 is None
    _close(dw0, w.grad[:rows0], tol)
    _close(dw1, w.grad[rows0:], tol)
    if case["dtype"] == "float64":
        # ...and the fused single-process op on the whole head.
        single = algenta.torch.linear_cross_entropy(
            h.detach(), w.detach(), t, linear_bias=None if b is None else b.detach(), weight=cw,
            **_kw(case))
        _close(l0, single, 1e-12)


def test_refusals_raise_on_every_rank(results):
    for r in results:
        assert r["gap"] == 582  # shards [0, 19) and [20, 38) leave a gap
        assert r["nan"] == 585  # rank 1's shard holds a NaN: rank 0 raises too
        assert r["beyond"] == 586


@pytest.mark.parametrize("case", DISTILL_CASES, ids=[c["name"] for c in DISTILL_CASES])
def test_distillation_matches_unsharded(results, case):
    si, sw, ti, tw, t, sb, tb = _distill_inputs(case)
    _, rows0 = VOCABS[case["vocab"]]
    si, sw = si.requires_grad_(True), sw.requires_grad_(True)
    if sb is not None:
        sb = sb.requires_grad_(True)
    ref = algenta.torch.linear_distillation_loss(si, sw, ti, tw, t, student_bias=sb,
                                                 teacher_bias=tb, **_distill_kw(case))
    ref.backward(_upstream(case, ref))
    tol = 1e-12 if case["dtype"] == "float64" else 3e-5
    (l0, dh0, dw0, db0), (l1, dh1, dw1, db1) = (results[0]["distill-" + case["name"]],
                                                results[1]["distill-" + case["name"]])
    torch.testing.assert_close(l0, l1, rtol=0, atol=0, equal_nan=True)
    _close(l0, ref.detach(), tol)
    assert torch.equal(dh0, dh1)
    _close(dh0, si.grad, tol)
    _close(dw0, sw.grad[:rows0], tol)
    _close(dw1, sw.grad[rows0:], tol)
    if sb is not None:
        _close(db0, sb.grad[:rows0], tol)
        _close(db1, sb.grad[rows0:], tol)


def test_distillation_refusals_raise_on_every_rank(results):
    for r in results:
        assert r["distill-objective"] == 588  # rank 0's unknown objective: rank 1 raises too
        assert r["distill-hard"] == 582       # hard_weight without a target

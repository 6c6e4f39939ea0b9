"""Fused linear distillation against the materialized PyTorch computation of the same loss.

Speed: ``algenta.torch.linear_distillation_loss`` forward + backward (student gradients for
input and weight) against PyTorch computing the same loss on materialized logits
(``s = x_s @ W_s.T``, the teacher's under no_grad, ``log_softmax`` of both over T,
``F.kl_div(..., log_target=True)``; JSD through the mixture ``m = beta q + (1 - beta) p``),
per objective, interleaved rounds, minimum kept; each result checked against PyTorch's before
timing. Memory (``--memory``): the resident-set high-water mark above the inputs of one forward +
backward in a fresh process, at Qwen3's vocabulary (151,936) for 2,048 tokens by default,
against PyTorch's materialized computation and against what the call must hold (the student's
gradients plus one chunk of each head's logits).

    python perf/bench_distill.py [--n 1024 --d 1024 --dt 1024 --v 32768 --reps 3]
    python perf/bench_distill.py --memory [--n 2048 --d 1024 --dt 1024 --v 151936]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import cpu_flags, cpu_name

OBJECTIVES = (("kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5))

SETUP = r"""
import math, torch, torch.nn.functional as F
import algenta.torch as at
torch.set_num_threads(2)
torch.manual_seed(0)
N, D, DT, V = %d, %d, %d, %d
si = (torch.randn(N, D) / math.sqrt(D)).requires_grad_()
sw = torch.randn(V, D).requires_grad_()
ti, tw = torch.randn(N, DT) / math.sqrt(DT), torch.randn(V, DT)
T = 2.0

def torch_loss(objective, beta):
    s = si @ sw.T
    with torch.no_grad():
        lq = F.log_softmax((ti @ tw.T) / T, -1)
    lp = F.log_softmax(s / T, -1)
    if objective == "kl":
        return F.kl_div(lp, lq, log_target=True, reduction="sum") / N
    if objective == "reverse_kl":
        return F.kl_div(lq, lp, log_target=True, reduction="sum") / N
    lm = torch.log(beta * lq.exp() + (1 - beta) * lp.exp())
    return (beta * F.kl_div(lm, lq, log_target=True, reduction="sum")
            + (1 - beta) * F.kl_div(lm, lp, log_target=True, reduction="sum")) / N

def ours(objective, beta):
    return at.linear_distillation_loss(si, sw, ti, tw, objective=objective, beta=beta,
                                       temperature=T)
"""


def speed(args):
    import torch

    ns = {}
    exec(SETUP % (args.n, args.d, args.dt, args.v), ns)
    si, sw = ns["si"], ns["sw"]

    def step(fn, objective, beta):
        def run():
            si.grad = sw.grad = None
            loss = fn(objective, beta)
            loss.backward()
            return loss
        return run

    fns = {}
    for objective, beta in OBJECTIVES:
        ref = step(ns["torch_loss"], objective, beta)
        got = step(ns["ours"], objective, beta)
        lr = ref()
        gr = (si.grad.clone(), sw.grad.clone())
        lg = got()
        torch.testing.assert_close(lg, lr, rtol=1e-4, atol=1e-5)
        for a, b in zip((si.grad, sw.grad), gr):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
        fns[("torch", objective)] = ref
        fns[("algenta", objective)] = got
    best = {k: float("inf") for k in fns}
    for _ in range(args.reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    print(f"{cpu_name()} [{cpu_flags()}], 2 threads; n_tok {args.n}, student d {args.d}, "
          f"teacher d {args.dt}, vocab {args.v}, float32, T=2, forward + backward, min of "
          f"{args.reps} interleaved rounds")
    print(f"{'objective':12} {'torch (materialized) s':>24} {'algenta s':>10} {'speed-up':>9}")
    for objective, _ in OBJECTIVES:
        t, a = best[("torch", objective)], best[("algenta", objective)]
        print(f"{objective:12} {t:24.3f} {a:10.3f} {t / a:9.2f}x")


CHILD = SETUP + r"""
what = %r
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
x = torch.zeros(2, D, requires_grad=True)  # first-use allocations of both code paths
at.linear_distillation_loss(x, sw[:300], ti[:2], tw[:300]).backward()
(x @ sw[:300].T).sum().backward()
si.grad = sw.grad = None
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
loss = (ours if what == "algenta" else torch_loss)("kl", 0.5)
loss.backward()
print(json.dumps({"extra": status("VmHWM:") - base, "loss": float(loss)}))
"""


def memory(args):
    from algenta.lossk.contract import loss_max_chunk

    out = {}
    for what in ("algenta", "torch"):
        src = "import json\n" + CHILD % (args.n, args.d, args.dt, args.v, what)
        res = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                             timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(res.stderr)
        out[what] = json.loads(res.stdout.strip().splitlines()[-1])
    assert abs(out["algenta"]["loss"] - out["torch"]["loss"]) < 1e-4 * abs(out["torch"]["loss"])
    n, v = args.n, args.v
    chunk = min(loss_max_chunk(n, v), n)
    need = 2 * chunk * v * 4 + (n * args.d + v * args.d) * 4
    mb = 1e-6
    print(f"{cpu_name()}; n_tok {n}, vocab {v}, student d {args.d}, teacher d {args.dt}, "
          f"float32, KL forward + backward; one chunk {chunk} tokens; materialized logits "
          f"{n * v * 4 * mb:.0f} MB per head")
    print(f"{'':28} {'peak above inputs':>18} {'x needed':>9}")
    print(f"{'needed (grads + 2 chunks)':28} {need * mb:15.0f} MB {1.0:9.2f}")
    for k, label in (("algenta", "algenta.torch"), ("torch", "torch, materialized")):
        print(f"{label:28} {out[k]['extra'] * mb:15.0f} MB {out[k]['extra'] / need:9.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--n", type=int)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--dt", type=int, default=1024)
    ap.add_argument("--v", type=int)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.memory:
        args.n, args.v = args.n or 2048, args.v or 151936
        memory(args)
    else:
        args.n, args.v = args.n or 1024, args.v or 32768
        speed(args)


if __name__ == "__main__":
    main()

"""Train a tiny bigram LM (embedding -> tanh projection -> head) twice on the same data and seed:
once with algenta.torch.linear_cross_entropy, once with PyTorch's materialized
F.cross_entropy(F.linear(h, W), y). Prints both loss curves, how far apart they land, and the
peak memory of each.

What is measured: each variant runs in a fresh Python subprocess, one after the other. Memory is
the process's resident-set high-water mark (VmHWM from /proc/self/status), read once just before
the first training step (after imports, data and model are in place: the "setup" figure) and
once after the last; "training peak" is the difference, i.e. how far training pushed the
high-water mark above setup. It counts everything resident (allocator caches included), not just
tensors; it is Linux-only. The analytic sizes printed next to it are the ones that explain it:
the materialized path holds [tokens, vocab] logits, their log-softmax and their gradient; the
fused path holds one chunk of logits at a time (`--chunk` tokens) plus the weight gradient.

Usage: python perf/train_tiny_lm.py [--vocab 32768] [--tokens 1024] [--steps 12] [--chunk 128] ...
(defaults run in well under a minute on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (this measurement is Linux-only)")


def _train(args) -> dict:
    import torch
    import torch.nn.functional as F

    import algenta.torch as at

    torch.manual_seed(args.seed)
    V, D, N = args.vocab, args.d_model, args.tokens
    # Data: a fixed random bigram table (each token has one likely successor), sampled with 10%
    # noise; contexts come from the first --contexts ids, so each is seen many times and the loss
    # falls well below log(V) in a few steps. Targets range over the whole vocabulary.
    succ = torch.randperm(V)
    x = torch.randint(0, min(args.contexts, V), (args.steps, N))
    y = succ[x]
    noise = torch.rand(args.steps, N) < 0.1
    y[noise] = torch.randint(0, V, (int(noise.sum()),))

    emb = torch.nn.Embedding(V, D)
    proj = torch.nn.Linear(D, D)
    head = torch.nn.Linear(D, V, bias=False)
    params = list(emb.parameters()) + list(proj.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)

    if args.run == "fused":
        def loss_fn(h, w, t):
            return at.linear_cross_entropy(h, w, t, chunk=args.chunk)
    else:
        def loss_fn(h, w, t):
            return F.cross_entropy(F.linear(h, w), t)

    setup_kib = _hwm_kib()
    curve = []
    t0 = time.perf_counter()
    for s in range(args.steps):
        opt.zero_grad(set_to_none=True)
        h = torch.tanh(proj(emb(x[s])))
        loss = loss_fn(h, head.weight, y[s])
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    elapsed = time.perf_counter() - t0
    return {"run": args.run, "curve": curve, "setup_kib": setup_kib, "peak_kib": _hwm_kib(),
            "seconds": elapsed}


def _child(args, run: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", run] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "run"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--contexts", type=int, default=256, help="distinct input tokens")
    p.add_argument("--chunk", type=int, default=128, help="tokens per pass of the fused loss")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", choices=("fused", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        print(json.dumps(_train(args)))
        return

    V, D, N, C = args.vocab, args.d_model, args.tokens, args.chunk
    print(f"tiny LM: vocab={V} d_model={D} tokens/step={N} steps={args.steps} float32, "
          f"fused chunk={C}")
    res = {r: _child(args, r) for r in ("fused", "torch")}
    fu, to = res["fused"]["curve"], res["torch"]["curve"]
    # Validate first: a memory figure for a loss that does not match would mean nothing.
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(fu, to))
    print(f"\n{'step':>4}  {'fused':>10}  {'pytorch':>10}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(fu, to)):
        print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    ok = worst < 1e-4 and fu[-1] < fu[0]
    print(f"max relative difference over the curve: {worst:.2e} "
          f"({'agree' if ok else 'DISAGREE'}); loss {fu[0]:.3f} -> {fu[-1]:.3f} "
          f"(log V = {__import__('math').log(V):.3f})")

    mib = 1024.0
    logits = N * V * 4 / 2**20
    print(f"\nanalytic: one [tokens, vocab] float32 logit tensor = {logits:.1f} MiB; "
          f"one fused chunk = {min(C, N) * V * 4 / 2**20:.1f} MiB; "
          f"head weight (and its gradient) = {V * D * 4 / 2**20:.1f} MiB")
    print(f"{'variant':>8}  {'setup RSS':>10}  {'peak RSS':>10}  {'training peak':>14}  "
          f"{'s/step':>7}")
    for r in ("fused", "torch"):
        x = res[r]
        print(f"{r:>8}  {x['setup_kib'] / mib:>7.1f} MiB  {x['peak_kib'] / mib:>7.1f} MiB  "
              f"{(x['peak_kib'] - x['setup_kib']) / mib:>10.1f} MiB  "
              f"{x['seconds'] / args.steps:>7.3f}")
    dt = res["torch"]["peak_kib"] - res["torch"]["setup_kib"]
    df = res["fused"]["peak_kib"] - res["fused"]["setup_kib"]
    if df > 0:
        print(f"training peak, pytorch / fused: {dt / df:.1f}x")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

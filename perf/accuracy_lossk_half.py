"""Loss and gradient error of half-precision inputs, algenta next to PyTorch's own half paths.

The same bfloat16 (or float16) hidden states and head are given to algenta.torch (float32
accumulation, float32 logits, gradients rounded once to the half type), to PyTorch's
F.cross_entropy(F.linear(...)) on the half tensors (its half GEMM: logits rounded to the half
type), and to F.linear_cross_entropy; each is compared with a float64 computation on exactly the
same half values. Errors are relative: |loss - ref| / |ref| and max |grad - ref| / max |ref|.

    python perf/accuracy_lossk_half.py [--n 512 --d 1024 --v 32768 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import algenta.torch as at


def run(fn, x, w, t):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w, t)
    loss.float().backward()
    return loss.detach().double(), x.grad.double(), w.grad.double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.n, a.d, generator=g).to(dt)
    w = (torch.randn(a.v, a.d, generator=g) * (2.0 / math.sqrt(a.d))).to(dt)
    t = torch.randint(0, a.v, (a.n,), generator=g)
    ref = run(lambda x_, w_, t_: F.cross_entropy(F.linear(x_, w_), t_), x.double(), w.double(), t)
    rows = [("algenta.torch.linear_cross_entropy", lambda x_, w_, t_: at.linear_cross_entropy(
                x_, w_, t_)),
            ("torch F.cross_entropy(F.linear(...))", lambda x_, w_, t_: F.cross_entropy(
                F.linear(x_, w_), t_)),
            ("torch F.linear_cross_entropy", lambda x_, w_, t_: F.linear_cross_entropy(
                x_, w_, t_))]
    print(f"{a.dtype} inputs, n_tok={a.n} d_model={a.d} vocab={a.v}; errors relative to float64 "
          f"on the same {a.dtype} values (loss {float(ref[0]):.4f})")
    print(f"{'':40} {'loss dtype':>11} {'loss rel err':>13} {'d_input':>10} {'d_weight':>10}")
    for name, fn in rows:
        out = run(fn, x, w, t)
        errs = [abs(float(out[0] - ref[0])) / abs(float(ref[0]))] + [
            float((o - r).abs().max()) / float(r.abs().max()) for o, r in zip(out[1:], ref[1:])]
        ldt = fn(x, w, t).dtype
        print(f"{name:40} {str(ldt).replace('torch.', ''):>11} {errs[0]:13.2e} {errs[1]:10.2e} "
              f"{errs[2]:10.2e}")


if __name__ == "__main__":
    main()

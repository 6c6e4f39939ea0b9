"""Fused cross-entropy against the hardware limit, measured side by side in one process.

Reference: a bare GEMM of the same shape (NumPy's ``h @ w.T``, OpenBLAS; for bfloat16, torch's
bf16 ``h @ w.T``), which is the practical limit for the forward; forward + both gradients is
three such GEMMs. Also PyTorch's own CPU ``torch.nn.functional.linear_cross_entropy`` (2.13+)
and ``F.cross_entropy(F.linear(...))`` when torch is installed, and for bfloat16 inputs
``algenta.torch.linear_cross_entropy`` against torch's in bfloat16 (algenta's bf16 path is named:
bf16 dot products on AVX512-BF16 hosts, widening elsewhere). Every result is validated against
a float64 reference before timing. Reports the minimum of several interleaved runs and ratios
to the GEMM measured in the same rounds.

    python perf/bench_lossk.py [--n 512 --d 1024 --v 32768 --reps 5] [--options]

--options adds, in the same interleaved rounds, forward+backward with each option of the loss
(bias, soft cap, z-loss, class weights with label smoothing, next-token shift, token accuracy,
all of them, temperature, token weights, the entropy with its gradient) and with bfloat16 /
float16 inputs, each as a ratio to the plain float32 forward+backward (target: an option costs
at most 5%, the entropy at most 10%; half inputs no slower than float32).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import algenta
from _common import cpu_flags, cpu_name


def best_of(fns: dict, reps: int) -> dict:
    """Minimum wall time of each function over `reps` rounds. The functions run interleaved,
    one of each per round, so a burst of load on a shared machine hits the reference and the
    measured code alike instead of skewing their ratio."""
    for fn in fns.values():
        fn()  # warm-up: page faults, thread pools
    out = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k] = min(out[k], time.perf_counter() - t0)
    return out


OPTION_ROWS = (
    ("opt_bias", "f+b with a bias (and its gradient)"),
    ("opt_softcap", "f+b with softcap=30"),
    ("opt_zloss", "f+b with lse_square_scale=1e-4"),
    ("opt_weights", "f+b with class weights + smoothing 0.1"),
    ("opt_shift", "f+b with shift=1"),
    ("opt_accuracy", "f+b with return_accuracy"),
    ("opt_all", "f+b with all of the above"),
    ("opt_temperature", "f+b with temperature=0.7"),
    ("opt_token_weight", "f+b with token weights"),
    ("opt_entropy", "f+b with the entropy and its gradient"),
    ("opt_entropy_fwd", "forward with the entropy (x plain fwd)"),
    ("bf16_fwd", "forward, bfloat16 inputs"),
    ("bf16_fwd_bwd", "f+b, bfloat16 inputs (bf16 gradients)"),
    ("f16_fwd_bwd", "f+b, float16 inputs (f16 gradients)"),
)


def option_fns(h, w, t):
    """forward+backward with each option, validated against float64 first where it is cheap."""
    from algenta.lossk.cross_entropy import HalfBits

    lce = algenta.linear_cross_entropy
    n, v = h.shape[0], w.shape[0]
    rng = np.random.default_rng(1)
    b = rng.standard_normal(v).astype(h.dtype)
    cw = rng.uniform(0.5, 2.0, v)
    u = rng.uniform(0.0, 2.0, n)
    seq = 256 if n % 256 == 0 else n
    h3, t3 = h.reshape(-1, seq, h.shape[1]), t.reshape(-1, seq)

    def bits(a):
        u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    hb, wb = HalfBits(bits(h), "bfloat16"), HalfBits(bits(w), "bfloat16")
    hf, wf = h.astype(np.float16), w.astype(np.float16)
    # half inputs: the same loss as float32 on the rounded values, to float32 rounding
    exact = lce((hb.bits.astype(np.uint32) << 16).view(np.float32),
                (wb.bits.astype(np.uint32) << 16).view(np.float32), t).loss
    assert abs(float(lce(hb, wb, t).loss) - float(exact)) <= 1e-4 * max(1.0, abs(float(exact)))
    full = dict(bias=b, class_weight=cw, label_smoothing=0.1, softcap=30.0,
                lse_square_scale=1e-4, return_accuracy=True)
    return {
        "opt_bias": lambda: lce(h, w, t, bias=b, with_grad=True),
        "opt_softcap": lambda: lce(h, w, t, softcap=30.0, with_grad=True),
        "opt_zloss": lambda: lce(h, w, t, lse_square_scale=1e-4, with_grad=True),
        "opt_weights": lambda: lce(h, w, t, class_weight=cw, label_smoothing=0.1,
                                   with_grad=True),
        "opt_shift": lambda: lce(h3, w, t3, shift=1, with_grad=True),
        "opt_accuracy": lambda: lce(h, w, t, return_accuracy=True, with_grad=True),
        "opt_all": lambda: lce(h3, w, t3, shift=1, with_grad=True, **full),
        "opt_temperature": lambda: lce(h, w, t, temperature=0.7, with_grad=True),
        "opt_token_weight": lambda: lce(h, w, t, token_weight=u, with_grad=True),
        "opt_entropy": lambda: lce(h, w, t, return_entropy=True, grad_entropy=-0.01,
                                   with_grad=True),
        "opt_entropy_fwd": lambda: lce(h, w, t, return_entropy=True),
        "bf16_fwd": lambda: lce(hb, wb, t),
        "bf16_fwd_bwd": lambda: lce(hb, wb, t, with_grad=True),
        "f16_fwd_bwd": lambda: lce(hf, wf, t, with_grad=True),
    }


def bf16_row(torch, n, d, v, reps):
    """bfloat16 inputs: algenta.torch against torch's own bf16 loss and matmul, same tensors."""
    import torch.nn.functional as F

    import algenta.torch as at

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    # validate: the loss against float64 of the same bf16 values
    ref = float(F.cross_entropy(h.double() @ w.double().T, t))
    with torch.no_grad():
        got = float(at.linear_cross_entropy(h, w, t))
    assert abs(got - ref) <= 1e-4 * max(1.0, abs(ref)), (got, ref)

    def fb(fn):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(hh, ww, t).backward()

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn(h, w, t)
        return run

    fns = {"gemm": no_grad(lambda x, y, _: x @ y.T),
           "fwd": no_grad(at.linear_cross_entropy),
           "fwd_bwd": lambda: fb(at.linear_cross_entropy)}
    lce = getattr(F, "linear_cross_entropy", None)
    if lce is not None:
        fns["torch_lce_fwd"] = no_grad(lce)
        fns["torch_lce_fwd_bwd"] = lambda: fb(lce)
    return {"dtype": "bfloat16", **best_of(fns, reps)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--options", action="store_true",
                    help="time each option of the loss against plain float32 forward+backward")
    a = ap.parse_args()
    n, d, v = a.n, a.d, a.v
    try:
        if a.no_torch:
            raise ImportError
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        torch = None

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; flags: {cpu_flags()}")
    print(f"algenta kernels: {algenta._core.isa_name()}, bfloat16 path: {algenta._core.bf16_path()}")
    print(f"shape: n_tok={n} d_model={d} vocab={v}; min of {a.reps} runs\n")
    rows = []
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        h = rng.standard_normal((n, d)).astype(dtype)
        w = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(dtype)
        t = rng.integers(0, v, n)

        # validate first: the loss and d_hidden against a float64 NumPy reference
        r = algenta.linear_cross_entropy(h, w, t, with_grad=True)
        z = h.astype(np.float64) @ w.astype(np.float64).T
        m = z.max(1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(1))
        ref = float(np.mean(lse - z[np.arange(n), t]))
        tol = 1e-10 if dtype == np.float64 else algenta.lossk.contract.loss_tol_for(ref, d)
        assert abs(float(r.loss) - ref) <= tol, (r.loss, ref)
        g = np.exp(z - lse[:, None])
        g[np.arange(n), t] -= 1
        g /= n
        dh = g @ w.astype(np.float64)
        gtol = 1e-12 if dtype == np.float64 else 1e-6
        assert np.abs(r.d_hidden - dh).max() <= gtol * max(1.0, np.abs(dh).max())
        del z, g, dh

        fns = {
            "gemm": lambda: h @ w.T,
            "fwd": lambda: algenta.linear_cross_entropy(h, w, t),
            "fwd_bwd": lambda: algenta.linear_cross_entropy(h, w, t, with_grad=True),
        }
        if torch is not None:
            th = torch.from_numpy(h)
            tw = torch.from_numpy(w)
            tt = torch.from_numpy(t)
            lce = getattr(F, "linear_cross_entropy", None)

            def torch_fb(fn):
                hh = th.clone().requires_grad_(True)
                ww = tw.clone().requires_grad_(True)
                fn(hh, ww).backward()

            def no_grad(fn):
                def run():
                    with torch.no_grad():
                        fn()
                return run

            if lce is not None:
                with torch.no_grad():
                    tl = float(lce(th, tw, tt))
                assert abs(tl - ref) <= max(tol, 1e-5), (tl, ref)
                fns["torch_lce_fwd"] = no_grad(lambda: lce(th, tw, tt))
                fns["torch_lce_fwd_bwd"] = lambda: torch_fb(lambda x, y: lce(x, y, tt))
            fns["torch_gemm"] = no_grad(lambda: th @ tw.T)
            fns["torch_mat_fwd"] = no_grad(lambda: F.cross_entropy(F.linear(th, tw), tt))
            fns["torch_mat_fwd_bwd"] = lambda: torch_fb(
                lambda x, y: F.cross_entropy(F.linear(x, y), tt))
        if a.options and dtype == np.float32:
            fns.update(option_fns(h, w, t))
        row = {"dtype": np.dtype(dtype).name, **best_of(fns, a.reps)}
        rows.append(row)
    if torch is not None:
        rows.append(bf16_row(torch, n, d, v, a.reps))

    print(f"{'dtype':8} {'what':30} {'seconds':>9} {'x GEMM':>8}")
    for row in rows:
        bf = row["dtype"] == "bfloat16"
        for key, label in (("gemm", "bare GEMM h @ w.T (torch)" if bf else "bare GEMM h @ w.T (NumPy)"),
                           ("fwd", "algenta.torch forward" if bf else "algenta forward"),
                           ("fwd_bwd", "algenta.torch forward+backward" if bf else
                            "algenta forward+backward"),
                           ("torch_gemm", "bare GEMM h @ w.T (torch)"),
                           ("torch_lce_fwd", "torch linear_cross_entropy fwd"),
                           ("torch_lce_fwd_bwd", "torch linear_cross_entropy f+b"),
                           ("torch_mat_fwd", "torch CE(linear) fwd"),
                           ("torch_mat_fwd_bwd", "torch CE(linear) f+b")):
            if key in row:
                print(f"{row['dtype']:8} {label:30} {row[key]:9.4f} {row[key] / row['gemm']:8.2f}")
        print()
    if a.options:
        row = rows[0]
        print(f"options (float32 inputs unless named; n_tok={n}, seq 256 for the shift):")
        print(f"{'what':40} {'seconds':>9} {'x plain f+b':>12}")
        for key, label in OPTION_ROWS:
            base = row["fwd"] if key == "opt_entropy_fwd" else row["fwd_bwd"]
            print(f"{label:40} {row[key]:9.4f} {row[key] / base:12.3f}")
        print()
    for row in rows:
        verdict = [f"fwd {row['fwd'] / row['gemm']:.2f}x GEMM (target <= 1.15)",
                   f"fwd+bwd {row['fwd_bwd'] / row['gemm']:.2f}x GEMM (target <= 3.5)"]
        if "torch_gemm" in row:
            verdict.append(f"fwd+bwd {row['fwd_bwd'] / row['torch_gemm']:.2f}x torch's GEMM")
        if "torch_lce_fwd" in row:
            verdict.append(f"vs torch lce: fwd {row['torch_lce_fwd'] / row['fwd']:.2f}x faster, "
                           f"fwd+bwd {row['torch_lce_fwd_bwd'] / row['fwd_bwd']:.2f}x faster")
        print(row["dtype"] + ": " + "; ".join(verdict))


if __name__ == "__main__":
    main()

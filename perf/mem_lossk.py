"""Peak memory of the fused loss, each variant in a fresh subprocess.

Two scales. The seed's: 2048 tokens x 151,936 vocab (Qwen3), d_model 32, float64, chunk 256,
through the NumPy API, algenta.torch, and PyTorch's materialized
F.cross_entropy(F.linear(...)); plus every option at once (bias, class weights, label smoothing,
soft cap, z-loss, shift, accuracy; float64) and bfloat16 inputs, whose gradients accumulate in
float32 (the reference there is float32 gradients plus a float32 chunk). And a training step's:
512 tokens x 1,024 d_model x 151,936 vocab, float32, mean, default chunk, algenta.torch forward +
backward against PyTorch's.

The figure is the resident-set high-water mark above the inputs: the peak is reset
(/proc/self/clear_refs) once the inputs exist, so only what the call itself holds counts; it is
compared with what the call must hold: the gradients it returns plus one chunk of logits.

    python perf/mem_lossk.py
"""

from __future__ import annotations

import json
import subprocess
import sys

SEED_SCALE = dict(N=2048, D=32, V=151936, CHUNK=256, dtype="float64")
STEP_SCALE = dict(N=512, D=1024, V=151936, CHUNK=None, dtype="float32")

CHILD = r"""
import json, sys, numpy as np
N, D, V, CHUNK, DTYPE, what = %d, %d, %d, %r, %r, %r

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)

rng = np.random.default_rng(0)
h = rng.standard_normal((N, D)).astype(DTYPE)
w = (rng.standard_normal((V, D)) / np.sqrt(D)).astype(DTYPE)
t = rng.integers(0, V, N)
if what.startswith(("torch", "at_")):
    import torch, torch.nn.functional as F
    torch.set_num_threads(2)
    th, tw, tt = torch.from_numpy(h), torch.from_numpy(w), torch.from_numpy(t)
    if what.endswith("fwd_bwd"):
        th.requires_grad_(True); tw.requires_grad_(True)
if not what.startswith("torch"):
    import algenta
    algenta.linear_cross_entropy(h[:2], w[:300], t[:2] %% 300)  # load the module, spin up threads
if what.startswith("at_"):
    import algenta.torch as at
    # Warm up once at a tiny size: libtorch's code pages and the autograd engine's first-use
    # allocations are not the call's memory.
    x = torch.zeros(2, D, dtype=th.dtype, requires_grad=True)
    at.linear_cross_entropy(x, torch.zeros(300, D, dtype=th.dtype, requires_grad=True),
                            tt[:2] %% 300).backward()
if what == "bf16_fwd_bwd":
    from algenta.lossk.cross_entropy import HalfBits
    def bits(a):
        u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    h, w = HalfBits(bits(h), "bfloat16"), HalfBits(bits(w), "bfloat16")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak: only what the call holds counts from here
base = status("VmRSS:")
if what == "fwd":
    r = algenta.linear_cross_entropy(h, w, t, chunk=CHUNK)
    loss = float(r.loss)
elif what in ("fwd_bwd", "bf16_fwd_bwd"):
    r = algenta.linear_cross_entropy(h, w, t, chunk=CHUNK, with_grad=True)
    loss = float(r.loss)
elif what == "opts_fwd_bwd":
    b, cw = rng.standard_normal(V), rng.uniform(0.5, 2.0, V)
    r = algenta.linear_cross_entropy(h.reshape(8, N // 8, D), w, t.reshape(8, N // 8),
                                     chunk=CHUNK, with_grad=True, bias=b, class_weight=cw,
                                     label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4,
                                     shift=1, return_accuracy=True)
    loss = float(r.loss)
elif what == "at_fwd_bwd":
    out = at.linear_cross_entropy(th, tw, tt, chunk=CHUNK)
    out.backward()
    loss = float(out)
elif what == "torch_fwd":
    with torch.no_grad():
        loss = float(F.cross_entropy(F.linear(th, tw), tt))
else:
    out = F.cross_entropy(F.linear(th, tw), tt)
    out.backward()
    loss = float(out)
peak = status("VmHWM:")
print(json.dumps({"what": what, "extra_bytes": peak - base, "loss": loss}))
"""

LABEL = {"fwd": "algenta forward", "fwd_bwd": "algenta fwd+bwd",
         "opts_fwd_bwd": "algenta f+b, all options", "bf16_fwd_bwd": "algenta f+b, bf16 in",
         "at_fwd_bwd": "algenta.torch f+b", "torch_fwd": "torch CE(linear) fwd",
         "torch_fwd_bwd": "torch CE(linear) f+b"}


def run(what, sc):
    src = CHILD % (sc["N"], sc["D"], sc["V"], sc["CHUNK"], sc["dtype"], what)
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def table(sc, variants, same_loss):
    from algenta.lossk.contract import loss_max_chunk

    N, D, V = sc["N"], sc["D"], sc["V"]
    esz = 8 if sc["dtype"] == "float64" else 4
    chunk = sc["CHUNK"] or loss_max_chunk(N, V)
    chunk_bytes = chunk * V * esz
    grads = (N * D + V * D) * esz
    out = {v: run(v, sc) for v in variants}
    losses = [out[k]["loss"] for k in same_loss if k in out]
    tol = 1e-9 if esz == 8 else 1e-5
    assert max(losses) - min(losses) < tol, losses  # every variant computed the same loss
    mb = 1 / 1e6
    print(f"n_tok={N} vocab={V} d_model={D} {sc['dtype']} chunk={chunk}; loss {losses[0]:.9f}")
    print(f"one chunk of logits: {chunk_bytes * mb:.1f} MB; gradients: {grads * mb:.1f} MB; "
          f"materialized logits: {N * V * esz * mb:.1f} MB")
    ref = {"fwd": chunk_bytes, "torch_fwd": chunk_bytes, "opts_fwd_bwd": chunk_bytes + grads + V * esz,
           "bf16_fwd_bwd": (chunk_bytes + grads) * 4 // esz}
    print(f"{'variant':26} {'peak above inputs':>18} {'ratio':>8}  reference")
    for k, r in out.items():
        refname = "one chunk" if k.endswith("fwd") else "grads + one chunk"
        if k == "bf16_fwd_bwd":
            refname = "float32 grads + one float32 chunk"
        x = r["extra_bytes"] / ref.get(k, chunk_bytes + grads)
        print(f"{LABEL[k]:26} {r['extra_bytes'] * mb:15.1f} MB {x:8.2f}  {refname}")
    print()


def main():
    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    seed = ["fwd", "fwd_bwd", "opts_fwd_bwd", "bf16_fwd_bwd"]
    seed += ["at_fwd_bwd", "torch_fwd", "torch_fwd_bwd"] if has_torch else []
    table(SEED_SCALE, seed, ["fwd", "fwd_bwd", "at_fwd_bwd", "torch_fwd", "torch_fwd_bwd"])
    if has_torch:
        table(STEP_SCALE, ["fwd_bwd", "at_fwd_bwd", "torch_fwd_bwd"],
              ["fwd_bwd", "at_fwd_bwd", "torch_fwd_bwd"])


if __name__ == "__main__":
    main()

"""Peak memory of the fused loss at the seed's scale, each variant in a fresh subprocess.

2048 tokens x 151,936 vocab (Qwen3), d_model 32, float64, chunk 256. The figure is the
resident-set high-water mark above the inputs: the peak is reset (/proc/self/clear_refs) once
the inputs exist, so only what the call itself holds counts. Compared with one chunk of logits
(256 x 151,936 x 8 bytes = 311 MB), with the gradients it must return, and with PyTorch's
materialized F.cross_entropy(F.linear(...)) when torch is installed. Two more variants: every
option at once (bias, class weights, label smoothing, soft cap, z-loss, shift, accuracy;
float64), and bfloat16 inputs, whose gradients accumulate in float32 (the reference there is
float32 gradients plus a float32 chunk).

    python perf/mem_lossk.py
"""

from __future__ import annotations

import json
import subprocess
import sys

N, D, V, CHUNK = 2048, 32, 151936, 256

CHILD = r"""
import json, sys, numpy as np
N, D, V, CHUNK, what = %d, %d, %d, %d, %r

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)

rng = np.random.default_rng(0)
h = rng.standard_normal((N, D))
w = rng.standard_normal((V, D)) / np.sqrt(D)
t = rng.integers(0, V, N)
if what.startswith("torch"):
    import torch, torch.nn.functional as F
    torch.set_num_threads(2)
    th, tw, tt = torch.from_numpy(h), torch.from_numpy(w), torch.from_numpy(t)
    if what == "torch_fwd_bwd":
        th.requires_grad_(True); tw.requires_grad_(True)
else:
    import algenta
    algenta.linear_cross_entropy(h[:2], w[:300], t[:2] %% 300)  # load the module, spin up threads
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
elif what == "fwd_bwd":
    r = algenta.linear_cross_entropy(h, w, t, chunk=CHUNK, with_grad=True)
    loss = float(r.loss)
elif what == "opts_fwd_bwd":
    b, cw = rng.standard_normal(V), rng.uniform(0.5, 2.0, V)
    r = algenta.linear_cross_entropy(h.reshape(8, N // 8, D), w, t.reshape(8, N // 8),
                                     chunk=CHUNK, with_grad=True, bias=b, class_weight=cw,
                                     label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4,
                                     shift=1, return_accuracy=True)
    loss = float(r.loss)
elif what == "bf16_fwd_bwd":
    r = algenta.linear_cross_entropy(h, w, t, chunk=CHUNK, with_grad=True)
    loss = float(r.loss)
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


def run(what):
    res = subprocess.run([sys.executable, "-c", CHILD % (N, D, V, CHUNK, what)],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    chunk_bytes = CHUNK * V * 8
    grads = (N * D + V * D) * 8
    try:
        import torch  # noqa: F401
        variants = ["fwd", "fwd_bwd", "opts_fwd_bwd", "bf16_fwd_bwd", "torch_fwd", "torch_fwd_bwd"]
    except ImportError:
        variants = ["fwd", "fwd_bwd", "opts_fwd_bwd", "bf16_fwd_bwd"]
    out = {v: run(v) for v in variants}
    losses = [r["loss"] for k, r in out.items() if k not in ("opts_fwd_bwd", "bf16_fwd_bwd")]
    assert max(losses) - min(losses) < 1e-9, losses  # every variant computed the same loss
    mb = 1 / 1e6
    print(f"n_tok={N} vocab={V} d_model={D} float64 chunk={CHUNK}; loss {losses[0]:.12f}")
    print(f"one chunk of logits: {chunk_bytes * mb:.1f} MB; gradients: {grads * mb:.1f} MB; "
          f"materialized logits: {N * V * 8 * mb:.1f} MB\n")
    print(f"{'variant':26} {'peak above inputs':>18} {'ratio':>8}  reference")
    ref = {"fwd": chunk_bytes, "fwd_bwd": chunk_bytes + grads,
           "opts_fwd_bwd": chunk_bytes + grads + V * 8,
           "bf16_fwd_bwd": chunk_bytes // 2 + grads // 2,
           "torch_fwd": chunk_bytes, "torch_fwd_bwd": chunk_bytes + grads}
    label = {"fwd": "algenta forward", "fwd_bwd": "algenta fwd+bwd",
             "opts_fwd_bwd": "algenta f+b, all options", "bf16_fwd_bwd": "algenta f+b, bf16 in",
             "torch_fwd": "torch CE(linear) fwd", "torch_fwd_bwd": "torch CE(linear) f+b"}
    for k, r in out.items():
        refname = "one chunk" if k.endswith("fwd") else "grads + one chunk"
        if k == "bf16_fwd_bwd":
            refname = "float32 grads + one float32 chunk"
        print(f"{label[k]:26} {r['extra_bytes'] * mb:15.1f} MB {r['extra_bytes'] / ref[k]:8.2f}  {refname}")


if __name__ == "__main__":
    main()

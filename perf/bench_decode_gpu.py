"""CUDA decode of the resident session against the HBM roofline, measured in the same run.

One random Qwen3 model (ResidentSession.random_weights: N(0, 1/fan_in) projections, N(0, 1)
embedding, tied head) is opened on the CUDA engine. Validated before any timing against the CPU
engine on the same weights (itself pinned to transformers by tests/test_residentk_transformers.py
and perf/bench_decode_cpu.py): prefill logits within 1e-4 x max(1, max |logit|), and --check
greedy tokens identical (the GPU's argmax formed on the device).

- decode tokens/s: greedy steps with the argmax on the device (one id copied back per token),
  timed over --new - 1 steps after the prompt, the minimum time of --reps runs. The run passes
  32 keys, so it times the standard and the split-K attention path; the logits-returning `step`
  is reported too.
- roofline: float32 weight bytes one decode token must read (every layer matrix and norm, the
  final norm and the head; the embedding row and the KV cache are left out, so the roofline is
  generous) divided into the device-to-device copy bandwidth measured in the same run
  (algenta._core.session.cuda_copy_bandwidth: best of several cudaMemcpy's of a 1 GiB buffer,
  read + write bytes counted). Target: >= 50% of it.

    python perf/bench_decode_gpu.py [--layers 28 --vocab 151936 --new 128 --reps 5]

Defaults are Qwen3-0.6B's shape (d_model 1024, 16/8 heads of 128, d_ff 3072, 28 layers, vocab
151,936, tied): 2.4 GB of float32 weights. Without the ALGENTA_GPU=ON build or without a usable
CUDA device it prints why and exits 0 having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from _common import add_model_shape_args
from algenta import _core
from algenta.residentk.session import ResidentSession, random_weights


def weight_bytes_per_token(c) -> int:
    D, Hq, Hkv, Dh, F, L, V = (c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab)
    per_layer = D * (Hq + 2 * Hkv) * Dh + Hq * Dh * D + 3 * D * F + 2 * D + 2 * Dh
    return 4 * (L * per_layer + D + V * D)


def gpu_name():
    try:  # a label for the report only; the measurements never depend on it
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def unavailable_reason():
    b = _core.session.cuda_backend()
    if b["kind"] == "none":
        return ("this algenta build has no CUDA backend (rebuild with "
                "-Ccmake.define.ALGENTA_GPU=ON)")
    if b["kind"] == "emulator":
        return ("this algenta build runs its CUDA kernels on the CPU emulator (ALGENTA_CUDA_EMU): "
                "nothing to time against a GPU's memory bandwidth")
    if not b["usable"]:
        return f"no usable CUDA device on this host: {b['why']}"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(ap, new_default=128, reps_default=5)
    ap.add_argument("--check", type=int, default=16, help="greedy tokens checked against the CPU")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args()

    why = unavailable_reason()
    if why is not None:
        msg = f"bench_decode_gpu: nothing measured: {why}"
        print(json.dumps({"skipped": msg}) if args.json else msg)
        return 0

    cfg = dict(d_model=args.d_model, h_q=args.h_q, h_kv=args.h_kv, d_head=args.d_head,
               d_ff=args.d_ff, n_layers=args.layers, vocab=args.vocab, rms_eps=1e-6,
               rope_theta=1e6, tie_word_embeddings=True)
    max_ctx = args.prompt + max(args.new, args.check) + 1
    prompt = np.random.default_rng(0).integers(0, args.vocab, args.prompt).tolist()

    # ---- validate against the CPU engine on the same weights -----------------------------------
    w = dict(random_weights(cfg, 0))
    cpu = ResidentSession(cfg, w, max_ctx=max_ctx, device="cpu")
    gpu = ResidentSession(cfg, w, max_ctx=max_ctx, device="cuda")
    del w
    want = cpu.prefill(prompt)
    got = gpu.prefill(prompt)
    scale = float(np.abs(want).max())
    dev = float(np.abs(got - want).max())
    assert dev <= 1e-4 * max(1.0, scale), f"prefill logits deviate by {dev} (max {scale})"
    ids_cpu = cpu.generate(prompt, args.check)
    del cpu
    ids_gpu = gpu.generate(prompt, args.check)
    assert ids_gpu == ids_cpu, f"greedy tokens differ: cuda {ids_gpu} vs cpu {ids_cpu}"

    # ---- time -----------------------------------------------------------------------------------
    greedy = gpu._engine.step_greedy

    def decode_greedy():
        gpu.reset()
        t = int(np.argmax(gpu.prefill(prompt)))
        t0 = time.perf_counter()
        for _ in range(args.new - 1):
            t = greedy(t)
        return time.perf_counter() - t0

    def decode_logits():
        gpu.reset()
        t = int(np.argmax(gpu.prefill(prompt)))
        t0 = time.perf_counter()
        for _ in range(args.new - 1):
            t = int(np.argmax(gpu.step(t)))
        return time.perf_counter() - t0

    bw_bytes = 1 << 30
    bw = _core.session.cuda_copy_bandwidth(bw_bytes, 10)
    decode_greedy()  # warm-up
    t_greedy = min(decode_greedy() for _ in range(args.reps))
    t_logits = min(decode_logits() for _ in range(args.reps))
    bw = max(bw, _core.session.cuda_copy_bandwidth(bw_bytes, 10))
    n_keys_last = args.prompt + args.new - 1
    L = args.layers
    want_disp = (_core.residentk.residentk_dispatch_budget_deep(L)
                 if _core.residentk.residentk_splitk_should_split(n_keys_last)
                 else _core.residentk.residentk_dispatch_budget(L))
    assert gpu.dispatches_per_token == want_disp, (gpu.dispatches_per_token, want_disp)

    wb = weight_bytes_per_token(gpu.config)
    roof = bw / wb
    tps = (args.new - 1) / t_greedy
    res = {
        "gpu": gpu_name(), "shape": dict(gpu.config), "weight_bytes_per_token": wb,
        "d2d_copy_bandwidth_GBs": bw / 1e9, "roofline_tok_s": roof,
        "greedy_tok_s": tps, "fraction_of_roofline": tps / roof,
        "step_logits_tok_s": (args.new - 1) / t_logits,
        "dispatches_per_token": gpu.dispatches_per_token,
        "max_prefill_logit_dev_vs_cpu": dev, "max_abs_logit": scale,
        "target_met": tps / roof >= 0.5,
    }
    if args.json:
        print(json.dumps(res))
        return 0
    c = gpu.config
    print(f"{res['gpu']}")
    print(f"Qwen3 shape D={c.d_model} Hq={c.h_q} Hkv={c.h_kv} Dh={c.d_head} F={c.d_ff} "
          f"L={c.n_layers} V={c.vocab}: {wb / 1e9:.3f} GB float32 weights per token, "
          f"{res['dispatches_per_token']} launches/token at {n_keys_last} keys")
    print(f"validated: prefill logits within {dev:.2e} of the CPU engine's (max |logit| "
          f"{scale:.1f}), {args.check} greedy tokens identical")
    print(f"d2d copy bandwidth (read+write)  {bw / 1e9:8.1f} GB/s -> roofline {roof:8.1f} tok/s")
    print(f"greedy decode, device argmax     {tps:8.1f} tok/s  "
          f"({100 * res['fraction_of_roofline']:.1f}% of roofline; target 50%)")
    print(f"step + logits copied back        {res['step_logits_tok_s']:8.1f} tok/s")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

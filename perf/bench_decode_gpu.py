"""CUDA decode of the resident session against the HBM roofline, measured in the same run.

One random Qwen3 model (ResidentSession.random_weights: N(0, 1/fan_in) projections, N(0, 1)
embedding, tied head) is opened on the CUDA engine once per (weights, kv) format pair of
--formats. Each is validated before any timing against the CPU engine on the same weights at the
same formats (itself pinned to transformers by tests/test_residentk_transformers.py and
perf/bench_decode_cpu.py): prefill logits within the per-format bound of
tests/test_residentk_cuda.py (1e-4 for f32 and f16, 2^-7 for bf16, times max(1, max |logit|)),
and --check greedy tokens identical (the GPU's argmax formed on the device). int8 is held to the
float32 engine instead: both engines quantize each activation row by the same rule, but a value
an ulp apart in float32 (another summation order) can round to the next int8 code, and over 28
random layers those flips reach about 1% of the largest logit between the engines (seen on the
emulator, whose kernels are the device's: 2.3 at max |logit| 226, while each engine is 4.2-4.6
from float32). So the CUDA engine's int8 logits must be no farther from the float32 engine's
than 1.5x the CPU engine's int8 logits are, and its greedy tokens are reported, not required
to match.

- decode tokens/s: greedy steps with the argmax on the device (one id copied back per token),
  timed over --new - 1 steps after the prompt, the minimum time of --reps runs. The run passes
  32 keys, so it times the standard and the split-K attention path; the logits-returning `step`
  is reported too.
- roofline: the weight bytes one decode token must read in the format (every matrix once, the
  head whole and one embedding row, the norms: algenta.traffic.weight_bytes; the KV cache is
  left out, so the roofline is generous) divided into the device-to-device copy bandwidth
  measured in the same run (algenta._core.session.cuda_copy_bandwidth: best of several
  cudaMemcpy's of a 1 GiB buffer, read + write bytes counted). Target: >= 75% of it for bf16
  weights (issue 24), >= 50% for the others.

- batched decode (--batch 1,2,4,8,16): B sequences of one session of slots stepped together
  (step_batch, the logits of all B copied back each step), aggregate tokens/s and the ratio to
  B = 1, after checking each batch row bit-identical to that sequence stepped alone.

    python perf/bench_decode_gpu.py [--formats f32:f32,bf16:f32,...] [--layers 28 --new 128]
                                    [--batch 1,2,4,8,16]

Defaults are Qwen3-0.6B's shape (d_model 1024, 16/8 heads of 128, d_ff 3072, 28 layers, vocab
151,936, tied): 2.4 GB of float32 weights, 1.2 GB in bf16. Without the ALGENTA_GPU=ON build or without a usable
CUDA device it prints why and exits 0 having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from _common import add_model_shape_args
from algenta import _core
from algenta.residentk.session import ResidentSession, random_weights
from algenta.traffic import weight_bytes

FORMATS = "f32:f32,bf16:f32,f16:f32,int8:f32,bf16:bf16"
# |cuda - cpu| per format, times max(1, max |logit|): tests/test_residentk_cuda.py's bounds
TOL = {"f32": 1e-4, "f16": 1e-4, "bf16": 2.0 ** -7, "int8": 1.0 / 127}
KV_TOL = {"f32": 0.0, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}
TARGET = {"bf16": 0.75}  # fraction of the roofline; 0.5 for the other formats


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


def bench(cfg, w, weights, kv, args, bw):
    """One format pair: validated against the CPU engine, then timed."""
    max_ctx = args.prompt + max(args.new, args.check) + 1
    prompt = np.random.default_rng(0).integers(0, args.vocab, args.prompt).tolist()
    cpu = ResidentSession(cfg, w, max_ctx=max_ctx, device="cpu", weights=weights, kv=kv)
    gpu = ResidentSession(cfg, w, max_ctx=max_ctx, device="cuda", weights=weights, kv=kv)
    want = cpu.prefill(prompt)
    got = gpu.prefill(prompt)
    scale = float(np.abs(want).max())
    dev = float(np.abs(got - want).max())
    if weights == "int8":  # against float32 (the docstring says why)
        ref = ResidentSession(cfg, w, max_ctx=max_ctx, device="cpu", kv=kv).prefill(prompt)
        dev_cpu, dev_gpu = (float(np.abs(x - ref).max()) for x in (want, got))
        assert dev_gpu <= max(1.5 * dev_cpu, TOL["f32"] * max(1.0, scale)), \
            f"int8/{kv}: {dev_gpu} from float32's logits, the CPU engine's int8 {dev_cpu}"
    else:
        tol = max(TOL[weights], KV_TOL[kv]) * max(1.0, scale)
        assert dev <= tol, f"{weights}/{kv}: prefill logits deviate by {dev} (max {scale})"
    ids_cpu = cpu.generate(prompt, args.check)
    del cpu
    ids_gpu = gpu.generate(prompt, args.check)
    same = sum(a == b for a, b in zip(ids_gpu, ids_cpu))
    assert ids_gpu == ids_cpu or weights == "int8", \
        f"{weights}/{kv}: greedy tokens differ: {ids_gpu} vs {ids_cpu}"
    print(f"{weights}/{kv}: prefill logits {dev:.3g} from the CPU engine's (max |logit| "
          f"{scale:.3g}); greedy tokens {same}/{len(ids_cpu)} equal", file=sys.stderr, flush=True)

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

    decode_greedy()  # warm-up
    t_greedy = min(decode_greedy() for _ in range(args.reps))
    t_logits = min(decode_logits() for _ in range(args.reps))
    n_keys_last = args.prompt + args.new - 1
    L = args.layers
    want_disp = (_core.residentk.residentk_dispatch_budget_deep(L)
                 if _core.residentk.residentk_splitk_should_split(n_keys_last)
                 else _core.residentk.residentk_dispatch_budget(L))
    assert gpu.dispatches_per_token == want_disp, (gpu.dispatches_per_token, want_disp)
    wb = weight_bytes(gpu)
    roof = bw / wb
    tps = (args.new - 1) / t_greedy
    return {
        "weights": weights, "kv": kv, "weight_bytes_per_token": wb, "roofline_tok_s": roof,
        "greedy_tok_s": tps, "fraction_of_roofline": tps / roof,
        "step_logits_tok_s": (args.new - 1) / t_logits,
        "dispatches_per_token": gpu.dispatches_per_token,
        "max_prefill_logit_dev_vs_cpu": dev, "max_abs_logit": scale, "greedy_equal": same,
        "target": TARGET.get(weights, 0.5), "target_met": tps / roof >= TARGET.get(weights, 0.5),
    }


def bench_batch(cfg, w, weights, kv, args):
    """Aggregate decode tokens/s of B sequences stepped together, per B of --batch."""
    sizes = [int(b) for b in args.batch.split(",")]
    max_ctx = args.prompt + args.new + 1
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, args.vocab, args.prompt).tolist() for _ in range(max(sizes))]
    s = ResidentSession(cfg, w, max_ctx=max_ctx, device="cuda", weights=weights, kv=kv,
                        slots=max(sizes))
    # the rows are the lone bits: two sequences alone and then together
    alone = []
    for k in (0, 1):
        s.truncate(0, slot=k)
        s.prefill(prompts[k], slot=k)
        alone.append(s.step(5, slot=k))
    for k in (0, 1):
        s.truncate(0, slot=k)
        s.prefill(prompts[k], slot=k)
    both = s.step_batch([1, 0], [5, 5])
    assert np.array_equal(both[0], alone[1]) and np.array_equal(both[1], alone[0]), \
        f"{weights}/{kv}: a batch row differs from the sequence stepped alone"

    def run(B):
        for k in range(B):
            s.truncate(0, slot=k)
            s.prefill(prompts[k], slot=k)
        toks = [int(t) for t in rng.integers(0, args.vocab, B)]
        slots = list(range(B))
        t0 = time.perf_counter()
        for _ in range(args.new - 1):
            logits = s.step_batch(slots, toks)
            toks = [int(t) for t in np.argmax(logits, axis=1)]
        return time.perf_counter() - t0

    out = {}
    for B in sizes:
        run(B)  # warm-up
        out[B] = B * (args.new - 1) / min(run(B) for _ in range(args.reps))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(ap, new_default=128, reps_default=5)
    ap.add_argument("--check", type=int, default=16, help="greedy tokens checked against the CPU")
    ap.add_argument("--formats", default=FORMATS, help="weights:kv pairs, comma-separated")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    ap.add_argument("--batch", default="", metavar="B,B,...",
                    help="also time B sequences stepped together (e.g. 1,2,4,8,16)")
    args = ap.parse_args()

    why = unavailable_reason()
    if why is not None and "emulator" in why and args.batch and \
            os.environ.get("ALGENTA_BENCH_SMOKE") == "1":
        why = None  # the script itself, smoke-tested on the emulator: its figures mean nothing
    if why is not None:
        msg = f"bench_decode_gpu: nothing measured: {why}"
        print(json.dumps({"skipped": msg}) if args.json else msg)
        return 0

    cfg = dict(d_model=args.d_model, h_q=args.h_q, h_kv=args.h_kv, d_head=args.d_head,
               d_ff=args.d_ff, n_layers=args.layers, vocab=args.vocab, rms_eps=1e-6,
               rope_theta=1e6, tie_word_embeddings=True)
    w = dict(random_weights(cfg, 0))
    bw_bytes = 1 << 30
    bw = _core.session.cuda_copy_bandwidth(bw_bytes, 10)
    rows = []
    for pair in args.formats.split(","):
        weights, kv = pair.split(":")
        rows.append(bench(cfg, w, weights, kv, args, bw))
        if args.batch:
            rows[-1]["batch_tok_s"] = bench_batch(cfg, w, weights, kv, args)
        r = rows[-1]  # as it comes, on stderr: a run cut short keeps what it measured
        print(f"{weights}/{kv}: greedy {r['greedy_tok_s']:.1f} tok/s, +logits "
              f"{r['step_logits_tok_s']:.1f}, batched {r.get('batch_tok_s', {})}",
              file=sys.stderr, flush=True)
        bw = max(bw, _core.session.cuda_copy_bandwidth(bw_bytes, 10))
    for r in rows:  # against the best bandwidth any point of the run saw
        r["roofline_tok_s"] = bw / r["weight_bytes_per_token"]
        r["fraction_of_roofline"] = r["greedy_tok_s"] / r["roofline_tok_s"]
        r["target_met"] = r["fraction_of_roofline"] >= r["target"]
    res = {"gpu": gpu_name(), "shape": cfg, "d2d_copy_bandwidth_GBs": bw / 1e9, "formats": rows}
    if args.json:
        print(json.dumps(res))
        return 0
    c = cfg
    print(f"{res['gpu']}: d2d copy bandwidth (read+write) {bw / 1e9:.1f} GB/s")
    print(f"Qwen3 shape D={c['d_model']} Hq={c['h_q']} Hkv={c['h_kv']} Dh={c['d_head']} "
          f"F={c['d_ff']} L={c['n_layers']} V={c['vocab']}, prompt {args.prompt}, "
          f"{args.new} new tokens, best of {args.reps}")
    print(f"{'weights':>7} {'kv':>4} {'GB/token':>9} {'roofline':>9} {'greedy':>9} {'share':>6} "
          f"{'target':>6} {'+logits':>9} {'dev vs cpu':>10}")
    for r in rows:
        print(f"{r['weights']:>7} {r['kv']:>4} {r['weight_bytes_per_token'] / 1e9:>9.3f} "
              f"{r['roofline_tok_s']:>9.1f} {r['greedy_tok_s']:>9.1f} "
              f"{100 * r['fraction_of_roofline']:>5.1f}% {100 * r['target']:>5.0f}% "
              f"{r['step_logits_tok_s']:>9.1f} {r['max_prefill_logit_dev_vs_cpu']:>10.2e}")
    print(f"(tok/s; greedy: argmax on the device; +logits: the logits copied back each step; "
          f"{args.check} greedy tokens identical to the CPU engine's in every format but int8, "
          f"whose count is on stderr)")
    if args.batch:
        sizes = list(rows[0]["batch_tok_s"])
        print("batched decode, aggregate tok/s (the logits of every row copied back each step):")
        print(f"{'weights':>7} {'kv':>4} " + " ".join(f"{'B=' + str(b):>9}" for b in sizes)
              + f" {'top/B=1':>8}")
        for r in rows:
            t = r["batch_tok_s"]
            print(f"{r['weights']:>7} {r['kv']:>4} " + " ".join(f"{t[b]:>9.1f}" for b in sizes)
                  + f" {t[sizes[-1]] / t[sizes[0]]:>7.2f}x")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

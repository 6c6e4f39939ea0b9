"""Training steps of a HuggingFace Qwen3 model, stock against algenta.transformers.apply_fused_loss:
step time and peak resident memory above setup, side by side.

The model is Qwen3-shaped and small enough for a CPU (default hidden 256, 2 layers, GQA 4/2
heads of 64, tied embeddings) but keeps the real 151,936-token vocabulary, so the output
projection and its logits dominate as they do in the real model. Both variants train on the same
random batch (ragged: the tail of every other sequence is padding, labels -100 there) with the
same seed and AdamW.

What is measured: each variant runs in a fresh Python subprocess. After setup (imports, model,
data, optimizer) one warm-up step runs, so AdamW's state exists and allocator caches are warm;
then the resident-set high-water mark is reset (writing 5 to /proc/self/clear_refs) and the
timed steps run. "peak above setup" is VmHWM after the steps minus VmRSS at the reset: how far
the training steps pushed resident memory (allocator caches included; Linux-only). Step time is
the minimum and the median over the timed steps. The loss curves (warm-up included) are validated
first: the two variants must agree to float32 rounding or nothing is reported.

The analytic sizes printed beside the figures explain them: the stock step holds the
[tokens, vocab] float32 logits, their log-softmax and their gradient; the fused step holds one
chunk of logits (`--chunk` tokens, default the kernel's logit budget) and the head's gradient.

    python perf/train_hf.py                                   # defaults: 2 x 512 tokens, 4 steps
    python perf/train_hf.py --batch 2 --seq 64 --steps 2      # smallest: proves the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status (this measurement is Linux-only)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _train(args) -> dict:
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        tie_word_embeddings=not args.untied, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = transformers.Qwen3ForCausalLM(cfg).train()
    if args.run == "fused":
        import algenta.transformers

        algenta.transformers.apply_fused_loss(model, chunk=args.chunk)

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, args.seq * 3 // 4:] = 0  # ragged: every other sequence ends early
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        return out

    out = step()  # warm-up: AdamW state, allocator caches
    curve = [float(out.loss)]
    logits_returned = out.logits is not None
    del out
    _reset_peak()
    base = _status_kib("VmRSS:")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        curve.append(float(out.loss))
        del out
    return {"run": args.run, "curve": curve, "times": times, "base_kib": base,
            "peak_kib": _status_kib("VmHWM:"), "logits_returned": logits_returned}


def _child(args, run: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", run]
    for k, v in vars(args).items():
        if k == "run" or v is None or v is False:
            continue
        cmd.append(f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"the {run} run failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--untied", action="store_true", help="separate lm_head (Qwen3 >= 4B)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per pass of the fused loss")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", choices=("stock", "fused"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        print(json.dumps(_train(args)))
        return

    n_tok, v = args.batch * args.seq, args.vocab
    print(f"Qwen3-shaped: vocab={v} hidden={args.hidden} layers={args.layers} "
          f"heads={args.heads}/{args.kv_heads}x{args.head_dim} "
          f"{'untied' if args.untied else 'tied'}; batch {args.batch} x {args.seq} tokens, "
          f"float32, AdamW; 1 warm-up + {args.steps} timed steps; fused chunk="
          f"{args.chunk or 'default'}")
    res = {r: _child(args, r) for r in ("stock", "fused")}
    st, fu = res["stock"], res["fused"]

    # Validate first: figures for a loss that does not match would mean nothing.
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(fu["curve"], st["curve"]))
    print(f"\n{'step':>4}  {'stock':>10}  {'fused':>10}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(st["curve"], fu["curve"])):
        print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    ok = worst < 1e-4 and st["logits_returned"] and not fu["logits_returned"]
    print(f"max relative difference: {worst:.2e} ({'agree' if ok else 'DISAGREE'}); "
          f"logits returned: stock {st['logits_returned']}, fused {fu['logits_returned']}")
    if not ok:
        sys.exit(1)

    mib = 2.0 ** 20
    logits = n_tok * v * 4 / mib
    print(f"\nanalytic: [tokens, vocab] float32 logits = {logits:.1f} MiB (the stock step also "
          f"holds their log-softmax and gradient); head weight (and its gradient) = "
          f"{v * args.hidden * 4 / mib:.1f} MiB")
    print(f"{'variant':>8}  {'s/step min':>10}  {'s/step median':>13}  {'peak above setup':>16}")
    for r in ("stock", "fused"):
        x = res[r]
        print(f"{r:>8}  {min(x['times']):>10.3f}  {statistics.median(x['times']):>13.3f}  "
              f"{(x['peak_kib'] - x['base_kib']) / 1024:>12.1f} MiB")
    ds = st["peak_kib"] - st["base_kib"]
    df = fu["peak_kib"] - fu["base_kib"]
    print(f"stock / fused: time {min(st['times']) / min(fu['times']):.2f}x, "
          f"peak memory {ds / df:.2f}x" if df > 0 else "fused peak above setup: 0")


if __name__ == "__main__":
    main()

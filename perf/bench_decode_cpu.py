"""CPU decode of the resident session against HuggingFace transformers and the memory roofline,
measured side by side in one process.

One random Qwen3 checkpoint (transformers' Qwen3ForCausalLM with O(1)-scale random weights,
written with save_pretrained in float32) is loaded both ways: algenta through
ResidentSession.from_pretrained, transformers as the in-memory eager model. Validated before any
timing: prefill logits agree within 1e-4 and the greedy tokens are identical.

- decode tokens/s: algenta, timed over `step` calls; transformers, (N - 1) new tokens of eager
  greedy `generate` (N new tokens minus a 1-token generate, which is its prefill), both after the
  same prompt. The minimum time of --reps interleaved runs each.
- roofline: float32 weight bytes one decode token must read (every layer matrix and norm, the
  final norm and the head; the embedding row is noise) divided into the all-core streaming read
  bandwidth, measured in the same run by algenta._core.session.cpu_read_bandwidth (the same SIMD
  loads and thread layout the matvec uses, best of several passes over a 1 GiB buffer).

    python perf/bench_decode_cpu.py [--layers 28 --vocab 151936 --new 32 --reps 3]

Defaults are Qwen3-0.6B's shape (d_model 1024, 16/8 heads of 128, d_ff 3072, 28 layers, vocab
151,936, tied): 2.4 GB of float32 weights. Without transformers only the roofline is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from _common import add_model_shape_args, cpu_name
from algenta import _core
from algenta.residentk.session import ResidentSession


def weight_bytes_per_token(c) -> int:
    D, Hq, Hkv, Dh, F, L, V = (c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab)
    per_layer = D * (Hq + 2 * Hkv) * Dh + Hq * Dh * D + 3 * D * F + 2 * D + 2 * Dh
    return 4 * (L * per_layer + D + V * D)


def make_hf(args, path):
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
        num_hidden_layers=args.layers, num_attention_heads=args.h_q,
        num_key_value_heads=args.h_kv, head_dim=args.d_head, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1e6,
        attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device("cpu"):
        m = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # O(1) logits, so the token comparison below is meaningful
        for name, p in m.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    m.save_pretrained(path)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(ap, new_default=32, reps_default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args()

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, args.prompt).tolist()
    bw_bytes = 1 << 30

    with tempfile.TemporaryDirectory() as tmp:
        if torch is not None:
            hf = make_hf(args, tmp)
            s = ResidentSession.from_pretrained(tmp, max_ctx=args.prompt + args.new + 1,
                                                progress=False)
        else:
            hf = None
            s = ResidentSession.random(args.d_model, args.h_q, args.h_kv, args.d_head, args.d_ff,
                                       args.layers, args.vocab, max_ctx=args.prompt + args.new + 1)

    # ---- validate ---------------------------------------------------------------------------
    budget = _core.residentk.residentk_dispatch_budget(args.layers)
    ours = s.generate(prompt, args.new)
    assert s.dispatches_per_token == budget, (s.dispatches_per_token, budget)
    dev = scale = None
    if hf is not None:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want = hf(ids).logits[0, -1].numpy()
            s.reset()
            dev = float(np.abs(s.prefill(prompt) - want).max())
            scale = float(np.abs(want).max())
            # float32 against float32: the tolerance scales with the logits (a tied head over
            # N(0, 1) embeddings gives logits of order sqrt(d_model)).
            assert dev <= 1e-5 * max(1.0, scale), f"prefill logits deviate by {dev} (max {scale})"
            out = hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        theirs = out[0, args.prompt:].tolist()
        assert ours == theirs, "greedy tokens differ from transformers"

    # ---- time -----------------------------------------------------------------------------------
    def ours_decode():
        s.reset()
        logits = s.prefill(prompt)
        t = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(args.new - 1):
            t = int(np.argmax(s.step(t)))
        return time.perf_counter() - t0

    def hf_generate(n):
        with torch.no_grad():
            t0 = time.perf_counter()
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, eos_token_id=None)
            return time.perf_counter() - t0

    # Interleaved repetitions (bandwidth, algenta, transformers, again...): on a machine shared
    # with other work all three see the same conditions, and the minimum time of each is kept.
    ours_decode()  # warm-ups: page faults, thread pools
    if hf is not None:
        hf_generate(2)
    bws, t_ours, t_hf = [], [], []
    for _ in range(args.reps):
        bws.append(_core.session.cpu_read_bandwidth(bw_bytes, 3))
        t_ours.append(ours_decode())
        if hf is not None:
            t_hf.append(hf_generate(args.new) - hf_generate(1))
    bw = max(bws)
    ours_tps = (args.new - 1) / min(t_ours)
    hf_tps = (args.new - 1) / min(t_hf) if t_hf else None
    wb = weight_bytes_per_token(s.config)
    roof_tps = bw / wb

    res = {
        "cpu": cpu_name(), "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count(),
        "isa": _core.isa_name(), "shape": dict(s.config), "weight_bytes_per_token": wb,
        "read_bandwidth_GBs": bw / 1e9, "roofline_tok_s": roof_tps, "algenta_tok_s": ours_tps,
        "fraction_of_roofline": ours_tps / roof_tps, "dispatches_per_token": s.dispatches_per_token,
        "transformers_tok_s": hf_tps,
        "speedup_vs_transformers": (ours_tps / hf_tps) if hf_tps else None,
        "max_prefill_logit_dev_vs_transformers": dev, "max_abs_logit": scale,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
    }
    if args.json:
        print(json.dumps(res))
        return
    c = s.config
    print(f"{res['cpu']} ({res['isa']}), {res['threads']} cores; torch threads "
          f"{res['torch_threads']}")
    print(f"Qwen3 shape D={c.d_model} Hq={c.h_q} Hkv={c.h_kv} Dh={c.d_head} F={c.d_ff} "
          f"L={c.n_layers} V={c.vocab}: {wb / 1e9:.3f} GB float32 weights per token, "
          f"{res['dispatches_per_token']} stages/token")
    print(f"validated: prefill logits within {dev:.2e} of transformers' (max |logit| "
          f"{scale:.1f}), {args.new} greedy tokens identical" if hf is not None else
          "validated: dispatch count (transformers not installed)")
    print(f"read bandwidth (all cores)      {bw / 1e9:8.2f} GB/s -> roofline {roof_tps:8.2f} tok/s")
    print(f"algenta decode                  {ours_tps:8.2f} tok/s  "
          f"({100 * res['fraction_of_roofline']:.1f}% of roofline)")
    if hf_tps:
        print(f"transformers eager generate     {hf_tps:8.2f} tok/s  "
              f"(algenta {res['speedup_vs_transformers']:.2f}x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

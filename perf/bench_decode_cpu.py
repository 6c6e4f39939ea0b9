"""CPU decode of the resident session in each weight format, against llama.cpp at the matching
precision, HuggingFace transformers and the memory roofline, measured side by side.

One random Qwen3 checkpoint (transformers' Qwen3ForCausalLM with O(1)-scale random weights,
written with save_pretrained in float32) is loaded by algenta once per weight format
(ResidentSession.from_pretrained(..., weights=f32|bf16|f16|int8|q4_0)) and, when `llama_cpp` and
`gguf` import, written as GGUF in the matching llama.cpp type (F32, BF16, F16, Q8_0, Q4_0; perf/_gguf.py)
and loaded by llama.cpp (llama-cpp-python, CPU, KV cache in F32 like algenta's).

Validated before any timing, against transformers' prefill logits and greedy tokens for the
prompt (computed once, in float32):
- algenta f32: prefill logits within 1e-5 x max|logit| and the greedy tokens identical (asserted);
- algenta bf16/f16/int8/q4_0: max |logit - f32 engine's| / max|logit| and how many of the greedy new
  tokens match the f32 ones before the first difference (reported, not asserted);
- llama.cpp: the same two figures against transformers; F32 within 1e-3 x max|logit| (asserted).

Timed, interleaved per round (bandwidth; then per format: algenta, llama.cpp; then transformers)
and the minimum of --reps rounds kept:
- decode tokens/s: prefill the prompt (untimed), then --new - 1 single-token steps, each
  returning the full logits and taking numpy's argmax (algenta `step`, llama.cpp `eval([t])` and
  llama_get_logits_ith: one token per call on both sides);
- prefill ms for prompts of each --prefill length (from an empty cache, last token's logits);
- roofline: the weight bytes one decode token must read in that format (every layer matrix and
  the head in the format, norms float32; the embedding row is noise) divided into the streaming
  read bandwidth algenta._core.session.cpu_read_bandwidth measures in the same run;
- transformers eager greedy `generate` (f32 only): (N - 1) new tokens, as N minus a 1-token run.

Each --threads count runs in a subprocess with OMP_NUM_THREADS set (the OpenMP team size is
fixed when the runtime starts); llama.cpp gets n_threads = n_threads_batch = the same count.
The checkpoint and GGUF files are written once, in the parent. Memory: all formats stay resident
for the interleaving, about 9.1 bytes/parameter for each engine plus the transformers model
(Qwen3-0.6B: about 14 GB in all); --workdir puts the checkpoint and GGUFs (about 8 GB) elsewhere.

    python perf/bench_decode_cpu.py [--weights f32,int8 --threads 1,2 --prefill 16,128 --json]
    python perf/bench_decode_cpu.py --families [--weights f32,bf16 --new 64 --reps 5]

--families times decode of every model family (Llama, Qwen2, Mistral, Gemma 2, Gemma 3) against
Qwen3 of the same shape and format instead (see families()).

Defaults are Qwen3-0.6B's shape (d_model 1024, 16/8 heads of 128, d_ff 3072, 28 layers, vocab
151,936, tied). Without llama.cpp the table is algenta's only (exit 0); without transformers the
weights are ResidentSession.random's and only the narrow-vs-f32 checks run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from _common import add_model_shape_args, cpu_flags, cpu_name, same_prefix

FORMATS = ("f32", "bf16", "f16", "int8", "q4_0")
LLAMA_TYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16", "int8": "Q8_0", "q4_0": "Q4_0"}


def csv_ints(s):
    return [int(v) for v in s.split(",") if v.strip()]


def csv_formats(s):
    out = [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in out if v not in FORMATS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"formats must be among {FORMATS}, got {s!r}")
    return out


def llama_available():
    """(True, version) when llama_cpp and gguf import, else (False, why)."""
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as e:
        return False, f"llama.cpp comparison skipped ({e}; pip install llama-cpp-python gguf)"
    return True, getattr(llama_cpp, "__version__", "?")


def weight_bytes_per_token(c, matrix_bytes) -> int:
    """Bytes of weights one decode token reads: every layer matrix and the head through
    matrix_bytes(rows, cols), norms float32 (the embedding row is noise)."""
    D, Hq, Hkv, Dh, F, L, V = (c["d_model"], c["h_q"], c["h_kv"], c["d_head"], c["d_ff"],
                               c["n_layers"], c["vocab"])
    mats = (matrix_bytes(Hq * Dh, D) + 2 * matrix_bytes(Hkv * Dh, D) + matrix_bytes(D, Hq * Dh)
            + 2 * matrix_bytes(F, D) + matrix_bytes(D, F))
    return L * mats + matrix_bytes(V, D) + 4 * (L * (2 * D + 2 * Dh) + D)  # head: tied or not


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


def hf_generate(hf, prompt, n):
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prompts(args):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, args.prompt).tolist()
    rng = np.random.default_rng(1)
    pre = {P: rng.integers(0, args.vocab, P).tolist() for P in args.prefill}
    return prompt, pre


# ---- parent: checkpoint, reference, GGUFs; one child per thread count ---------------------------
def prepare(args, work, with_llama):
    """Write the checkpoint, transformers' reference (prompt logits, greedy tokens) and the GGUF
    files into `work`. Returns False when transformers is missing (children then use random
    weights and have no transformers reference)."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return False
    hf = make_hf(args, work)
    prompt, _ = prompts(args)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    tokens = hf_generate(hf, prompt, args.new)
    np.savez(os.path.join(work, "reference.npz"), logits=want, tokens=np.array(tokens))
    if with_llama:
        from _gguf import write_qwen3_gguf

        sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        for fmt in args.weights:
            t0 = time.perf_counter()
            write_qwen3_gguf(os.path.join(work, f"model-{LLAMA_TYPE[fmt]}.gguf"), hf.config, sd,
                             LLAMA_TYPE[fmt])
            log(f"wrote model-{LLAMA_TYPE[fmt]}.gguf ({time.perf_counter() - t0:.1f} s)")
    return True


def log(msg):
    print(f"[bench_decode_cpu] {msg}", file=sys.stderr, flush=True)


def parent(args):
    ok, llama_note = llama_available()
    with_llama = ok and not args.no_llama
    if args.no_llama:
        llama_note = "llama.cpp comparison skipped (--no-llama)"
    if with_llama and args.vocab < 259:
        with_llama, llama_note = False, "llama.cpp comparison skipped (vocab < 259)"
    if not with_llama:
        log(llama_note)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        have_hf = prepare(args, work, with_llama)
        for T in args.threads:
            cmd = [sys.executable, os.path.abspath(__file__), "--_child", work,
                   "--threads", str(T), "--weights", ",".join(args.weights),
                   "--prefill", ",".join(map(str, args.prefill)),
                   "--d-model", str(args.d_model), "--h-q", str(args.h_q),
                   "--h-kv", str(args.h_kv), "--d-head", str(args.d_head),
                   "--d-ff", str(args.d_ff), "--layers", str(args.layers),
                   "--vocab", str(args.vocab), "--prompt", str(args.prompt),
                   "--new", str(args.new), "--reps", str(args.reps)]
            if not with_llama:
                cmd.append("--no-llama")
            if not have_hf:
                cmd.append("--no-hf")
            if args.no_transformers_timing:
                cmd.append("--no-transformers-timing")
            env = dict(os.environ, OMP_NUM_THREADS=str(T))
            log(f"threads={T}: running {len(args.weights)} formats")
            out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            if out.returncode != 0:
                sys.exit(f"threads={T} run failed (exit {out.returncode})")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res = {"cpu": cpu_name(), "cores": os.cpu_count(), "isa": runs[0]["isa"],
           "paths": runs[0]["paths"],
           "shape": runs[0]["shape"], "prompt": args.prompt, "new": args.new,
           "reps": args.reps, "prefill": args.prefill, "llama_cpp": llama_note if not with_llama
           else f"llama-cpp-python {llama_note}", "runs": runs}
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res, with_llama)
    sys.stdout.flush()


def print_table(res, with_llama):
    c = res["shape"]
    na = "-"

    def f(v, spec):
        return na if v is None else format(v, spec)

    def pct(x, who):
        v = x[f"{who}_roofline_fraction"]
        return na if v is None else f"{100 * v:.1f}%"

    print(f"{res['cpu']} ({res['isa']}), {res['cores']} cores; {res['llama_cpp']}")
    print("algenta multiplies: " + ", ".join(f"{k} {v}" for k, v in res["paths"].items()))
    print(f"Qwen3 shape D={c['d_model']} Hq={c['h_q']} Hkv={c['h_kv']} Dh={c['d_head']} "
          f"F={c['d_ff']} L={c['n_layers']} V={c['vocab']}; prompt {res['prompt']}, "
          f"{res['new']} new tokens, min of {res['reps']} rounds")
    print()
    print("decode      format     MB/token     tok/s (algenta  llama.cpp   ratio)   "
          "% of roofline (algenta llama.cpp)")
    for r in res["runs"]:
        bw = r["read_bandwidth_GBs"]
        print(f"threads={r['threads']}  read bandwidth {bw:.2f} GB/s")
        for fmt, x in r["formats"].items():
            mb = f"{x['algenta_bytes_per_token'] / 1e6:7.1f}"
            if with_llama:
                mb += f"/{x['llama_bytes_per_token'] / 1e6:<7.1f}"
            name = f"{fmt}/{x['llama_type']}" if with_llama else fmt
            print(f"            {name:<10} {mb:<15}       {x['algenta_tok_s']:8.2f}  "
                  f"{f(x['llama_tok_s'], '9.2f'):>9}  {f(x['ratio'], '6.2f'):>6}x   "
                  f"{100 * x['algenta_roofline_fraction']:16.1f}% {pct(x, 'llama'):>9}")
        if r.get("transformers_tok_s"):
            t = r["transformers_tok_s"]
            print(f"            transformers eager f32 generate {t:8.2f} tok/s "
                  f"(algenta f32 {r['formats'].get('f32', {}).get('algenta_tok_s', 0) / t:.2f}x)")
    print()
    lens = res["prefill"]
    heads = [f"P={P}" + (" alg/llama" if with_llama else "") for P in lens]
    print("prefill ms  format     " + "".join(f"{h:>22}" for h in heads))
    for r in res["runs"]:
        print(f"threads={r['threads']}")
        for fmt, x in r["formats"].items():
            cells = []
            for P in lens:
                a = x["algenta_prefill_ms"][str(P)]
                b = x["llama_prefill_ms"][str(P)] if with_llama else None
                cells.append(f"{a:.1f}" + (f" / {b:.1f}" if b is not None else ""))
            name = f"{fmt}/{x['llama_type']}" if with_llama else fmt
            print(f"            {name:<10} " + "".join(f"{s:>22}" for s in cells))
    print()
    print("accuracy    format     algenta: max|dlogit|/max|logit|  greedy   "
          "llama.cpp: max|dlogit|/max|logit|  greedy")
    print("            (algenta f32 and llama.cpp against transformers; algenta narrow "
          "formats against the f32 engine; greedy: new tokens equal to the reference's before "
          "the first difference)")
    for r in res["runs"]:
        print(f"threads={r['threads']}")
        for fmt, x in r["formats"].items():
            name = f"{fmt}/{x['llama_type']}" if with_llama else fmt
            ag = f"{x['algenta_greedy_agree']}/{res['new']}" if x["algenta_greedy_agree"] \
                is not None else na
            lg = f"{x['llama_greedy_agree']}/{res['new']}" if x["llama_greedy_agree"] \
                is not None else na
            print(f"            {name:<10} {f(x['algenta_logit_dev_rel'], '31.2e'):>31}  "
                  f"{ag:>6}   {f(x['llama_logit_dev_rel'], '33.2e'):>33}  {lg:>6}")


# ---- child: one thread count ---------------------------------------------------------------
def child(args):
    from algenta import _core
    from algenta.residentk.contract import residentk_matrix_bytes
    from algenta.residentk.session import ResidentSession

    work, T = args._child, args.threads[0]
    prompt, pre = prompts(args)
    ctx = max(args.prompt + args.new, max(args.prefill)) + 1
    new = args.new

    ref_logits = ref_tokens = None
    if not args.no_hf:
        ref = np.load(os.path.join(work, "reference.npz"))
        ref_logits, ref_tokens = ref["logits"], ref["tokens"].tolist()

    # ---- algenta: one session per format, validated ----------------------------------------
    sess, res = {}, {}
    for fmt in args.weights:
        if args.no_hf:
            s = ResidentSession.random(args.d_model, args.h_q, args.h_kv, args.d_head, args.d_ff,
                                       args.layers, args.vocab, max_ctx=ctx, weights=fmt)
        else:
            s = ResidentSession.from_pretrained(work, max_ctx=ctx, progress=False, weights=fmt)
        sess[fmt] = s
    # The reference for the narrow formats: the f32 engine (equal to transformers' within
    # 1e-5 x max|logit|, asserted below), transformers' when f32 is not in the run, or a random
    # f32 engine when neither is there.
    f32 = sess.get("f32")
    if f32 is None and ref_logits is None:
        f32 = ResidentSession.random(args.d_model, args.h_q, args.h_kv, args.d_head, args.d_ff,
                                     args.layers, args.vocab, max_ctx=ctx)
    if ref_logits is None:
        f32.reset()
        ref_logits, ref_tokens = f32.prefill(prompt), f32.generate(prompt, new)
    scale = float(np.abs(ref_logits).max())
    base_name = "f32 engine" if f32 is not None else "transformers"
    if f32 is not None:
        f32.reset()
        base_logits, base_tokens = f32.prefill(prompt), f32.generate(prompt, new)
    else:
        base_logits, base_tokens = ref_logits, ref_tokens
    if "f32" not in sess:
        f32 = None  # a reference-only engine: free it before timing
    budget = _core.residentk.residentk_dispatch_budget(args.layers)
    for fmt, s in sess.items():
        s.reset()
        got = s.prefill(prompt)
        toks = s.generate(prompt, new)
        if fmt == "f32":
            ref_name = "itself" if args.no_hf else "transformers"
            dev = float(np.abs(got - ref_logits).max())
            # float32 against float32: the tolerance scales with the logits (a tied head over
            # N(0, 1) embeddings gives logits of order sqrt(d_model)).
            assert dev <= 1e-5 * max(1.0, scale), f"f32 prefill logits deviate by {dev} ({scale})"
            assert toks == ref_tokens, "f32 greedy tokens differ from transformers'"
            assert s.dispatches_per_token == budget, (s.dispatches_per_token, budget)
            agree = same_prefix(toks, ref_tokens)
        else:
            ref_name = base_name
            dev = float(np.abs(got - base_logits).max())
            agree = same_prefix(toks, base_tokens)
        res[fmt] = {
            "algenta_logit_dev": dev, "algenta_logit_dev_rel": dev / max(scale, 1e-30),
            "algenta_dev_reference": ref_name,
            "algenta_greedy_agree": agree,
            "algenta_dispatches_per_token": s.dispatches_per_token,
            "algenta_bytes_per_token": weight_bytes_per_token(
                dict(s.config), lambda r, c, fmt=fmt: residentk_matrix_bytes(r, c, fmt)),
            "llama_type": LLAMA_TYPE[fmt], "llama_tok_s": None, "ratio": None,
            "llama_roofline_fraction": None, "llama_bytes_per_token": None,
            "llama_logit_dev": None, "llama_logit_dev_rel": None, "llama_greedy_agree": None,
            "llama_prefill_ms": {str(P): None for P in args.prefill},
        }
        log(f"threads={T} algenta {fmt}: logits {dev / max(scale, 1e-30):.2e} x max|logit| "
            f"from {ref_name}, greedy {res[fmt]['algenta_greedy_agree']}/{new}")

    # ---- llama.cpp: one model per format, validated against transformers -------------------
    llms = {}
    if not args.no_llama:
        import llama_cpp
        from _gguf import matrix_bytes as gguf_matrix_bytes

        V = args.vocab
        for fmt in args.weights:
            lt = LLAMA_TYPE[fmt]
            llm = llama_cpp.Llama(
                os.path.join(work, f"model-{lt}.gguf"), n_ctx=ctx, n_batch=max(args.prefill),
                n_ubatch=max(args.prefill), n_threads=T, n_threads_batch=T, logits_all=False,
                verbose=False, n_gpu_layers=0, type_k=llama_cpp.GGML_TYPE_F32,
                type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False)
            assert llm.n_vocab() == V, (llm.n_vocab(), V)

            def logits(llm=llm):  # the last evaluated token's logits: a view, valid until eval
                return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                             shape=(V,))
            llm.logits = logits
            llms[fmt] = llm
            llm.reset()
            llm.eval(prompt)
            got = logits().copy()
            toks = [int(np.argmax(got))]
            for _ in range(new - 1):
                llm.eval([toks[-1]])
                toks.append(int(np.argmax(logits())))
            dev = float(np.abs(got - ref_logits).max())
            if lt == "F32" and not args.no_hf:
                assert dev <= 1e-3 * max(1.0, scale), \
                    f"llama.cpp F32 prompt logits deviate by {dev} (max |logit| {scale})"
            r = res[fmt]
            r["llama_logit_dev"], r["llama_logit_dev_rel"] = dev, dev / max(scale, 1e-30)
            r["llama_greedy_agree"] = same_prefix(toks, ref_tokens)
            r["llama_bytes_per_token"] = weight_bytes_per_token(
                dict(sess[fmt].config), lambda rr, cc, lt=lt: gguf_matrix_bytes(rr, cc, lt))
            log(f"threads={T} llama.cpp {lt}: logits {r['llama_logit_dev_rel']:.2e} x "
                f"max|logit| from transformers, greedy {r['llama_greedy_agree']}/{new}")

    hf = None
    if not args.no_hf and not args.no_transformers_timing and "f32" in args.weights:
        import torch
        import transformers

        torch.set_num_threads(T)
        hf = transformers.Qwen3ForCausalLM.from_pretrained(
            work, dtype=torch.float32, attn_implementation="eager").eval()

    # ---- time -----------------------------------------------------------------------------
    def ours_decode(s):
        s.reset()
        t = int(np.argmax(s.prefill(prompt)))
        t0 = time.perf_counter()
        for _ in range(new - 1):
            t = int(np.argmax(s.step(t)))
        return time.perf_counter() - t0

    def ours_prefill(s, ids):
        s.reset()
        t0 = time.perf_counter()
        s.prefill(ids)
        return time.perf_counter() - t0

    def llama_decode(llm):
        llm.reset()
        llm.eval(prompt)
        t = int(np.argmax(llm.logits()))
        t0 = time.perf_counter()
        for _ in range(new - 1):
            llm.eval([t])  # one token per call, its logits only (logits_all=False)
            t = int(np.argmax(llm.logits()))
        return time.perf_counter() - t0

    def llama_prefill(llm, ids):
        llm.reset()  # n_tokens = 0; eval drops the cached positions from there on
        t0 = time.perf_counter()
        llm.eval(ids)
        llm.logits()
        return time.perf_counter() - t0

    def hf_time(n):
        t0 = time.perf_counter()
        hf_generate(hf, prompt, n)
        return time.perf_counter() - t0

    for fmt in args.weights:  # warm-ups: page faults (mmapped GGUFs), thread pools
        ours_decode(sess[fmt])
        if fmt in llms:
            llama_decode(llms[fmt])
    if hf is not None:
        hf_time(2)
    inf = float("inf")
    bws, t_hf = [], []
    t_ours = {f: inf for f in args.weights}
    t_llama = {f: inf for f in args.weights}
    p_ours = {(f, P): inf for f in args.weights for P in args.prefill}
    p_llama = {(f, P): inf for f in args.weights for P in args.prefill}
    # Interleaved rounds: on a machine shared with other work every engine and format sees the
    # same conditions; the minimum time of each is kept.
    for rep in range(args.reps):
        bws.append(_core.session.cpu_read_bandwidth(1 << 30, 3))
        for fmt in args.weights:
            t_ours[fmt] = min(t_ours[fmt], ours_decode(sess[fmt]))
            llm = llms.get(fmt)
            if llm is not None:
                t_llama[fmt] = min(t_llama[fmt], llama_decode(llm))
            for P in args.prefill:
                p_ours[fmt, P] = min(p_ours[fmt, P], ours_prefill(sess[fmt], pre[P]))
                if llm is not None:
                    p_llama[fmt, P] = min(p_llama[fmt, P], llama_prefill(llm, pre[P]))
        if hf is not None:
            t_hf.append(hf_time(new) - hf_time(1))
        log(f"threads={T} round {rep + 1}/{args.reps} done")
    bw = max(bws)
    for fmt in args.weights:
        r = res[fmt]
        r["algenta_tok_s"] = (new - 1) / t_ours[fmt]
        r["algenta_roofline_tok_s"] = bw / r["algenta_bytes_per_token"]
        r["algenta_roofline_fraction"] = r["algenta_tok_s"] / r["algenta_roofline_tok_s"]
        r["algenta_prefill_ms"] = {str(P): 1e3 * p_ours[fmt, P] for P in args.prefill}
        if fmt in llms:
            r["llama_tok_s"] = (new - 1) / t_llama[fmt]
            r["ratio"] = r["algenta_tok_s"] / r["llama_tok_s"]
            r["llama_roofline_tok_s"] = bw / r["llama_bytes_per_token"]
            r["llama_roofline_fraction"] = r["llama_tok_s"] / r["llama_roofline_tok_s"]
            r["llama_prefill_ms"] = {str(P): 1e3 * p_llama[fmt, P] for P in args.prefill}
    for llm in llms.values():
        llm.close()
    shape = dict(next(iter(sess.values())).config)
    print(json.dumps({
        "threads": T, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "isa": _core.isa_name(), "paths": _core.session.cpu_weight_paths(), "shape": shape,
        "read_bandwidth_GBs": bw / 1e9,
        "max_abs_logit": scale,
        "transformers_tok_s": (new - 1) / min(t_hf) if t_hf else None,
        "formats": res,
    }))
    sys.stdout.flush()


def family_configs(layers):
    """One representative family dict per model family at `layers` layers (the defaults of each
    family's published configs: Gemma 2's alternating 4096-key windows and 50/30 soft caps,
    Gemma 3's every-sixth-layer-global pattern with a local RoPE base, Mistral's window, Qwen2's
    q/k/v biases)."""
    return {
        "qwen3": {},
        "llama": {"arch": "llama"},
        "qwen2": {"arch": "qwen2"},
        "mistral": {"arch": "mistral", "sliding_window": 4096},
        "gemma2": {"arch": "gemma2", "sliding_window": 4096,
                   "sliding_layers": [i % 2 == 0 for i in range(layers)],
                   "attn_scale": 256 ** -0.5, "attn_softcap": 50.0, "final_softcap": 30.0},
        "gemma3_text": {"arch": "gemma3_text", "sliding_window": 512,
                        "sliding_layers": [(i + 1) % 6 != 0 for i in range(layers)],
                        "attn_scale": 256 ** -0.5, "rope_local_theta": 10000.0},
    }


def families(args):
    """--families: decode tokens/s of each model family at the same shape and format as Qwen3,
    in this process (OMP_NUM_THREADS threads), random weights, interleaved rounds, the minimum
    time of --reps kept; the ratio to Qwen3 of the same round set. The extra work a family does
    per token (biases, the GELU gate, soft caps, Gemma's two more norms a layer) is small next
    to streaming the weights."""
    from algenta import _core
    from algenta.residentk.session import ResidentSession

    dims = (args.d_model, args.h_q, args.h_kv, args.d_head, args.d_ff, args.layers, args.vocab)
    fams = family_configs(args.layers)
    prompt = list(range(1, args.prompt + 1))
    rows = []
    for fmt in args.weights:
        sessions = {}
        for name, fam in fams.items():
            log(f"{fmt}: building {name}")
            sessions[name] = ResidentSession.random(*dims, weights=fmt, family=fam, seed=1,
                                                    max_ctx=args.prompt + args.new + 8)
        best = dict.fromkeys(fams, float("inf"))
        names = list(fams)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order
                s = sessions[name]
                s.reset()
                s.prefill(prompt)
                t0 = time.perf_counter()
                for t in range(args.new - 1):
                    int(np.argmax(s.step(3 + t)))
                best[name] = min(best[name], time.perf_counter() - t0)
        for name in names:
            tok_s = (args.new - 1) / best[name]
            rows.append({"format": fmt, "family": name, "tok_s": tok_s,
                         "vs_qwen3": best["qwen3"] / best[name],
                         "stages": sessions[name].dispatches_per_token})
        del sessions
    res = {"cpu": cpu_name(), "flags": cpu_flags(), "isa": _core.isa_name(),
           "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())), "shape": dims,
           "prompt": args.prompt, "new": args.new, "reps": args.reps, "rows": rows}
    if args.json:
        print(json.dumps(res))
        return
    print(f"# {res['cpu']} ({res['flags']}), kernels {res['isa']}, {res['threads']} threads; "
          f"shape {dims}; prompt {args.prompt}, {args.new - 1} timed steps, best of {args.reps}")
    print("| format | family | stages/token | tok/s | vs Qwen3 |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['family']} | {r['stages']} | {r['tok_s']:.2f} | "
              f"{r['vs_qwen3']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(ap, new_default=32, reps_default=3)
    ap.add_argument("--weights", type=csv_formats, default=list(FORMATS),
                    help="comma list of algenta weight formats (default f32,bf16,f16,int8,q4_0)")
    ap.add_argument("--threads", type=csv_ints, default=[1, 2],
                    help="comma list of thread counts, one subprocess each (default 1,2)")
    ap.add_argument("--prefill", type=csv_ints, default=[16, 64, 128, 512],
                    help="prompt lengths whose prefill is timed (default 16,64,128,512)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if installed")
    ap.add_argument("--no-transformers-timing", action="store_true",
                    help="skip timing transformers' generate (it is still the reference)")
    ap.add_argument("--workdir", default=None,
                    help="where the temporary checkpoint and GGUF files go (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the tables")
    ap.add_argument("--families", action="store_true",
                    help="decode tok/s of every model family against Qwen3 at the same shape "
                         "and format, in this process (OMP_NUM_THREADS), random weights")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-hf", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.prefill or min(args.prefill) < 1 or not args.threads or min(args.threads) < 1:
        ap.error("--prefill and --threads need positive values")
    if args.families:
        families(args)
    elif args._child is not None:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

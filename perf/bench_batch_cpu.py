"""Batched decode on the CPU: aggregate tokens/s of B sequences stepped together, algenta's
slots (``ResidentSession(slots=N).step_batch``) against llama.cpp's batch API (llama_decode of
one token for each of B sequences), side by side in one process, interleaved.

One random Qwen3 model (algenta.residentk.random_weights) is opened by algenta with ``slots`` =
the largest B and, when ``llama_cpp`` and ``gguf`` import, written as GGUF in the matching
llama.cpp type (F32, BF16, F16, Q8_0; perf/_gguf.py) and loaded by llama.cpp with
``n_seq_max`` = the largest B, a unified F32 KV cache (algenta's KV is F32 too) and the same
thread count. One format is resident at a time.

Per round, per B (interleaved: algenta then llama.cpp), the minimum over --reps rounds kept:
each of B sequences gets its own --prompt-token prompt, prefilled untimed; then --new steps of
all B at once are timed, every step returning B rows of logits and taking numpy's argmax of
each (the next token). Aggregate tokens/s = B * new / seconds.

Checked before timing: algenta's batched rows equal each sequence stepped alone, bit for bit
(asserted); llama.cpp's greedy tokens against algenta's, per sequence (the count of agreeing
leading tokens, reported: the two engines round differently outside F32). Also reported: the
scheduler's overhead, algenta.residentk.batch.Scheduler decoding the same B greedy requests
(Python: admission, sampling, events) against the bare loop (prefills and steps, both timed).

    python perf/bench_batch_cpu.py [--weights f32,int8 --batch 1,2,4,8,16 --threads 2 --json]

Defaults: a small model (d_model 512, 8/4 heads of 64, d_ff 1536, 6 layers, vocab 32,000);
pass --d-model 1024 --h-q 16 --h-kv 8 --d-head 128 --d-ff 3072 --layers 28 --vocab 151936 for
Qwen3-0.6B's shape. Run it on a quiet machine; the CPU model and flags are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (SMALL, add_model_dims_args, cpu_flags, cpu_name,  # noqa: E402
                     same_prefix)

FORMATS = ("f32", "bf16", "f16", "int8")
LLAMA_TYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16", "int8": "Q8_0"}


def csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v.strip()]


def log(msg):
    print(f"[bench_batch_cpu] {msg}", file=sys.stderr, flush=True)


def prompts(args, B):
    rng = np.random.default_rng(7)
    return [rng.integers(3, args.vocab, args.prompt).tolist() for _ in range(B)]


# ---- algenta --------------------------------------------------------------------------------
def algenta_run(s, ps, new, with_prefill=False):
    """(seconds, tokens per sequence) of `new` batched greedy steps after the prefills (timed
    too with with_prefill)."""
    B = len(ps)
    nxt = []
    t_pre = time.perf_counter()
    for b, p in enumerate(ps):
        s.truncate(0, slot=b)
        nxt.append(int(np.argmax(s.prefill(p, slot=b))))
    t_pre = time.perf_counter() - t_pre if with_prefill else 0.0
    slots = list(range(B))
    out = [[t] for t in nxt]
    t0 = time.perf_counter()
    for _ in range(new):
        rows = s.step_batch(slots, nxt) if B > 1 else s.step(nxt[0], slot=0)[None]
        nxt = [int(np.argmax(r)) for r in rows]
        for b in range(B):
            out[b].append(nxt[b])
    return time.perf_counter() - t0 + t_pre, out


def check_invariance(s, ps, new):
    """Rows of a batch equal each sequence stepped alone (asserted): the property the server's
    batch invariance rests on, checked on the timed model."""
    _, together = algenta_run(s, ps, new)
    for b, p in enumerate(ps):
        _, alone = algenta_run(s, [p], new)
        assert alone[0] == together[b], f"sequence {b}: batched tokens differ from alone"


def in_thread(fn):
    """fn() on a thread that ends when it returns (its OpenMP pool with it)."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def scheduler_overhead(args, fmt, B):
    """The scheduler's time over the bare loop's for B greedy requests, in a fresh process
    where nothing else has run OpenMP: the bare loop on a passing thread, the scheduler on its
    worker, the session opened on a passing thread (see algenta.residentk.batch)."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--_sched", fmt, "--batch", str(B)]
    for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff", "layers", "vocab", "prompt", "new",
              "reps", "threads"):
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def sched_child(args):
    from algenta.residentk.session import ResidentSession

    B, fmt = args.batch[0], args._sched
    s = in_thread(lambda: ResidentSession.random(
        args.d_model, args.h_q, args.h_kv, args.d_head, args.d_ff, args.layers, args.vocab,
        max_ctx=args.prompt + args.new + 2, weights=fmt, slots=B))
    ps = prompts(args, B)
    sched = bare = float("inf")
    for _ in range(args.reps):  # interleaved
        bare = min(bare, in_thread(lambda: algenta_run(s, ps, args.new, with_prefill=True)[0]))
        sched = min(sched, scheduler_run(s, ps, args.new))
    print(sched / bare - 1.0)


def scheduler_run(s, ps, new):
    from algenta.residentk.batch import Scheduler

    sched = Scheduler(s)
    try:
        for b in range(s.slots):  # no prefix reuse: the same work as the bare loop
            s.truncate(0, slot=b)
        t0 = time.perf_counter()
        jobs = [sched.submit(p, new + 1) for p in ps]
        for j in jobs:
            j.result(timeout=600)
        return time.perf_counter() - t0
    finally:
        sched.close()


# ---- llama.cpp ------------------------------------------------------------------------------
class Llama:
    """llama.cpp's batch API through llama-cpp-python's bindings: one context of n_seq_max
    sequences with a unified F32 KV cache."""

    def __init__(self, path, n_seq, ctx_per_seq, threads, vocab, prompt_len):
        import llama_cpp as L

        self.L, self.V = L, vocab
        L.llama_log_set(_QUIET, None)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * ctx_per_seq
        cp.n_batch = cp.n_ubatch = max(n_seq, prompt_len)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = L.GGML_TYPE_F32
        cp.flash_attn_type = 0  # disabled, as algenta's attention is not flash
        cp.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx, "llama.cpp context creation failed"
        self.batch = L.llama_batch_init(max(n_seq, prompt_len), 0, n_seq)

    def _decode(self, toks, seqs, poss, want_logits):
        b = self.batch
        b.n_tokens = len(toks)
        for i, (t, s, p, w) in enumerate(zip(toks, seqs, poss, want_logits)):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, p, 1
            b.seq_id[i][0] = s
            b.logits[i] = w
        rc = self.L.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode returned {rc}"

    def row(self, i):
        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.V,))

    def run(self, ps, new):
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        B, P = len(ps), len(ps[0])
        nxt = []
        for s, p in enumerate(ps):
            self._decode(p, [s] * P, list(range(P)), [0] * (P - 1) + [1])
            nxt.append(int(np.argmax(self.row(P - 1))))
        out = [[t] for t in nxt]
        t0 = time.perf_counter()
        for k in range(new):
            self._decode(nxt, list(range(B)), [P + k] * B, [1] * B)
            nxt = [int(np.argmax(self.row(b))) for b in range(B)]
            for b in range(B):
                out[b].append(nxt[b])
        return time.perf_counter() - t0, out

    def close(self):
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


_QUIET = None


def llama_available():
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as e:
        return None, f"llama.cpp comparison skipped ({e}; pip install llama-cpp-python gguf)"
    global _QUIET
    _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept referenced
    return llama_cpp, f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"


# ---- main -----------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=csv(str), default=list(FORMATS))
    ap.add_argument("--batch", type=csv(int), default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    add_model_dims_args(ap, dims=SMALL)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_sched", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != str(args.threads):
        # the OpenMP team is fixed when the runtime starts: rerun with it set
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)

    if args._sched:
        return sched_child(args)
    from algenta import _core
    from algenta.residentk.session import ResidentSession, make_config, random_weights

    llama_cpp, llama_note = (None, "llama.cpp comparison skipped (--no-llama)") \
        if args.no_llama else llama_available()
    if llama_cpp is None:
        log(llama_note)
    cfg = make_config(dict(d_model=args.d_model, h_q=args.h_q, h_kv=args.h_kv,
                           d_head=args.d_head, d_ff=args.d_ff, n_layers=args.layers,
                           vocab=args.vocab))
    Bmax = max(args.batch)
    ctx = args.prompt + args.new + 2
    res = {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
           "isa": _core.isa_name(), "threads": args.threads, "shape": dict(cfg),
           "prompt": args.prompt, "new": args.new, "reps": args.reps, "llama_cpp": llama_note,
           "paths": _core.session.cpu_weight_paths(), "formats": {}}
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        for fmt in args.weights:
            # Opened on a thread that ends: the scheduler's worker is then the only other
            # thread with an OpenMP pool (see algenta.residentk.batch).
            box = []
            t = threading.Thread(target=lambda: box.append(ResidentSession.random(
                *[cfg[k] for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers",
                                   "vocab")], max_ctx=ctx, weights=fmt, slots=Bmax)))
            t.start()
            t.join()
            s = box[0]
            check_invariance(s, prompts(args, min(Bmax, 4)), 6)
            llm = None
            if llama_cpp is not None:
                from _gguf import write_qwen3_gguf

                hf_cfg = types.SimpleNamespace(
                    vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                    num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.h_q,
                    num_key_value_heads=cfg.h_kv, head_dim=cfg.d_head, rms_norm_eps=cfg.rms_eps,
                    rope_theta=cfg.rope_theta, max_position_embeddings=ctx,
                    tie_word_embeddings=True)
                path = os.path.join(work, f"model-{LLAMA_TYPE[fmt]}.gguf")
                write_qwen3_gguf(path, hf_cfg, dict(random_weights(cfg, 0)), LLAMA_TYPE[fmt])
                llm = Llama(path, Bmax, ctx, args.threads, cfg.vocab, args.prompt)
            rows = {}
            for B in args.batch:
                ps = prompts(args, B)
                best = {"algenta": float("inf"), "llama": float("inf")}
                for _ in range(args.reps):
                    dt, ours = algenta_run(s, ps, args.new)
                    best["algenta"] = min(best["algenta"], dt)
                    if llm is not None:
                        dt, theirs = llm.run(ps, args.new)
                        best["llama"] = min(best["llama"], dt)
                r = {"algenta_tok_s": B * args.new / best["algenta"]}
                if llm is not None:
                    r["llama_tok_s"] = B * args.new / best["llama"]
                    r["ratio"] = r["algenta_tok_s"] / r["llama_tok_s"]
                    r["greedy_agree"] = [same_prefix(a, b) for a, b in zip(ours, theirs)]
                rows[B] = r
                log(f"{fmt} B={B}: algenta {r['algenta_tok_s']:.1f} tok/s" +
                    (f", llama.cpp {r['llama_tok_s']:.1f} ({r['ratio']:.2f}x)" if llm else ""))
            if llm is not None:
                llm.close()
            del s
            res["formats"][fmt] = {"rows": rows,
                                   "scheduler_overhead": scheduler_overhead(args, fmt, Bmax)}
    if args.json:
        print(json.dumps(res))
        return
    print(f"CPU: {res['cpu']} ({res['cores']} cores; {res['flags']}); kernels {res['isa']}; "
          f"{args.threads} threads")
    print(f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab}; prompt "
          f"{args.prompt}, {args.new} timed steps, best of {args.reps}; {llama_note}")
    for fmt, f in res["formats"].items():
        print(f"\n{fmt} ({res['paths'][fmt]}) vs llama.cpp {LLAMA_TYPE[fmt]}; scheduler overhead "
              f"at B={Bmax}: {100 * f['scheduler_overhead']:+.1f}%")
        print(f"  {'B':>3} {'algenta tok/s':>14} {'x B=1':>6} {'llama tok/s':>12} {'ratio':>6}")
        one = f["rows"][args.batch[0]]["algenta_tok_s"]
        for B, r in f["rows"].items():
            lt = f"{r['llama_tok_s']:.1f}" if "llama_tok_s" in r else "-"
            ra = f"{r['ratio']:.2f}" if "ratio" in r else "-"
            print(f"  {B:>3} {r['algenta_tok_s']:>14.1f} {r['algenta_tok_s'] / one:>6.2f} "
                  f"{lt:>12} {ra:>6}")


if __name__ == "__main__":
    main()

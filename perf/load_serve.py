"""Load test of ``algenta serve``: concurrent streaming clients against a random Qwen3
checkpoint, reporting throughput, time to first token and inter-token latency (p50/p99), and
the server's own overhead against the engine stepping the same number of sequences bare.

A checkpoint directory is written (config.json, model.safetensors from
algenta.residentk.random_weights, a word-level tokenizer.json whose token i is the word "w<i>"),
``algenta serve`` is started on it as a subprocess, and --clients threads each send --requests
streamed ``/v1/completions`` requests one after another (a prompt of --prompt token ids,
``max_tokens`` --new, greedy; the checkpoint has no eos, so every request runs to --new). Every
response is checked: --new tokens, finish_reason "length".

Overhead, two ways: the server's aggregate tokens/s against the bare engine's at B =
min(clients, slots) sequences (ResidentSession.step_batch in a loop, prefills included),
measured in a fresh process before the server starts, 1 - server / bare (this counts partly
filled batches as requests come and go, and the clients' own Python, which shares the CPU with
the engine on a small machine); and the share of the wall time the engine computed (the
scheduler's engine_seconds from /health), the rest being HTTP, JSON, tokenizing, scheduling and
waiting.

    python perf/load_serve.py [--clients 8 --requests 4 --slots 8 --weights int8 --json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMALL, add_model_dims_args, cpu_flags, cpu_name  # noqa: E402


def write_checkpoint(path, args):
    from algenta.residentk.session import make_config, random_weights

    cfg = make_config(dict(d_model=args.d_model, h_q=args.h_q, h_kv=args.h_kv,
                           d_head=args.d_head, d_ff=args.d_ff, n_layers=args.layers,
                           vocab=args.vocab))
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
          "hidden_size": cfg.d_model, "num_attention_heads": cfg.h_q,
          "num_key_value_heads": cfg.h_kv, "head_dim": cfg.d_head,
          "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
          "vocab_size": cfg.vocab, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
          "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
          "use_sliding_window": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    meta, off, arrays = {}, 0, []
    for name, a in random_weights(cfg, 0):
        b = np.ascontiguousarray(a, np.float32).tobytes()
        meta[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        arrays.append(b)
        off += len(b)
    head = json.dumps(meta).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in arrays:
            f.write(b)
    import tokenizers

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(cfg.vocab)}, unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tk.save(os.path.join(path, "tokenizer.json"))


def add_server_args(ap):
    """The options start_server reads: the server's slots, weights and context."""
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--max-ctx", type=int, default=512)


def start_server(path, args, max_queue):
    """``algenta serve`` on the checkpoint at ``path`` (model id "bench", --slots, --max-ctx,
    --weights from args) on a free loopback port, once /health answers: (process, port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "algenta", "serve", "--model", path, "--name",
                            "bench", "--port", str(port), "--slots", str(args.slots),
                            "--max-ctx", str(args.max_ctx), "--weights", args.weights,
                            "--max-queue", str(max_queue)])
    deadline = time.time() + 120
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            c.getresponse().read()
            return srv, port
        except OSError:
            if time.time() > deadline or srv.poll() is not None:
                srv.kill()
                sys.exit("the server did not start")
            time.sleep(0.2)


def bare_rate(path, args, B):
    """Aggregate tokens/s of the engine alone at B sequences, in a fresh process."""
    code = f"""
import threading, time, numpy as np
from algenta.residentk.session import ResidentSession
box = []
t = threading.Thread(target=lambda: box.append(ResidentSession.from_pretrained(
    {path!r}, max_ctx={args.max_ctx}, weights={args.weights!r}, slots={B}, progress=False)))
t.start(); t.join(); s = box[0]
rng = np.random.default_rng(1)
def run():
    ps = [rng.integers(0, {args.vocab}, {args.prompt}).tolist() for _ in range({B})]
    t0 = time.perf_counter(); nxt = []
    for b, p in enumerate(ps):
        s.truncate(0, slot=b); nxt.append(int(np.argmax(s.prefill(p, slot=b))))
    for _ in range({args.new} - 1):
        rows = s.step_batch(list(range({B})), nxt); nxt = [int(np.argmax(r)) for r in rows]
    return {B} * {args.new} / (time.perf_counter() - t0)
out = []
th = threading.Thread(target=lambda: out.append(max(run() for _ in range(3)))); th.start(); th.join()
print(out[0])
"""
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                       check=True)
    return float(r.stdout.strip().splitlines()[-1])


def client(port, args, seed, out):
    rng = np.random.default_rng(seed)
    for _ in range(args.requests):
        prompt = rng.integers(0, args.vocab, args.prompt).tolist()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=json.dumps(
            {"model": "bench", "prompt": prompt, "max_tokens": args.new, "temperature": 0,
             "stream": True}))
        r = c.getresponse()
        assert r.status == 200, r.read()
        times, reason, buf = [], None, b""
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            ch = json.loads(data)["choices"][0]
            if ch["text"]:
                times.append(time.perf_counter())
                buf += ch["text"].encode()
            if ch["finish_reason"]:
                reason = ch["finish_reason"]
        c.close()
        n = len(buf.split())
        assert reason == "length" and n == args.new, (reason, n)
        out.append({"ttft": times[0] - t0, "itl": np.diff(times).tolist(), "tokens": n,
                    "t0": t0, "t1": times[-1]})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="per client, one after another")
    add_server_args(ap)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    add_model_dims_args(ap, dims=SMALL)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as work:
        write_checkpoint(work, args)
        B = min(args.clients, args.slots)
        bare = bare_rate(work, args, B)
        srv, port = start_server(work, args, args.clients * args.requests)
        try:
            def engine_seconds():
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                return json.loads(c.getresponse().read())["stats"]["engine_seconds"]

            out = []
            threads = [threading.Thread(target=client, args=(port, args, i, out))
                       for i in range(args.clients)]
            e0 = engine_seconds()
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            busy = (engine_seconds() - e0) / wall
        finally:
            srv.terminate()
            rc = srv.wait(60)
    assert len(out) == args.clients * args.requests
    toks = sum(r["tokens"] for r in out)
    itl = np.array([x for r in out for x in r["itl"]])
    ttft = np.array([r["ttft"] for r in out])
    res = {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
           "clients": args.clients, "requests": len(out), "slots": args.slots,
           "weights": args.weights, "prompt": args.prompt, "new": args.new,
           "throughput_tok_s": toks / wall, "bare_tok_s": bare,
           "overhead": 1.0 - (toks / wall) / bare, "engine_busy": busy,
           "ttft_ms": {"p50": 1e3 * np.percentile(ttft, 50), "p99": 1e3 * np.percentile(ttft, 99)},
           "itl_ms": {"p50": 1e3 * np.percentile(itl, 50), "p99": 1e3 * np.percentile(itl, 99)},
           "server_exit": rc}
    if args.json:
        print(json.dumps(res))
        return
    print(f"CPU: {res['cpu']} ({res['cores']} cores; {res['flags']})")
    print(f"{args.clients} clients x {args.requests} streamed requests ({args.prompt} prompt + "
          f"{args.new} new tokens, {args.weights}), {args.slots} slots")
    print(f"  throughput {res['throughput_tok_s']:.1f} tok/s; the engine alone at {B} sequences "
          f"{bare:.1f} tok/s: {100 * res['overhead']:.1f}% less; the engine computed "
          f"{100 * busy:.1f}% of the wall time")
    print(f"  time to first token p50 {res['ttft_ms']['p50']:.1f} ms, p99 "
          f"{res['ttft_ms']['p99']:.1f} ms; inter-token p50 {res['itl_ms']['p50']:.2f} ms, p99 "
          f"{res['itl_ms']['p99']:.2f} ms; server exit status {rc} on SIGTERM")


if __name__ == "__main__":
    main()

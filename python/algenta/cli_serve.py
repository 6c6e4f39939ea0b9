"""``algenta serve``: an OpenAI-compatible HTTP server over a resident session's slots.

    algenta serve --model DIR [--weights F] [--kv F] [--slots N] [--max-ctx N] [--device D]
                  [--host H] [--port P] [--api-key K] [--max-queue N] [--name NAME]

Needs the ``serve`` extra (``pip install ".[serve]"``: starlette, uvicorn, tokenizers, jinja2)
and the checkpoint's ``tokenizer.json`` (its ``tokenizer_config.json`` for the chat template).
Whether the weights and ``--slots`` KV caches of ``--max-ctx`` positions fit this host's
available memory is answered from the plan arithmetic before anything is read or allocated.
Binds to 127.0.0.1 unless ``--host`` says otherwise. SIGTERM or Ctrl-C stops accepting, lets
running responses finish for up to ``--grace`` seconds, cancels the rest and exits 0.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import signal
import sys
import threading
from pathlib import Path

from .cli import CliError
from .cli_generate import ModelPath, _positive_int


def register(subparsers) -> None:
    from .residentk.contract import RESIDENT_KV_FORMATS, RESIDENT_WEIGHT_FORMATS

    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a HuggingFace checkpoint (Qwen3, Llama, Qwen2, Mistral, Gemma 2 or 3) "
                    "to OpenAI clients: /v1/completions, "
                    "/v1/chat/completions (streamed or not), /v1/models, /health. Every slot "
                    "decodes in the same step (continuous batching).")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="checkpoint directory, or a llama.cpp .gguf file (Qwen3, Qwen2, Llama)")
    p.add_argument("--name", metavar="NAME",
                   help="the model id clients send (default: the directory's or file's name)")
    p.add_argument("--weights", choices=RESIDENT_WEIGHT_FORMATS, default=None,
                   help="default f32; a GGUF file's matrices as stored")
    p.add_argument("--kv", choices=RESIDENT_KV_FORMATS, default="f32")
    p.add_argument("--slots", type=_positive_int, default=4, metavar="N",
                   help="sequences decoded together (default 4)")
    p.add_argument("--max-ctx", type=_positive_int, default=2048, metavar="N",
                   help="positions per slot: a prompt plus max_tokens (default 2048)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="cpu (default), cuda, or auto (the GPU when one is usable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0 picks one)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("ALGENTA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $ALGENTA_API_KEY)")
    p.add_argument("--max-queue", type=_positive_int, default=64, metavar="N",
                   help="requests waiting for a slot before 429 (default 64)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=256, metavar="N",
                   help="prompt tokens prefilled between two decode steps (default 256)")
    p.add_argument("--max-body", type=_positive_int, default=1 << 20, metavar="BYTES",
                   help="largest request body (default 1 MiB; past it 413)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="seconds running responses get to finish at shutdown (default 30)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send its request body (default 30; past it 408)")
    p.set_defaults(handler=run)


def _port(text: str) -> int:
    import argparse
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in [0, 65535], got {text!r}")
    return v


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _load_in_passing_thread(load):
    """load() on a thread that ends when it returns. Loading runs OpenMP regions, and libgomp
    keeps a thread pool for each thread that ever ran one; with the scheduler's pool alive too,
    more pool threads than cores throttle every pool's spin-waits to a short count, and each of
    a decode step's parallel regions then pays a futex wake-up (measured on 2 cores: batched
    steps 1.5-1.8x slower). A pool is freed when its thread exits, so the scheduler's worker is
    left the only one."""
    from .errors import AlgentaError

    box = {}

    def run():
        try:
            box["session"] = load()
        except BaseException as e:  # re-raised on the calling thread
            box["error"] = e

    t = threading.Thread(target=run, name="algenta-load")
    t.start()
    t.join()
    e = box.get("error")
    if isinstance(e, (AlgentaError, FileNotFoundError)):
        raise CliError(str(e)) from None
    if e is not None:
        raise e
    return box["session"]


def _chat_template(root: Path):
    """(template, bos_token, eos_token) from tokenizer_config.json (or chat_template.jinja)."""
    from .residentk.config import read_json_file

    tc = {}
    if (root / "tokenizer_config.json").is_file():
        tc = read_json_file(root / "tokenizer_config.json", "tokenizer_config.json")
    tpl = tc.get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict)
                    and t.get("name") == "default"), None)
    if tpl is None and (root / "chat_template.jinja").is_file():
        tpl = (root / "chat_template.jinja").read_text()

    def token(v):
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    return tpl, token(tc.get("bos_token")), token(tc.get("eos_token"))


def run(args) -> int:
    try:
        import uvicorn

        from .serve import build_app
    except ImportError as e:
        raise CliError(f"algenta serve needs the 'serve' extra (pip install \"algenta[serve]\" "
                       f"or \".[serve]\" in a checkout): {e}") from None
    from .errors import AlgentaError
    from .residentk.batch import Scheduler
    from .residentk.contract import (resident_bucket_ctx, residentk_footprint,
                                     residentk_slots_fitting)
    from .residentk.loader import open_checkpoint
    from .residentk.session import ResidentSession

    if args.api_key is not None and not args.api_key:
        raise CliError("the API key is empty (--api-key or $ALGENTA_API_KEY): no client could "
                       "send it; give a key, or unset it to serve without one")
    for name in ("grace", "body_timeout"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            raise CliError(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                           f"got {v}")
    model = ModelPath(args.model)
    root = model.root
    weights = model.weights(args.weights)
    tok = model.tokenizer(why="algenta serve reads prompts and writes text with it",
                          instead="serve a checkpoint directory that has its tokenizer.json")
    try:
        ck = model.gguf or open_checkpoint(root)  # headers only: nothing allocated yet
    except (AlgentaError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    c = ck.config
    if not 1 <= args.max_ctx <= 65536:
        raise CliError(f"--max-ctx {args.max_ctx} outside [1, 65536] (status 602)")
    cap = resident_bucket_ctx(args.max_ctx)
    fp = residentk_footprint(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab,
                             cap, tied=c.tie_word_embeddings, check_tier=False,
                             format=weights, kv_format=args.kv, family=c.family)
    need = int(fp["weight_bytes"]) + args.slots * int(fp["kv_bytes"])
    from . import _core

    # Where the session will live: the CUDA engine checks device memory itself, before it
    # allocates; on the CPU the question is this host's available memory.
    on_host = args.device == "cpu" or (
        args.device == "auto" and not _core.session.cuda_backend()["usable"])
    avail = _mem_available() if on_host else 0
    if avail and need > avail:
        per = int(fp["kv_bytes"])
        fit = residentk_slots_fitting(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers,
                                      c.vocab, args.max_ctx, avail, tied=c.tie_word_embeddings,
                                      check_tier=False, format=weights,
                                      kv_format=args.kv, family=c.family)
        raise CliError(f"the weights ({int(fp['weight_bytes']) / 2**30:.2f} GiB, {weights}) "
                       f"and {args.slots} slots of {cap} positions ({per / 2**30:.2f} GiB each, "
                       f"kv {args.kv}) need {need / 2**30:.2f} GiB; this host has "
                       f"{avail / 2**30:.2f} GiB available: at most {fit} slots fit "
                       f"(see algenta plan --slots)")
    # The socket is bound before the weights are read and the banner printed: a port in use
    # is one line at once, not a load, a banner and then a failure.
    try:
        info = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    session = _load_in_passing_thread(lambda: ResidentSession.from_pretrained(
        root, max_ctx=args.max_ctx, device=args.device, weights=weights, kv=args.kv,
        slots=args.slots))
    if model.gguf is not None:
        g = model.gguf
        tpl, bos, eos = g.chat_template, g.special_text("bos"), g.special_text("eos")
    else:
        tpl, bos, eos = _chat_template(root)
    sched = Scheduler(session, prefill_chunk=args.prefill_chunk, max_queue=args.max_queue)
    name = args.name or (root.resolve().stem if model.gguf is not None else root.resolve().name)
    app = build_app(sched, tok, model_name=name, eos_ids=model.eos_ids(), chat_template=tpl,
                    bos_token=bos, eos_token=eos, api_key=args.api_key, max_body=args.max_body,
                    body_timeout=args.body_timeout)
    port = sock.getsockname()[1]
    print(f"algenta serve: '{name}' on http://{args.host}:{port} ({session.device}, "
          f"weights {weights}, kv {args.kv}, {args.slots} slots of {args.max_ctx} "
          f"positions, {need / 2**30:.2f} GiB resident)", file=sys.stderr, flush=True)
    # uvicorn's own graceful limit is a little past --grace: at --grace the jobs still running
    # are cancelled by us, so every open stream ends with a final event instead of being cut.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=args.grace + 5))
    stopped = []

    def cancel_the_rest():
        sched.close(cancel=True)  # each open response gets its 503 event and ends

    def stop(signum, frame):  # the first signal drains; a second one forces the exit
        server.force_exit = bool(stopped)
        server.should_exit = True
        if not stopped:
            t = threading.Timer(args.grace, cancel_the_rest)
            t.daemon = True
            t.start()
        stopped.append(signum)

    # Our handlers, not uvicorn's: it re-raises the signal after its graceful shutdown, which
    # ends the process "killed by SIGTERM" instead of the exit status 0 a clean stop is.
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    server.run(sockets=[sock])
    if not server.started:
        raise CliError(f"cannot serve on {args.host}:{port}")
    return 0

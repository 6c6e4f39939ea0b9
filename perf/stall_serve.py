"""Can a few clients stall everyone else on ``algenta serve``? A normal request's latency (a
plain ``/v1/completions`` of --probe-new tokens) measured three ways, interleaved in rounds:

- idle: nothing else running;
- plain load: --clients streaming clients decoding --load-new tokens each, no stop strings;
- stop-string load: the same clients, each with four stop strings of --stop-chars characters
  that never match.

The stop-string load against the plain load isolates what the stop strings cost the server's
event loop (issue 59's target: within 10%); against idle, what sharing the engine costs. Each
figure is the median of the probe requests of its round, the rounds' minimum reported.

    python perf/stall_serve.py [--clients 4 --rounds 3 --probes 10 --warmup 1 --json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMALL, add_model_dims_args, cpu_flags, cpu_name  # noqa: E402
from load_serve import add_server_args, start_server, write_checkpoint  # noqa: E402


def post(port, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps(body))
    r = c.getresponse()
    data = r.read()
    c.close()
    assert r.status == 200, data[:300]
    return data


def probe(port, args, n):
    """Median seconds of n plain requests, one after another."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        post(port, {"model": "bench", "prompt": [1 + i % 7, 2, 3, 4, 5, 6, 7, 8],
                    "max_tokens": args.probe_new, "temperature": 0})
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def loaded(port, args, stops):
    """Median probe latency while --clients streams run (with `stops` on each)."""
    stop = threading.Event()

    def stream(k):
        while not stop.is_set():
            post(port, {"model": "bench", "prompt": [9 + k, 10, 11], "max_tokens": args.load_new,
                        "temperature": 0, "stream": True, "stop": stops})

    threads = [threading.Thread(target=stream, args=(k,), daemon=True)
               for k in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)  # the streams are decoding (their outputs long) before the probes
    try:
        return probe(port, args, args.probes)
    finally:
        stop.set()
        for t in threads:
            t.join(600)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--probe-new", type=int, default=4)
    ap.add_argument("--load-new", type=int, default=200)
    ap.add_argument("--stop-chars", type=int, default=12000)
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="seconds the streams decode before the probes (a rescan's cost grows "
                         "with the output, up to the stop strings' length)")
    add_server_args(ap)
    add_model_dims_args(ap, dims=SMALL)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    # Stop strings that never match: a rescan of the held-back tail per token costs
    # O(stop length^2) whatever the output (each candidate prefix sliced and compared); the
    # automata cost the token's own characters.
    words = (args.stop_chars + 2) // 3
    stops = [" ".join(["w1"] * words) + f" w{k}" for k in range(2, 6)]

    with tempfile.TemporaryDirectory() as work:
        write_checkpoint(work, args)
        srv, port = start_server(work, args, 64)
        try:
            rounds = {"idle": [], "plain": [], "stops": []}
            for _ in range(args.rounds):  # interleaved: the machine's drift hits all three
                rounds["idle"].append(probe(port, args, args.probes))
                rounds["plain"].append(loaded(port, args, []))
                rounds["stops"].append(loaded(port, args, stops))
        finally:
            srv.terminate()
            srv.wait(60)
    best = {k: min(v) for k, v in rounds.items()}
    res = {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
           "clients": args.clients, "stop_chars": len(stops[0]), "probe_new": args.probe_new,
           "weights": args.weights, "ms": {k: 1e3 * v for k, v in best.items()},
           "stops_over_plain": best["stops"] / best["plain"],
           "plain_over_idle": best["plain"] / best["idle"]}
    if args.json:
        print(json.dumps(res))
        return
    print(f"CPU: {res['cpu']} ({res['cores']} cores; {res['flags']})")
    print(f"a {args.probe_new}-token request: idle {res['ms']['idle']:.1f} ms; beside "
          f"{args.clients} streams {res['ms']['plain']:.1f} ms; beside {args.clients} streams "
          f"with four {len(stops[0])}-character stop strings each {res['ms']['stops']:.1f} ms")
    print(f"  stop strings / plain load: {res['stops_over_plain']:.3f}; plain load / idle: "
          f"{res['plain_over_idle']:.3f}")


if __name__ == "__main__":
    main()

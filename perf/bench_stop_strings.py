"""The per-token cost of stop strings on ``algenta serve``'s event loop: ``TextStream.push``
with four stop strings that never match, once the output has grown past a stop string's
length (a word-level tokenizer whose every token is a word; the last --timed tokens timed).
Run it against another tree's install (PYTHONPATH) to compare.

    python perf/bench_stop_strings.py [--lengths 2000,12000 --timed 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_flags, cpu_name  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2000,12000", help="stop strings' lengths, characters")
    ap.add_argument("--timed", type=int, default=50)
    args = ap.parse_args()
    import tokenizers

    import algenta.serve as serve

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(16)}, unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores; {cpu_flags()}); algenta from "
          f"{os.path.dirname(serve.__file__)}")
    for n_chars in (int(x) for x in args.lengths.split(",")):
        stops = [" ".join(["w1"] * (n_chars // 3)) + f" w{k}" for k in range(2, 6)]
        n = n_chars // 3 + 200  # tokens of "w7": ~3 characters each, past the stop's length
        ts = serve.TextStream(tk, stops)
        for _ in range(n - args.timed):
            ts.push(7)
        t0 = time.perf_counter()
        for _ in range(args.timed):
            ts.push(7)
        ms = 1e3 * (time.perf_counter() - t0) / args.timed
        print(f"four stop strings of {len(stops[0])} characters, output {n} tokens: "
              f"{ms:.2f} ms a token")


if __name__ == "__main__":
    main()

"""Memory efficiency of the CUDA kernels (the session's decode, lossk's fused loss), measured
without a GPU.

Decode is bound by bytes moved. On the CUDA emulator (the ALGENTA_CUDA_EMU=ON build) every
global load and store of the kernels is counted per warp instruction in 32-byte sectors
(algenta.traffic): for each kernel and each (weights, kv) format it prints the warp instructions,
the sectors they touched, the fewest sectors their bytes could have occupied, the sector
efficiency (fewest / touched: 1.00 is perfectly coalesced), the megabytes the sectors amount to
and the bytes an instruction asked for on average; then, per token, all sectors against the weight bytes the format must stream. Then the same
table for one forward + backward of lossk's fused loss (--loss N,D,V) in float32 and bf16.

    python perf/cuda_traffic.py [--layers 2] [--formats f32:f32,bf16:f32,...]
                                [--loss 256,1024,8192] [--json]

The shape is Qwen3-0.6B's widths (d_model 1024, 16/8 heads of 128, d_ff 3072, vocab 151,936)
with --layers layers (default 2: every layer moves the same bytes, and the emulator runs each CUDA
thread as a fiber; --layers 28 is the whole model, minutes per format). The step measured is the
first after a 64-token prompt (the split-K attention path).

Sectors are what the SMs ask of L1/L2, not DRAM traffic: the normed vector every block of a
matvec stages is counted once per block (on a device those re-reads hit L2). Without the
emulation build it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import algenta
from _common import add_model_dims_args
from algenta import _core
from algenta._dtypes import Bf16Bits
from algenta.residentk.session import ResidentSession
from algenta.traffic import DECODE_KERNELS, count, decode_traffic, weight_bytes

FORMATS = "f32:f32,bf16:f32,f16:f32,int8:f32,bf16:bf16,bf16:f16,int8:bf16"


def table(t: dict, names) -> None:
    # B/req: the bytes one warp instruction asked for, on average (512 for a warp of 16-byte
    # loads; 64 for a warp of 2-byte ones: the same bytes in eight times the instructions)
    print(f"  {'kernel':<18} {'requests':>10} {'sectors':>11} {'fewest':>11} "
          f"{'efficiency':>10} {'MB':>9} {'B/req':>6}")
    for name in list(names) + ["total"]:
        k = t.get(name)
        if k is None:
            continue
        print(f"  {name:<18} {k['requests']:>10,} {k['sectors']:>11,} {k['ideal_sectors']:>11,} "
              f"{k['efficiency']:>10.3f} {32 * k['sectors'] / 1e6:>9.2f} "
              f"{k['bytes'] / max(k['requests'], 1):>6.0f}")


def loss_traffic(n: int, d: int, v: int, dtype: str) -> dict:
    """One forward + backward of the fused loss on the CUDA engine, counted."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(np.float32)
    if dtype == "bf16":
        h, w = (Bf16Bits((x.view(np.uint32) >> 16).astype(np.uint16)) for x in (h, w))
    t = rng.integers(0, v, n)
    return count(lambda: algenta.linear_cross_entropy(h, w, t, with_grad=True, device="cuda"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_dims_args(ap, layers_default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--formats", default=FORMATS, help="weights:kv pairs, comma-separated")
    ap.add_argument("--loss", default="256,1024,8192", metavar="N,D,V",
                    help="lossk's problem (tokens, d_model, vocab); 'none' skips it")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)

    backend = _core.session.cuda_backend()
    if backend["kind"] != "emulator":
        print(f"cuda_traffic: needs the CUDA emulation build (ALGENTA_CUDA_EMU=ON); this build's "
              f"CUDA backend is {backend['kind']!r}: nothing measured")
        return 0
    shape = dict(d_model=a.d_model, h_q=a.h_q, h_kv=a.h_kv, d_head=a.d_head, d_ff=a.d_ff,
                 n_layers=a.layers, vocab=a.vocab)
    report = {"shape": shape, "prompt": a.prompt, "formats": {}}
    for pair in a.formats.split(","):
        weights, kv = pair.split(":")
        s = ResidentSession.random(**shape, max_ctx=a.prompt + 8, device="cuda", seed=1,
                                   weights=weights, kv=kv)
        s.prefill([i % a.vocab for i in range(a.prompt)])
        t = decode_traffic(s, 3)
        need = weight_bytes(s)
        report["formats"][pair] = {"kernels": t, "weight_bytes": need}
        if a.json:
            continue
        print(f"\nweights {weights}, kv {kv}: one decode step of {shape}, "
              f"after {a.prompt} tokens (CUDA emulator, sectors of 32 bytes)")
        table(t, DECODE_KERNELS)
        moved = 32 * t["total"]["sectors"]
        print(f"  per token: {moved / 1e6:.2f} MB in sectors, the format's weights "
              f"{need / 1e6:.2f} MB (sectors / weights {moved / need:.3f})")
    if a.loss != "none":
        n, d, v = (int(x) for x in a.loss.split(","))
        report["loss"] = {"shape": [n, d, v]}
        for dtype in ("f32", "bf16"):
            t = loss_traffic(n, d, v, dtype)
            report["loss"][dtype] = t
            if not a.json:
                print(f"\nlossk, {dtype}: forward + backward of {n} tokens, d_model {d}, vocab "
                      f"{v} (CUDA emulator, sectors of 32 bytes)")
                table(t, sorted(k for k in t if k != "total"))
    if a.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory efficiency of the CUDA session's decode kernels, measured without a GPU.

Decode is bound by bytes moved. On the CUDA emulator (the ALGENTA_CUDA_EMU=ON build) every
global load and store of the decode kernels is counted per warp instruction in 32-byte sectors
(algenta.residentk.traffic): for each kernel and each (weights, kv) format it prints the warp
instructions, the sectors they touched, the fewest sectors their bytes could have occupied, the
sector efficiency (fewest / touched: 1.00 is perfectly coalesced) and the megabytes the sectors
amount to; then, per token, all sectors against the weight bytes the format must stream.

    python perf/cuda_traffic.py [--layers 2] [--formats f32:f32,bf16:f32,...] [--json]

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

from algenta import _core
from algenta.residentk.session import ResidentSession
from algenta.residentk.traffic import DECODE_KERNELS, decode_traffic, weight_bytes

FORMATS = "f32:f32,bf16:f32,f16:f32,int8:f32,bf16:bf16,bf16:f16,int8:bf16"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--h-q", type=int, default=16)
    ap.add_argument("--h-kv", type=int, default=8)
    ap.add_argument("--d-head", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--formats", default=FORMATS, help="weights:kv pairs, comma-separated")
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
        print(f"  {'kernel':<18} {'requests':>10} {'sectors':>11} {'fewest':>11} "
              f"{'efficiency':>10} {'MB':>9}")
        for name in list(DECODE_KERNELS) + ["total"]:
            k = t.get(name)
            if k is None:
                continue
            print(f"  {name:<18} {k['requests']:>10,} {k['sectors']:>11,} "
                  f"{k['ideal_sectors']:>11,} {k['efficiency']:>10.3f} "
                  f"{32 * k['sectors'] / 1e6:>9.2f}")
        moved = 32 * t["total"]["sectors"]
        print(f"  per token: {moved / 1e6:.2f} MB in sectors, the format's weights "
              f"{need / 1e6:.2f} MB (sectors / weights {moved / need:.3f})")
    if a.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

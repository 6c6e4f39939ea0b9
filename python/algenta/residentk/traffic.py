"""Global-memory traffic of the CUDA session's decode kernels, counted on the CUDA emulator.

Decode is bound by the bytes it moves, and that can be counted without a GPU: in the emulation
build (``-Ccmake.define.ALGENTA_CUDA_EMU=ON``) every global load and store the kernels spell with
CUDA's cache-hint intrinsics is recorded, grouped into warp instructions, and each instruction's
32-byte sectors are counted against the fewest sectors its bytes could occupy (Nsight Compute's
sectors per request; see cuda/emu/cuda_runtime.h). ``decode_traffic`` runs one decode step of a
session under that count; ``perf/cuda_traffic.py`` prints it per kernel and format, and
tests/test_residentk_cuda.py keeps every decode kernel coalesced.

What the count is not: a device's DRAM traffic. Sectors are what the SMs request from L1/L2; a
vector every block of a matvec stages (the normed input, re-read from L2 by each block) counts
once per block here, and is served from L2 on a device. ``weight_bytes`` says what the format
itself must stream.
"""

from __future__ import annotations

import re

from .. import _core
from ..errors import ResidentUnavailableError

# The decode kernels, by the name their launch has in the emulator's report (template arguments
# and the session's "_" suffix of a kernel chosen at open stripped).
DECODE_KERNELS = ("k_embed", "k_norm_qkv", "k_qk_norm_rope", "k_attn_partial", "k_attn_merge",
                  "k_matvec_residual", "k_norm_gateup", "k_rmsnorm_rows", "k_head_argmax")


def _kernel(name: str) -> str:
    return re.sub(r"<.*>$", "", name).rstrip("_")


def decode_traffic(session, token: int) -> dict:
    """One decode step of ``session`` (a CUDA session on the emulator) with its global accesses
    counted: ``{kernel: {"requests", "sectors", "ideal_sectors", "bytes", "efficiency"}}`` over
    loads and stores together, plus ``"total"``. ``efficiency`` is ideal / moved sectors (1.0:
    every warp instruction touched the fewest sectors its bytes allow). Refuses (605) outside
    the emulation build, where nothing is counted."""
    if session.device != "cuda" or _core.session.cuda_backend()["kind"] != "emulator":
        raise ResidentUnavailableError(
            "decode_traffic counts on the CUDA emulator only (an ALGENTA_CUDA_EMU=ON build, "
            "device='cuda')", 605)
    _core.session.cuda_emulator_traffic(True)
    try:
        session.step(token)
    finally:
        raw = _core.session.cuda_emulator_traffic(False)
    out = {}
    keys = ("requests", "sectors", "ideal_sectors", "bytes")
    for name, ls in raw.items():
        k = out.setdefault(_kernel(name), dict.fromkeys(keys, 0))
        for part in ("load", "store"):
            for key in keys:
                k[key] += ls[part][key]
    total = dict.fromkeys(keys, 0)
    for k in out.values():
        for key in keys:
            total[key] += k[key]
    out["total"] = total
    for k in out.values():
        k["efficiency"] = k["ideal_sectors"] / k["sectors"] if k["sectors"] else 1.0
    return out


def weight_bytes(session) -> int:
    """Bytes of weights one decode token must read in the session's format: every matrix once
    (the head included; of the embedding one row), and the norms."""
    from .contract import residentk_footprint, residentk_matrix_bytes

    c = session.config
    fp = residentk_footprint(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab,
                             512, tied=c.tie_word_embeddings, check_tier=False,
                             format=session.weights)
    row = residentk_matrix_bytes(1, c.d_model, session.weights)
    embed = residentk_matrix_bytes(c.vocab, c.d_model, session.weights)
    # a tied table is read whole as the head and one row as the embedding; an untied one, one row
    return int(fp["weight_bytes"] + row - (0 if c.tie_word_embeddings else embed))

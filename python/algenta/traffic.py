"""Global-memory traffic of the CUDA kernels, counted on the CUDA emulator.

Decode is bound by the bytes it moves, and that can be counted without a GPU: in the emulation
build (``-Ccmake.define.ALGENTA_CUDA_EMU=ON``) every global load and store the kernels spell with
CUDA's cache-hint intrinsics is recorded, grouped into warp instructions, and each instruction's
32-byte sectors are counted against the fewest sectors its bytes could occupy (Nsight Compute's
sectors per request; see cuda/emu/cuda_runtime.h). ``count`` runs any call under that count;
``decode_traffic`` one decode step of a session. ``perf/cuda_traffic.py`` prints both the
session's decode kernels and lossk's per kernel and format; tests/test_residentk_cuda.py and
tests/test_lossk_cuda.py keep them coalesced.

What is counted: every global access of the session's decode kernels, and of lossk's tile GEMM
(k_tile, labelled logits / d_hidden / d_weight), k_softmax_grad, k_bias_grad and k_narrow but for
the tile's 40-byte per-block statistics records; lossk's per-token kernels (k_prepare, k_merge,
k_finish: O(tokens) bytes) read through the shared lossk_math.hpp and are not counted. What the
count is not: a device's DRAM traffic. Sectors are what the SMs request from L1/L2; a vector
every block of a matvec stages (the normed input, re-read from L2 by each block) counts once per
block here, and is served from L2 on a device. ``weight_bytes`` says what a session's format
itself must stream.
"""

from __future__ import annotations

import re

from . import _core
from .errors import ResidentUnavailableError

# The decode kernels, by the name their launch has in the emulator's report (template arguments
# and the session's "_" suffix of a kernel chosen at open stripped).
DECODE_KERNELS = ("k_embed", "k_norm_qkv", "k_qk_norm_rope", "k_attn_partial", "k_attn_merge",
                  "k_matvec_residual", "k_norm_gateup", "k_rmsnorm_rows", "k_head_argmax")


def _kernel(name: str) -> str:
    """k_tile<P>[logits] -> k_tile[logits]; k_attn_partial_ (chosen at open) -> k_attn_partial."""
    m = re.fullmatch(r"([^<\[]*)(<.*>)?(\[.*\])?", name)
    return m.group(1).rstrip("_") + (m.group(3) or "")


def count(fn, parts=("load", "store")) -> dict:
    """Runs ``fn()`` with the emulator counting global-memory traffic: ``{kernel: {"requests",
    "sectors", "ideal_sectors", "bytes", "efficiency"}}`` over the accesses named in ``parts``
    (loads and stores together by default), plus ``"total"``. ``efficiency`` is ideal / moved sectors (1.0: every warp instruction touched the
    fewest sectors its bytes allow). Refuses (605) outside the emulation build, where nothing is
    counted."""
    if _core.session.cuda_backend()["kind"] != "emulator":
        raise ResidentUnavailableError(
            "the traffic count is the CUDA emulator's (an ALGENTA_CUDA_EMU=ON build)", 605)
    _core.session.cuda_emulator_traffic(True)
    try:
        fn()
    finally:
        raw = _core.session.cuda_emulator_traffic(False)
    out = {}
    keys = ("requests", "sectors", "ideal_sectors", "bytes")
    for name, ls in raw.items():
        k = out.setdefault(_kernel(name), dict.fromkeys(keys, 0))
        for part in parts:
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


def decode_traffic(session, token: int) -> dict:
    """:func:`count` of one decode step of ``session``, a CUDA session on the emulator."""
    if session.device != "cuda":
        raise ResidentUnavailableError("decode_traffic needs a device='cuda' session", 605)
    return count(lambda: session.step(token))


def weight_bytes(session) -> int:
    """Bytes of weights one decode token must read in the session's format: every matrix once
    (the head included; of the embedding one row), and the norms."""
    from .residentk.contract import residentk_footprint, residentk_matrix_bytes

    c = session.config
    fp = residentk_footprint(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab,
                             512, tied=c.tie_word_embeddings, check_tier=False,
                             format=session.weights, family=c.family)
    row = residentk_matrix_bytes(1, c.d_model, session.weights)
    embed = residentk_matrix_bytes(c.vocab, c.d_model, session.weights)
    # a tied table is read whole as the head and one row as the embedding; an untied one, one row
    return int(fp["weight_bytes"] + row - (0 if c.tie_word_embeddings else embed))

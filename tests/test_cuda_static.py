"""The static performance model of the CUDA kernels (perf/cuda_static.py) keeps the key ratios
of the compiled SASS from regressing: no kernel spills; the decode matvecs stream their weights
with 16-byte loads (int8: with its block scales, at least 256 bytes a warp instruction) and keep
enough of them in flight for the H200's bandwidth in the model; attention's loads are whole
rows; the bf16 prefill tile's main loop issues at most 50 instructions per tensor-core MMA
(today 45.6: the staging the CUDA performance-model issue rewrites).

Needs nvcc, cuobjdump and nvdisasm (the PyPI packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm; .ci/run installs them) and compiles cuda/session_cuda.cu for sm_90 (about
ten seconds); skipped, not faked, without them.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "perf"))
cuda_static = pytest.importorskip("cuda_static")

if any(cuda_static.tool(t) is None for t in cuda_static.TOOLS):
    pytest.skip("nvcc, cuobjdump and nvdisasm are needed to read the kernels' SASS",
                allow_module_level=True)

MATVECS = ("k_norm_qkv", "k_norm_gateup", "k_matvec_residual", "k_head_argmax")


@pytest.fixture(scope="module")
def rows():
    with tempfile.TemporaryDirectory() as tmp:
        return cuda_static.analyze("sm_90", tmp, sources=("cuda/session_cuda.cu",))


def test_no_kernel_spills(rows):
    assert rows
    assert [r for r in rows if r["spill_bytes"]] == []


def test_decode_matvecs_stream_16_byte_loads(rows):
    seen = set()
    for r in rows:
        if r["kernel"] not in MATVECS:
            continue
        seen.add((r["kernel"], r["variant"]))
        floor = 256 if r["variant"] == "int8" else 512  # bytes a warp load instruction asks
        assert r["bytes_per_load"] >= floor, r
        assert r["estimate_hbm_share"] == 1.0, r
    assert len(seen) == 4 * 4  # every matvec in every weight format


def test_attention_and_prefill_tile(rows):
    attn = [r for r in rows if r["kernel"] == "k_attn_partial"]
    assert len(attn) == 3 and all(r["bytes_per_load"] >= 64 for r in attn), attn
    tile = [r for r in rows if r["variant"] == "bf16/prefill"]
    assert len(tile) == 1 and tile[0]["mma"] > 0, tile
    assert tile[0]["insns_per_mma"] <= 50, tile[0]
    assert tile[0]["blocks_per_sm"] >= 2, tile[0]


def test_distillation_row_kernel_does_not_spill():
    # k_distill_row's float64 sums at 1,024 threads (64 registers a thread) spilled 80 bytes;
    # it runs 256.
    with tempfile.TemporaryDirectory() as tmp:
        rows = cuda_static.analyze("sm_90", tmp, sources=("cuda/lossk_distill.cu",))
    row = [r for r in rows if r["kernel"] == "k_distill_row"]
    assert len(row) == 2 and all(r["spill_bytes"] == 0 for r in row), row

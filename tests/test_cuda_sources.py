"""Rules the CUDA sources keep that no emulator run can check, read from the source text.

A read-only `__ldg` (ld.global.nc) may be run speculatively by nvcc: on an H200 it hoisted the
bf16 logits tile's bias loads out of their row loop and past their column bound, reading past the
bias (compute-sanitizer; README, "On a GPU"). The emulator runs each load where it is written,
so only the rule in cuda/common.cuh (gpu::ld_guarded) keeps the fault from coming back. This test
catches its plainest breach, an `__ldg` on a line that also tests something (`?`, `if (`,
`while (`); a guard on another line, an early return or a helper called under a test are for
review (common.cuh says which `__ldg`s are safe there and why). Skipped where the sources are
absent (CI's bare-environment stage copies tests/ alone).
"""

from __future__ import annotations

import pathlib
import re

import pytest

# Reads the CUDA sources as text.
pytestmark = pytest.mark.python_only

ROOT = pathlib.Path(__file__).resolve().parent.parent
if not (ROOT / "cuda" / "common.cuh").is_file():
    pytest.skip("the CUDA sources are not beside these tests", allow_module_level=True)
SOURCES = sorted(p for p in (ROOT / "cuda").glob("*.cu*"))
GUARD = re.compile(r"\?|\bif\s*\(|\bwhile\s*\(")


def test_the_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"session_kernels.cuh", "session_matvec.cuh", "session_cuda_decode.cuh",
            "lossk_tile.cuh", "lossk_token.cuh"} <= names


def test_no_ldg_under_a_condition_on_its_line():
    bad = []
    for p in SOURCES:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if "__ldg(" in code and GUARD.search(code):
                bad.append(f"{p.name}:{n}: {line.strip()}")
    assert not bad, "guarded __ldg (use gpu::ld_guarded):\n" + "\n".join(bad)


"""Rules the CUDA sources keep that no emulator run can check, read from the source text.

A read-only `__ldg` (ld.global.nc) may be run speculatively by nvcc: on an H200 it hoisted the
bf16 logits tile's bias loads out of their row loop and past their column bound, reading past the
bias (compute-sanitizer; README, "On a GPU"). The emulator runs each load where it is written,
so only this rule keeps the fault from coming back: a load that a condition makes valid (a
bound, a null pointer) is `gpu::ld_guarded`, never `__ldg`, which this test finds on any line
that also tests something (`?`, `if (`, `while (`).
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for p in (ROOT / "cuda").glob("*.cu*"))
GUARD = re.compile(r"\?|\bif\s*\(|\bwhile\s*\(")


def test_the_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"session_kernels.cuh", "lossk_tile.cuh", "lossk_token.cuh"} <= names


def test_no_ldg_under_a_condition_on_its_line():
    bad = []
    for p in SOURCES:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if "__ldg(" in code and GUARD.search(code):
                bad.append(f"{p.name}:{n}: {line.strip()}")
    assert not bad, "guarded __ldg (use gpu::ld_guarded):\n" + "\n".join(bad)


def test_the_rule_catches_the_fault_it_was_written_for():
    # the line that read past the bias on the H200, as it was
    line = "    if (bias) x += T(widen(__ldg(bias + n0 + c)));"
    assert GUARD.search(line) and "__ldg(" in line

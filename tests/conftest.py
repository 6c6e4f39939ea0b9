"""Shared test setup: which CUDA backend this build has, and the `device` fixture that runs one
session test body on every engine (pytorch/extension-cpp's pattern).

- "cpu": the CPU engine, always.
- "cuda": the CUDA engine, on whatever backs it here: a real device (the ALGENTA_GPU build on a
  GPU host) or the CPU emulator (the ALGENTA_CUDA_EMU build, ALGENTA_EMU_ORDER choosing the thread
  order). Skipped where this build has no CUDA backend or the host no usable device, unless
  ALGENTA_EXPECT_GPU=1, which turns "no usable device" into a failure (a GPU job whose driver is
  older than the toolkit must not pass by skipping everything).

The report header says which backend ran, so a log shows whether "cuda" meant a device, the
emulator, or nothing.
"""

from __future__ import annotations

import os

import pytest

from algenta import _core

CUDA = _core.session.cuda_backend()
# Every instruction set this build compiled, best first: the tests that force each one
# (ALGENTA_ISA) skip those the host cannot run.
ISAS = _core.isa_names().split(",")
EMULATED = CUDA["kind"] == "emulator"
EXPECT_GPU = os.environ.get("ALGENTA_EXPECT_GPU") == "1"


def cuda_backend_line() -> str:
    if CUDA["kind"] == "none":
        return "none (this build has no CUDA backend: cuda tests skip)"
    if not CUDA["usable"]:
        return f"{CUDA['kind']}, NOT usable: {CUDA['why']}"
    if EMULATED:
        return (f"emulator: {CUDA['device_name']}, order "
                f"{os.environ.get('ALGENTA_EMU_ORDER', 'forward')}")
    return f"device: {CUDA['device_name']}"


def pytest_report_header(config):
    note = _core.isa_note()
    return [f"algenta CPU kernels: {_core.isa_name()} (compiled: {', '.join(ISAS)})"
            + (f"; {note}" if note else ""),
            f"algenta CUDA backend: {cuda_backend_line()}"]


# The format each engine keeps under the sanitizers (.ci/run selects -m "not format_sweep"
# there): the emulated CUDA engine runs about 3x slower under ASan, and the emulator stage runs
# every format in reverse and in random thread order anyway, so a session test in another format
# is marked format_sweep. The CPU engine keeps int8 (the format whose kernels index the most:
# blocks, scales, packed panels) and the CUDA engine float32, each with a float32 cache.
SANITIZED_FORMAT = {"cpu": ("int8", "f32"), "cuda": ("f32", "f32")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        spec = getattr(item, "callspec", None)
        p = spec.params if spec is not None else {}
        # The engine a test runs: its device parameter, or for a test without one (the CUDA-only
        # files) its cuda marker.
        engine = p.get("device", "cuda" if item.get_closest_marker("cuda") else "cpu")
        if engine == "cuda":
            item.add_marker(pytest.mark.cuda)
        if "weights" in p or "kv" in p:
            keep_w, keep_kv = SANITIZED_FORMAT[engine]
            if (p.get("weights", keep_w), p.get("kv", keep_kv)) != (keep_w, keep_kv):
                item.add_marker(pytest.mark.format_sweep)


def need_cuda():
    """Skip (or, with ALGENTA_EXPECT_GPU=1, fail) where the CUDA engine cannot run."""
    if CUDA["usable"]:
        return
    msg = f"CUDA backend {cuda_backend_line()}"
    if EXPECT_GPU:
        pytest.fail(f"ALGENTA_EXPECT_GPU=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu", "cuda-emu" if EMULATED else "cuda"])
def device(request):
    if request.param == "cuda":
        need_cuda()
    return request.param

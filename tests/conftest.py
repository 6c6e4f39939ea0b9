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
# Set by tools/sanitize-test: the suite runs against the ASan + UBSan build (see below).
SANITIZED = os.environ.get("ALGENTA_SANITIZED") == "1"


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


def _sanitizers_leave_out(item) -> bool:
    # Under the sanitizers the emulated CUDA engine runs about 3x slower, and CI's plain emulator
    # stage runs every format anyway (the whole suite in forward thread order; the reverse and
    # random orders rerun the kernels' files). So here the tests written for both engines keep
    # float32 weights and cache on the CUDA engine (other formats run the same host code), while
    # the CUDA engine's own files (test_residentk_cuda*.py) keep every format, so each format's
    # kernels still run under ASan; test_cuda_static.py reads SASS, where nothing sanitized runs.
    if item.path.name == "test_cuda_static.py":
        return True
    spec = getattr(item, "callspec", None)
    p = spec.params if spec is not None else {}
    on_cuda = p.get("device") == "cuda"
    # The two slowest sanitized tests (108 s and 78 s of the stage's 1,421 s, measured with
    # --durations on Zen 3): many emulated steps that check tokens and GIL release, which the
    # plain emulator stage checks in full; the CUDA engine's concurrent memory safety stays here
    # (separate sessions, a shared session serialized or refused, hold).
    if on_cuda and item.path.name == "test_concurrency.py" and item.originalname in (
            "test_threads_sharing_one_session_each_get_their_own_tokens",
            "test_gil_released_by_the_session"):
        return True
    return (on_cuda and (p.get("weights", "f32"), p.get("kv", "f32")) != ("f32", "f32")
            and not item.path.name.startswith("test_residentk_cuda"))


def pytest_collection_modifyitems(config, items):
    if not SANITIZED:
        return
    out = [it for it in items if _sanitizers_leave_out(it)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [it for it in items if not _sanitizers_leave_out(it)]


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

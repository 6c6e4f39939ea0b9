"""residentk.probe: what each build must report.

The default (CPU) build: no kernels, status 604 for a supported shape. The ALGENTA_GPU=ON build:
kernels compiled, and whether a device is usable depends on the host; on a host without a
usable CUDA device (CI) it reads status 605. Expectations that hold in only one build are
skipped in the other; the device-present case runs only where a GPU is actually usable.
"""

import pickle

import pytest

import algenta
from algenta.residentk import probe
from algenta.residentk.probe import ResidentProbe

# The probe's answers depend on the build's CUDA backend: run with every backend CI builds.
pytestmark = pytest.mark.cuda

QWEN3_06B = [1024, 16, 8, 128, 3072, 28, 151936]
BAD_HEADS = [1024, 5, 2, 128, 3072, 2, 151936]

COMPILED = probe.resident_gpu_kernels_compiled()
AVAILABLE = probe.resident_available()
cpu_build_only = pytest.mark.skipif(COMPILED, reason="default-build expectation (ALGENTA_GPU off)")
gpu_build_only = pytest.mark.skipif(not COMPILED, reason="needs the ALGENTA_GPU=ON build")


def test_facts_are_bools_and_consistent():
    assert isinstance(COMPILED, bool) and isinstance(AVAILABLE, bool)
    assert not AVAILABLE or COMPILED          # a device is only usable with kernels compiled
    assert probe.resident_available() is AVAILABLE   # asked once, stable for the process


def test_record_shape():
    r = probe.resident_session_probe(*QWEN3_06B)
    assert isinstance(r, ResidentProbe)
    assert list(dict(r)) == ["kernels_compiled", "device_present", "session_possible",
                             "dispatch_budget", "resident_f32_elems", "status"]
    assert r.status == r["status"]
    assert pickle.loads(pickle.dumps(r)) == r
    assert r.dispatch_budget == 171 and r.resident_f32_elems == 625_410_048
    assert r.kernels_compiled is COMPILED and r.device_present is AVAILABLE
    assert r.session_possible is (r.status == 600)


@cpu_build_only
def test_seed_example_default_build():
    r = probe.resident_session_probe(*QWEN3_06B)
    assert r == {"kernels_compiled": False, "device_present": False, "session_possible": False,
                 "dispatch_budget": 171, "resident_f32_elems": 625410048, "status": 604}
    assert not probe.resident_available()


@cpu_build_only
def test_seed_example_through_runtime_default_build():
    out = algenta.MojoRuntime(mode="local").execute("residentk.probe", "resident_session_probe",
                                                    QWEN3_06B)
    assert out == {"result": {"kernels_compiled": False, "device_present": False,
                              "session_possible": False, "dispatch_budget": 171,
                              "resident_f32_elems": 625410048, "status": 604},
                   "status": 604}


@gpu_build_only
def test_gpu_build_reports_kernels():
    r = probe.resident_session_probe(*QWEN3_06B)
    assert r.kernels_compiled is True
    assert r.status == (600 if AVAILABLE else 605)
    assert r.session_possible is AVAILABLE


@gpu_build_only
@pytest.mark.skipif(AVAILABLE, reason="host has a usable CUDA device")
def test_gpu_build_without_device_is_605():
    r = algenta.MojoRuntime(mode="local").execute("residentk.probe", "resident_session_probe",
                                                  QWEN3_06B)
    assert r == {"result": {"kernels_compiled": True, "device_present": False,
                            "session_possible": False, "dispatch_budget": 171,
                            "resident_f32_elems": 625410048, "status": 605},
                 "status": 605}


@gpu_build_only
@pytest.mark.skipif(not AVAILABLE, reason="no usable CUDA device on this host")
def test_gpu_build_with_device_is_600():
    r = probe.resident_session_probe(*QWEN3_06B)
    assert r == {"kernels_compiled": True, "device_present": True, "session_possible": True,
                 "dispatch_budget": 171, "resident_f32_elems": 625410048, "status": 600}


def test_shape_refusal_comes_first_on_every_build():
    r = probe.resident_session_probe(*BAD_HEADS)
    assert r.status == 603 and r.session_possible is False
    assert r.device_present is False          # the device is not asked about a shape it can't run
    assert r.kernels_compiled is COMPILED
    assert r.resident_f32_elems == 0 and r.dispatch_budget == 2 * 6 + 3
    out = algenta.MojoRuntime(mode="local").execute("residentk.probe", "resident_session_probe",
                                                    BAD_HEADS)
    assert out["status"] == 603 and out["result"]["session_possible"] is False


@pytest.mark.parametrize("args,status", [
    ([0, 16, 8, 128, 3072, 28, 151936], 601),
    ([1024, 16, 8, 128, 3072, 0, 151936], 601),
    ([1024, 16, 8, 128, 3072, 28, -1], 601),
    ([1024, 16, 8, 128, 3072, 2000, 151936], 602),
    ([1024, 16, 8, 128, 3072, 28, 2**70], 602),
    ([5120, 40, 8, 128, 17408, 40, 151936], 602),   # Qwen3-14B: d_ff past the 48 KiB tier
    ([1024, 16, 8, 100, 3072, 28, 151936], 603),
])
def test_shape_refusals(args, status):
    r = probe.resident_session_probe(*args)
    assert r.status == status and not r.session_possible and not r.device_present
    assert r.resident_f32_elems == 0


def test_supported_shape_status_is_a_device_question():
    r = probe.resident_session_probe(64, 4, 2, 16, 96, 2, 97)
    assert r.status == (604 if not COMPILED else 605 if not AVAILABLE else 600)
    assert r.dispatch_budget == 15


def test_runtime_lists_probe_functions():
    rt = algenta.MojoRuntime(mode="local")
    assert rt.execute("residentk.probe", "resident_gpu_kernels_compiled", []) == {
        "result": COMPILED, "status": 600}
    assert rt.execute("residentk.probe", "resident_available", [])["result"] is AVAILABLE


def test_types():
    with pytest.raises(TypeError):
        probe.resident_session_probe(1024.0, 16, 8, 128, 3072, 28, 151936)
    with pytest.raises(TypeError):
        probe.resident_session_probe(*QWEN3_06B[:-1], "151936")

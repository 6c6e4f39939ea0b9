"""Allocation failure is a MemoryError, never an abort, and the process stays usable after it.

Each case runs in a child process whose address space is capped (RLIMIT_AS) a little above what
it has mapped after building its inputs, then asks for a computation that is legal (every
contract check passes) but needs more memory than the cap leaves: the core's scratch, its output
arrays, a session's resident buffers. The child then runs a small computation and checks its
answer, so a MemoryError that left state half-built would show. Skipped under AddressSanitizer,
whose shadow memory cannot live under an address-space cap and whose allocator reports an
oversized request instead of failing it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

HEADROOM = 256 << 20

_PRELUDE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import algenta
    from algenta.residentk.session import ResidentSession

    def cap(headroom):
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))

    def still_works():
        # A small, exactly known answer after the failure: uniform logits give log(vocab).
        r = algenta.linear_cross_entropy(np.zeros((3, 4)), np.zeros((7, 4)), [0, 1, 6],
                                         with_grad=True)
        assert r.loss == np.log(7), r.loss
        s = ResidentSession.random(d_model=16, h_q=2, h_kv=1, d_head=8, d_ff=32, n_layers=1,
                                   vocab=32, seed=1)
        assert s.generate([1, 2], 3) == s.generate([1, 2], 3)

    # Warm-up: OpenMP's pool and the allocator's arenas exist before the cap, so the cap
    # measures the case and not the runtime's first use.
    still_works()
""")


def run_capped(body: str, timeout=180):
    with open("/proc/self/maps") as f:
        if any("libasan" in line for line in f):
            pytest.skip("RLIMIT_AS cannot coexist with ASan's shadow memory")
    code = _PRELUDE + textwrap.dedent(body) + "\nstill_works()\nprint('usable after MemoryError')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, MALLOC_ARENA_MAX="2"))
    assert r.returncode == 0, f"child exit {r.returncode} (negative: killed by a signal)\n{r.stderr[-3000:]}"
    assert "usable after MemoryError" in r.stdout, r.stdout + r.stderr[-2000:]
    return r.stdout


@pytest.mark.slow
def test_fused_loss_scratch_failure_is_memory_error():
    # 2048 tokens x 65,536 classes with gradients: the budget admits a 2048-token chunk
    # (2^27 logit cells, 1 GiB in float64) though the inputs are a few MB.
    run_capped(f"""
        rng = np.random.default_rng(0)
        h = rng.standard_normal((2048, 8)); w = rng.standard_normal((65536, 8))
        t = rng.integers(0, 65536, 2048)
        assert algenta.lossk.contract.loss_chunk_check(2048, 65536) == 580
        cap({HEADROOM})
        try:
            algenta.linear_cross_entropy(h, w, t, with_grad=True)
            raise SystemExit("a 1 GiB chunk fitted under a 256 MiB cap")
        except MemoryError:
            pass
        # A chunk that fits the cap still computes, in the same process.
        r = algenta.linear_cross_entropy(h, w, t, chunk=64, with_grad=True)
        assert np.isfinite(r.loss)
    """)


def test_fused_loss_output_failure_is_memory_error():
    # d_weight is as large as weight: 200 MB of it against 128 MiB of headroom, for one token.
    run_capped("""
        w = np.random.default_rng(0).standard_normal((25600, 1024))
        h = np.ones((1, 1024))
        cap(128 << 20)
        try:
            algenta.linear_cross_entropy(h, w, [3], with_grad="weight")
            raise SystemExit("a 200 MB d_weight fitted under 128 MiB")
        except MemoryError:
            pass
        r = algenta.linear_cross_entropy(h, w, [3])
        assert np.isfinite(r.loss)
    """)


def test_flat_grad_logits_output_failure_is_memory_error():
    run_capped("""
        from algenta.lossk import cross_entropy as ce
        n, v = 64, 200_000  # 100 MB of logits in, 100 MB of gradient out
        z = np.zeros(n * v)
        cap(64 << 20)
        try:
            ce.ce_grad_logits_flat(z, [1] * n, n, v)
            raise SystemExit("100 MB of gradient fitted under 64 MiB")
        except MemoryError:
            pass
        assert ce.ce_from_logits_flat(z, [1] * n, n, v).mean_loss == np.log(v)
    """)


def test_session_resident_buffers_failure_is_memory_error():
    # Qwen3-0.6B's shape is legal everywhere (2.5 GB of float32 weights); the cap is not.
    run_capped(f"""
        from algenta.residentk import ResidentSession
        cap({HEADROOM})
        for tied in (True, False):
            try:
                algenta._core.session.cpu_session(1024, 16, 8, 128, 3072, 28, 151936, 1e-6, 1e6,
                                                   tied, 512)
                raise SystemExit("a 0.6B-parameter session fitted under a 256 MiB cap")
            except MemoryError:
                pass
        try:
            algenta._core.session.cpu_read_bandwidth(2**40, 1)
            raise SystemExit("a 1 TiB buffer was allocated")
        except MemoryError:
            pass
    """)

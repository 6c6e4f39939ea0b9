"""The CUDA engine's own cases of several sequences in one session (slots), on a device or the
emulator (in every thread order CI asks for); test_residentk_slots.py runs the guarantees both
engines share (batched rows equal to lone steps, copied prefixes, refusals) on both. Here: decode's
one-row graph and the row kernels agree at every position; a session of several slots gives a
prompt the same bits however it is split (it prefills through decode's own kernels, where a
session of one slot prefills through GEMMs); a CUDA failure inside a batched step moves no
sequence."""

from __future__ import annotations

import numpy as np
import pytest

from algenta import ResidentUnavailableError, _core
from algenta.residentk.session import ResidentSession
from conftest import EMULATED, need_cuda

pytestmark = pytest.mark.cuda

# Widths of whole 32-element blocks, so every format's matvecs take their 16-byte loads (int8's
# dp4a path among them; test_residentk_slots.py's widths take the element-wise loops for int8).
DIMS = dict(d_model=64, h_q=4, h_kv=2, d_head=16, d_ff=128, n_layers=2, vocab=197)


@pytest.fixture(autouse=True)
def _cuda():
    need_cuda()


def session(slots, weights="f32", kv="f32", device="cuda", **kw):
    return ResidentSession.random(**DIMS, slots=slots, weights=weights, kv=kv, seed=3,
                                  device=device, **kw)


@pytest.mark.parametrize("weights,kv", [("f32", "f32"), ("bf16", "bf16"), ("f16", "f32"),
                                        ("int8", "f16")])
def test_one_step_graph_and_the_row_kernels_agree(weights, kv):
    # step() on slot 0 replays decode's one-row graph; step_batch runs the row kernels, here
    # with another sequence beside it. The same sequence through either, at every position, on
    # both attention paths.
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, DIMS["vocab"], 29)
    a, b = session(2, weights, kv), session(2, weights, kv)
    assert np.array_equal(a.prefill(prompt), b.prefill(prompt, slot=0))
    b.prefill(prompt[:3], slot=1)
    for t in rng.integers(0, DIMS["vocab"], 6):  # keys 30 to 35: the split begins at 32
        assert np.array_equal(a.step(int(t)), b.step_batch([1, 0], [5, int(t)])[1])


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_a_prompt_gives_the_same_bits_however_it_is_split(weights):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, DIMS["vocab"], 34)
    whole = session(2, weights)
    want = [whole.prefill(prompt), whole.step(3)]
    for cuts in ([16, 16], [1, 20, 3], [33], [1] * 5):  # pieces, then the rest
        s = session(2, weights)
        at = 0
        for c in cuts:
            s.prefill(prompt[at:at + c], slot=1)
            at += c
        assert np.array_equal(s.prefill(prompt[at:], slot=1), want[0]), cuts
        assert np.array_equal(s.step(3, slot=1), want[1]), cuts
    stepped = session(2, weights)
    stepped.prefill(prompt[:1], slot=1)
    for t in prompt[1:-1]:
        stepped.step(int(t), slot=1)
    assert np.array_equal(stepped.step(int(prompt[-1]), slot=1), want[0])


def test_a_failing_cuda_call_in_a_batched_step_moves_no_one():
    if not EMULATED:
        pytest.skip("failure injection is a hook of the CUDA emulator")
    s, ref = session(3), session(3)
    for x in (s, ref):
        x.prefill([3, 1, 4], slot=0)
        x.prefill([1, 5], slot=2)
    failed = 0
    try:
        for k in range(1, 200):
            assert _core.session.cuda_emulator_fail_after(k)
            try:
                s.step_batch([2, 0], [9, 2])
            except ResidentUnavailableError as e:
                assert e.status == 608 and "cudaErrorLaunchFailure" in str(e), e
                assert (s.slot_position(0), s.slot_position(2)) == (3, 2)
                failed += 1
                continue
            break
    finally:
        _core.session.cuda_emulator_fail_after(0)
    assert failed >= 3, failed
    want = ref.step_batch([2, 0], [9, 2])
    s.truncate(3, slot=0)
    s.truncate(2, slot=2)
    assert np.array_equal(s.step_batch([2, 0], [9, 2]), want)



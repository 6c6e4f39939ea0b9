"""Several sequences in one session (slots): a sequence's logits are bit-identical whether it is
stepped alone or in a batch with any others, in any slot, whenever it joined; truncate and
copy_prefix keep exactly the bits a recomputation would write. Every weight and KV format, on
both engines: the CPU engine on the instruction set the process runs (CI runs this file once per
ISA with ALGENTA_ISA), the CUDA engine on a device or the emulator (CI's three thread orders).

"Alone" is the sequence by itself in a session of two slots: on the CUDA engine a session of
one slot prefills through GEMMs (agreeing with stepping to float32 rounding, see
test_residentk_cuda.py), one of several through decode's own kernels; the CPU engine gives the
same bits either way. test_residentk_cuda_slots.py has the CUDA engine's own cases."""

from __future__ import annotations

import numpy as np
import pytest

from algenta import ResidentError
from algenta.residentk.session import ResidentSession

pytestmark = pytest.mark.kernels

DIMS = dict(d_model=72, h_q=4, h_kv=2, d_head=16, d_ff=136, n_layers=2, vocab=197)


# |cuda - cpu| over max(1, max |logit|) per weight format: test_residentk_cuda.py's bounds
FORMAT_TOL = {"f32": 1e-4, "f16": 1e-4, "bf16": 2.0 ** -7, "int8": 1.0 / 127}


def session(slots, weights="f32", kv="f32", device="cpu", **kw):
    return ResidentSession.random(**DIMS, slots=slots, weights=weights, kv=kv, seed=3,
                                  device=device, **kw)


def alone(weights, kv, prompt, toks, device="cpu"):
    s = session(2, weights, kv, device)
    out = [s.prefill(prompt, slot=1)]
    out += [s.step(int(t), slot=1) for t in toks]
    return out


@pytest.mark.parametrize("weights,kv", [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"),
                                        ("int8", "f32")])
def test_batched_steps_equal_lone_steps_bit_for_bit(weights, kv, device):
    # Prompts of 1 to 40 tokens: rows on the standard attention path and, past 32 keys, on
    # split-K share a step. A step of slot 0 alone goes through step() (on the CUDA engine the
    # one-row graph), the rest through step_batch.
    rng = np.random.default_rng(0)
    n = 5
    prompts = [rng.integers(0, DIMS["vocab"], k) for k in (1, 7, 3, 40, 12)]
    toks = [rng.integers(0, DIMS["vocab"], 6) for _ in range(n)]
    want = [alone(weights, kv, p, t, device) for p, t in zip(prompts, toks)]
    s = session(6, weights, kv, device)
    slot_of = [4, 0, 5, 2, 1]  # not in order, slot 3 never used
    joins = [0, 0, 2, 3, 3]  # the step at which each sequence joins
    done = [0] * n
    for step in range(12):
        for i in range(n):
            if joins[i] == step:
                got = s.prefill(prompts[i], slot=slot_of[i])
                assert np.array_equal(got, want[i][0]), (i, "prefill")
        live = [i for i in range(n) if joins[i] <= step and done[i] < 6]
        order = live[::-1] if step % 2 else live  # rows in varying order
        if not order:
            break
        if order == [1]:
            rows = [s.step(int(toks[1][done[1]]))]
        else:
            rows = s.step_batch([slot_of[i] for i in order], [toks[i][done[i]] for i in order])
        for b, i in enumerate(order):
            done[i] += 1
            assert np.array_equal(rows[b], want[i][done[i]]), (i, done[i])
    assert done == [6] * n
    assert [s.slot_position(slot_of[i]) for i in range(n)] == [p.size + 6 for p in prompts]
    assert s.slot_position(3) == 0
    if device == "cuda":  # the same model as the CPU engine computes
        got = session(1, weights, kv).prefill(prompts[3])
        scale = max(1.0, float(np.abs(got).max()))
        assert np.abs(got - want[3][0]).max() <= FORMAT_TOL[weights] * scale


def test_more_sequences_than_one_pass_carries(device):
    # 16 rows a pass: 19 sequences step in two groups, each row still its lone bits
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, DIMS["vocab"], 1 + k % 5) for k in range(19)]
    s = session(19, "int8", device=device)
    solo = session(2, "int8", device=device)
    want = []
    for p in prompts:
        solo.truncate(0, slot=1)
        solo.prefill(p, slot=1)
        want.append(solo.step(9, slot=1))
    for k, p in enumerate(prompts):
        s.prefill(p, slot=k)
    order = list(range(19))[::-1]
    rows = s.step_batch(order, [9] * 19)
    for b, k in enumerate(order):
        assert np.array_equal(rows[b], want[k]), k


@pytest.mark.parametrize("kv", ["f32", "bf16", "f16"])
def test_copied_and_kept_prefixes_continue_as_recomputed(kv, device):
    rng = np.random.default_rng(1)
    shared = rng.integers(0, DIMS["vocab"], 30)
    tail = rng.integers(0, DIMS["vocab"], 5)
    want = alone("bf16", kv, np.concatenate([shared, tail]), [7, 8], device)
    s = session(3, "bf16", kv, device)
    s.prefill(np.concatenate([shared, rng.integers(0, DIMS["vocab"], 9)]), slot=0)
    s.copy_prefix(0, 2, shared.size)
    assert s.slot_position(2) == shared.size
    assert np.array_equal(s.prefill(tail, slot=2), want[0])
    assert np.array_equal(s.step(7, slot=2), want[1])
    # slot 0 rewound to the shared prefix continues as if it never held its own tail
    s.truncate(shared.size, slot=0)
    assert np.array_equal(s.prefill(tail, slot=0), want[0])
    rows = s.step_batch([2, 0], [8, 7])
    assert np.array_equal(rows[0], want[2]) and np.array_equal(rows[1], want[1])


def test_slot_refusals_come_before_any_work(device):
    s = session(3, device=device)
    s.prefill([1, 2, 3], slot=1)
    cases = [
        (lambda: s.step_batch([1, 1], [4, 5]), 601, "twice"),
        (lambda: s.step_batch([0, 3], [4, 5]), 601, "slot 3"),
        (lambda: s.step_batch([], []), 601, "at least one"),
        (lambda: s.step_batch([0], [4, 5]), 601, "token ids"),
        (lambda: s.step_batch([0, 1], [4, DIMS["vocab"]]), 601, "vocabulary"),
        (lambda: s.copy_prefix(1, 1, 2), 601, "truncate"),
        (lambda: s.copy_prefix(1, 2, 4), 601, "holds 3"),
        (lambda: s.truncate(4, slot=1), 601, "holds 3"),
        (lambda: s.prefill([1], slot=-1), 601, "slot -1"),
        (lambda: session(0, device=device), 601, "slots must be"),
        (lambda: session(1025, device=device), 602, "RESIDENT_MAX_SLOTS"),
    ]
    for call, status, words in cases:
        with pytest.raises(ResidentError) as e:
            call()
        assert e.value.status == status and words in str(e.value), (words, str(e.value))
    with pytest.raises(TypeError):
        s.step_batch([0.5], [1])
    assert [s.slot_position(k) for k in range(3)] == [0, 3, 0]


def test_a_full_slot_refuses_the_whole_batch_and_moves_no_one():
    # SessionBase's refusal, the same code for both engines (filling 512 positions would take
    # the CUDA emulator most of a minute)
    s = session(2, max_ctx=512)
    s.prefill(np.arange(s.capacity) % DIMS["vocab"], slot=1)
    s.prefill([1], slot=0)
    with pytest.raises(ResidentError) as e:
        s.step_batch([0, 1], [2, 3])
    assert e.value.status == 606 and "slot 1" in str(e.value)
    assert (s.slot_position(0), s.slot_position(1)) == (1, s.capacity)


def test_resident_bytes_count_every_slot():
    one, three = session(1), session(3)
    kv = three.resident_bytes - one.resident_bytes
    assert kv > 0 and kv % 2 == 0
    assert one.resident_bytes - kv // 2 > 0  # the weights are counted once

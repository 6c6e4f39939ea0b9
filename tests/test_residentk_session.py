"""ResidentSession against the independent NumPy float64 reference (tests/qwen3_reference.py):
prefill logits, step-by-step logits and greedy tokens of two-layer models, plus the session's
contract (capacity, dispatch count, the weight registry, refusals, reset, sampling, greedy).

One test body per engine (the `device` fixture, conftest.py): the CPU engine always, the CUDA
engine where this build and host have one (a device, or the CPU emulator in the ALGENTA_CUDA_EMU
build). The contract is written once (SessionBase, session_weights) for both, and tested on both,
so the copies can never drift again."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import qwen3_reference as ref
from algenta import ResidentError, ResidentUnavailableError, _core
from algenta.errors import ResidentWarning
from algenta.residentk.session import ResidentSession, random_weights
from algenta.residentk.weights import Bf16Bits
from conftest import ISAS

pytestmark = pytest.mark.kernels

RC = _core.residentk

# Awkward on purpose: d_model not a multiple of any SIMD width, h_q*d_head != d_model, a prime
# vocabulary, GQA groups of 1 and 3, tied and untied heads.
CONFIGS = {
    "gqa2_untied": dict(d_model=52, h_q=4, h_kv=2, d_head=16, d_ff=84, n_layers=2, vocab=101,
                        rms_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False),
    "mha_tied": dict(d_model=40, h_q=2, h_kv=2, d_head=32, d_ff=72, n_layers=2, vocab=89,
                     rms_eps=1e-5, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "gqa3_tied": dict(d_model=64, h_q=6, h_kv=2, d_head=8, d_ff=100, n_layers=2, vocab=131,
                      rms_eps=1e-6, rope_theta=500.0, tie_word_embeddings=True),
}

# float32 engine vs float64 reference on O(1) logits: a few float32 ulps times the reduction
# widths; 2e-5 is ~100x what the engine shows and far below any real error (a wrong RoPE
# pairing, head mapping or norm moves logits by O(0.1)).
TOL = 2e-5


def _pair(name, seed=0):
    cfg = CONFIGS[name]
    return cfg, ref.random_weights(cfg, seed)


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_golden_two_layer_prefill_steps_greedy(name, device):
    cfg, w = _pair(name, seed=7)
    s = ResidentSession(cfg, w, max_ctx=64, device=device)
    prompt = [1, 5, 9, 2, 33, 17, 0]
    want = ref.greedy(cfg, w, prompt, 12)
    full = ref.forward(cfg, w, prompt + want)
    lg = s.prefill(prompt)
    assert lg.dtype == np.float32 and lg.shape == (cfg["vocab"],)
    np.testing.assert_allclose(lg, full[len(prompt) - 1], rtol=0, atol=TOL)
    for i, t in enumerate(want[:-1]):
        lg = s.step(t)
        np.testing.assert_allclose(lg, full[len(prompt) + i], rtol=0, atol=TOL)
    assert s.position == len(prompt) + len(want) - 1
    assert s.generate(prompt, 12) == want


def test_prefill_narrow_wide_and_blocked_paths_agree_with_reference(device):
    # 300 tokens: two prefill blocks (256 + 44), both on the wide GEMM path; 5 and 31 tokens on
    # the narrow tile; and a prompt fed as prefill(5) + prefill(31) continuing at position 5.
    cfg, w = _pair("gqa2_untied", seed=3)
    ids = np.random.default_rng(0).integers(0, cfg["vocab"], 300)
    full = ref.forward(cfg, w, ids)
    s = ResidentSession(cfg, w, max_ctx=300, device=device)
    np.testing.assert_allclose(s.prefill(ids), full[-1], rtol=0, atol=TOL)
    assert s.position == 300
    for n in (5, 31, 32, 33):
        s.reset()
        np.testing.assert_allclose(s.prefill(ids[:n]), full[n - 1], rtol=0, atol=TOL)
    s.reset()
    s.prefill(ids[:5])
    np.testing.assert_allclose(s.prefill(ids[5:36]), full[35], rtol=0, atol=TOL)
    np.testing.assert_allclose(s.step(int(ids[36])), full[36], rtol=0, atol=TOL)


def test_capacity_dispatches_and_properties(device):
    cfg, w = _pair("gqa3_tied")
    s = ResidentSession(cfg, w, max_ctx=600, device=device)
    assert s.max_ctx == 600
    assert s.capacity == RC.resident_bucket_ctx(600) == 1024
    assert s.device == device and dict(s.config) == {**cfg, "family": {}} and s.config.d_head == 8
    assert s.dispatches_per_token == 0
    s.prefill([1, 2, 3])
    s.step(4)
    assert s.dispatches_per_token == RC.residentk_dispatch_budget(cfg["n_layers"]) == 15


def test_reset_rewinds_bit_exactly(device):
    cfg, w = _pair("gqa2_untied", seed=1)
    s = ResidentSession(cfg, w, device=device)
    a = s.prefill([4, 8, 15, 16])
    b = s.step(23)
    s.reset()
    assert s.position == 0 and s.capacity == 512
    np.testing.assert_array_equal(s.prefill([4, 8, 15, 16]), a)
    np.testing.assert_array_equal(s.step(23), b)


def test_context_refusal_before_first_token_leaves_session_untouched(device):
    cfg, w = _pair("mha_tied", seed=2)
    s = ResidentSession(cfg, w, max_ctx=10, device=device)
    s.prefill([1, 2, 3])
    want = s.step(4)
    s.reset()
    s.prefill([1, 2, 3])
    with pytest.raises(ResidentError) as e:
        s.generate([1, 2, 3, 4, 5, 6], 5)  # 11 > max_ctx 10
    assert e.value.status == 606 and e.value.status_name == "resident_kv_context_full"
    assert s.position == 3
    np.testing.assert_array_equal(s.step(4), want)
    assert len(s.generate([1, 2, 3, 4, 5], 5)) == 5  # exactly max_ctx fits


@pytest.mark.one_order
def test_step_and_prefill_past_capacity_refuse_606(device):
    cfg, w = _pair("gqa3_tied", seed=4)
    s = ResidentSession(cfg, w, max_ctx=8, device=device)  # capacity 512
    ids = np.arange(510) % cfg["vocab"]
    s.prefill(ids)
    with pytest.raises(ResidentError) as e:
        s.prefill([1, 2, 3])
    assert e.value.status == 606 and s.position == 510
    s.step(1)
    s.step(2)
    with pytest.raises(ResidentError) as e:
        s.step(3)
    assert e.value.status == 606 and s.position == 512
    # A token outside the vocabulary is 601 whether or not the cache is full: the request's own
    # fault is named before the session's state.
    for call in (lambda: s.step(cfg["vocab"]), lambda: s.prefill([1, -1])):
        with pytest.raises(ResidentError) as e:
            call()
        assert e.value.status == 601 and s.position == 512


def test_sampling_is_reproducible_with_a_seed_and_respects_filters(device):
    cfg, w = _pair("gqa2_untied", seed=5)
    s = ResidentSession(cfg, w, max_ctx=64, device=device)
    p = [3, 1, 4, 1, 5]
    greedy = s.generate(p, 10)
    a = s.generate(p, 10, temperature=1.3, seed=11)
    b = s.generate(p, 10, temperature=1.3, seed=11)
    assert a == b
    runs = {tuple(s.generate(p, 10, temperature=1.3, seed=k)) for k in range(6)}
    assert len(runs) > 1  # a sampler that ignored its seed would give one run
    assert s.generate(p, 10, temperature=0.7, top_k=1, seed=3) == greedy
    assert s.generate(p, 10, temperature=0.7, top_p=1e-9, seed=3) == greedy
    # top_k=3: every sampled id is among the 3 largest logits at its position.
    toks = s.generate(p, 8, temperature=5.0, top_k=3, seed=9)
    s.reset()
    lg = s.prefill(p)
    for t in toks:
        assert t in np.argsort(-lg)[:3]
        lg = s.step(t)


def test_stream_callback_and_stop_ids(device):
    cfg, w = _pair("gqa3_tied", seed=6)
    s = ResidentSession(cfg, w, max_ctx=64, device=device)
    full = s.generate([7, 7, 2], 12)
    seen = []
    got = s.generate([7, 7, 2], 12, on_token=seen.append, stop_ids=[full[4]])
    k = full.index(full[4])
    assert got == full[: k + 1] and seen == got


def test_random_matches_reference_on_the_same_weights(device):
    cfg = dict(CONFIGS["gqa2_untied"])
    a = ResidentSession.random(52, 4, 2, 16, 84, 2, 101, seed=3, rope_theta=10_000.0,
                               tie_word_embeddings=False, device=device)
    b = ResidentSession.random(52, 4, 2, 16, 84, 2, 101, seed=3, rope_theta=10_000.0,
                               tie_word_embeddings=False, device=device)
    c = ResidentSession.random(52, 4, 2, 16, 84, 2, 101, seed=4, rope_theta=10_000.0,
                               tie_word_embeddings=False, device=device)
    la, lb, lc = a.prefill([1, 2, 3]), b.prefill([1, 2, 3]), c.prefill([1, 2, 3])
    np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(la, lc)
    w = dict(random_weights(cfg, seed=3))
    np.testing.assert_allclose(la, ref.forward(cfg, w, [1, 2, 3])[-1], rtol=0, atol=TOL)


# ---- refusals -------------------------------------------------------------------------------

def test_weight_shape_mismatch_names_the_tensor(device):
    cfg, w = _pair("gqa2_untied")
    w = dict(w)
    name = "model.layers.1.self_attn.k_proj.weight"
    w[name] = w[name][:, :-1]
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, device=device)
    assert e.value.status == 607 and name in str(e.value)


def test_missing_unknown_and_non_finite_tensors(device):
    cfg, w = _pair("gqa2_untied")
    w = dict(w)
    del w["lm_head.weight"]
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, device=device)
    assert e.value.status == 607 and "lm_head.weight" in str(e.value)
    _, w = _pair("gqa2_untied")
    w = dict(w, **{"model.layers.2.mlp.up_proj.weight": np.zeros((84, 52), np.float32)})
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, device=device)
    assert e.value.status == 607 and "model.layers.2.mlp.up_proj.weight" in str(e.value)
    _, w = _pair("gqa2_untied")
    w["model.norm.weight"] = w["model.norm.weight"].copy()
    w["model.norm.weight"][3] = np.nan
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, device=device)
    assert e.value.status == 609 and "model.norm.weight" in str(e.value)


def test_tied_config_with_a_shipped_head_follows_transformers(device):
    # transformers 5.x: a shipped lm_head.weight equal to the embedding table is the tie; one
    # that differs is kept as a separate head, with a warning. The session computes the same.
    cfg, w = _pair("mha_tied")
    same = dict(w, **{"lm_head.weight": w["model.embed_tokens.weight"].copy()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ResidentSession(cfg, same, device=device)
    assert s.config.tie_word_embeddings
    np.testing.assert_allclose(s.prefill([1, 2]), ref.forward(cfg, w, [1, 2])[-1], atol=TOL)

    head = np.random.default_rng(5).standard_normal((89, 40)).astype(np.float32)
    other = dict(w, **{"lm_head.weight": head})
    with pytest.warns(ResidentWarning, match="keeps the two apart"):
        s = ResidentSession(cfg, other, device=device)
    untied = dict(cfg, tie_word_embeddings=False)
    assert not s.config.tie_word_embeddings
    np.testing.assert_allclose(s.prefill([1, 2]), ref.forward(untied, other, [1, 2])[-1],
                               atol=TOL)
    assert s.resident_bytes == ResidentSession(untied, other, device=device).resident_bytes
    # A stream cannot be looked ahead in: refused once both have arrived, in either order.
    for order in (list(other.items()), list(other.items())[::-1]):
        with pytest.raises(ResidentError) as e:
            ResidentSession(cfg, iter(order), device=device)
        assert e.value.status == 607 and "tie_word_embeddings false" in str(e.value)
    s = ResidentSession(cfg, iter(same.items()), device=device)  # an equal head streams fine
    assert s.config.tie_word_embeddings


@pytest.mark.parametrize("change,status", [
    (dict(h_q=3, h_kv=2), 603),      # h_q not a multiple of h_kv
    (dict(d_head=12), 603),          # d_head not a power of two
    (dict(d_ff=0), 601),
    (dict(vocab=0), 601),
    (dict(n_layers=1 << 20), 602),
])
def test_shape_refusals(change, status, device):
    cfg = dict(CONFIGS["gqa2_untied"], **change)
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, {}, device=device)
    assert e.value.status == status


def test_scalar_token_and_context_refusals(device):
    cfg, w = _pair("gqa2_untied")
    with pytest.raises(ResidentError) as e:
        ResidentSession(dict(cfg, rms_eps=float("nan")), w, device=device)
    assert e.value.status == 609
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, max_ctx=70_000, device=device)
    assert e.value.status == 602
    s = ResidentSession(cfg, w, device=device)
    for bad in ([1, 101], [-1]):
        with pytest.raises(ResidentError) as e:
            s.generate(bad, 2)
        assert e.value.status == 601
    with pytest.raises(ResidentError) as e:
        s.step(101)
    assert e.value.status == 601 and s.position == 0
    with pytest.raises(ResidentError):
        s.generate([1], 2, temperature=-1.0)
    with pytest.raises(TypeError):
        s.step(1.5)
    with pytest.raises(TypeError):
        s.generate([[1, 2]], 2)


def test_refusals_carry_a_status_and_say_what_is_wrong(device):
    # Integers past int64 reach no binding unconverted; an id is reported as it was written.
    cfg, w = _pair("gqa2_untied")
    for weights in ("int4", None, 8):
        with pytest.raises(ResidentError) as e:
            ResidentSession(cfg, w, device=device, weights=weights)
        assert e.value.status == 601 and "weights must be one of" in str(e.value)
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, device=device, max_ctx=2**70)
    assert e.value.status == 602
    s = ResidentSession(cfg, w, device=device)
    cases = [(lambda: s.generate([1], 2**70), 606, "does not fit"),
             (lambda: s.generate([1], -1), 601, "n_new must be >= 0"),
             (lambda: s.generate([], 3), 601, "prompt_ids is empty"),
             (lambda: s.step(2**64), 601, str(2**64)),
             (lambda: s.prefill([2**63]), 601, str(2**63)),
             (lambda: s.prefill(np.array([2**64 - 1], np.uint64)), 601, str(2**64 - 1)),
             (lambda: s.prefill([3, 2**90]), 601, str(2**90)),
             (lambda: s.generate([1], 2, temperature=1.0, seed=-1), 601, "seed"),
             (lambda: s.generate([1], 2, top_k=0), 601, "top_k"),
             (lambda: s.generate([1], 2, top_p=2), 609, "top_p")]
    for call, status, words in cases:
        with pytest.raises(ResidentError) as e:
            call()
        assert e.value.status == status and words in str(e.value), (status, str(e.value))
    assert s.position == 0
    with pytest.raises(TypeError):
        s.prefill([1.5])


def test_weights_must_be_floating_point(device):
    # A complex tensor would lose its imaginary part and an integer one is most likely a packed
    # quantized format whose values are not the weights: refused, naming the tensor.
    torch = pytest.importorskip("torch")
    cfg, w = _pair("gqa2_untied")
    name = "model.norm.weight"
    for bad in (np.ones(52, np.complex64), np.ones(52, bool), np.ones(52, np.int32),
                torch.ones(52, dtype=torch.complex64), torch.ones(52, dtype=torch.bool),
                torch.ones(52, dtype=torch.int8)):
        with pytest.raises(TypeError, match=f"{name} must hold floating-point values"):
            ResidentSession(cfg, dict(w, **{name: bad}), device=device)
    s = ResidentSession(cfg, dict(w, **{name: torch.from_numpy(w[name]).double()}),
                        device=device)
    np.testing.assert_allclose(s.prefill([1, 2]), ref.forward(cfg, w, [1, 2])[-1], atol=TOL)


def test_temperatures_down_to_the_smallest_subnormal_sample_finite_probabilities():
    # exp((z - max) / T): finite at every T > 0, so a tiny temperature is the greedy limit
    # (one maximum here) instead of NaN probabilities from inf / inf.
    cfg, w = _pair("gqa2_untied")
    s = ResidentSession(cfg, w)
    greedy = s.generate([1, 5, 9], 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (5e-324, 1e-320, 1e-300, 1e-30):
            assert s.generate([1, 5, 9], 8, temperature=t, seed=4) == greedy
    from algenta.residentk.session import _sampler

    pick = _sampler(1.0, None, None, 0, 4)
    with pytest.raises(ResidentError) as e:
        pick(np.array([0.0, np.nan, 1.0, 2.0], np.float32))
    assert e.value.status == 609


@pytest.mark.cuda
def test_cuda_device_refuses_with_604_or_605_where_unavailable():
    cfg, w = _pair("gqa2_untied")
    backend = _core.session.cuda_backend()
    if backend["usable"]:
        pytest.skip(f"a CUDA backend is usable here ({backend['kind']})")
    with pytest.raises(ResidentUnavailableError) as e:
        ResidentSession(cfg, w, device="cuda")
    assert e.value.status == (604 if backend["kind"] == "none" else 605)
    assert backend["why"] and backend["why"] in str(e.value)
    assert ResidentSession(cfg, w, device="auto").device == "cpu"


@pytest.mark.cuda
def test_no_device_605_names_the_cuda_error_and_versions():
    # The emulator can play a host without a device (ALGENTA_EMU_DEVICES=0): the refusal must
    # say what failed, with the driver's and the runtime's CUDA versions.
    if _core.session.cuda_backend()["kind"] != "emulator":
        pytest.skip("needs the emulation build (which can pretend to have no device)")
    import os
    import subprocess
    import sys

    code = ("from algenta.residentk.session import ResidentSession\n"
            "from algenta import ResidentUnavailableError, _core\n"
            "try:\n"
            "    ResidentSession.random(40, 2, 2, 32, 72, 1, 89, device='cuda')\n"
            "except ResidentUnavailableError as e:\n"
            "    print(e.status, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, ALGENTA_EMU_DEVICES="0"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("605 ") and "cudaErrorNoDevice" in r.stdout, r.stdout
    assert "no CUDA driver found" in r.stdout and "runtime is CUDA 13.0" in r.stdout, r.stdout


# ---- greedy, the registry, source types ------------------------------------------------------

def test_greedy_argmax_is_numpy_argmax():
    rng = np.random.default_rng(0)
    cases = [np.array([1.0, 3.0, 3.0, 2.0]), np.array([np.nan, 5.0]), np.array([1.0, np.nan]),
             np.array([np.inf, 1.0, np.nan, np.nan]), np.array([-np.inf, -np.inf]),
             np.array([2.0]), np.array([0.0, -0.0])]
    for _ in range(50):
        a = rng.integers(-3, 3, 40).astype(np.float32)
        a[rng.random(40) < 0.1] = np.nan
        a[rng.random(40) < 0.1] = np.inf
        cases.append(a)
    for a in cases:
        a = np.asarray(a, np.float32)
        assert _core.session.greedy_argmax(a) == int(np.argmax(a)), a


def test_step_greedy_is_the_argmax_of_step(device):
    cfg, w = _pair("gqa3_tied", seed=11)
    s = ResidentSession(cfg, w, max_ctx=64, device=device)
    prompt = [5, 6, 7]
    for t in (3, 9, 130):
        s.reset()
        s.prefill(prompt)
        g = s._engine.step_greedy(t)
        assert s.position == 4
        s.reset()
        s.prefill(prompt)
        assert g == int(np.argmax(s.step(t)))
        assert s.dispatches_per_token == RC.residentk_dispatch_budget(cfg["n_layers"])


def test_nan_logits_greedy_picks_the_first_nan(device):
    # Logits with NaNs and infinities, by construction, identically on every engine: zero output
    # projections keep the residual stream equal to the embedding, whose element 0 the final
    # norm's weight (3e38, finite) pushes past float32's range. xf[0] = inf, so row v of the head
    # gives NaN where H[v, 0] == 0 (0 * inf) and +/-inf where it is not. numpy.argmax's order
    # (the engines' too) picks the first NaN; a plain '>' argmax would pick the first +inf.
    cfg = dict(CONFIGS["gqa2_untied"])
    w = {k: v.copy() for k, v in ref.random_weights(cfg, 2).items()}
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k][:] = 0
    w["model.embed_tokens.weight"][4] = 1.0
    w["model.embed_tokens.weight"][4, 0] = 5.0
    w["model.norm.weight"][:] = 1.0
    w["model.norm.weight"][0] = 3e38
    head = w["lm_head.weight"]
    head[:, 0] = 1.0
    head[[0, 2], 0] = -1.0  # -inf
    head[[7, 9, 40], 0] = 0.0  # NaN
    s = ResidentSession(cfg, w, max_ctx=64, device=device)
    lg = s.prefill([4])
    assert np.isnan(lg[[7, 9, 40]]).all() and lg[0] == -np.inf and lg[1] == np.inf
    assert int(np.argmax(lg)) == 7
    assert s._engine.step_greedy(4) == 7
    assert s.generate([4], 1) == [7]


def test_refused_tensor_is_left_unset(device):
    cfg, w = _pair("gqa2_untied")
    s = ResidentSession(cfg, w, device=device)
    name = "model.layers.1.mlp.up_proj.weight"
    bad = w[name].copy()
    bad[3, 5] = np.inf
    with pytest.raises(ResidentError) as e:
        s._engine.set_weight(name, bad)
    assert e.value.status == 609 and name in str(e.value) and f"flat index {3 * 52 + 5}" in str(e.value)
    assert s._engine.missing_weights() == [name]  # never half old, half new
    with pytest.raises(ResidentError) as e:
        s.prefill([1])
    assert e.value.status == 607 and name in str(e.value) and s.position == 0
    s._engine.set_weight(name, w[name])
    np.testing.assert_allclose(s.prefill([1, 2]), ref.forward(cfg, w, [1, 2])[-1], atol=TOL)


def test_f16_and_bf16_sources_widen_exactly(device):
    # float16 arrays, bf16 bit patterns (Bf16Bits, the loader's form) and torch bfloat16 tensors
    # are widened by the engine itself; a session from them equals, bit for bit, one from the
    # same values already widened to float32 by NumPy.
    cfg, w = _pair("gqa3_tied", seed=4)
    half = {k: v.astype(np.float16) for k, v in w.items()}
    bits = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in w.items()}
    want_h = ResidentSession(cfg, {k: v.astype(np.float32) for k, v in half.items()},
                             device=device).prefill([1, 2, 3])
    got_h = ResidentSession(cfg, half, device=device).prefill([1, 2, 3])
    np.testing.assert_array_equal(got_h, want_h)
    widened = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    want_b = ResidentSession(cfg, widened, device=device).prefill([1, 2, 3])
    got_b = ResidentSession(cfg, {k: Bf16Bits(b) for k, b in bits.items()},
                            device=device).prefill([1, 2, 3])
    np.testing.assert_array_equal(got_b, want_b)
    torch = pytest.importorskip("torch")
    tb = {k: torch.from_numpy(v.copy()).to(torch.bfloat16) for k, v in widened.items()}
    np.testing.assert_array_equal(ResidentSession(cfg, tb, device=device).prefill([1, 2, 3]),
                                  want_b)


def test_unaligned_bf16_and_f16_sources(device):
    # A tensor's bytes in a memory-mapped file need not be aligned: read bytewise, same values.
    cfg, w = _pair("mha_tied", seed=8)
    def odd(a, dt):
        raw = np.zeros(a.size * 2 + 1, np.uint8)
        view = raw[1:].view(dt).reshape(a.shape)
        view[...] = a
        return view
    half = {k: odd(v.astype(np.float16), np.float16) for k, v in w.items()}
    assert not half["model.embed_tokens.weight"].flags.aligned
    want = ResidentSession(cfg, {k: v.astype(np.float16) for k, v in w.items()},
                           device=device).prefill([3, 4])
    np.testing.assert_array_equal(ResidentSession(cfg, half, device=device).prefill([3, 4]), want)
    bits = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in w.items()}
    want = ResidentSession(cfg, {k: Bf16Bits(b) for k, b in bits.items()},
                           device=device).prefill([3, 4])
    oddb = {k: Bf16Bits(odd(b, np.uint16)) for k, b in bits.items()}
    np.testing.assert_array_equal(ResidentSession(cfg, oddb, device=device).prefill([3, 4]), want)


# ---- thread count and instruction set ----------------------------------------------------------

_PROBE = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import qwen3_reference as ref
from test_residentk_session import CONFIGS
from algenta.residentk.session import ResidentSession
cfg = CONFIGS["gqa2_untied"]
w = ref.random_weights(cfg, 9)
s = ResidentSession(cfg, w, max_ctx=64)
ids = list(range(40))
out = [s.prefill(ids[:3]), s.step(7)]
s.reset()
out.append(s.prefill(ids))
print(np.concatenate(out).astype(np.float32).tobytes().hex())
"""


# A head and MLP wide enough for a decode step's two-block tasks on one thread (1,100 and 600 rows:
# at least four 128-row tasks a thread) and one-block tasks on three (fewer than twelve), in
# every weight format; int8 there multiplies up to eight panels a tile (AVX-512), ending on
# partial ones.
_TASKS_PROBE = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import qwen3_reference as ref
from test_residentk_session import CONFIGS
from algenta.residentk.session import ResidentSession
cfg = dict(CONFIGS["gqa2_untied"], d_ff=600, vocab=1100)
w = ref.random_weights(cfg, 9)
out = []
for fmt in ("f32", "bf16", "f16", "int8"):
    s = ResidentSession(cfg, w, max_ctx=64, weights=fmt)
    out += [s.prefill(list(range(5))), s.step(7), s.step(900)]
print(np.concatenate(out).astype(np.float32).tobytes().hex())
"""


def _probe(env_extra, code=_PROBE):
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **env_extra)
    r = subprocess.run([sys.executable, "-c", code.format(tests=tests)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return np.frombuffer(bytes.fromhex(r.stdout.strip()), np.float32)


def test_logits_are_bit_identical_for_every_thread_count():
    a = _probe({"OMP_NUM_THREADS": "1"})
    b = _probe({"OMP_NUM_THREADS": "3"})
    np.testing.assert_array_equal(a, b)


def test_decode_task_size_does_not_change_the_bits():
    """A decode step's rows go to tasks of two panel blocks where every thread still gets four
    (session_cpu.cpp, step_task_rows), of one elsewhere: one thread and three give the same
    logits in every weight format."""
    a = _probe({"OMP_NUM_THREADS": "1"}, _TASKS_PROBE)
    b = _probe({"OMP_NUM_THREADS": "3"}, _TASKS_PROBE)
    assert a.size == 4 * 3 * 1100
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_matches_the_reference(isa):
    import os
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-c", "import algenta; print(algenta._core.isa_name())"],
                        env=dict(os.environ, ALGENTA_ISA=isa), capture_output=True, text=True)
    if ok.stdout.strip() != isa:
        pytest.skip(f"{isa} is not available on this host")
    got = _probe({"ALGENTA_ISA": isa})
    cfg, w = CONFIGS["gqa2_untied"], ref.random_weights(CONFIGS["gqa2_untied"], 9)
    ids = list(range(40))
    full = ref.forward(cfg, w, ids)
    full7 = ref.forward(cfg, w, ids[:3] + [7])
    want = np.concatenate([full[2], full7[3], full[-1]])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)

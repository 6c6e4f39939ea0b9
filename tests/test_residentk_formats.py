"""Resident weight formats of the CPU session (weights="bf16", "f16", "int8"): logits against the
float32 engine and against independent models of each format, greedy agreement over 64 steps,
bit-identical logits for every thread count, a bfloat16 checkpoint kept bit for bit, the
refusals (a value past float16's range, an unknown name), "auto" device choice, and the CLI.

Measured on the project's random checkpoints (tests/qwen3_reference.py random_weights, seed 3;
the three CONFIGS and a 4-layer d_model-256 model), largest logit deviation from the float32
engine over a 7-token prefill and 63 decode steps, relative to the largest |logit|:

    bf16  2.3e-3 .. 6.9e-3     f16  1.9e-4 .. 5.7e-4     int8  8.3e-3 .. 1.7e-2

(bf16 and int8 multiply bf16-rounded and int8-quantized activations; with float32 activations
they were 1.7e-3 .. 4.5e-3 and 5.8e-3 .. 1.2e-2) and greedy decoding agreed with the float32
engine on all 64 tokens in every case. The bounds below are about three times those figures.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import qwen3_reference as ref
from algenta import ResidentError, _core
from algenta.residentk.session import ResidentSession
from algenta.residentk.weights import Bf16Bits
from conftest import CUDA, ISAS
from test_residentk_session import CONFIGS

pytestmark = pytest.mark.kernels

REL = {"bf16": 2e-2, "f16": 2e-3, "int8": 5e-2}
BIG = dict(d_model=256, h_q=4, h_kv=2, d_head=64, d_ff=704, n_layers=4, vocab=2003,
           rms_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
MODELS = {**CONFIGS, "big": BIG}
PROMPT = [1, 5, 9, 2, 33, 17, 0]


def _trace(cfg, w, fmt, steps):
    """Prefill logits then one per decode step, feeding the float32 engine's greedy tokens."""
    s = ResidentSession(cfg, w, max_ctx=128, weights=fmt)
    out = [s.prefill(PROMPT)]
    out += [s.step(t) for t in steps]
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fmt", ["bf16", "f16", "int8"])
def test_logits_and_greedy_against_the_float32_engine(name, fmt):
    cfg = MODELS[name]
    w = ref.random_weights(cfg, 3)
    f32 = ResidentSession(cfg, w, max_ctx=128)
    want = f32.generate(PROMPT, 64)
    base = _trace(cfg, w, "f32", want[:-1])
    got = _trace(cfg, w, fmt, want[:-1])
    scale = max(float(np.abs(x).max()) for x in base)
    dev = max(float(np.abs(a - b).max()) for a, b in zip(got, base))
    assert dev <= REL[fmt] * scale, (fmt, dev, scale)
    assert dev > 0.0  # the format is really in use
    s = ResidentSession(cfg, w, max_ctx=128, weights=fmt)
    assert s.generate(PROMPT, 64) == want


def _bf16_values(a):
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_bf16_checkpoint_keeps_its_bits():
    """A bf16 checkpoint held as bf16 keeps the checkpoint's bits: loading the bits, or their
    exact float32 values, gives the same resident weights and so the same logits, bit for bit;
    and those logits are the float64 model's of the same weights times bf16-rounded
    activations."""
    cfg = CONFIGS["gqa3_tied"]
    bits = {k: _bf16_values(v) for k, v in ref.random_weights(cfg, 5).items()}
    widened = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    a = ResidentSession(cfg, {k: Bf16Bits(b) for k, b in bits.items()}, weights="bf16")
    b = ResidentSession(cfg, widened, weights="bf16")
    got = [a.prefill(PROMPT)]
    np.testing.assert_array_equal(got[0], b.prefill(PROMPT))
    for t in (3, 7, 11):
        got.append(a.step(t))
        np.testing.assert_array_equal(got[-1], b.step(t))
    want = ref.forward(cfg, widened, PROMPT + [3, 7, 11], act=ref.bf16_activations)[6:]
    np.testing.assert_allclose(np.stack(got), want, rtol=0,
                               atol=TOL["bf16"] * max(1.0, float(np.abs(want).max())))


def test_f16_values_are_held_exactly():
    cfg = CONFIGS["gqa2_untied"]
    w = {k: v.astype(np.float16).astype(np.float32) for k, v in ref.random_weights(cfg, 6).items()}
    a = ResidentSession(cfg, w, weights="f16")
    b = ResidentSession(cfg, w, weights="f32")
    np.testing.assert_array_equal(a.prefill(PROMPT), b.prefill(PROMPT))
    np.testing.assert_array_equal(a.step(4), b.step(4))


def _quantize_q8(a):
    """An independent model of the int8 weights: per row, blocks of 32, scale amax / 127,
    round half to even, dequantized (the activations' rule, qwen3_reference.q8_activations)."""
    return ref.q8_activations(a).astype(np.float32)


# The activations each format multiplies: int8 rounds them to int8 blocks (Q8_0 x Q8_0), bf16
# to bf16 (as transformers' and llama.cpp's bf16 matmuls), f16 multiplies float32 activations.
ACT = {"bf16": ref.bf16_activations, "f16": None, "int8": ref.q8_activations}
# Against the float64 model of the same format: float32 rounding (5e-5 x max|logit|), and for
# bf16 and int8 the activation that rounds to its neighbouring bf16 value or int8 quantum (see
# test_int8_matches_an_independent_quantizer; measured up to 1.7e-3 for bf16 and 7.3e-3 for int8
# over the four models, three seeds, 7- and 40-token prompts and every ISA).
TOL = {"bf16": 5e-3, "f16": 5e-5, "int8": 1.5e-2}


def test_int8_matches_an_independent_quantizer():
    """Prefill and decode steps against the float64 model of int8 weights times int8 activation
    blocks. Mostly only float32 rounding remains (about 1e-7 x max|logit|), but where the
    engine's float32 activation and the reference's land on opposite sides of a rounding
    boundary, one activation moves by one quantum and these small, chaotic random models carry
    that to the logits: measured up to 7.3e-3 x max|logit| over the four models, three seeds,
    7- and 40-token prompts and every ISA. The exactness of the products themselves is
    test_int8_products_against_exact_integer_sums's."""
    cfg = CONFIGS["gqa3_tied"]
    w = ref.random_weights(cfg, 8)
    deq = {k: (_quantize_q8(v) if v.ndim == 2 else v) for k, v in w.items()}
    a = ResidentSession(cfg, w, weights="int8")
    ids = PROMPT + [9, 4]
    want = ref.forward(cfg, deq, ids, act=ref.q8_activations)[len(PROMPT) - 1:]
    got = np.stack([a.prefill(PROMPT), a.step(9), a.step(4)])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL["int8"] * max(1.0, float(np.abs(want).max())))
    # and the activations are really quantized (float32 activations are about 5e-3 away)
    plain = ref.forward(cfg, deq, ids)[len(PROMPT) - 1:]
    assert np.abs(got - plain).max() > 5e-4 * float(np.abs(want).max())


def _held(w):
    """The float32 values each format holds for the weights w (matrices only; norms stay)."""
    return {
        "bf16": {k: (_bf16_values(v).astype(np.uint32) << 16).view(np.float32) if v.ndim == 2
                 else v for k, v in w.items()},
        "f16": {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v
                for k, v in w.items()},
        "int8": {k: _quantize_q8(v) if v.ndim == 2 else v for k, v in w.items()},
    }


def test_against_the_float64_reference_of_the_same_format():
    """Each format against qwen3_reference.forward in float64 over the weights that format
    actually holds (bf16/f16 rounded, int8 dequantized): what remains is float32 rounding."""
    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 2)
    for fmt, ww in _held(w).items():
        want = ref.forward(cfg, ww, PROMPT, act=ACT[fmt])[-1]
        got = ResidentSession(cfg, w, weights=fmt).prefill(PROMPT)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL[fmt] * max(1.0, np.abs(want).max()))


KV = {"bf16": ref.bf16_activations, "f16": ref.f16_values}
KV_UNIT = {"f32": 0.0, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}  # a rounded key or value's step
# The (weights, kv) pairs the thread-count and instruction-set probes run, in _held's order.
PROBE_FORMATS = (("bf16", "f32"), ("f16", "f16"), ("int8", "bf16"))


@pytest.mark.parametrize("kv", ["bf16", "f16"])
def test_kv_cache_formats_against_the_float64_reference(kv):
    """A bf16 or f16 KV cache against the float64 model whose keys and values are rounded as the
    cache holds them (prefill, and steps that read the cache): what remains is float32 rounding,
    and a key or value whose float32 value rounds to its neighbour (one unit of the format:
    2^-8 of it for bf16, 2^-11 for f16) where the float64 one does not. Also with int8 weights:
    the two formats compose."""
    cfg = CONFIGS["gqa2_untied"]
    w = ref.random_weights(cfg, 5)
    ids = PROMPT + [3, 8, 13, 21]
    for fmt, act, tol in (("f32", None, 1e-5), ("int8", ref.q8_activations, TOL["int8"])):
        ww = _held(w)[fmt] if fmt != "f32" else w
        want = ref.forward(cfg, ww, ids, act=act, kv=KV[kv])
        s = ResidentSession(cfg, w, max_ctx=64, weights=fmt, kv=kv)
        assert s.kv == kv and f"kv={kv!r}" in repr(s)
        got = [s.prefill(PROMPT)] + [s.step(t) for t in ids[len(PROMPT):]]
        scale = max(1.0, float(np.abs(want).max()))
        for i, g in enumerate(got):
            np.testing.assert_allclose(g, want[len(PROMPT) - 1 + i], rtol=0,
                                       atol=(tol + KV_UNIT[kv]) * scale, err_msg=f"{fmt} row {i}")
        # and the cache really is narrow: the float32 cache's logits are not these
        f32 = ResidentSession(cfg, w, max_ctx=64, weights=fmt).prefill(PROMPT)
        assert float(np.abs(f32 - got[0]).max()) > 0.0


def test_kv_cache_refusals_and_bytes():
    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 1)
    for bad in ("int8", "fp8", "float16"):
        with pytest.raises(ResidentError) as e:
            ResidentSession(cfg, w, kv=bad)
        assert e.value.status == 601 and "kv" in str(e.value)
    with pytest.raises(ValueError, match="KV cache format"):
        _core.session.cpu_session(40, 2, 2, 32, 72, 2, 89, 1e-5, 1e6, True, 64, kv="int8")
    from algenta.residentk.contract import residentk_footprint

    f32 = ResidentSession(cfg, w, max_ctx=100)
    half = ResidentSession(cfg, w, max_ctx=100, kv="f16")
    fp = residentk_footprint(40, 2, 2, 32, 72, 2, 89, 512, tied=True)
    assert f32.resident_bytes - half.resident_bytes == 2 * fp["kv_cache"]
    h = residentk_footprint(40, 2, 2, 32, 72, 2, 89, 512, tied=True, kv_format="bf16")
    assert h["kv_bytes"] == 2 * h["kv_cache"] == 2 * fp["kv_cache"]


_PROBE = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import qwen3_reference as ref
from test_residentk_formats import BIG
from algenta.residentk.session import ResidentSession
w = ref.random_weights(BIG, 4)
out = []
from test_residentk_formats import PROBE_FORMATS
for fmt, kv in PROBE_FORMATS:
    s = ResidentSession(BIG, w, max_ctx=128, weights=fmt, kv=kv)
    out += [s.prefill(list(range(40))), s.step(7), s.step(8)]
print(np.concatenate(out).astype(np.float32).tobytes().hex())
"""


def _probe(threads, **env_extra):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **env_extra)
    r = subprocess.run([sys.executable, "-c", _PROBE.format(tests=tests)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return np.frombuffer(bytes.fromhex(r.stdout.strip()), np.float32)


@pytest.mark.slow
def test_bit_identical_for_every_thread_count():
    a = _probe(1)
    np.testing.assert_array_equal(a, _probe(2))
    np.testing.assert_array_equal(a, _probe(3))


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_against_the_float64_reference(isa):
    """Each ISA's weight panels (decode steps and prefill, one kernel), in every
    format (and a bf16 and an f16 KV cache), against the float64 reference over the values the
    formats hold."""
    ok = subprocess.run([sys.executable, "-c", "import algenta; print(algenta._core.isa_name())"],
                        env=dict(os.environ, ALGENTA_ISA=isa), capture_output=True, text=True)
    if ok.stdout.strip() != isa:
        pytest.skip(f"{isa} is not available on this host")
    got = _probe(2, ALGENTA_ISA=isa).reshape(9, -1)
    w = ref.random_weights(BIG, 4)
    ids = list(range(40)) + [7, 8]
    for k, (fmt, ww) in enumerate(_held(w).items()):
        kv = dict(PROBE_FORMATS)[fmt]
        want = ref.forward(BIG, ww, ids, act=ACT[fmt], kv=KV.get(kv))[39:]
        np.testing.assert_allclose(got[3 * k:3 * k + 3], want, rtol=0,
                                   atol=(TOL[fmt] + KV_UNIT[kv]) * max(1.0, np.abs(want).max()),
                                   err_msg=f"{fmt}, kv {kv}")


def _run_on_isa(code, isa):
    """Runs a kernel probe in a process whose kernels are pinned to isa (skipped where the host
    lacks it); the probe asserts, then prints the ISA it ran on."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, ALGENTA_ISA=isa), timeout=300)
    if "not support" in r.stderr:
        pytest.skip(f"{isa} is not available on this host")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == isa


_INT8_KERNEL = """
import numpy as np
from algenta import _core
rng = np.random.default_rng(5)
# weight rows: one partial panel; three panels; four and a partial fifth; eight ending on a
# partial one; eight and a partial ninth (decode takes up to four panels a tile on AVX2 and
# eight on AVX-512, fewer at the end of a matrix)
for n, rows in [(n, r) for n in (32, 64, 96, 128, 160, 200, 1024, 3072)
                for r in (7, 40, 67, 120, 131)]:
    blocks = -(-n // 32)
    q = rng.integers(-127, 128, size=(rows, n)).astype(np.int8)
    sc = rng.uniform(1e-3, 1.0, size=(rows, blocks)).astype(np.float32)
    sc[0, 0] = 0.0
    x = (rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-3, 3, blocks), 32)[:n])
    x = x.astype(np.float32)
    x[:min(n, 32) // 2] = 0.0
    x[-1] = 1e4  # an outlier takes its block's scale
    y, xq, xs = _core.session.cpu_int8_products(q, sc, x)
    # the activation quantizer, independently: float32 scale amax / 127, half to even, +-127
    for b in range(blocks):
        blk = x[32 * b:32 * b + 32]
        s = np.float32(np.abs(blk).max()) / np.float32(127)
        want = np.rint(blk / s).clip(-127, 127) if s > 0 else np.zeros_like(blk)
        assert xs[b] == s, (n, b, xs[b], s)
        assert np.array_equal(xq[32 * b:32 * b + 32], want.astype(np.int8)), (n, b)
    # exact integer block sums, each times sw * sx rounded to float32 once
    prod = q.astype(np.int64) * xq.astype(np.int64)
    isum = np.add.reduceat(prod, np.arange(0, n, 32), axis=1).astype(np.float64)
    c = (sc * xs[None, :]).astype(np.float32).astype(np.float64)
    want = (isum * c).sum(axis=1)
    bound = 2e-6 * (np.abs(isum) * c).sum(axis=1) + 1e-30
    assert np.all(np.abs(y - want) <= bound), (n, np.abs(y - want) / bound)
x = np.ones(64, np.float32)
x[40] = np.nan  # a broken activation stays visible, in every row
y, _, _ = _core.session.cpu_int8_products(np.ones((3, 64), np.int8), np.ones((3, 2), np.float32), x)
assert np.isnan(y).all(), y
# whole blocks (vectorized on AVX2 and AVX-512) at the quantizer's edges: all zeros (scale 0),
# an infinity (scale inf, every code 0 as q8_block gives), ties of the scale (to even), the clamp
x = np.zeros(96, np.float32)
x[32], x[33:40] = np.inf, 3.0
x[64], x[65:71] = -127.0, [0.5, 1.5, 2.5, -0.5, -2.5, 127.0]
_, xq, xs = _core.session.cpu_int8_products(np.ones((3, 96), np.int8), np.ones((3, 3), np.float32), x)
assert xs[0] == 0 and not xq[:32].any(), (xs, xq[:32])
assert xs[1] == np.inf and not xq[32:64].any(), (xs, xq[32:64])
assert xs[2] == 1 and list(xq[64:71]) == [-127, 0, 2, 2, 0, -2, 127], (xs, xq[64:71])
print(_core.isa_name())
"""


@pytest.mark.parametrize("isa", ISAS)
def test_int8_products_against_exact_integer_sums(isa):
    """Each ISA's int8 decode product (activation quantizer, integer dots: vpdpbusd on
    avx512bf16, vpmaddubsw elsewhere, scalar on generic) against an independent NumPy model:
    the int8 activations bit for bit, each block's integer sum exact, float32 rounding after."""
    _run_on_isa(_INT8_KERNEL, isa)


_BF16_KERNEL = """
import numpy as np
from algenta import _core
rng = np.random.default_rng(6)
for n in (1, 31, 32, 33, 96, 128, 200, 1024, 3072):  # masked tails, single vectors, quads
    rows = 5
    w32 = rng.standard_normal((rows, n)).astype(np.float32)
    wb = (w32.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 bits will do
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    y, xb = _core.session.cpu_bf16_products(wb, x)
    u = x.view(np.uint32).astype(np.uint64)
    want_b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(xb, want_b), n
    wf = (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    xf = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    prod = wf * xf[None, :]  # exact: a bf16 x bf16 product fits float32's significand
    want = prod.sum(axis=1)
    assert np.all(np.abs(y - want) <= 2e-6 * np.abs(prod).sum(axis=1)), (n, y - want)
print(_core.isa_name())
"""


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_products_against_exact_products(isa):
    """Each ISA's bf16 decode product (vdpbf16ps on avx512bf16, the widening dot elsewhere)
    against NumPy: the activation's bf16 bits exactly, the sum of exact products to float32
    rounding."""
    _run_on_isa(_BF16_KERNEL, isa)


_ELEMENTWISE = """
import numpy as np
from algenta import _core
rng = np.random.default_rng(8)
for n in (1, 15, 16, 17, 100, 3072):  # partial groups of 16 and whole ones
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1.3, n)).astype(np.float32)
    g[: min(n, 4)] = [-100.0, -88.0, 0.0, 30.0][: min(n, 4)]  # past exp's floor, zero, large
    u = rng.standard_normal(n).astype(np.float32)
    gd, ud = g.astype(np.float64), u.astype(np.float64)
    # silu against float64; past g = -87 exp is floored: |g| exp(-87) absolutely
    y = _core.session.cpu_gate(g, u).astype(np.float64)
    want = gd / (1.0 + np.exp(-gd)) * ud
    bound = 4e-7 * np.abs(want) + np.where(gd < -87, np.abs(gd * ud) * 1.7e-38, 1e-45)
    assert np.all(np.abs(y - want) <= bound), (n, np.max(np.abs(y - want) / bound))
    # GELU's tanh form: tanh within 1e-7 absolutely, so the error scales with |g u|
    y = _core.session.cpu_gate(g, u, gelu=True).astype(np.float64)
    want = 0.5 * gd * (1.0 + np.tanh(0.7978845608028654 * (gd + 0.044715 * gd ** 3))) * ud
    assert np.all(np.abs(y - want) <= 4e-7 * np.abs(want) + 1.5e-7 * np.abs(gd * ud)), n
    # an element's bits do not depend on where it sits (decode and prefill start anywhere)
    for gelu in (False, True):
        a = _core.session.cpu_gate(g, u, gelu=gelu)
        assert np.array_equal(_core.session.cpu_gate(g[3:], u[3:], gelu=gelu), a[3:]), n
    # RMSNorm's squares: square i into partial i mod 16, partials added in order, exactly
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20, n)).astype(np.float32)
    xd = x.astype(np.float64) ** 2  # exact
    parts = [np.cumsum(xd[k::16])[-1] if k < n else 0.0 for k in range(16)]
    assert _core.session.cpu_sum_sq(x) == np.cumsum(parts)[-1], n
x = np.array([1.0, np.nan, 2.0], np.float32)
assert np.isnan(_core.session.cpu_gate(x, np.ones(3, np.float32))[1])
assert np.isnan(_core.session.cpu_sum_sq(x))
print(_core.isa_name())
"""


@pytest.mark.parametrize("isa", ISAS)
def test_gate_and_norm_kernels_against_float64(isa):
    """Each ISA's MLP gates (silu, GELU's tanh form) against NumPy float64 within a few float32
    ulps, the same bits for an element wherever it sits, and RMSNorm's sum of squares equal to
    its definition (16 partial sums of exact squares, added in order) on every ISA."""
    _run_on_isa(_ELEMENTWISE, isa)


def test_int8_prefill_gemm_against_exact_integer_sums():
    """The int8 prefill GEMM of the instruction set in use against NumPy on the activations
    decode's quantizer gives: every cell the exact block sums times sw * sx, to float32
    rounding; partial blocks, partial panels and partial row tiles included. And every row is
    bit for bit what a decode step computes for it (one kernel, one sequence per cell)."""
    rng = np.random.default_rng(7)
    for M, N, K in ((1, 16, 32), (5, 33, 52), (40, 84, 100), (7, 64, 128), (3, 40, 1000),
                    (2, 144, 96)):
        nb = -(-K // 32)
        q = rng.integers(-127, 128, size=(N, K)).astype(np.int8)
        sc = rng.uniform(1e-3, 1.0, size=(N, nb)).astype(np.float32)
        X = (rng.standard_normal((M, K)) * 10.0 ** rng.uniform(-2, 2, (M, 1))).astype(np.float32)
        Y = _core.session.cpu_int8_gemm(q, sc, X)
        for r in range(M):
            y1, xq, xs = _core.session.cpu_int8_products(q, sc, X[r])  # checked exact above
            np.testing.assert_array_equal(Y[r], y1, err_msg=f"{M} {N} {K} row {r}")
            prod = q.astype(np.int64) * xq.astype(np.int64)
            isum = np.add.reduceat(prod, np.arange(0, K, 32), axis=1).astype(np.float64)
            c = (sc * xs[None, :]).astype(np.float32).astype(np.float64)
            want = (isum * c).sum(axis=1)
            bound = 2e-6 * (np.abs(isum) * c).sum(axis=1) + 1e-30
            assert np.all(np.abs(Y[r] - want) <= bound), (M, N, K, r)


_PANEL_ROWS = """
import numpy as np
from algenta import _core
rng = np.random.default_rng(8)
def bits(a, fmt):
    if fmt == "f16":
        return a.astype(np.float16).view(np.uint16)
    u = a.view(np.uint32).astype(np.uint64)  # bf16, round to nearest even
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
def values(b, fmt):
    if fmt == "f16":
        return b.view(np.float16).astype(np.float64)
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
# k blocks of 256: one short (1, 255, 300), whole passes (1024), passes whose last block is
# short (600, 900), a short lone block after whole passes (1100, 1300, 2100); partial panels;
# prefill's row counts past two tile rows (30: half panels widened once) and past a row block
# (100: 96 + 4), over several k blocks of every layout (bf16 pairs: blocks of 512)
for M, N, K in ((3, 17, 1), (2, 64, 255), (5, 40, 300), (2, 100, 600), (4, 33, 900),
                (3, 81, 1024), (2, 33, 1100), (6, 130, 1300), (3, 20, 2100), (30, 70, 1100),
                (100, 45, 600)):
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    X = (rng.standard_normal((M, K)) * 10.0 ** rng.uniform(-2, 2, (M, 1))).astype(np.float32)
    for fmt in ("f32", "bf16", "f16"):
        w = w32 if fmt == "f32" else bits(w32, fmt)
        Y = _core.session.cpu_panel_products(w, X, weights=fmt)
        # a batched decode step (rows not packed) gives the same bits as prefill (packed once)
        Yb = _core.session.cpu_panel_products(w, X, weights=fmt, packed=False)
        assert np.array_equal(Y, Yb), (fmt, M, N, K)
        wv = w.astype(np.float64) if fmt == "f32" else values(w, fmt)
        # bf16 activations are rounded to bf16 once per product, on every path
        xv = values(bits(X, "bf16"), "bf16") if fmt == "bf16" else X.astype(np.float64)
        prod = np.abs(wv)[None, :, :] * np.abs(xv)[:, None, :]
        bound = 4e-5 * prod.sum(axis=2) + 1e-30
        assert np.all(np.abs(Y - xv @ wv.T) <= bound), (fmt, M, N, K)
        for r in range(M):  # a decode step's product: the row's bits in the GEMM
            y1 = _core.session.cpu_panel_products(w, X[r:r + 1], weights=fmt)
            assert np.array_equal(y1[0], Y[r]), (fmt, M, N, K, r)
print(_core.isa_name())
"""


@pytest.mark.parametrize("isa", ISAS)
def test_panel_gemm_rows_are_their_decode_products(isa):
    """Each ISA's f32, bf16 and f16 weight panels: every row of a prefill GEMM is bit for bit
    what a decode step's product gives it (one chain per k block, block sums in order, however
    a pass groups panels and k blocks), and what a batched step's unpacked rows give it, over
    short, whole and mixed k blocks, partial panels and several row blocks; and all against
    float64."""
    _run_on_isa(_PANEL_ROWS, isa)


def test_weight_paths_follow_the_instruction_set():
    """What multiplies each format, as the benchmarks report it, is the active instruction
    set's: bf16 pairs on vdpbf16ps and int8 on vpdpbusd where the host has them (amx hosts too:
    the session's bf16 stays off the tiles), the widening and vpmaddubsw paths elsewhere."""
    paths = _core.session.cpu_weight_paths()
    isa = _core.isa_name()
    dot = isa in ("avx512bf16", "amx")
    assert paths == {
        "f32": "fp32", "f16": "fp32 on widened f16",
        "bf16": "vdpbf16ps" if dot else "fp32 on widened bf16",
        "int8": "vpdpbusd" if dot else "vpmaddubsw" if isa in ("avx512", "avx2") else "scalar",
        "q4_0": "scalar on 4-bit codes" if isa == "generic" else "vpmaddubsw on 4-bit codes",
    }, (isa, paths)


def test_int8_products_refuse_mismatched_shapes():
    with pytest.raises(ResidentError) as e:
        _core.session.cpu_int8_products(np.ones((2, 64), np.int8), np.ones((2, 3), np.float32),
                                        np.ones(64, np.float32))
    assert e.value.status == 607 and "ceil(n / 32)" in str(e.value)


def test_value_past_float16_range_is_refused_and_leaves_the_tensor_unset():
    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 1)
    name = "model.layers.1.mlp.up_proj.weight"
    w[name] = w[name].copy()
    w[name][3, 5] = 1e5
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, weights="f16")
    assert e.value.status == 609 and name in str(e.value) and "65504" in str(e.value)
    ResidentSession(cfg, w, weights="bf16")  # bf16 has float32's range
    w[name][3, 5] = 3.4e38  # but not all of it: this rounds up to infinity in bf16
    with pytest.raises(ResidentError) as e:
        ResidentSession(cfg, w, weights="bf16")
    assert e.value.status == 609 and "bf16's range" in str(e.value) and "65504" not in str(e.value)


def test_unknown_format_and_dispatch_count():
    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 1)
    with pytest.raises(ValueError, match="weights must be"):
        ResidentSession(cfg, w, weights="q4")
    with pytest.raises(ValueError):
        _core.session.cpu_session(40, 2, 2, 32, 72, 2, 89, 1e-5, 1e6, True, 64, weights="fp8")
    for fmt in ("f32", "bf16", "f16", "int8"):
        s = ResidentSession(cfg, w, weights=fmt)
        s.prefill([1, 2])
        s.step(3)
        assert s.weights == fmt and fmt in repr(s)
        assert s.dispatches_per_token == _core.residentk.residentk_dispatch_budget(2)


@pytest.mark.cuda
def test_auto_device_takes_every_format():
    # Every format runs on both engines: "auto" picks the CUDA engine wherever it can run, as
    # for float32 (the CUDA engine's formats are tested against this one in
    # test_residentk_cuda.py).
    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 1)
    want = "cuda" if CUDA["usable"] else "cpu"
    for fmt in ("f32", "bf16", "int8"):
        assert ResidentSession(cfg, w, device="auto", weights=fmt).device == want


def test_transformers_checkpoint_in_every_format(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hc = transformers.Qwen3Config(vocab_size=211, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                  rms_norm_eps=1e-6, rope_theta=1e6, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(hc).eval()
    ref.o1_init_(m)
    m.save_pretrained(tmp_path)
    with torch.no_grad():
        want = m(torch.tensor([PROMPT])).logits[0, -1].numpy()
    scale = float(np.abs(want).max())
    for fmt in ("f32", "bf16", "f16", "int8"):
        s = ResidentSession.from_pretrained(tmp_path, weights=fmt, progress=False)
        dev = float(np.abs(s.prefill(PROMPT) - want).max())
        assert dev <= (1e-5 if fmt == "f32" else REL[fmt]) * max(1.0, scale), (fmt, dev, scale)


def test_generate_cli_takes_weights(tmp_path):
    import json

    cfg = CONFIGS["mha_tied"]
    w = ref.random_weights(cfg, 1)
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=cfg["vocab"],
        hidden_size=cfg["d_model"], intermediate_size=cfg["d_ff"], num_hidden_layers=2,
        num_attention_heads=cfg["h_q"], num_key_value_heads=cfg["h_kv"], head_dim=cfg["d_head"],
        rms_norm_eps=cfg["rms_eps"], rope_theta=cfg["rope_theta"], tie_word_embeddings=True)))
    r = subprocess.run([sys.executable, "-m", "algenta", "generate", "--model", str(tmp_path),
                        "--ids", "1,2,3", "--max-new", "4", "--weights", "int8", "--kv", "bf16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "weights int8, kv bf16" in r.stderr
    ids = [int(x) for x in r.stdout.split()]
    assert ids == ResidentSession(cfg, w, weights="int8", kv="bf16").generate([1, 2, 3], 4)


def test_resident_bytes_count_the_format():
    """The session reports the bytes `algenta plan --weights` counts for it: float32 elements
    times four for f32, half of the matrices' bytes for bf16/f16, a byte plus a 4-byte scale per
    32 for int8; the KV cache float32 in every format."""
    from algenta.residentk.contract import residentk_footprint

    w = ref.random_weights(BIG, 4)
    got = {fmt: ResidentSession(BIG, w, max_ctx=100, weights=fmt).resident_bytes
           for fmt in ("f32", "bf16", "f16", "int8")}
    fp = residentk_footprint(256, 4, 2, 64, 704, 4, 2003, 512, tied=True)
    assert got["f32"] == 4 * fp["total"]
    kv = 4 * fp["kv_cache"]
    norms = 4 * fp["norms"]
    mats = fp["weights"] - fp["norms"]  # matrix elements; every matrix row here is 256 or 704 long
    assert got["bf16"] == got["f16"] == 2 * mats + norms + kv
    rows_256 = 4 * (256 + 128 + 128 + 256 + 704 + 704) + 2003  # q k v o gate up; the embedding
    rows_704 = 4 * 256                                          # down
    scales = 4 * (rows_256 * (256 // 32) + rows_704 * (704 // 32))
    assert got["int8"] == mats + scales + norms + kv

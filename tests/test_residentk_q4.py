"""The CPU session's q4_0 weights (llama.cpp's Q4_0 held as its blocks): the quantizer is ggml's
(a session over a Q4_0 GGUF file equals one quantizing the same floats, and a file's blocks
requantize to themselves); the panels' products are exactly the int8 panels' for the codes
q - 8 on every instruction set; the logits are within the int8 bound of a float64 model of the
same weights; and the bits do not depend on splits, batches or threads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from algenta import _core
from algenta.errors import AlgentaError, ResidentError
from algenta.residentk import ResidentSession
from algenta.residentk.config import make_config

import qwen3_reference as ref

sys.path.insert(0, os.path.dirname(__file__))

# d_model 96 and d_ff 200: partial panels and a partial last block (200 = 6 * 32 + 8)
CFG = dict(d_model=96, h_q=3, h_kv=1, d_head=32, d_ff=200, n_layers=2, vocab=301,
           rms_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
W = ref.random_weights(CFG, 21)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, CFG["vocab"], 23)]


def q4_0_dequantized(a: np.ndarray) -> np.ndarray:
    """An independent model of the q4_0 weights: ggml's Q4_0 rule per row, blocks of up to 32
    (the last one partial), in NumPy float32, dequantized."""
    a = np.asarray(a, np.float32)
    out = np.empty_like(a)
    for r in range(a.shape[0]):
        for b0 in range(0, a.shape[1], 32):
            x = a[r, b0:b0 + 32]
            m = x[np.argmax(np.abs(x))]  # the first of equal magnitudes
            d = np.float32(m / np.float32(-8.0))
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            q = np.minimum(np.trunc(x * inv + np.float32(8.5)), 15).astype(np.int32)
            out[r, b0:b0 + 32] = (q - 8).astype(np.float32) * np.float32(np.float16(d))
    return out


def test_q4_0_logits_against_a_float64_model_of_its_weights():
    # The int8 bound of test_residentk_formats (the activations are int8 blocks here too).
    s = ResidentSession(CFG, W, weights="q4_0")
    deq = {k: (q4_0_dequantized(v) if v.ndim == 2 else v) for k, v in W.items()}
    ids = PROMPT[:7] + [9, 4]
    want = ref.forward(CFG, deq, ids, act=ref.q8_activations)[6:]
    got = np.stack([s.prefill(PROMPT[:7]), s.step(9), s.step(4)])
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=1.5e-2 * max(1.0, float(np.abs(want).max())))
    assert s.resident_bytes < ResidentSession(CFG, W, weights="int8").resident_bytes


@pytest.mark.kernels
@pytest.mark.parametrize("rows,n,M", [(37, 200, 1), (64, 96, 1), (130, 64, 5), (16, 33, 3)])
def test_q4_0_products_are_the_int8_products_of_the_same_codes(rows, n, M):
    rng = np.random.default_rng(rows * n + M)
    codes = rng.integers(0, 16, (rows, n), dtype=np.uint8)
    blocks = (n + 31) // 32
    scales = (rng.standard_normal((rows, blocks)) * 2.0 ** rng.integers(-12, 4, (rows, blocks))
              ).astype(np.float16).astype(np.float32)
    X = rng.standard_normal((M, n)).astype(np.float32)
    got = _core.session.cpu_q4_gemm(codes, scales, X)
    want = _core.session.cpu_int8_gemm((codes.astype(np.int16) - 8).astype(np.int8), scales, X)
    np.testing.assert_array_equal(got, want)
    # and each row of a GEMM is the bits of its own decode product
    for m in range(M):
        np.testing.assert_array_equal(_core.session.cpu_q4_gemm(codes, scales, X[m:m + 1])[0],
                                      got[m])
    with pytest.raises(ResidentError, match="0..15"):
        _core.session.cpu_q4_gemm(codes | 16, scales, X)


def test_q4_0_prefill_in_any_split_and_batched_steps_give_the_same_bits():
    s = ResidentSession(CFG, W, weights="q4_0", max_ctx=64, slots=3)
    stepped = [s.prefill(PROMPT[:1])] + [s.step(t) for t in PROMPT[1:]]
    s.reset()
    np.testing.assert_array_equal(s.prefill(PROMPT), stepped[-1])
    s.reset()
    for a, b in zip([0, 5, 6], [5, 6, len(PROMPT)]):
        got = s.prefill(PROMPT[a:b])
    np.testing.assert_array_equal(got, stepped[-1])
    # three slots stepped together: each row the bits it gets alone
    s.reset()
    for slot in range(3):
        s.prefill(PROMPT[:4 + slot], slot=slot)
    batch = s.step_batch([0, 1, 2], [3, 5, 8])
    for slot, tok in zip(range(3), (3, 5, 8)):
        alone = ResidentSession(CFG, W, weights="q4_0", max_ctx=64)
        alone.prefill(PROMPT[:4 + slot])
        np.testing.assert_array_equal(batch[slot], alone.step(tok))


def test_q4_0_logits_do_not_depend_on_the_thread_count():
    code = (
        "import sys, numpy as np; sys.path.insert(0, %r)\n"
        "import qwen3_reference as ref\n"
        "from algenta.residentk import ResidentSession\n"
        "from test_residentk_q4 import CFG, W, PROMPT\n"
        "s = ResidentSession(CFG, W, weights='q4_0')\n"
        "sys.stdout.write(np.stack([s.prefill(PROMPT), s.step(3)]).tobytes().hex())\n"
    ) % os.path.dirname(__file__)
    outs = set()
    for nt in ("1", "2", "3"):
        env = dict(os.environ, OMP_NUM_THREADS=nt)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120, cwd=os.path.dirname(__file__))
        assert r.returncode == 0, r.stderr[-2000:]
        outs.add(r.stdout)
    assert len(outs) == 1


def test_a_q4_0_gguf_file_is_held_as_its_own_blocks(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf_files import write_gguf

    cfg = make_config(dict(d_model=64, h_q=4, h_kv=2, d_head=16, d_ff=96, n_layers=2, vocab=67,
                           rms_eps=float(np.float32(1e-6)), rope_theta=10000.0,
                           tie_word_embeddings=False, family={"arch": "llama"}))
    from algenta.residentk.weights import random_weights

    t = dict(random_weights(cfg, 3))
    p = tmp_path / "m-q4_0.gguf"
    write_gguf(p, cfg, t, "Q4_0")
    got = ResidentSession.from_pretrained(p, progress=False)
    assert got.weights == "q4_0"
    # the same floats quantized by the session, and the file's own values requantized
    direct = ResidentSession(cfg, t, weights="q4_0")
    qt = gguf.GGMLQuantizationType.Q4_0
    deq = {k: (gguf.quants.dequantize(gguf.quants.quantize(v, qt), qt) if v.ndim == 2 else v)
           for k, v in t.items()}
    again = ResidentSession(cfg, deq, weights="q4_0")
    ids = [5, 1, 60, 7, 2]
    a = [got.prefill(ids), got.step(3)]
    for other in (direct, again):
        np.testing.assert_array_equal(np.stack([other.prefill(ids), other.step(3)]),
                                      np.stack(a))


def test_q4_0_is_cpu_only_for_now_and_refused_by_name_elsewhere():
    with pytest.raises(AlgentaError) as e:
        ResidentSession(CFG, W, weights="q4_0", device="cuda")
    # 604 naming q4_0 where CUDA kernels are built (make_plan), 604/605 where they are not
    assert e.value.status in (604, 605)
    assert ResidentSession(CFG, W, weights="q4_0", device="auto").device == "cpu"
    big = dict(W)
    big["model.layers.0.mlp.up_proj.weight"] = W["model.layers.0.mlp.up_proj.weight"].copy()
    big["model.layers.0.mlp.up_proj.weight"][3, 40] = 7e5  # its block's scale past float16
    with pytest.raises(ResidentError, match="up_proj.*q4_0.*weights='int8'") as e:
        ResidentSession(CFG, big, weights="q4_0")
    assert e.value.status == 609

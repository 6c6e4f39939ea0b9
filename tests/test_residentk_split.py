"""A prompt's logits do not depend on how the CPU session takes it in: prefilled at once, in
pieces, across the engine's internal prefill blocks, or one decode step at a time, the logits
are bit-identical, in every weight format and KV format, on the instruction set in use (CI runs
this file once per instruction set the host has, ALGENTA_ISA pinned).

Why it holds: every weight matrix is resident as panels that one kernel multiplies for any
number of tokens (kernels.hpp, PanelOps::gemm), with one multiply-add sequence per output cell,
and every other stage (norms, RoPE, attention, the KV cache) runs the same code per token either
way. The shape is chosen to put cells on every edge: 45 tokens (not a multiple of any register
tile's rows), d_model 96 and d_ff 200 (partial panels and partial int8 blocks), vocab 301 (a
partial block of 64 rows)."""

from __future__ import annotations

import numpy as np
import pytest

import qwen3_reference as ref
from algenta.residentk.session import ResidentSession

pytestmark = pytest.mark.kernels

CFG = dict(d_model=96, h_q=3, h_kv=1, d_head=32, d_ff=200, n_layers=2, vocab=301, rms_eps=1e-6,
           rope_theta=10_000.0, tie_word_embeddings=True)
W = ref.random_weights(CFG, 11)
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, CFG["vocab"], 45)]


def _session(fmt, kv, max_ctx=64):
    return ResidentSession(CFG, W, max_ctx=max_ctx, weights=fmt, kv=kv, device="cpu")


@pytest.mark.parametrize("fmt,kv", [("f32", "f32"), ("bf16", "f32"), ("f16", "f32"),
                                    ("int8", "f32"), ("bf16", "bf16"), ("int8", "f16")])
def test_prefill_in_any_split_gives_the_stepped_logits(fmt, kv):
    s = _session(fmt, kv)
    stepped = [s.prefill(PROMPT[:1])] + [s.step(t) for t in PROMPT[1:]]

    s.reset()
    np.testing.assert_array_equal(s.prefill(PROMPT), stepped[-1], err_msg="at once")
    for cuts in ([20, 33], [1, 2, 3, 30], [12, 13, 44]):
        s.reset()
        for a, b in zip([0] + cuts, cuts + [len(PROMPT)]):
            got = s.prefill(PROMPT[a:b])
            np.testing.assert_array_equal(got, stepped[b - 1], err_msg=f"{fmt} {kv} {cuts} {b}")
    # prefill then steps, and steps after a prefill continue the same way
    s.reset()
    s.prefill(PROMPT[:17])
    np.testing.assert_array_equal(s.step(PROMPT[17]), stepped[17])


def test_prefill_across_the_engines_prefill_blocks():
    """Past 256 tokens the engine prefills in blocks of 256: the logits of a 270-token prompt
    are those of stepping it."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, CFG["vocab"], 270)]
    s = _session("int8", "f32", max_ctx=288)
    last = s.prefill(prompt[:1])
    for t in prompt[1:]:
        last = s.step(t)
    s.reset()
    np.testing.assert_array_equal(s.prefill(prompt), last)


@pytest.mark.parametrize("kv", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("d_head", [8, 128])
def test_prefill_attention_groups_give_the_stepped_logits(kv, d_head):
    """Prefill attends up to 8 queries of a KV head at once, from several rows; a step its own
    row's heads of that KV head (both through SessionOps::kv_dots / kv_axpys, in groups of
    different sizes): with 9 query heads on one KV head and heads of 8 values (no full
    accumulator round anywhere, a padded tail on AVX-512) or 128 (two full rounds), over 35 keys
    (whole blocks of 16 and single keys), the bits still agree."""
    cfg = dict(CFG, h_q=9, h_kv=1, d_head=d_head)
    s = ResidentSession(cfg, ref.random_weights(cfg, 12), max_ctx=40, weights="f32", kv=kv,
                        device="cpu")
    prompt = PROMPT[:35]
    last = s.prefill(prompt[:1])
    for t in prompt[1:]:
        last = s.step(t)
    s.reset()
    s.prefill(prompt[:4])
    np.testing.assert_array_equal(s.prefill(prompt[4:]), last)

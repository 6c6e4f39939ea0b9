"""The model families against HuggingFace transformers itself: a random tiny model of each
(Llama, Qwen2, Mistral, Gemma 2, Gemma 3 text) saved with save_pretrained, loaded back with
ResidentSession.from_pretrained; prefill logits, stepwise decode logits along transformers' own
greedy path, and 32 greedy tokens. Each case puts a family's differences where they count: odd
sizes, GQA and MHA, tied and untied heads, biases, a sliding window shorter than the sequence,
soft caps small enough to bend the logits, scaled RoPE (llama3 bands all three in use, linear),
Gemma 3's local RoPE base, a prompt past one prefill block. Then the rest of the family
contract: every weight format, split and batch invariance, the dispatch count from the family's
stage list, planning in bytes, and the refusals. Skipped where transformers (a test extra) is
not installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.kernels

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from algenta import _core  # noqa: E402
from algenta.errors import ResidentError  # noqa: E402
from algenta.residentk.config import parse_hf_config, session_config  # noqa: E402
from algenta.residentk.session import ResidentSession  # noqa: E402

CASES = {
    # GQA 2, untied, q/k/v/o and MLP biases, llama3 RoPE whose bands (wavelengths past 32, under
    # 8, between) all hold some of the 8 frequencies.
    "llama_bias_llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=88, num_hidden_layers=2, vocab_size=113, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # MHA, tied, linear RoPE scaling.
    "llama_tied_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        intermediate_size=72, num_hidden_layers=2, vocab_size=97, tie_word_embeddings=True,
        rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # GQA 3 with odd sizes, q/k/v biases (always, in Qwen2), untied.
    "qwen2_gqa3": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        intermediate_size=76, num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False,
        rope_theta=10000.0)),
    # Every layer slides over 7 keys; the prompt runs past one 256-token prefill block.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, num_hidden_layers=2, vocab_size=89, tie_word_embeddings=False,
        sliding_window=7, rope_theta=10000.0)),
    # Alternating sliding (5 keys) and full layers, both soft caps tight enough to bend, a query
    # scale other than 1/sqrt(head_dim), tied head.
    "gemma2_caps": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=80, num_hidden_layers=3, vocab_size=107, sliding_window=5,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
        rope_theta=10000.0)),
    # Two sliding layers (6 keys, local RoPE base 100) and a full one (linear-scaled RoPE at
    # 1e6); q/k norms with (1 + w); untied head.
    "gemma3_local_rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=56, num_hidden_layers=3, vocab_size=103, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=40, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}
PROMPT = [1, 17, 5, 60, 33, 2, 64, 8, 41, 3, 9, 27, 14, 50, 6, 22, 71, 12, 4, 30]
LONG = 300  # past one prefill block (256 rows)


def _init_(m):
    """O(1) activations in which every term counts (transformers' own init gives near-zero
    logits): N(0, 1) embeddings, N(0, 1/fan_in) matrices, biases N(0, 0.01), norm weights
    around their identity (1 + w for Gemma's, so w around 0)."""
    gemma = "gemma" in m.config.model_type
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))


_MODELS = {}


def _model(case, root):
    """(transformers model, checkpoint directory), built once per case."""
    if case not in _MODELS:
        cls, model_cls, kw = CASES[case]
        cfg = getattr(transformers, cls)(rms_norm_eps=1e-6, attn_implementation="eager", **kw)
        torch.manual_seed(sum(map(ord, case)))
        m = getattr(transformers, model_cls)(cfg).eval()
        _init_(m)
        path = root / case
        m.save_pretrained(path)
        _MODELS[case] = (m, path)
    return _MODELS[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _atol(want):
    return 2e-4 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(case, root):
    m, path = _model(case, root)
    s = ResidentSession.from_pretrained(path, max_ctx=512, progress=False)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert arch == CASES[case][1]
    n = LONG if case == "mistral_window" else len(PROMPT)
    prompt = (PROMPT * (n // len(PROMPT) + 1))[:n]
    with torch.no_grad():
        want = m(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(s.prefill(prompt), want[-1], rtol=0, atol=_atol(want[-1]))
    s.reset()
    np.testing.assert_allclose(s.prefill(prompt[:3]), want[2], rtol=0, atol=_atol(want[2]))

    n_new = 32
    head = prompt[:len(PROMPT)]
    with torch.no_grad():
        out = m.generate(torch.tensor([head]), max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
        full = m(out).logits[0].numpy()
    hf_tokens = out[0, len(head):].tolist()
    s.reset()
    s.prefill(head)
    for i, t in enumerate(hf_tokens):  # step logits along transformers' greedy path
        want_i = full[len(head) + i]
        np.testing.assert_allclose(s.step(t), want_i, rtol=0, atol=_atol(want_i),
                                   err_msg=f"step {i}")
    s.reset()
    assert s.generate(head, n_new) == hf_tokens
    # What the engine ran is what the family's stage list counts.
    assert s.dispatches_per_token == _core.session.decode_stages(s.config.n_layers,
                                                                 dict(s.config.family))


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_formats_split_and_batch_invariance(case, root):
    """Every weight and KV format near the float32 session; a prompt's logits bit-identical
    prefilled at once, in pieces, or stepped; a sequence's bit-identical alone or batched."""
    _, path = _model(case, root)
    prompt = PROMPT[:12]
    ref = ResidentSession.from_pretrained(path, max_ctx=64, progress=False).prefill(prompt)
    for weights, kv, tol in (("bf16", "bf16", 0.15), ("f16", "f16", 0.02), ("int8", "f32", 0.15)):
        s = ResidentSession.from_pretrained(path, max_ctx=64, weights=weights, kv=kv,
                                            progress=False, slots=3)
        whole = s.prefill(prompt)
        assert np.abs(whole - ref).max() <= tol * max(1.0, np.abs(ref).max()), (weights, kv)
        s.prefill(prompt[:5], slot=1)
        s.prefill(prompt[5:9], slot=1)
        for t in prompt[9:-1]:
            s.step(t, slot=1)
        assert np.array_equal(s.step(prompt[-1], slot=1), whole), weights
        # slots 0 and 1 now hold the same 12 tokens; slot 2 another prompt
        s.prefill(prompt[::-1], slot=2)
        batch = s.step_batch([2, 0], [7, 7])
        alone = s.step(7, slot=1)
        assert np.array_equal(batch[1], alone), weights


def test_generate_cli_decodes_each_family(root, capsys):
    from algenta.cli import main

    for case in sorted(CASES):
        _, path = _model(case, root)
        want = ResidentSession.from_pretrained(path, max_ctx=64, progress=False).generate(
            [1, 17, 5], 6, stop_ids=[])
        assert main(["generate", "--model", str(path), "--ids", "1,17,5", "--max-new", "6",
                     "--ignore-eos"]) == 0
        out = capsys.readouterr().out.split()
        assert [int(t) for t in out[:6]] == want, case


def test_plan_sizes_each_family_as_the_session_holds_it(root, capsys):
    from algenta.cli import main

    for case in sorted(CASES):
        _, path = _model(case, root)
        s = ResidentSession.from_pretrained(path, max_ctx=512, progress=False, weights="bf16")
        assert main(["plan", "--config", str(path / "config.json"), "--ctx", "512", "--weights",
                     "bf16", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["bytes"]["total_bucket"] == s.resident_bytes, case
        assert sum(rep["bytes"]["weight_terms"].values()) == rep["bytes"]["weights"]
        fam = dict(s.config.family)
        assert rep["dispatch_budget"] == _core.session.decode_stages(s.config.n_layers, fam)
        # the tensors the session holds, by count: what plan's vector terms add up
        held = sum(int(np.prod(shape)) for _, shape, _, _ in
                   _core.session.tensor_table(s.config.d_model, s.config.h_q, s.config.h_kv,
                                              s.config.d_head, s.config.d_ff, s.config.n_layers,
                                              s.config.vocab, s.config.tie_word_embeddings,
                                              family=fam))
        assert rep["weights_f32_elems"] == held, case


def _config(**kw):
    base = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                intermediate_size=48, num_hidden_layers=2, vocab_size=50)
    return {**base, **kw}


@pytest.mark.parametrize("cfg, words", [
    (_config(architectures=["PhiForCausalLM"], model_type="phi"),
     ["PhiForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM"]),
    (_config(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["yarn"]),
    (_config(model_type="llama", hidden_act="gelu"), ["hidden_act", "gelu"]),
    (_config(model_type="gemma2", hidden_activation="gelu"), ["hidden_activation"]),
    (_config(model_type="gemma3_text", use_bidirectional_attention=True),
     ["use_bidirectional_attention"]),
    (_config(model_type="mistral", partial_rotary_factor=0.5), ["partial_rotary_factor"]),
])
def test_what_the_session_does_not_compute_is_refused_by_name(cfg, words):
    with pytest.raises(ResidentError) as e:
        session_config(parse_hf_config(cfg))
    assert e.value.status == 607
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("family, error, status", [
    ({"arch": 3}, TypeError, None),
    ({"bogus": 1}, TypeError, None),
    ({"sliding_layers": "yes"}, TypeError, None),
    ({"arch": "gpt2"}, ResidentError, 607),
    ({"arch": "mistral", "sliding_window": -1}, ResidentError, 601),
    ({"arch": "gemma2", "attn_softcap": float("nan")}, ResidentError, 609),
    ({"arch": "llama", "rope_type": "yarn"}, ResidentError, 607),
    ({"arch": "llama", "rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 4.0,
      "rope_high_freq_factor": 1.0}, ResidentError, 609),
    ({"arch": "gemma3_text", "sliding_window": 4, "sliding_layers": [True]}, ResidentError, 607),
])
def test_family_fields_refused_before_any_allocation(family, error, status):
    with pytest.raises(error) as e:
        ResidentSession.random(32, 2, 1, 16, 48, 2, 50, family=family, max_ctx=16)
    if status is not None:
        assert e.value.status == status


def test_plan_sizes_a_family_the_session_does_not_compute(tmp_path, capsys):
    from algenta.cli import main

    cfg = _config(model_type="llama4_text", architectures=["Llama4ForCausalLM"],
                  layer_types=["chunked_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(tmp_path / "config.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status_name"] == "resident_ok"
    with pytest.raises(ResidentError, match="Llama4ForCausalLM"):
        session_config(parse_hf_config(cfg))


def test_family_fields_read_as_transformers_reads_them():
    fam = session_config(parse_hf_config(_config(model_type="gemma2"))).family
    assert fam["sliding_layers"] == (True, False) and fam["sliding_window"] == 4096
    assert fam["attn_softcap"] == 50.0 and fam["final_softcap"] == 30.0
    assert fam["attn_scale"] == 256 ** -0.5
    # Gemma 3 before transformers 5: sliding_window_pattern and rope_local_base_freq
    fam = session_config(parse_hf_config(_config(
        model_type="gemma3_text", num_hidden_layers=7, sliding_window=16, rope_theta=1e6,
        rope_local_base_freq=5000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}))).family
    assert fam["sliding_layers"] == (True,) * 5 + (False, True)
    assert fam["rope_local_theta"] == 5000.0 and fam["rope_factor"] == 8.0
    assert "attn_softcap" not in fam
    # Qwen2 slides only with use_sliding_window, from max_window_layers on
    assert "sliding_window" not in session_config(parse_hf_config(_config(
        model_type="qwen2", sliding_window=8))).family
    fam = session_config(parse_hf_config(_config(
        model_type="qwen2", sliding_window=8, use_sliding_window=True,
        max_window_layers=1))).family
    assert fam["sliding_layers"] == (False, True)
    # Mistral's attention_bias is not a field transformers reads: no biases
    fam = session_config(parse_hf_config(_config(model_type="mistral", attention_bias=True,
                                                 sliding_window=None))).family
    assert fam == {"arch": "mistral"}
    assert session_config(parse_hf_config(_config(model_type="mistral"))).family == {
        "arch": "mistral", "sliding_window": 4096}  # MistralConfig's default


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_on_the_cuda_engine(case, root):
    """The CUDA engine (a device, or the emulator CI runs) computes each family as the CPU
    engine does, to float32 reduction-order rounding (test_residentk_cuda.py's TOL_SMALL scaled
    to the logits), and picks the same greedy tokens; every weight format stays near the CPU
    engine's own result in that format, and prefill and steps agree."""
    from conftest import need_cuda

    need_cuda()
    m, path = _model(case, root)
    prompt = (PROMPT * 2)[:40]  # the steps after it run split-K attention (32+ keys)
    for weights, kv in (("f32", "f32"), ("bf16", "bf16"), ("f16", "f32"), ("int8", "f16")):
        cpu = ResidentSession.from_pretrained(path, max_ctx=64, weights=weights, kv=kv,
                                              progress=False)
        gpu = ResidentSession.from_pretrained(path, max_ctx=64, weights=weights, kv=kv,
                                              device="cuda", progress=False)
        want = cpu.prefill(prompt)
        tol = (1e-4 if weights == "f32" else 2e-2) * max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(gpu.prefill(prompt), want, rtol=0, atol=tol, err_msg=weights)
        for t in (3, 11, 7):
            np.testing.assert_allclose(gpu.step(t), cpu.step(t), rtol=0, atol=tol,
                                       err_msg=weights)
        if weights == "f32":
            cpu.reset()
            gpu.reset()
            assert gpu.generate(prompt[:8], 12) == cpu.generate(prompt[:8], 12)
            assert gpu.dispatches_per_token == _core.session.decode_stages(
                gpu.config.n_layers, dict(gpu.config.family))

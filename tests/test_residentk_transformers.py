"""ResidentSession against HuggingFace transformers itself: random tiny Qwen3 models saved with
save_pretrained and loaded back with from_pretrained; prefill logits within 1e-4 of transformers'
float32 forward, greedy tokens identical to its generate() over 24 steps. Skipped where
transformers (a test extra) is not installed."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3ForCausalLM"):
    pytest.skip("this transformers has no Qwen3", allow_module_level=True)

import qwen3_reference as ref  # noqa: E402
from algenta.residentk.loader import read_header  # noqa: E402
from algenta.residentk.session import ResidentSession  # noqa: E402

CASES = {
    # h_q*d_head (64) != d_model (48); GQA group 2; untied; newer rope_parameters config.
    "gqa2_untied_params": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, intermediate_size=88, num_hidden_layers=2,
                               vocab_size=113, tie_word_embeddings=False, theta=5000.0,
                               style="parameters", dtype="float32", shard=None),
    # GQA group 1 (plain MHA), tied, the published config style (rope_theta top level).
    "mha_tied_toplevel": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                              head_dim=32, intermediate_size=96, num_hidden_layers=3,
                              vocab_size=97, tie_word_embeddings=True, theta=1_000_000.0,
                              style="top_level", dtype="float32", shard=None),
    # GQA group 4, untied, stored as bfloat16 in shards behind an index.
    "gqa4_bf16_sharded": dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=8, intermediate_size=64, num_hidden_layers=2,
                              vocab_size=101, tie_word_embeddings=False, theta=20000.0,
                              style="parameters", dtype="bfloat16", shard="30KB"),
}


def _model(case, tmp_path):
    c = dict(CASES[case])
    theta, style, dtype, shard = c.pop("theta"), c.pop("style"), c.pop("dtype"), c.pop("shard")
    # rope_theta as a keyword works on transformers 4.x (its attribute) and 5.x (folded into
    # rope_parameters); the written config.json is then put in the style under test.
    cfg = transformers.Qwen3Config(rms_norm_eps=1e-6, rope_theta=theta,
                                   attn_implementation="eager", **c)
    torch.manual_seed(sum(map(ord, case)))
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    ref.o1_init_(m)
    kw = {"max_shard_size": shard} if shard else {}
    if dtype == "bfloat16":
        # Round the float32 reference's parameters to what bf16 stores (exactly representable
        # in float32), and save a bf16 copy: converting the model itself would also round
        # its RoPE inv_freq buffer and put the error in the reference.
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.bfloat16().float())
        copy.deepcopy(m).to(torch.bfloat16).save_pretrained(tmp_path, **kw)
    else:
        m.save_pretrained(tmp_path, **kw)
    path = tmp_path / "config.json"
    j = json.loads(path.read_text())
    for k in ("rope_parameters", "rope_theta", "rope_scaling"):
        j.pop(k, None)
    if style == "top_level":  # the published Qwen3 files
        j["rope_theta"] = theta
        j["rope_scaling"] = None
    else:  # newer transformers
        j["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    path.write_text(json.dumps(j))
    hf_theta = getattr(m.config, "rope_parameters", None) or {}
    assert hf_theta.get("rope_theta", getattr(m.config, "rope_theta", None)) == theta
    return m


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    m = _model(case, tmp_path)
    if CASES[case]["shard"]:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    if CASES[case]["dtype"] == "bfloat16":
        shard = sorted(tmp_path.glob("*.safetensors"))[0]
        assert {e[0] for e in read_header(shard)[0].values()} == {"BF16"}
    s = ResidentSession.from_pretrained(tmp_path, max_ctx=64, progress=False)
    assert s.config["rope_theta"] == CASES[case]["theta"]
    prompt = [1, 17, 5, 90, 33, 2, 64, 8, 41]
    with torch.no_grad():
        want = m(torch.tensor([prompt])).logits[0].numpy()
    got = s.prefill(prompt)
    np.testing.assert_allclose(got, want[-1], rtol=0, atol=1e-4)
    # Every earlier position too, through fresh prefills of each prefix.
    for n in (1, 4):
        s.reset()
        np.testing.assert_allclose(s.prefill(prompt[:n]), want[n - 1], rtol=0, atol=1e-4)

    n_new = 24
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    hf_tokens = out[0, len(prompt):].tolist()
    assert len(hf_tokens) == n_new
    assert s.generate(prompt, n_new) == hf_tokens
    # Step logits along the greedy path against transformers' full forward of it.
    with torch.no_grad():
        full = m(out).logits[0].numpy()
    s.reset()
    s.prefill(prompt)
    for i, t in enumerate(hf_tokens[:8]):
        np.testing.assert_allclose(s.step(t), full[len(prompt) + i], rtol=0, atol=1e-4)


def test_state_dict_of_a_transformers_model_opens_a_session(tmp_path):
    m = _model("mha_tied_toplevel", tmp_path)
    c = m.config
    cfg = dict(d_model=c.hidden_size, h_q=c.num_attention_heads, h_kv=c.num_key_value_heads,
               d_head=c.head_dim, d_ff=c.intermediate_size, n_layers=c.num_hidden_layers,
               vocab=c.vocab_size, rms_eps=c.rms_norm_eps,
               rope_theta=CASES["mha_tied_toplevel"]["theta"], tie_word_embeddings=True)
    s = ResidentSession(cfg, m.state_dict())
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        want = m(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(s.prefill(prompt), want, rtol=0, atol=1e-4)

"""ResidentSession.from_pretrained on checkpoint directories written here byte by byte (no
torch, no safetensors package needed to write them): config styles, dtypes, shards, tied heads,
and every refusal a malformed or hostile checkpoint must get."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest

import qwen3_reference as ref
from algenta import ResidentError
from algenta.errors import ResidentWarning
from algenta.residentk.session import ResidentSession

CFG = dict(d_model=40, h_q=4, h_kv=2, d_head=16, d_ff=56, n_layers=2, vocab=61, rms_eps=1e-6,
           rope_theta=5000.0, tie_word_embeddings=False)
TOL = 2e-5


def hf_config(cfg, style="parameters", **extra):
    c = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
         "hidden_size": cfg["d_model"], "num_attention_heads": cfg["h_q"],
         "num_key_value_heads": cfg["h_kv"], "head_dim": cfg["d_head"],
         "intermediate_size": cfg["d_ff"], "num_hidden_layers": cfg["n_layers"],
         "vocab_size": cfg["vocab"], "rms_norm_eps": cfg["rms_eps"], "hidden_act": "silu",
         "tie_word_embeddings": cfg["tie_word_embeddings"], "use_sliding_window": False,
         "attention_bias": False}
    if style == "parameters":  # newer transformers
        c["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    else:  # the published Qwen3 config.json files
        c["rope_theta"] = cfg["rope_theta"]
        c["rope_scaling"] = None
    c.update(extra)
    return c


def bf16_bits(a):
    """Round-to-nearest-even float32 -> bf16 bit patterns (uint16)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def encode(arr, dtype):
    if dtype == "BF16":
        return bf16_bits(arr).tobytes()
    return np.ascontiguousarray(arr, {"F16": np.float16, "F32": np.float32}[dtype]).tobytes()


def decoded(arr, dtype):
    """What the stored bytes mean as float32 (the values a loader must reproduce exactly)."""
    if dtype == "BF16":
        return (bf16_bits(arr).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr).astype({"F16": np.float16, "F32": np.float32}[dtype]).astype(np.float32)


def write_safetensors(path, tensors, dtype="F32", header_override=None):
    meta, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        b = encode(arr, dtype)
        meta[name] = {"dtype": dtype, "shape": list(np.shape(arr)),
                      "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if header_override:
        header_override(meta)
    h = json.dumps(meta).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_ckpt(tmp_path, cfg=CFG, dtype="F32", style="parameters", shards=1, seed=0, extra=None,
              drop=(), override=None, **cfg_extra):
    w = ref.random_weights(cfg, seed)
    w.update(extra or {})
    for k in drop:
        del w[k]
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, style, **cfg_extra)))
    names = list(w)
    if shards == 1:
        write_safetensors(tmp_path / "model.safetensors", w, dtype, override)
    else:
        wm = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: w[n] for n in names[s::shards]}
            write_safetensors(tmp_path / fname, part, dtype)
            wm.update({n: fname for n in part})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return {k: decoded(v, dtype) for k, v in w.items()}


@pytest.mark.parametrize("dtype,style,shards", [
    ("F32", "parameters", 1), ("BF16", "top_level", 3), ("F16", "top_level", 1),
    ("BF16", "parameters", 2)])
def test_loads_and_matches_reference(tmp_path, dtype, style, shards):
    w = make_ckpt(tmp_path, dtype=dtype, style=style, shards=shards)
    s = ResidentSession.from_pretrained(tmp_path, max_ctx=100, progress=False)
    assert s.config["rope_theta"] == 5000.0 and s.capacity == 512 and s.max_ctx == 100
    ids = [5, 9, 1, 60, 33]
    want = ref.forward(CFG, w, ids)
    np.testing.assert_allclose(s.prefill(ids[:4]), want[3], rtol=0, atol=TOL)
    np.testing.assert_allclose(s.step(ids[4]), want[4], rtol=0, atol=TOL)


@pytest.mark.parametrize("dtype,shards", [("F32", 1), ("BF16", 3)])
def test_tied_checkpoint_with_shipped_lm_head_and_progress(tmp_path, dtype, shards):
    # As transformers 5.x: a shipped head equal to the embedding table is the tie (read once);
    # one that differs is kept apart from it, with a warning, and the model is the untied one.
    cfg = dict(CFG, tie_word_embeddings=True)
    emb = ref.random_weights(cfg, 0)["model.embed_tokens.weight"]
    w = make_ckpt(tmp_path, cfg=cfg, extra={"lm_head.weight": emb.copy()}, style="top_level",
                  dtype=dtype, shards=shards)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ResidentSession.from_pretrained(tmp_path, progress=lambda d, t: seen.append((d, t)))
    assert s.config.tie_word_embeddings
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    np.testing.assert_allclose(s.prefill([1, 2, 3]), ref.forward(cfg, w, [1, 2, 3])[-1],
                               rtol=0, atol=TOL)

    head = np.random.default_rng(3).standard_normal((61, 40)).astype(np.float32)
    w = make_ckpt(tmp_path, cfg=cfg, extra={"lm_head.weight": head}, style="top_level",
                  dtype=dtype, shards=shards)
    with pytest.warns(ResidentWarning, match="keeps the two apart"):
        s = ResidentSession.from_pretrained(tmp_path, progress=False)
    assert not s.config.tie_word_embeddings
    np.testing.assert_allclose(s.prefill([1, 2, 3]),
                               ref.forward(dict(cfg, tie_word_embeddings=False), w,
                                           [1, 2, 3])[-1], rtol=0, atol=TOL)


def test_config_without_the_tie_key_means_untied_for_plan_and_loader_alike(tmp_path):
    # transformers' Qwen3Config defaults tie_word_embeddings to False: `algenta plan --config`
    # and from_pretrained read config.json with the one parser, so both expect an lm_head.
    import subprocess
    import sys

    w = make_ckpt(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    del c["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    s = ResidentSession.from_pretrained(tmp_path, progress=False)
    assert s.config.tie_word_embeddings is False
    np.testing.assert_allclose(s.prefill([1, 2, 3]), ref.forward(CFG, w, [1, 2, 3])[-1],
                               rtol=0, atol=TOL)
    r = subprocess.run([sys.executable, "-m", "algenta", "plan", "--config", str(tmp_path),
                        "--json"], capture_output=True, text=True, timeout=120)
    rep = json.loads(r.stdout)
    assert rep["shape"]["tied"] is False
    from algenta.residentk import contract as rc
    assert rep["resident_f32_elems"] == rc.residentk_weight_elems(
        40, 4, 2, 16, 56, 2, 61, tied=False)


def _refused(tmp_path, *words, status=607):
    with pytest.raises(ResidentError) as e:
        ResidentSession.from_pretrained(tmp_path, progress=False)
    assert e.value.status == status
    for word in words:
        assert word in str(e.value)
    return e.value


def test_shape_mismatch_names_the_tensor(tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    make_ckpt(tmp_path, extra={name: np.zeros((40, 55), np.float32)})
    _refused(tmp_path, name, "[40, 55]", "[40, 56]")


def test_missing_and_unknown_tensors(tmp_path):
    make_ckpt(tmp_path, drop=["model.layers.0.self_attn.k_norm.weight"])
    _refused(tmp_path, "model.layers.0.self_attn.k_norm.weight")
    make_ckpt(tmp_path, extra={"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    _refused(tmp_path, "model.layers.0.self_attn.q_proj.bias")


def test_architecture_and_variant_refusals(tmp_path):
    make_ckpt(tmp_path, architectures=["PhiForCausalLM"], model_type="phi")
    _refused(tmp_path, "PhiForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
    # a family the session computes, whose tensors the checkpoint does not hold (Qwen3's q_norm)
    make_ckpt(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    _refused(tmp_path, "q_norm", "llama model")
    make_ckpt(tmp_path, style="top_level", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    _refused(tmp_path, "yarn")
    make_ckpt(tmp_path, hidden_act="gelu")
    _refused(tmp_path, "hidden_act", "gelu")
    make_ckpt(tmp_path, head_dim=12)  # not a power of two: the contract's shape refusal
    _refused(tmp_path, status=603)


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        ResidentSession.from_pretrained(tmp_path / "nope")
    _refused(tmp_path, "config.json")
    (tmp_path / "config.json").write_text("{not json")
    _refused(tmp_path, "JSON")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(CFG)))
    _refused(tmp_path, "model.safetensors")


@pytest.mark.parametrize("case", ["huge_len", "short_len", "truncated_file", "bad_json",
                                  "offsets_past_end", "size_mismatch", "negative_offset",
                                  "bad_dtype", "bad_shape"])
def test_hostile_headers_are_refused_cleanly(tmp_path, case):
    make_ckpt(tmp_path)
    f = tmp_path / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n])
    name = "model.layers.0.mlp.up_proj.weight"

    def rewrite(m):
        h = json.dumps(m).encode()
        f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])

    if case == "huge_len":
        f.write_bytes(struct.pack("<Q", 2**63 + 5) + raw[8:])
    elif case == "short_len":
        f.write_bytes(raw[:5])
    elif case == "truncated_file":
        f.write_bytes(raw[: len(raw) - 100])
    elif case == "bad_json":
        f.write_bytes(struct.pack("<Q", n) + b"{" * n + raw[8 + n:])
    elif case == "offsets_past_end":
        meta[name]["data_offsets"] = [0, 10**15]
        meta[name]["shape"] = [10**15 // 4]
        rewrite(meta)
    elif case == "size_mismatch":
        meta[name]["data_offsets"][1] -= 4
        rewrite(meta)
    elif case == "negative_offset":
        meta[name]["data_offsets"] = [-4, meta[name]["data_offsets"][1] - 4]
        rewrite(meta)
    elif case == "bad_dtype":
        meta[name]["dtype"] = "I64"
        rewrite(meta)
    elif case == "bad_shape":
        meta[name]["shape"] = [56, "40"]
        rewrite(meta)
    _refused(tmp_path, "model.safetensors")


def test_shard_index_cannot_point_outside_the_directory(tmp_path):
    make_ckpt(tmp_path, shards=2)
    idx = tmp_path / "model.safetensors.index.json"
    m = json.loads(idx.read_text())
    first = next(iter(m["weight_map"]))
    m["weight_map"][first] = "../model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(m))
    _refused(tmp_path, "../model-00001-of-00002.safetensors")


# ---- algenta generate ---------------------------------------------------------------------

def _cli(argv, capsys):
    from algenta.cli import main

    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_generate_ids_streams_the_greedy_tokens(tmp_path, capsys):
    w = make_ckpt(tmp_path)
    rc, out, err = _cli(["--model", str(tmp_path), "--ids", "5,9,1", "--max-new", "6"], capsys)
    assert rc == 0
    assert [int(x) for x in out.split()] == ref.greedy(CFG, w, [5, 9, 1], 6)
    assert "tokens/s" in err and "15 stages/token" in err


def test_cli_generate_bad_input_exits_2_with_one_line(tmp_path, capsys):
    for argv in (["--model", str(tmp_path / "none"), "--ids", "1"],
                 ["--model", str(tmp_path), "--ids", "1"],  # no config.json
                 ["--model", str(tmp_path), "--prompt", "hi"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "error" in err
    make_ckpt(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    rc, out, err = _cli(["--model", str(tmp_path), "--ids", "1"], capsys)
    assert rc == 2 and "GPT2LMHeadModel" in err and "Gemma3ForCausalLM" in err
    assert len(err.strip().splitlines()) == 1
    make_ckpt(tmp_path)
    rc, out, err = _cli(["--model", str(tmp_path), "--ids", "1,x"], capsys)
    assert rc == 2 and "--ids" in err
    rc, out, err = _cli(["--model", str(tmp_path), "--ids", "1", "--max-ctx", "4",
                         "--max-new", "8"], capsys)
    assert rc == 2 and "606" in err
    # Values past int64, a negative seed, an empty id between commas: one line, exit 2, whether
    # argparse (SystemExit) or the command refuses them.
    for extra, word in ((["--ids", "99999999999999999999999"], "99999999999999999999999"),
                        (["--ids", "1", "--max-new", "99999999999999999999999"], "--max-new"),
                        (["--ids", "1", "--max-new", "70000"], "65536"),
                        (["--ids", "1", "--seed", "-1", "--temperature", "1"], "--seed"),
                        (["--ids", "1,,2"], "--ids"), (["--ids", ","], "--ids")):
        try:
            rc, out, err = _cli(["--model", str(tmp_path), *extra], capsys)
        except SystemExit as e:
            rc, (out, err) = e.code, capsys.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1 and word in err, (extra, err)
        assert "Traceback" not in err and out == ""


@pytest.mark.smoke
def test_cli_generate_text_prompt_with_tokenizer_json(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    make_ckpt(tmp_path)
    words = [f"w{i}" for i in range(CFG["vocab"])]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    rc, out, err = _cli(["--model", str(tmp_path), "--prompt", "w5 w9 w1", "--max-new", "4",
                         "--temperature", "0.8", "--seed", "3", "--top-k", "5"], capsys)
    assert rc == 0 and out.startswith("w5 w9 w1")
    s = ResidentSession.from_pretrained(tmp_path, progress=False)
    want = s.generate([5, 9, 1], 4, temperature=0.8, seed=3, top_k=5)
    assert out[len("w5 w9 w1"):].split() == [words[t] for t in want]


def test_non_finite_bf16_weight_is_refused_naming_it(tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = ref.random_weights(CFG, 0)[name].copy()
    bad[3, 7] = np.inf
    make_ckpt(tmp_path, dtype="BF16", extra={name: bad})
    _refused(tmp_path, name, "non-finite", status=609)


def test_config_fields_of_the_wrong_type_or_range_are_refused(tmp_path):
    make_ckpt(tmp_path, tie_word_embeddings="false")
    _refused(tmp_path, "tie_word_embeddings")
    make_ckpt(tmp_path, style="top_level", rope_theta=10**400)
    _refused(tmp_path, "rope_theta", status=609)
    make_ckpt(tmp_path, rms_norm_eps=-1e-6)
    _refused(tmp_path, "rms_norm_eps", status=609)


def test_a_config_bigger_than_its_tensors_is_refused_from_the_headers(tmp_path):
    # The checkpoint holds CFG's tensors; config.json claims 36 layers of an 8B-sized model. The
    # headers alone refute it, so the refusal comes before the session would allocate ~33 GB.
    make_ckpt(tmp_path, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
              head_dim=128, intermediate_size=12288, num_hidden_layers=36, vocab_size=151936)
    _refused(tmp_path, "model.embed_tokens.weight", "[61, 40]", "[151936, 4096]")


def test_expected_shapes_match_the_engine_table():
    from algenta import _core
    from algenta.residentk.weights import expected_shapes

    for tied in (True, False):
        cfg = dict(CFG, tie_word_embeddings=tied)
        eng = _core.session.cpu_session(*(cfg[k] for k in ("d_model", "h_q", "h_kv", "d_head",
                                                           "d_ff", "n_layers", "vocab",
                                                           "rms_eps", "rope_theta",
                                                           "tie_word_embeddings")), 16)
        names = eng.missing_weights()
        assert expected_shapes(cfg) == {n: tuple(eng.weight_shape(n)) for n in names}


def test_config_integers_past_int64_and_a_malformed_architectures_get_a_status(tmp_path):
    make_ckpt(tmp_path, num_hidden_layers=2**64)
    _refused(tmp_path, "num_hidden_layers", status=602)
    make_ckpt(tmp_path, hidden_size=-(2**70))
    _refused(tmp_path, "hidden_size", status=601)
    make_ckpt(tmp_path, architectures=2)
    _refused(tmp_path, "architectures")
    with pytest.raises(ResidentError) as e:
        ResidentSession(dict(CFG, vocab=2**63), {})
    assert e.value.status == 602

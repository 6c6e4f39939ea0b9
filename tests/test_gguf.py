"""GGUF files (algenta.residentk.gguf_file, gguf_model, gguf_tokenizer): the same model read from
a GGUF file and from its tensors gives the same bits; ggml's block types widen block by block as
the `gguf` package's dequantizers do; a damaged file is refused (607) before anything is
allocated from it; the vocabulary reads back as the tokenizer it was written from."""

from __future__ import annotations

import os
import struct
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from algenta import _core  # noqa: E402
from algenta.errors import ResidentError  # noqa: E402
from algenta.residentk import ResidentSession  # noqa: E402
from algenta.residentk.config import make_config  # noqa: E402
from algenta.residentk.gguf_model import open_gguf  # noqa: E402
from algenta.residentk.weights import random_weights  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gguf_files import dequantized, permute, write_gguf  # noqa: E402

SHAPE = dict(d_model=64, h_q=4, h_kv=2, d_head=16, d_ff=96, n_layers=2, vocab=67)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def config(arch="qwen3", tied=True):
    fam = {} if arch == "qwen3" else {"arch": arch}
    # GGUF stores eps as float32: the config the file gives back holds that value
    return make_config(dict(SHAPE, rms_eps=float(np.float32(1e-6)), rope_theta=10000.0,
                            tie_word_embeddings=tied,
                            family=fam))


def tensors_of(cfg, seed=0):
    return dict(random_weights(cfg, seed))


def logits(session, ids=PROMPT):
    out = [session.prefill(ids[:5])]
    out += [session.step(t) for t in ids[5:]]
    return np.stack(out)


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen2", False), ("llama", True)])
def test_a_gguf_file_is_the_same_model_as_its_tensors(tmp_path, arch, tied):
    # F32: the file's tensors are the session's, names and (for Llama) q/k row order undone.
    cfg = config(arch, tied)
    t = tensors_of(cfg)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, t)
    ck = open_gguf(path)
    assert dict(ck.config) == dict(cfg) and ck.stored_format == "f32"
    got = ResidentSession.from_pretrained(path, progress=False)
    want = ResidentSession(cfg, t)
    assert got.weights == "f32"
    np.testing.assert_array_equal(logits(got), logits(want))


@pytest.mark.parametrize("fmt,held", [("F16", "f16"), ("BF16", "bf16"), ("Q8_0", "int8")])
def test_each_stored_type_is_held_as_it_is(tmp_path, fmt, held):
    # F16/BF16 keep their bits; Q8_0's blocks are the int8 session's blocks: the session over the
    # file equals a session quantizing the file's own values with its amax / 127 rule.
    cfg = config()
    t = tensors_of(cfg, 1)
    path = tmp_path / f"m-{fmt}.gguf"
    write_gguf(path, cfg, t, fmt)
    got = ResidentSession.from_pretrained(path, progress=False)
    assert got.weights == held
    want = ResidentSession(cfg, dequantized(t, cfg, fmt), weights=held)
    np.testing.assert_array_equal(logits(got), logits(want))


def test_q8_0_blocks_requantize_to_themselves():
    # Why a Q8_0 file held as int8 is exact: every nonzero block ggml writes reaches +-127, so
    # s = amax / 127 of the dequantized values is the file's scale and q = rint(x / s) its codes.
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-20, 8, (64, 1)))).astype(np.float32)
    x[3, 32:64] = 0.0
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32).ravel()
    q = raw[:, 2:].view(np.int8)
    y = q.astype(np.float32) * d[:, None]
    s = np.abs(y).max(axis=1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        q2 = np.where(s[:, None] > 0, np.rint(y / s[:, None]), 0)
    np.testing.assert_array_equal(s, d)
    live = d > 0  # a scale that underflowed float16 holds codes whose values are all zero
    assert (~live).any() and live.any()
    np.testing.assert_array_equal(q2[live], q[live])
    np.testing.assert_array_equal(q2 * s[:, None], y)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_block_types_widen_as_ggml_dequantizes(name):
    # Random bytes with finite half-precision scales: every code and scale pattern, compared
    # with the gguf package's NumPy dequantizer (llama.cpp's reference).
    qtype = getattr(gguf.GGMLQuantizationType, name.upper())
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(3)
    n_blocks = 64
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    # the f16 scale fields, where each layout keeps them, set to finite values of any size
    fields = {"q8_0": [0], "q4_0": [0], "q4_k": [0, 2], "q6_k": [208]}[name]
    for off in fields:
        h = (rng.standard_normal(n_blocks) * 2.0 ** rng.integers(-14, 14, n_blocks))
        raw[:, off:off + 2] = h.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    got = _core.session.widen(raw.ravel(), name, n_blocks * block)
    want = gguf.quants.dequantize(raw, qtype).ravel()
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_a_file_of_mixed_types_needs_a_format_named_and_then_matches_its_values(tmp_path):
    # as Q4_K_M mixes Q4_K and Q6_K: here Q4_0 and Q8_0 (the gguf package quantizes only these)
    cfg = config("llama")
    t = tensors_of(cfg, 4)
    path = tmp_path / "m-mixed.gguf"
    fmt = lambda name: "Q8_0" if "down_proj" in name or "embed" in name else "Q4_0"  # noqa: E731
    write_gguf(path, cfg, t, fmt)
    with pytest.raises(ResidentError, match="Q4_0, Q8_0.*weights='q4_0'") as e:
        ResidentSession.from_pretrained(path, progress=False)
    assert e.value.status == 607
    got = ResidentSession.from_pretrained(path, progress=False, weights="f32")
    deq = {k: dequantized({k: v}, cfg, fmt(k))[k] for k, v in t.items()}
    want = ResidentSession(cfg, deq)
    np.testing.assert_array_equal(logits(got), logits(want))


def test_the_llama_permutation_is_undone_row_for_row():
    from algenta.residentk.gguf_model import _unpermute

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(_unpermute(permute(w, 8), 8), w)


# ---- damaged files -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    cfg = config()
    path = tmp_path_factory.mktemp("g") / "good.gguf"
    write_gguf(path, cfg, tensors_of(cfg))
    return path.read_bytes()


def _refused(tmp_path, raw, match=None):
    p = tmp_path / "bad.gguf"
    p.write_bytes(raw)
    with pytest.raises(ResidentError) as e:
        open_gguf(p)
    assert e.value.status == 607, str(e.value)
    if match:
        assert match in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def _tensor_info_at(raw, name):
    """Offset of tensor `name`'s info entry (its name's length field)."""
    key = name.encode()
    i = raw.index(struct.pack("<Q", len(key)) + key)
    return i, i + 8 + len(key)


def test_damaged_files_are_refused_with_607(tmp_path, good):
    _refused(tmp_path, good[:10], "too short")
    _refused(tmp_path, b"GGUX" + good[4:], "not a GGUF file")
    _refused(tmp_path, good[:4] + struct.pack("<I", 1) + good[8:], "version 1")
    _refused(tmp_path, good[:4] + struct.pack("<I", 4) + good[8:], "version 4")
    _refused(tmp_path, good[:8] + struct.pack("<Q", 1 << 40) + good[16:], "more than")
    _refused(tmp_path, good[:16] + struct.pack("<Q", 1 << 40) + good[24:], "more than")
    for cut in (30, len(good) // 3, len(good) - 100):
        _refused(tmp_path, good[:cut])
    # the first key's length: past the file
    _refused(tmp_path, good[:24] + struct.pack("<Q", 1 << 62) + good[32:], "truncated")
    # a tensor's dims, type and offset
    _, at = _tensor_info_at(good, "token_embd.weight")
    n_dims = struct.unpack_from("<I", good, at)[0]
    dims_at, type_at = at + 4, at + 4 + 8 * n_dims
    off_at = type_at + 4

    def put(fmt, pos, v):
        return good[:pos] + struct.pack(fmt, v) + good[pos + struct.calcsize(fmt):]

    _refused(tmp_path, put("<I", at, 9), "9 dimensions")
    _refused(tmp_path, put("<Q", dims_at, 0), "zero")
    _refused(tmp_path, put("<Q", dims_at, 1 << 61), "2**62")
    _refused(tmp_path, put("<I", type_at, 99), "unknown ggml type 99")
    _refused(tmp_path, put("<I", type_at, 13), "Q5_K")
    _refused(tmp_path, put("<Q", off_at, 1 << 50), "past the end")
    _refused(tmp_path, put("<Q", off_at, 3), "alignment")
    _, at2 = _tensor_info_at(good, "blk.1.ffn_up.weight")  # not the first tensor: move it to 0
    _refused(tmp_path, put("<Q", at2 + 4 + 16 + 4, 0), "overlap")
    # rows of 64 values are not whole Q4_K blocks (256)
    _refused(tmp_path, put("<I", type_at, 12), "blocks of 256")


def test_files_of_the_wrong_model_are_refused(tmp_path):
    cfg = config()
    t = tensors_of(cfg)
    p = tmp_path / "m.gguf"
    write_gguf(p, cfg, {k: v for k, v in t.items() if "layers.1.mlp.up" not in k})
    with pytest.raises(ResidentError, match="blk.1.ffn_up.weight.*missing"):
        open_gguf(p)
    t2 = dict(t)
    t2["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:64]
    write_gguf(p, cfg, t2)
    with pytest.raises(ResidentError, match="shape"):
        open_gguf(p)
    write_gguf(p, cfg, t, meta={"general.architecture": "gemma3"})
    with pytest.raises(ResidentError, match="architecture 'gemma3'"):
        open_gguf(p)


def test_flipped_bytes_are_refused_or_read_never_a_crash(tmp_path, good):
    # Whatever one flipped byte in the header region does, the reader answers with a
    # ResidentError or a file it checked whole: never another exception, never a crash.
    rng = np.random.default_rng(5)
    end = good.index(struct.pack("<Q", len(b"token_embd.weight")) + b"token_embd.weight") + 200
    p = tmp_path / "f.gguf"
    for _ in range(300):
        raw = bytearray(good)
        i = int(rng.integers(0, end))
        raw[i] ^= 1 << int(rng.integers(0, 8))
        p.write_bytes(bytes(raw))
        try:
            open_gguf(p)
        except ResidentError:
            pass


# ---- the vocabulary ----------------------------------------------------------------------
def trained_vocabulary():
    """A byte-level BPE trained here (Qwen2's split rule and NFC, two special tokens and a
    plain added <think>) and its GGUF arrays: (tokenizer, (tokens, merges, types, pre))."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from algenta.residentk.gguf_tokenizer import PRE

    hf = Tokenizer(BPE())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE["qwen2"][0]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog 12345 times", "naïve café résumé",
            "def f(x):\n    return x * 2  # ok", "日本語のテキスト"] * 20
    hf.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"]))
    hf.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    model = __import__("json").loads(hf.to_str())["model"]
    vocab = dict(model["vocab"], **{t.content: i for i, t in hf.get_added_tokens_decoder().items()})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in ("<|im_start|>", "<|im_end|>") else 4 if t == "<think>" else 1
             for t in tokens]
    return hf, (tokens, merges, types, "qwen2")


def test_the_vocabulary_reads_back_as_the_tokenizer_it_came_from(tmp_path, capsys):
    hf, (tokens, merges, types, _) = trained_vocabulary()
    cfg = make_config(dict(SHAPE, vocab=len(tokens)))
    p = tmp_path / "v.gguf"
    write_gguf(p, cfg, tensors_of(cfg), tokenizer=(tokens, merges, types, "qwen2"),
               chat_template="{{ messages }}")
    ck = open_gguf(p)
    tok = ck.tokenizer()
    for s in ["<|im_start|>user\nthe lazy fox<|im_end|>", "<think>café 123456</think>",
              "naïve résumé", "  spaces\n\n\ttabs", "日本語", "e\u0301"]:
        assert tok.encode(s).ids == hf.encode(s).ids, s
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == \
            hf.decode(hf.encode(s).ids, skip_special_tokens=False)
    assert ck.chat_template == "{{ messages }}"
    assert ck.eos_ids() == {len(tokens) - 1}
    # algenta generate reads the same file: the prompt through this vocabulary, the text back
    from algenta.cli import main

    s = ResidentSession.from_pretrained(p, max_ctx=64, progress=False)
    ids = tok.encode("the lazy fox").ids
    want = s.generate(ids, 5, stop_ids=[])
    assert main(["generate", "--model", str(p), "--prompt", "the lazy fox", "--max-new", "5",
                 "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip() == tok.decode(ids + want).strip()  # prompt echoed


def test_the_command_line_names_what_a_file_needs(tmp_path, capsys):
    from algenta.cli import main

    cfg = config()
    p = tmp_path / "m-mixed.gguf"
    write_gguf(p, cfg, tensors_of(cfg), lambda name: "Q8_0" if "embed" in name else "Q4_0")
    assert main(["generate", "--model", str(p), "--ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "--weights" in err and "Q4_0, Q8_0" in err and "Traceback" not in err
    assert main(["generate", "--model", str(p), "--ids", "1,2", "--weights", "int8",
                 "--max-new", "2", "--ignore-eos"]) == 0
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(30))
    assert main(["generate", "--model", str(tmp_path / "x.gguf"), "--ids", "1"]) == 2
    assert "GGUF version 0" in capsys.readouterr().err


def test_plan_sizes_a_gguf_file_as_the_session_holds_it(tmp_path, capsys):
    from algenta.cli import main

    cfg = config("qwen2", tied=False)
    p = tmp_path / "m.gguf"
    write_gguf(p, cfg, tensors_of(cfg), "Q4_0")
    s = ResidentSession.from_pretrained(p, max_ctx=512, progress=False)
    assert main(["plan", "--config", str(p), "--weights", "q4_0", "--ctx", "512",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert str(s.resident_bytes) in out.replace(",", "").replace("_", ""), out[:2000]


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_algenta_serve_serves_a_gguf_file(tmp_path):
    # The file alone: its vocabulary, chat template and eos from the metadata, held as q4_0.
    import http.client
    import json
    import socket
    import subprocess
    import time

    hf, vocab = trained_vocabulary()
    cfg = make_config(dict(SHAPE, vocab=len(vocab[0])))
    p = tmp_path / "tiny-Q4_0.gguf"
    write_gguf(p, cfg, tensors_of(cfg), "Q4_0", tokenizer=vocab, chat_template=TEMPLATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "algenta", "serve", "--model", str(p),
                             "--port", str(port), "--slots", "2"], stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 60
        body = {"model": "tiny-Q4_0", "messages": [{"role": "user", "content": "the lazy fox"}],
                "max_tokens": 4, "temperature": 0}
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("POST", "/v1/chat/completions", body=json.dumps(body))
                r = c.getresponse()
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        out = json.loads(r.read())
        assert r.status == 200, out
        solo = ResidentSession.from_pretrained(p, progress=False)
        assert solo.weights == "q4_0"
        prompt = hf.encode("<|im_start|>user\nthe lazy fox<|im_end|>\n<|im_start|>assistant\n").ids
        want = solo.generate(prompt, 4, stop_ids=[len(vocab[0]) - 1])
        assert len(want) == 4 and out["choices"][0]["message"]["content"] == hf.decode(want)
        proc.send_signal(__import__("signal").SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

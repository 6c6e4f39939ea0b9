"""Regenerates the fuzz corpus (run from anywhere: python tests/fuzz_corpus/make_corpus.py).

tiny_qwen3/: a valid, untied Qwen3 checkpoint small enough to commit (D 8, 2 query heads sharing
one KV head of 4, F 16, one layer, vocab 16): embed/lm_head/MLP in F32, attention in BF16, so both
of the loader's read paths are seeds. hostile/: that model.safetensors with one lie each.
hostile_json/: JSON files nested far deeper than any real config, index or header (Python's
parser would recurse out of its stack on them), used as config.json and as the shard index.
"""

import json
import struct
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# Nesting depth of the hostile JSON files: 20x what CPython's parser recurses through.
DEEP = 20_000
CFG = dict(d_model=8, h_q=2, h_kv=1, d_head=4, d_ff=16, n_layers=1, vocab=16, rms_eps=1e-6,
           rope_theta=10000.0, tie_word_embeddings=False)


def tensors():
    from algenta.residentk.session import random_weights

    return dict(random_weights(CFG, seed=7))


def encode(name, a):
    if "self_attn" in name:
        u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        return "BF16", ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    return "F32", a.astype(np.float32).tobytes()


def safetensors(t, edit=None, length=None, cut=None):
    meta, blobs, off = {}, [], 0
    for name, a in t.items():
        dt, b = encode(name, a)
        meta[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if edit:
        edit(meta)
    h = json.dumps(meta).encode()
    h += b" " * (-len(h) % 8)
    out = struct.pack("<Q", len(h) if length is None else length) + h + b"".join(blobs)
    return out[:cut] if cut else out


def main():
    t = tensors()
    ck = HERE / "tiny_qwen3"
    ck.mkdir(exist_ok=True)
    (ck / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 8,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "num_hidden_layers": 1, "vocab_size": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "use_sliding_window": False, "attention_bias": False,
    }, indent=1) + "\n")
    (ck / "model.safetensors").write_bytes(safetensors(t))
    full = safetensors(t)
    emb = "model.embed_tokens.weight"

    def set_(key, value, name=emb):
        return lambda m: m[name].__setitem__(key, value)

    hostile = {
        "header_len_2p64m1.safetensors": safetensors(t, length=2**64 - 1),
        "header_len_past_file.safetensors": safetensors(t, length=len(full)),
        "offsets_past_end.safetensors": safetensors(t, set_("data_offsets", [0, 10**9])),
        "offsets_reversed.safetensors": safetensors(t, set_("data_offsets", [512, 0])),
        "shape_2p40_squared.safetensors": safetensors(t, set_("shape", [2**40, 2**40])),
        "dtype_f64.safetensors": safetensors(t, set_("dtype", "F64")),
        "dtype_f16_for_f32_bytes.safetensors": safetensors(t, set_("dtype", "F16")),
        "truncated_data.safetensors": full[:-5],
        "header_not_json.safetensors": struct.pack("<Q", 8) + b"{not js}" + full[8:],
        "header_nested_deep.safetensors": struct.pack("<Q", 2 * DEEP) + b"[" * DEEP + b"]" * DEEP
        + full[8 + struct.unpack("<Q", full[:8])[0]:],
    }
    (HERE / "hostile").mkdir(exist_ok=True)
    for name, blob in hostile.items():
        (HERE / "hostile" / name).write_bytes(blob)
    (HERE / "hostile_json").mkdir(exist_ok=True)
    (HERE / "hostile_json" / "nested_list.json").write_bytes(b"[" * DEEP + b"]" * DEEP)
    (HERE / "hostile_json" / "nested_object.json").write_bytes(
        b'{"a":' * DEEP + b"1" + b"}" * DEEP)


if __name__ == "__main__":
    main()

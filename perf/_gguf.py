"""Write a HuggingFace Qwen3 checkpoint as a GGUF file llama.cpp loads (perf scripts only).

Uses the `gguf` package (llama.cpp's own writer). Layout, as convert_hf_to_gguf.py writes Qwen3:
architecture `qwen3`, HF (out, in) matrices stored as they are (ggml's shape is the reverse, so
no transpose; Qwen3 uses NEOX RoPE, so no q/k permutation either), 1-D norms always F32, every
2-D matrix (token_embd included) in the chosen type. A tied checkpoint gets no output.weight:
llama.cpp then uses token_embd as the head, so in Q8_0 the head is Q8_0 too (as algenta's int8
session holds its tied head in int8).

The tokenizer is a placeholder that only lets llama.cpp load the file: a SentencePiece ("llama")
vocabulary of `vocab` entries, <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF> (llama.cpp
looks up <0x0A> as the newline token), then dummy tokens. Benchmarks feed token ids directly, so
it is never used to tokenize text; it needs vocab >= 259.
"""

from __future__ import annotations

# ggml type name -> (gguf type, file type); every 2-D matrix is written in it, norms in F32.
FORMATS = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
# bytes one element of a matrix costs in each type (Q8_0: 32 int8 + one float16 scale = 34 B;
# Q4_0: 16 B of 4-bit codes + one float16 scale = 18 B a block of 32)
BYTES_PER_ELEM = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34.0 / 32.0, "Q4_0": 18.0 / 32.0}

_LAYER = {  # HF name inside model.layers.N -> llama.cpp name inside blk.N
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's tensor name for a HF Qwen3 tensor name (None: lm_head.weight, dropped when
    tied)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        key = ".".join(parts[3:-1])
        if key in _LAYER:
            return f"blk.{int(parts[2])}.{_LAYER[key]}.weight"
    raise KeyError(f"no GGUF name for {hf_name!r}")


def matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of one (rows, cols) matrix in a ggml type (Q8_0/Q4_0 rows: multiples of 32)."""
    if fmt in ("Q8_0", "Q4_0"):
        return rows * (cols // 32) * (34 if fmt == "Q8_0" else 18)
    return int(rows * cols * BYTES_PER_ELEM[fmt])


def rope_theta(cfg) -> float:
    """RoPE base of a transformers config: `rope_theta` (4.x) or `rope_parameters` (5.x)."""
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        rp = getattr(cfg, "rope_parameters", None) or {}
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"only plain RoPE is written, got {rp}")
        theta = rp["rope_theta"]
    return float(theta)


def write_qwen3_gguf(path, cfg, tensors, fmt: str) -> None:
    """Write `tensors` (HF name -> float32 ndarray) of a Qwen3 model with config `cfg` (a
    transformers Qwen3Config) to `path`, every 2-D matrix in `fmt` (one of FORMATS)."""
    import gguf
    import numpy as np

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    V = cfg.vocab_size
    if V < 259:
        raise ValueError(f"the placeholder tokenizer needs vocab >= 259, got {V}")
    qt = gguf.GGMLQuantizationType
    qtype = {"F32": qt.F32, "F16": qt.F16, "BF16": qt.BF16, "Q8_0": qt.Q8_0, "Q4_0": qt.Q4_0}[fmt]
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[fmt]

    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name(f"random-qwen3-{fmt}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(V)
    w.add_file_type(ftype)

    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256)
    toks += [f"tok{i}" for i in range(len(toks), V)]
    types += [gguf.TokenType.NORMAL] * (V - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    tied = bool(getattr(cfg, "tie_word_embeddings", True))
    for name, arr in tensors.items():
        if name == "lm_head.weight" and tied:
            continue
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or fmt == "F32":
            w.add_tensor(gguf_name(name), arr)
        elif fmt == "F16":
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:  # BF16 / Q8_0 / Q4_0: the bytes gguf.quants makes (bit-exact with ggml's own)
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

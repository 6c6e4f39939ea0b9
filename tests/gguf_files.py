"""GGUF files the tests write themselves, as llama.cpp's converter (convert_hf_to_gguf.py) writes
them: the `gguf` package's writer and quantizers (llama.cpp's own, bit-exact with ggml's), the
converter's names, metadata and Llama q/k permutation. Not collected by pytest."""

from __future__ import annotations

import numpy as np

from algenta.residentk.gguf_model import gguf_name

ARCH = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's q/k row order for ggml's interleaved RoPE (LlamaModel.permute)."""
    return np.ascontiguousarray(
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
        .reshape(w.shape))


def write_gguf(path, cfg, tensors, fmt="F32", tokenizer=None, chat_template=None, meta=None):
    """Write `tensors` (transformers name -> float32 array) of a session config `cfg` (a
    ResidentConfig) to `path`: every 2-D matrix in `fmt` (F32, F16, BF16, Q8_0, Q4_0; or a
    function of the tensor's name giving one), norms and biases in F32, no output.weight when the
    head is tied. tokenizer: (tokens, merges, types,
    pre) for a byte-level BPE vocabulary, else placeholder tokens. meta: extra key -> value."""
    import gguf

    arch = cfg.family.get("arch", "qwen3")
    qt = gguf.GGMLQuantizationType
    fmt_of = fmt if callable(fmt) else (lambda _name: fmt)
    w = gguf.GGUFWriter(str(path), ARCH[arch])
    w.add_context_length(4096)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_block_count(cfg.n_layers)
    w.add_head_count(cfg.h_q)
    w.add_head_count_kv(cfg.h_kv)
    w.add_key_length(cfg.d_head)
    w.add_value_length(cfg.d_head)
    w.add_rope_dimension_count(cfg.d_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    if tokenizer is None:
        tokens = [f"t{i}" for i in range(cfg.vocab)]
        merges, types, pre = [], [1] * cfg.vocab, "qwen2"
    else:
        tokens, merges, types, pre = tokenizer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for k, v in (meta or {}).items():
        w.add_key_value(k, v, gguf.GGUFValueType.get_type(v))
    for name, arr in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        fmt = fmt_of(name)
        qtype = getattr(qt, fmt)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = permute(arr, cfg.h_q if "q_proj" in name else cfg.h_kv)
        if arr.ndim == 1 or fmt == "F32":
            w.add_tensor(gguf_name(name), arr)
        elif fmt == "F16":
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized(tensors, cfg, fmt):
    """The float32 values a `fmt` file written from `tensors` holds (gguf's dequantizers)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    out = {}
    for name, a in tensors.items():
        if a.ndim == 2 and fmt not in ("F32",):
            if fmt == "F16":
                a = a.astype(np.float16).astype(np.float32)
            else:
                a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out

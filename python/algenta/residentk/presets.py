"""Model shapes a resident session or ``algenta plan`` can size, by name or from a config file.

The Qwen3 dense family as published in each model's HuggingFace ``config.json`` (Qwen/Qwen3-*):
head_dim 128, vocabulary 151,936, rope_theta 1,000,000, RMSNorm eps 1e-6 throughout; the three
smaller models tie the embedding to the lm_head, the three larger ones do not.
"""

from __future__ import annotations

import json
import numbers

from .._records import record_type

ModelShape = record_type(
    "ModelShape",
    ("name", "d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers", "vocab", "tied",
     "rope_theta", "rms_eps"),
    """One decoder-only transformer shape: the seven residentk dimensions (``d_model``, ``h_q``,
    ``h_kv``, ``d_head``, ``d_ff``, ``n_layers``, ``vocab``), whether the embedding is ``tied`` to
    the lm_head, and the RoPE base and RMSNorm eps a session needs.""",
)
ModelShape.__module__ = __name__  # so records pickle by reference to this module


def _qwen3(name, d_model, h_q, d_ff, n_layers, tied):
    return ModelShape(name=name, d_model=d_model, h_q=h_q, h_kv=8, d_head=128, d_ff=d_ff,
                      n_layers=n_layers, vocab=151936, tied=tied, rope_theta=1000000.0,
                      rms_eps=1e-6)


PRESETS = {
    "qwen3-0.6b": _qwen3("Qwen3-0.6B", 1024, 16, 3072, 28, True),
    "qwen3-1.7b": _qwen3("Qwen3-1.7B", 2048, 16, 6144, 28, True),
    "qwen3-4b": _qwen3("Qwen3-4B", 2560, 32, 9728, 36, True),
    "qwen3-8b": _qwen3("Qwen3-8B", 4096, 32, 12288, 36, False),
    "qwen3-14b": _qwen3("Qwen3-14B", 5120, 40, 17408, 40, False),
    "qwen3-32b": _qwen3("Qwen3-32B", 5120, 64, 25600, 64, False),
}


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive; ``Qwen/Qwen3-8B`` and ``qwen3-8b-base`` are
    accepted too). Unknown names raise ``KeyError`` listing the known ones."""
    key = str(name).strip().lower()
    if "/" in key:
        key = key.rsplit("/", 1)[1]
    if key.endswith("-base"):
        key = key[: -len("-base")]
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def _int_field(cfg: dict, key: str) -> int:
    if key not in cfg:
        raise ValueError(f"config has no {key!r}")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"config {key!r} must be an integer, got {v!r}")
    return int(v)


def _real_field(cfg: dict, key: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"config {key!r} must be a number, got {v!r}")
    return float(v)


def shape_from_hf_config(cfg: dict, name: str = "config") -> ModelShape:
    """A :class:`ModelShape` from a HuggingFace ``config.json`` dict (Qwen3/Llama-style keys).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads``
    to ``num_attention_heads`` (as transformers does); ``rope_theta`` is read at the top level or
    inside ``rope_parameters`` (newer transformers); ``tie_word_embeddings`` defaults to True (the
    transformers default). A missing or non-integer size raises ``ValueError``; the numbers
    themselves are judged by :func:`algenta.residentk.contract.residentk_shape_check`."""
    if not isinstance(cfg, dict):
        raise ValueError("config must be a JSON object")
    if "text_config" in cfg and "hidden_size" not in cfg and isinstance(cfg["text_config"], dict):
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model's shape here
    d_model = _int_field(cfg, "hidden_size")
    h_q = _int_field(cfg, "num_attention_heads")
    h_kv = _int_field(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else h_q
    if cfg.get("head_dim") is not None:
        d_head = _int_field(cfg, "head_dim")
    else:
        d_head = d_model // h_q if h_q > 0 else 0
    theta = cfg.get("rope_theta")
    rope = cfg.get("rope_parameters")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    tied = cfg.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise ValueError(f"config 'tie_word_embeddings' must be true or false, got {tied!r}")
    return ModelShape(
        name=str(cfg.get("_name_or_path") or name), d_model=d_model, h_q=h_q, h_kv=h_kv,
        d_head=d_head, d_ff=_int_field(cfg, "intermediate_size"),
        n_layers=_int_field(cfg, "num_hidden_layers"), vocab=_int_field(cfg, "vocab_size"),
        tied=tied, rope_theta=_real_field({"rope_theta": theta}, "rope_theta", 10000.0),
        rms_eps=_real_field(cfg, "rms_norm_eps", 1e-6),
    )


def load_hf_config(path) -> ModelShape:
    """:func:`shape_from_hf_config` of a ``config.json`` file (or a directory holding one).
    Raises ``OSError`` if it cannot be read and ``ValueError`` if it is not a usable config."""
    import os

    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e.msg} (line {e.lineno})") from None
    return shape_from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(p))) or p)


__all__ = ["ModelShape", "PRESETS", "preset", "shape_from_hf_config", "load_hf_config"]

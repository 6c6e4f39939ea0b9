"""Model shapes a resident session or ``algenta plan`` can size, by name or from a config file.

The Qwen3 dense family as published in each model's HuggingFace ``config.json`` (Qwen/Qwen3-*):
head_dim 128, vocabulary 151,936, rope_theta 1,000,000, RMSNorm eps 1e-6 throughout; the three
smaller models tie the embedding to the lm_head, the three larger ones do not.
"""

from __future__ import annotations

from .._records import record_type
from ..errors import ResidentError
from .config import SHAPE_KEYS, parse_hf_config, read_json_file

ModelShape = record_type(
    "ModelShape",
    ("name",) + SHAPE_KEYS + ("tied", "rope_theta", "rms_eps", "family"),
    """One decoder-only transformer shape: the seven residentk dimensions (``d_model``, ``h_q``,
    ``h_kv``, ``d_head``, ``d_ff``, ``n_layers``, ``vocab``), whether the embedding is ``tied`` to
    the lm_head, the RoPE base and RMSNorm eps a session needs, and the model ``family`` (a
    ResidentConfig family dict, {} for Qwen3; what a config the session cannot compute would
    hold, planning sizes all the same).""",
)
ModelShape.__module__ = __name__  # so records pickle by reference to this module


def _qwen3(name, d_model, h_q, d_ff, n_layers, tied):
    return ModelShape(name=name, d_model=d_model, h_q=h_q, h_kv=8, d_head=128, d_ff=d_ff,
                      n_layers=n_layers, vocab=151936, tied=tied, rope_theta=1000000.0,
                      rms_eps=1e-6, family={})


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


def shape_from_hf_config(cfg: dict, name: str = "config") -> ModelShape:
    """A :class:`ModelShape` from a HuggingFace ``config.json`` dict, read by the one config
    reader (:func:`algenta.residentk.config.parse_hf_config`, transformers' defaults: an untied
    head for Qwen3 unless the file says otherwise). A field that is missing or of the wrong type
    raises ``ResidentError`` (a ``ValueError``) with its status; the sizes themselves are judged
    by :func:`algenta.residentk.contract.residentk_shape_check`."""
    m = parse_hf_config(cfg)
    src = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    return ModelShape(
        name=str(src.get("_name_or_path") or name), d_model=m.d_model, h_q=m.h_q, h_kv=m.h_kv,
        d_head=m.d_head, d_ff=m.d_ff, n_layers=m.n_layers, vocab=m.vocab, tied=m.tied,
        rope_theta=m.rope_theta, rms_eps=m.rms_eps, family=dict(m.family))


def load_hf_config(path) -> ModelShape:
    """:func:`shape_from_hf_config` of a ``config.json`` file (or a directory holding one), or of
    a GGUF file's metadata (read as the session reads it, gguf_model). Raises ``OSError`` if it
    cannot be read and ``ResidentError`` (a ``ValueError``) if it is not a usable config."""
    import os

    from .gguf_model import gguf_hf_config, is_gguf

    p = os.fspath(path)
    if is_gguf(p):
        return shape_from_hf_config(gguf_hf_config(p), name=os.path.splitext(os.path.basename(p))[0])
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    cfg = read_json_file(p, os.path.basename(p))
    if not isinstance(cfg, dict):
        raise ResidentError(f"{os.path.basename(p)} is not a JSON object", 607)
    return shape_from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(p))) or p)


__all__ = ["ModelShape", "PRESETS", "preset", "shape_from_hf_config", "load_hf_config"]

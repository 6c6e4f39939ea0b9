"""Model configs: the session's own record (``ResidentConfig``) and the one reader of HuggingFace
``config.json`` files, used by ``algenta plan --config`` and by checkpoint loading alike.

Defaults are transformers' own for the declared model: ``head_dim`` is ``hidden_size //
num_attention_heads``, ``num_key_value_heads`` is ``num_attention_heads``, ``rope_theta`` (at the
top level, or inside ``rope_parameters`` as newer transformers writes it) 10000, ``rms_norm_eps``
1e-6, and ``tie_word_embeddings`` what that model type's config class defaults to (false for
Qwen3, Qwen2, Llama and Mistral, true for Gemma; the model type is read from ``model_type`` or
the ``architectures`` list), and ``PretrainedConfig``'s own default (true) for a model type not in
that list.

Every refusal is a ``ResidentError`` with a status: 607 for a file or field that is not a usable
config (bad JSON, JSON nested past any real config's depth, a wrong type), 601/602 for an integer
past int64, 609 for a non-finite or non-positive scalar.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping

from .._records import record_type
from ..errors import ResidentError

_WEIGHT = 607

# The seven residentk dimensions, in the order every contract function takes them: the one list
# of a model's shape that ResidentConfig, HFModel, presets.ModelShape and `algenta plan` share.
SHAPE_KEYS = ("d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers", "vocab")
CONFIG_KEYS = SHAPE_KEYS + ("rms_eps", "rope_theta", "tie_word_embeddings")
ResidentConfig = record_type(
    "ResidentConfig", CONFIG_KEYS,
    "The shape and scalars of a Qwen3 model as a resident session holds it (d_head need not "
    "equal d_model / h_q).")
ResidentConfig.__module__ = __name__

_DEFAULTS = {"rms_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True}
_INT_KEYS = SHAPE_KEYS

HFModel = record_type(
    "HFModel",
    ("model_type", "architectures") + SHAPE_KEYS +
    ("tied", "rope_theta", "rms_eps", "rope_type", "sliding_window", "attention_bias",
     "hidden_act"),
    "What a HuggingFace config.json says about a decoder-only model, with transformers' "
    "defaults filled in.")
HFModel.__module__ = __name__

# transformers' config classes' own tie_word_embeddings defaults, by model_type.
_TIED_DEFAULT = {"qwen3": False, "qwen2": False, "llama": False, "mistral": False,
                 "gemma": True, "gemma2": True, "gemma3_text": True}
_ARCH_TYPE = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
              "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
              "Gemma3ForCausalLM": "gemma3_text"}


def _refuse(msg: str, status: int = _WEIGHT) -> ResidentError:
    return ResidentError(msg, status)


def make_config(config) -> ResidentConfig:
    """A ResidentConfig from a mapping with CONFIG_KEYS (rms_eps, rope_theta and
    tie_word_embeddings default to Qwen3's 1e-6, 1e6 and True)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping with keys {CONFIG_KEYS}, "
                        f"got {type(config).__name__}")
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise TypeError(f"unknown config keys {sorted(unknown)}; expected {CONFIG_KEYS}")
    items = {}
    for k in CONFIG_KEYS:
        if k not in config and k not in _DEFAULTS:
            raise TypeError(f"config is missing {k!r}")
        v = config.get(k, _DEFAULTS.get(k))
        if k in _INT_KEYS:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"config[{k!r}] must be an int, got {type(v).__name__}")
            v = int(v)
            if not -(2**63) <= v < 2**63:
                raise ResidentError(f"config[{k!r}] = {v} is past any dimension ceiling",
                                    601 if v < 0 else 602)
        elif k == "tie_word_embeddings":
            v = bool(v)
        else:
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"config[{k!r}] must be a number, got {type(v).__name__}")
            v = float(v)
        items[k] = v
    return ResidentConfig(**items)


def load_json(raw, what: str):
    """JSON text or bytes -> object, every failure a 607 naming `what`: invalid UTF-8 or JSON,
    and JSON nested so deep that the parser would recurse out of its stack (a real config,
    index or safetensors header is a handful of levels deep)."""
    try:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raw = bytes(raw).decode("utf-8")
        return json.loads(raw)
    except RecursionError:
        raise _refuse(f"{what} is nested too deeply to be a real file of its kind") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(f"{what} is not valid JSON ({e})") from None


# A config.json is a few KB and a shard index a few hundred; past these a file is not one of
# them (`--config /dev/zero` would otherwise read until the process is killed).
MAX_CONFIG_BYTES = 4 * 2**20
MAX_INDEX_BYTES = 64 * 2**20


def read_json_file(path, what: str | None = None, limit: int = MAX_CONFIG_BYTES):
    """load_json of a file's bytes, at most `limit` of them read (607 past it); OSError (not
    found, unreadable) passes through. Reads rather than stats, so a pipe (`<(...)`) works."""
    what = what or str(path)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise _refuse(f"{what} is larger than {limit // 2**20} MiB, far past any real file of "
                      "its kind; not read further")
    return load_json(raw, what)


def _int(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise _refuse(f"config.json lacks {key!r}")
    v = hf[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _refuse(f"config.json {key!r} must be an integer, got {v!r}")
    if not -(2**63) <= v < 2**63:  # the contract's own ceilings then name the real limit
        raise ResidentError(f"config.json {key!r} = {v} is past any dimension ceiling",
                            601 if v < 0 else 602)
    return v


def _positive_real(key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _refuse(f"config.json {key!r} must be a number, got {v!r}")
    try:
        f = float(v)  # a JSON integer past 1e308 overflows here
    except OverflowError:
        f = math.inf
    if not (math.isfinite(f) and f > 0):
        raise ResidentError(f"config.json {key!r} must be finite and > 0, got {v!r}", 609)
    return f


def parse_hf_config(hf) -> HFModel:
    """The :class:`HFModel` of a config.json dict (a multimodal wrapper's ``text_config`` is
    read when the top level has no ``hidden_size``). Sizes are not judged here: the residentk
    contract's checks name their own limits."""
    if not isinstance(hf, dict):
        raise _refuse("config.json is not a JSON object")
    if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
    arch = hf.get("architectures") or []
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise _refuse(f"config.json 'architectures' must be a list of names, got {arch!r}")
    model_type = hf.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise _refuse(f"config.json 'model_type' must be a string, got {model_type!r}")
    if model_type is None:
        model_type = next((_ARCH_TYPE[a] for a in arch if a in _ARCH_TYPE), None)

    d_model, h_q = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    h_kv = _int(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else h_q
    if hf.get("head_dim") is not None:
        d_head = _int(hf, "head_dim")
    else:
        d_head = d_model // h_q if h_q > 0 else 0

    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise _refuse("config.json 'rope_parameters' must be an object")
    rope = rope or {}
    theta = hf.get("rope_theta")
    if theta is None:
        theta = rope.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", rope_type))

    if "tie_word_embeddings" in hf:
        tied = hf["tie_word_embeddings"]
        # Only a JSON bool: the string "false" would otherwise read as true and drop lm_head.
        if not isinstance(tied, bool):
            raise _refuse(f"config.json 'tie_word_embeddings' must be true or false, got {tied!r}")
    else:
        tied = _TIED_DEFAULT.get(model_type, True)

    sliding = hf.get("use_sliding_window")
    return HFModel(
        model_type=model_type, architectures=tuple(arch), d_model=d_model, h_q=h_q, h_kv=h_kv,
        d_head=d_head, d_ff=_int(hf, "intermediate_size"), n_layers=_int(hf, "num_hidden_layers"),
        vocab=_int(hf, "vocab_size"), tied=tied,
        rope_theta=_positive_real("rope_theta", theta),
        rms_eps=_positive_real("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        rope_type=rope_type, sliding_window=bool(sliding), attention_bias=bool(hf.get("attention_bias")),
        hidden_act=hf.get("hidden_act", "silu"))


def session_config(m: HFModel) -> ResidentConfig:
    """The resident session's config of a parsed model, refusing (607) what the session does not
    compute: another architecture, scaled RoPE, sliding windows, projection biases, an
    activation other than SiLU."""
    if m.model_type != "qwen3" and "Qwen3ForCausalLM" not in m.architectures:
        raise _refuse(f"architecture {list(m.architectures) or m.model_type!r} is not Qwen3 "
                      "(model_type 'qwen3', Qwen3ForCausalLM); the resident session computes "
                      "Qwen3 only")
    if m.rope_type not in (None, "default"):
        raise _refuse(f"rope_type {m.rope_type!r} is not supported (plain RoPE only)")
    if m.sliding_window:
        raise _refuse("sliding-window attention is not supported (use_sliding_window is true)")
    if m.attention_bias:
        raise _refuse("attention_bias is true: the session holds no projection biases")
    if m.hidden_act != "silu":
        raise _refuse(f"hidden_act {m.hidden_act!r} is not silu")
    return make_config(dict(d_model=m.d_model, h_q=m.h_q, h_kv=m.h_kv, d_head=m.d_head,
                            d_ff=m.d_ff, n_layers=m.n_layers, vocab=m.vocab, rms_eps=m.rms_eps,
                            rope_theta=m.rope_theta, tie_word_embeddings=m.tied))


__all__ = ["CONFIG_KEYS", "ResidentConfig", "make_config", "HFModel", "parse_hf_config",
           "session_config", "load_json", "read_json_file", "MAX_CONFIG_BYTES",
           "MAX_INDEX_BYTES"]

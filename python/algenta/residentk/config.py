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

from .. import _core
from .._records import record_type
from ..errors import ResidentError

_WEIGHT = 607

# The seven residentk dimensions, in the order every contract function takes them: the one list
# of a model's shape that ResidentConfig, HFModel, presets.ModelShape and `algenta plan` share.
SHAPE_KEYS = ("d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers", "vocab")
CONFIG_KEYS = SHAPE_KEYS + ("rms_eps", "rope_theta", "tie_word_embeddings", "family")
ResidentConfig = record_type(
    "ResidentConfig", CONFIG_KEYS,
    "The shape and scalars of a model as a resident session holds it (d_head need not equal "
    "d_model / h_q), and its ``family``: a dict of FAMILY_KEYS (empty for plain Qwen3; "
    "``{'arch': 'llama', ...}`` otherwise), what sets the model apart beyond its sizes.")
ResidentConfig.__module__ = __name__

# The family fields the engines read (the session core's SessionConfig after `arch`; the
# bindings refuse any other key). Absent means Qwen3's behaviour.
FAMILY_KEYS = ("arch", "qkv_bias", "o_bias", "mlp_bias", "sliding_window", "sliding_layers",
               "attn_scale", "attn_softcap", "final_softcap", "rope_type", "rope_factor",
               "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_ctx",
               "rope_local_theta")

# The families, as the session core declares them (name = transformers' model_type, HF class,
# what each layer holds and computes): read from the core, never restated.
ARCHS = {a["name"]: dict(a) for a in _core.session.ARCHS}
_ARCH_BY_CLASS = {a["hf_class"]: n for n, a in ARCHS.items()}

_DEFAULTS = {"rms_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
             "family": {}}
_INT_KEYS = SHAPE_KEYS

HFModel = record_type(
    "HFModel",
    ("model_type", "architectures") + SHAPE_KEYS +
    ("tied", "rope_theta", "rms_eps", "family", "unsupported"),
    "What a HuggingFace config.json says about a decoder-only model, with transformers' "
    "defaults filled in: its sizes, its ``family`` fields (FAMILY_KEYS, as the session reads "
    "them) and, in ``unsupported``, every field the session does not compute, by name.")
HFModel.__module__ = __name__

# transformers' config classes' own tie_word_embeddings defaults, by model_type.
_TIED_DEFAULT = {"qwen3": False, "qwen2": False, "llama": False, "mistral": False,
                 "gemma": True, "gemma2": True, "gemma3_text": True}
# Classes a config may name that are not session families (planning sizes them all the same).
_ARCH_TYPE = {"GemmaForCausalLM": "gemma", "Gemma3ForConditionalGeneration": "gemma3_text",
              **_ARCH_BY_CLASS}


def _refuse(msg: str, status: int = _WEIGHT) -> ResidentError:
    return ResidentError(msg, status)


_FAMILY_BOOLS = ("qkv_bias", "o_bias", "mlp_bias")
_FAMILY_INTS = ("sliding_window", "rope_original_ctx")
_FAMILY_STRS = ("arch", "rope_type")


def _family_value(key, v):
    """One family field checked for its type (a TypeError naming it); the session core judges
    the values themselves (601/607/609)."""
    if key in _FAMILY_BOOLS:
        if not isinstance(v, bool):
            raise TypeError(f"family[{key!r}] must be a bool, got {type(v).__name__}")
    elif key in _FAMILY_STRS:
        if not isinstance(v, str):
            raise TypeError(f"family[{key!r}] must be a str, got {type(v).__name__}")
    elif key == "sliding_layers":
        if not isinstance(v, (list, tuple)) or not all(isinstance(b, bool) for b in v):
            raise TypeError("family['sliding_layers'] must be a sequence of bools")
        v = tuple(v)
    elif key in _FAMILY_INTS:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"family[{key!r}] must be an int, got {type(v).__name__}")
        v = int(v)
        if not -(2**63) <= v < 2**63:
            raise ResidentError(f"family[{key!r}] = {v} is past int64", 601 if v < 0 else 602)
    else:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"family[{key!r}] must be a number, got {type(v).__name__}")
        v = float(v)
    return v


def make_config(config) -> ResidentConfig:
    """A ResidentConfig from a mapping with CONFIG_KEYS (rms_eps, rope_theta,
    tie_word_embeddings and family default to Qwen3's 1e-6, 1e6, True and {})."""
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
        elif k == "family":
            if not isinstance(v, Mapping):
                raise TypeError(f"config['family'] must be a mapping, got {type(v).__name__}")
            bad = set(v) - set(FAMILY_KEYS)
            if bad:
                raise TypeError(f"unknown family keys {sorted(bad)}; expected {FAMILY_KEYS}")
            v = {f: _family_value(f, v[f]) for f in FAMILY_KEYS if f in v}
            if "arch" in v and v["arch"] not in ARCHS:
                raise ResidentError(f"family arch {v['arch']!r} is not one the session computes "
                                    f"({', '.join(ARCHS)})", _WEIGHT)
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

    if "tie_word_embeddings" in hf:
        tied = hf["tie_word_embeddings"]
        # Only a JSON bool: the string "false" would otherwise read as true and drop lm_head.
        if not isinstance(tied, bool):
            raise _refuse(f"config.json 'tie_word_embeddings' must be true or false, got {tied!r}")
    else:
        tied = _TIED_DEFAULT.get(model_type, True)

    n_layers = _int(hf, "num_hidden_layers")
    family, unsupported, theta = _family(hf, model_type, n_layers)
    return HFModel(
        model_type=model_type, architectures=tuple(arch), d_model=d_model, h_q=h_q, h_kv=h_kv,
        d_head=d_head, d_ff=_int(hf, "intermediate_size"), n_layers=n_layers,
        vocab=_int(hf, "vocab_size"), tied=tied,
        rope_theta=_positive_real("rope_theta", theta),
        rms_eps=_positive_real("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        family=family, unsupported=tuple(unsupported))


# Sliding-window layer patterns of configs that predate `layer_types` (transformers' own
# defaults): Gemma 2 alternates from a sliding first layer, Gemma 3 slides on all but every
# sliding_window_pattern-th layer.
def _default_layer_types(model_type, hf, n_layers):
    if model_type == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if model_type == "gemma3_text":
        pattern = hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise _refuse(f"config.json 'sliding_window_pattern' must be an integer >= 1, "
                          f"got {pattern!r}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n_layers)]
    if model_type == "mistral":
        return ["sliding_attention"] * n_layers
    if model_type in ("qwen2", "qwen3"):  # layers from max_window_layers on slide
        first = hf.get("max_window_layers", n_layers)
        first = first if isinstance(first, int) and not isinstance(first, bool) else n_layers
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def _rope(params, where, unsupported):
    """(theta or None, family rope fields) of one RoPE parameter set (transformers 5's
    rope_parameters, or a 4.x rope_scaling dict with the top-level rope_theta)."""
    out = {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        pass
    elif kind == "linear":
        out = {"rope_type": "linear", "rope_factor": _positive_real(f"{where}.factor",
                                                                  params.get("factor"))}
    elif kind == "llama3":
        oc = params.get("original_max_position_embeddings")
        if isinstance(oc, bool) or not isinstance(oc, int) or oc < 1:
            raise _refuse(f"config.json {where}.original_max_position_embeddings must be an "
                          f"integer >= 1, got {oc!r}")
        out = {"rope_type": "llama3",
               "rope_factor": _positive_real(f"{where}.factor", params.get("factor")),
               "rope_low_freq_factor": _positive_real(f"{where}.low_freq_factor",
                                                      params.get("low_freq_factor", 1.0)),
               "rope_high_freq_factor": _positive_real(f"{where}.high_freq_factor",
                                                       params.get("high_freq_factor", 4.0)),
               "rope_original_ctx": oc}
        if not out["rope_high_freq_factor"] > out["rope_low_freq_factor"]:
            raise ResidentError(f"config.json {where}: high_freq_factor must exceed "
                                "low_freq_factor", 609)
    else:
        unsupported.append(f"{where}.rope_type {kind!r} (the session computes default, linear "
                           "and llama3 RoPE)")
    if params.get("attention_factor") not in (None, 1, 1.0):
        unsupported.append(f"{where}.attention_factor {params['attention_factor']!r}")
    return params.get("rope_theta"), out


def _family(hf, model_type, n_layers):
    """(family fields, unsupported field names, rope_theta) of a config, as transformers reads
    that model type's config: what the session computes goes in the family, what it does not is
    named in unsupported (session_config refuses those; planning sizes the model regardless)."""
    unsupported = []
    if model_type not in ARCHS:
        unsupported.append(f"architecture {model_type!r}")
    fam = {"arch": model_type} if model_type in ARCHS and model_type != "qwen3" else {}
    gemma = model_type in ("gemma2", "gemma3_text")

    # Biases: attention_bias puts them on q, k, v and o where the model type reads it (Qwen2
    # has q/k/v biases always, its o_proj and Mistral's projections none); mlp_bias is Llama's.
    if model_type in ("llama", "qwen3", "gemma2", "gemma3_text") and hf.get("attention_bias"):
        fam["qkv_bias"] = fam["o_bias"] = True
    if model_type == "llama" and hf.get("mlp_bias"):
        fam["mlp_bias"] = True

    act = hf.get("hidden_activation") if gemma else hf.get("hidden_act", "silu")
    if gemma and act is None:
        act = "gelu_pytorch_tanh"
    want = ARCHS.get(model_type, {}).get("act", "silu")
    if act != want:
        unsupported.append(f"{'hidden_activation' if gemma else 'hidden_act'} {act!r} "
                           f"(this family computes {want!r})")
    if hf.get("use_bidirectional_attention"):
        unsupported.append("use_bidirectional_attention true")

    # Sliding windows: the layers `layer_types` (or the model type's default) marks, at
    # sliding_window keys (4096 when absent, as the config classes default); Qwen2/3 slide only
    # with use_sliding_window, Llama never.
    window = hf.get("sliding_window", 4096)  # the config classes' default; null: none
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if model_type == "llama" or model_type not in ARCHS:  # another family's layer kinds are
        window = None                                      # not read: planning sizes it as is
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise _refuse(f"config.json 'sliding_window' must be an integer >= 1 or null, "
                          f"got {window!r}")
        types = hf.get("layer_types")
        if types is None:
            types = _default_layer_types(model_type, hf, n_layers)
        if (not isinstance(types, list) or len(types) != n_layers or
                not all(t in ("sliding_attention", "full_attention") for t in types)):
            raise _refuse(f"config.json 'layer_types' must list 'sliding_attention' or "
                          f"'full_attention' for each of the {n_layers} layers, got {types!r}")
        slides = [t == "sliding_attention" for t in types]
        if any(slides):
            fam["sliding_window"] = window
            if not all(slides):
                fam["sliding_layers"] = tuple(slides)

    if gemma:
        qpas = hf.get("query_pre_attn_scalar", 256)
        fam["attn_scale"] = _positive_real("query_pre_attn_scalar", qpas) ** -0.5
        default_caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
        for key, field, dflt in (("attn_logit_softcapping", "attn_softcap", default_caps[0]),
                                 ("final_logit_softcapping", "final_softcap", default_caps[1])):
            cap = hf.get(key, dflt)
            if cap is not None:
                fam[field] = _positive_real(key, cap)

    # RoPE: transformers 5's rope_parameters (per layer type for Gemma 3), or 4.x's top-level
    # rope_theta with rope_scaling (and Gemma 3's rope_local_base_freq).
    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise _refuse("config.json 'rope_parameters' must be an object")
    theta = hf.get("rope_theta")
    if rope and ("full_attention" in rope or "sliding_attention" in rope):
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise _refuse("config.json 'rope_parameters' per layer type must be objects")
        t, fields = _rope(full, "rope_parameters.full_attention", unsupported)
        fam.update(fields)
        theta = theta if theta is not None else t
        lt, lfields = _rope(local, "rope_parameters.sliding_attention", unsupported)
        if lfields:
            unsupported.append("scaled RoPE on sliding layers")
        if lt is not None:
            fam["rope_local_theta"] = _positive_real("rope_parameters.sliding_attention."
                                                     "rope_theta", lt)
    else:
        params = dict(rope or {})
        scaling = hf.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise _refuse("config.json 'rope_scaling' must be an object or null")
        params.update(scaling or {})
        t, fields = _rope(params, "rope_scaling" if scaling else "rope_parameters", unsupported)
        fam.update(fields)
        theta = theta if theta is not None else t
        if model_type == "gemma3_text":
            fam["rope_local_theta"] = _positive_real("rope_local_base_freq",
                                                     hf.get("rope_local_base_freq", 10000.0))
    if theta is None:
        theta = 10000.0
    if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
        unsupported.append(f"partial_rotary_factor {hf['partial_rotary_factor']!r}")
    return fam, unsupported, theta


def session_config(m: HFModel) -> ResidentConfig:
    """The resident session's config of a parsed model, refusing (607) what the session does not
    compute: an architecture outside its families (naming those), and any field of a known one
    it does not implement, by name (never ignored)."""
    if m.model_type not in ARCHS:
        names = ", ".join(f"{a['hf_class']}" for a in ARCHS.values())
        raise _refuse(f"architecture {list(m.architectures) or m.model_type!r} is not one the "
                      f"resident session computes ({names})")
    if m.unsupported:
        raise _refuse(f"{ARCHS[m.model_type]['hf_class']}: the session does not compute "
                      f"{'; '.join(m.unsupported)}")
    return make_config(dict(d_model=m.d_model, h_q=m.h_q, h_kv=m.h_kv, d_head=m.d_head,
                            d_ff=m.d_ff, n_layers=m.n_layers, vocab=m.vocab, rms_eps=m.rms_eps,
                            rope_theta=m.rope_theta, tie_word_embeddings=m.tied,
                            family=m.family))


__all__ = ["CONFIG_KEYS", "FAMILY_KEYS", "ARCHS", "ResidentConfig", "make_config", "HFModel",
           "parse_hf_config",
           "session_config", "load_json", "read_json_file", "MAX_CONFIG_BYTES",
           "MAX_INDEX_BYTES"]

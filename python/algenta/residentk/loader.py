"""Load a HuggingFace Qwen3 checkpoint directory into a ResidentSession, tensor by tensor.

What is read: ``config.json`` (``rope_theta`` at top level, as the published Qwen3 files, or
inside ``rope_parameters``, as newer transformers writes it) and ``model.safetensors`` or the
shards a ``model.safetensors.index.json`` names. Tensors stored as BF16, F16 or F32 become
float32: F16/F32 through the ``safetensors`` package when it is installed, BF16 (which NumPy
cannot represent) by widening its bits in the engine (a bf16 is the top half of a float32, so
the conversion is exact), and everything through a read-only memory map when ``safetensors`` is
absent.

Peak memory is about the float32 session: the session allocates its resident buffers first, then
each tensor is copied in and dropped before the next is read. BF16 tensors are widened by the
engine straight from a read-only memory map of the file into the resident buffer; an F16/F32
tensor costs one float32 copy of itself on the way.

Every safetensors header is validated before any tensor data is touched: the 8-byte header
length must fit the file and a 100 MB ceiling, every entry needs a supported dtype, a shape of
non-negative ints and data offsets inside the file whose span equals the shape's byte size; and
every tensor's name and shape are checked against the config. A violation raises ResidentError
with status 607 naming the file and tensor, so a hostile or truncated file can neither crash the
process nor make it allocate more than the file holds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import _core
from ..errors import AlgentaError, ResidentError
from .session import expected_shapes

_c = _core.residentk

_WEIGHT = 607
# Safetensors' own reader refuses headers past 100 MB; a real one is a few hundred KB.
_MAX_HEADER_BYTES = 100_000_000
_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}
# Non-weight buffers some older exports saved next to the weights; nothing the session holds.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _refuse(msg: str) -> ResidentError:
    return ResidentError(msg, _WEIGHT)


def config_from_hf(hf: dict) -> dict:
    """The session config (algenta.residentk.session.CONFIG_KEYS) of a Qwen3 config.json dict.
    Refuses (607) another architecture or a Qwen3 variant the session does not compute."""
    if not isinstance(hf, dict):
        raise _refuse("config.json is not a JSON object")
    arch = hf.get("architectures") or []
    if not isinstance(arch, list):
        raise _refuse(f"config.json 'architectures' must be a list, got {arch!r}")
    model_type = hf.get("model_type")
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in arch:
        raise _refuse(f"architecture {arch or model_type!r} is not Qwen3 (model_type 'qwen3', "
                      "Qwen3ForCausalLM); the resident session computes Qwen3 only")

    def need(key):
        if key not in hf:
            raise _refuse(f"config.json lacks {key!r}")
        v = hf[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise _refuse(f"config.json {key!r} must be an integer, got {v!r}")
        if not -(2**63) <= v < 2**63:  # the contract's own ceilings then name the real limit
            raise ResidentError(f"config.json {key!r} = {v} is past any dimension ceiling",
                                601 if v < 0 else 602)
        return v

    d_model, h_q = need("hidden_size"), need("num_attention_heads")
    h_kv = need("num_key_value_heads") if "num_key_value_heads" in hf else h_q
    if hf.get("head_dim") is not None:
        d_head = need("head_dim")
    else:
        d_head = d_model // h_q if h_q > 0 else 0
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise _refuse("config.json 'rope_parameters' must be an object")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
    if rope_type not in (None, "default"):
        raise _refuse(f"rope_type {rope_type!r} is not supported (plain RoPE only)")
    if hf.get("use_sliding_window"):
        raise _refuse("sliding-window attention is not supported (use_sliding_window is true)")
    if hf.get("attention_bias"):
        raise _refuse("attention_bias is true: the session holds no projection biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(f"hidden_act {hf.get('hidden_act')!r} is not silu")
    scalars = {}
    for key, v in (("rope_theta", theta), ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _refuse(f"config.json {key!r} must be a number, got {v!r}")
        try:
            f = float(v)  # a JSON integer past 1e308 overflows here
        except OverflowError:
            f = math.inf
        if not (math.isfinite(f) and f > 0):
            raise ResidentError(f"config.json {key!r} must be finite and > 0, got {v!r}", 609)
        scalars[key] = f
    # Qwen3Config's own default is untied (the small published models set true). Only a JSON
    # bool is accepted: the string "false" would otherwise read as true and drop lm_head.
    tied = hf.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise _refuse(f"config.json 'tie_word_embeddings' must be true or false, got {tied!r}")
    return dict(d_model=d_model, h_q=h_q, h_kv=h_kv, d_head=d_head,
                d_ff=need("intermediate_size"), n_layers=need("num_hidden_layers"),
                vocab=need("vocab_size"), rms_eps=scalars["rms_norm_eps"],
                rope_theta=scalars["rope_theta"], tie_word_embeddings=tied)


def read_header(path) -> tuple[dict, int]:
    """(entries, data_start) of a safetensors file: entries maps tensor name to
    (dtype, shape, begin, end) with offsets relative to data_start. Validated (607) against the
    file's real size before anything is allocated from it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(f"{path.name}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise _refuse(f"{path.name}: header length {n} exceeds the file ({size} bytes) or the "
                          f"{_MAX_HEADER_BYTES}-byte ceiling")
        raw = f.read(n)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _refuse(f"{path.name}: header is not a JSON object")
    data_len = size - 8 - n
    out = {}
    for name, e in meta.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict):
            raise _refuse(f"{path.name}: tensor '{name}' has a malformed header entry")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _DTYPES:
            raise _refuse(f"{path.name}: tensor '{name}' has dtype {dtype!r}; "
                          "only BF16, F16 and F32 are read")
        if (not isinstance(shape, list) or
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise _refuse(f"{path.name}: tensor '{name}' has a malformed shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise _refuse(f"{path.name}: tensor '{name}' has malformed data_offsets {offs!r}")
        begin, end = offs
        nbytes = math.prod(shape) * _DTYPES[dtype]
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise _refuse(f"{path.name}: tensor '{name}' data_offsets [{begin}, {end}] do not "
                          f"hold its {nbytes} bytes inside the {data_len}-byte data section")
        out[name] = (dtype, tuple(shape), begin, end)
    return out, 8 + n


def _shard_files(root: Path) -> list:
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise _refuse(f"{index.name}: no readable weight_map ({e})") from None
        if not isinstance(wm, dict):
            raise _refuse(f"{index.name}: weight_map is not an object")
        files = []
        for fname in wm.values():
            # A shard name is a bare file in this directory: never a path out of it.
            if (not isinstance(fname, str) or os.path.basename(fname) != fname or
                    fname in ("", ".", "..")):
                raise _refuse(f"{index.name}: shard name {fname!r} is not a file in the checkpoint")
            if fname not in files:
                files.append(fname)
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise _refuse(f"{index.name} names shard {missing[0]!r}, which is not in {root}")
        return [root / f for f in files]
    if single.is_file():
        return [single]
    raise _refuse(f"{root}: neither model.safetensors nor model.safetensors.index.json")


def _load_tensor(session, path: Path, data_start: int, name: str, entry, st_handle) -> None:
    """One tensor into the session. BF16 is handed over as its bit patterns, read through a
    memory map and widened by the engine into its own buffer (no float32 copy on the side);
    F16/F32 come through the safetensors package when installed, else the same memory map."""
    dtype, shape, begin, end = entry
    count = math.prod(shape)
    if dtype != "BF16" and st_handle is not None:
        session._set(name, np.asarray(st_handle.get_tensor(name), dtype=np.float32))
        return
    np_dtype = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype]
    if count == 0:
        raw = np.zeros(shape, np_dtype)
    else:
        raw = np.memmap(path, dtype=np_dtype, mode="r", offset=data_start + begin,
                        shape=tuple(shape))
    try:
        if dtype == "BF16":
            session._set_bf16(name, raw)
        else:
            session._set(name, raw.astype(np.float32))
    finally:
        del raw


def _wrapped(f: Path, thunk, name=None):
    """thunk(), with the safetensors package's own refusals (stricter than the header checks
    above: trailing bytes, gaps or overlaps between tensors) turned into a 607 naming the file."""
    try:
        return thunk()
    except (AlgentaError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # SafetensorError and whatever else the package raises
        what = f"tensor '{name}' of {f.name}" if name else f.name
        raise _refuse(f"{what} could not be read ({type(e).__name__}: {e})") from None


class _Progress:
    """`loading NAME: 1.2/2.4 GB` on a terminal, at most a few times a second."""

    def __init__(self, total: int, enabled):
        self.total, self.done, self.last = total, 0, 0.0
        self.cb = enabled if callable(enabled) else None
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.tty = bool(enabled) and self.cb is None

    def add(self, nbytes: int, name: str):
        self.done += nbytes
        if self.cb is not None:
            self.cb(self.done, self.total)
        elif self.tty and (time.monotonic() - self.last > 0.2 or self.done == self.total):
            self.last = time.monotonic()
            sys.stderr.write(f"\rloading {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                             f"({100 * self.done / max(self.total, 1):3.0f}%) {name[:48]:<48}")
            sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")


def load_pretrained(cls, path, *, max_ctx=512, device="cpu", progress=None):
    """A `cls` (ResidentSession) holding the Qwen3 checkpoint in directory `path`.

    progress: None shows a progress line when stderr is a terminal; True/False force it; a
    callable receives (bytes_done, bytes_total) after each tensor.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a checkpoint directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise _refuse(f"{root}: no config.json")
    try:
        hf = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(f"config.json is not valid JSON ({e})") from None
    cfg = config_from_hf(hf)
    files = _shard_files(root)

    # The shape itself first (601-603 from the contract), then every header, name and shape
    # against it: all before the session allocates (a 2 KB checkpoint whose config.json claims
    # an 8B model is refused, not answered with a 33 GB allocation).
    st, why = _c.residentk_shape_check(cfg["d_model"], cfg["h_q"], cfg["h_kv"], cfg["d_head"],
                                       cfg["d_ff"], cfg["n_layers"], cfg["vocab"])
    if st != _c.RESIDENT_OK:
        raise ResidentError(f"config.json declares a model shape the session refuses: {why}", st)
    shapes = expected_shapes(cfg)
    headers = []
    seen = {}
    total = 0
    for f in files:
        entries, start = read_header(f)
        keep = {}
        for name, e in entries.items():
            if name in seen:
                raise _refuse(f"tensor '{name}' appears in both {seen[name]} and {f.name}")
            seen[name] = f.name
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
                continue  # tied: the embedding table is the head, loaded once
            want = shapes.get(name)
            if want is None:
                raise _refuse(f"{f.name}: tensor '{name}' is not part of a Qwen3 model with this "
                              "config")
            if e[1] != want:
                raise _refuse(f"{f.name}: tensor '{name}' has shape {list(e[1])}, config.json "
                              f"declares {list(want)}")
            keep[name] = e
            total += e[3] - e[2]
        headers.append((f, start, keep))
    found = {n for _, _, k in headers for n in k}
    missing = [n for n in shapes if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _refuse(f"checkpoint lacks tensor '{missing[0]}'{more}")

    session = cls.__new__(cls)
    session._open(cfg, max_ctx, device)

    try:
        from safetensors import safe_open
    except ImportError:
        safe_open = None
    bar = _Progress(total, progress)
    try:
        for f, start, keep in headers:
            handle = None
            if safe_open is not None and any(e[0] != "BF16" for e in keep.values()):
                handle = _wrapped(f, lambda: safe_open(str(f), framework="numpy"))
            for name, e in sorted(keep.items(), key=lambda kv: kv[1][2]):  # file order
                _wrapped(f, lambda: _load_tensor(session, f, start, name, e, handle), name)
                bar.add(e[3] - e[2], name)
            handle = None  # closes the file before the next shard opens
    finally:
        bar.close()
    session._check_complete()
    return session

"""Read a HuggingFace checkpoint directory of a family the session computes:
``open_checkpoint(path)`` checks it whole and gives its session config and a stream of (name,
tensor) pairs that ``ResidentSession`` consumes (``ResidentSession.from_pretrained`` is exactly
that). The loader never touches a session.

What is read: ``config.json`` (through the one config reader, algenta.residentk.config) and
``model.safetensors`` or the shards a ``model.safetensors.index.json`` names. Tensors stored as
BF16, F16 or F32 are handed over as they are stored, and the engine widens them to float32
(exactly) straight into its resident buffers: BF16 (which NumPy cannot represent) as its bit
patterns from a read-only memory map, F16/F32 through the ``safetensors`` package when it is
installed (stricter about the file's layout), and through the same memory map when it is absent.

Peak memory is about the float32 session: the session allocates its resident buffers first, then
each tensor is read and dropped before the next. A memory-mapped tensor is never copied on the
host; one read by the safetensors package costs one copy of itself in its stored width.

Every safetensors header is validated before any tensor data is touched: the 8-byte header
length must fit the file and a 100 MB ceiling, every entry needs a supported dtype, a shape of
non-negative ints and data offsets inside the file whose span equals the shape's byte size; and
every tensor's name and shape are checked against the config. A violation raises ResidentError
with status 607 naming the file and tensor, so a hostile or truncated file can neither crash the
process nor make it allocate more than the file holds.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import _core
from ..errors import AlgentaError, ResidentError
from .config import MAX_INDEX_BYTES, load_json, parse_hf_config, read_json_file, session_config
from .weights import EMBED as _EMBED
from .weights import HEAD as _HEAD
from .weights import Bf16Bits, expected_shapes, head_differs, warn_untied_head

_c = _core.residentk

_WEIGHT = 607
# Safetensors' own reader refuses headers past 100 MB; a real one is a few hundred KB.
_MAX_HEADER_BYTES = 100_000_000
_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}
# Non-weight buffers some older exports saved next to the weights; nothing the session holds.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _refuse(msg: str) -> ResidentError:
    return ResidentError(msg, _WEIGHT)


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
    meta = load_json(raw, f"{path.name}: header")
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
        doc = read_json_file(index, index.name, MAX_INDEX_BYTES)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
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


def _read_tensor(path: Path, data_start: int, name: str, entry, st_handle):
    """One tensor as it is stored: BF16 as its bit patterns (Bf16Bits) from a read-only memory
    map, F16/F32 through the safetensors package when installed, else the same memory map."""
    dtype, shape, begin, end = entry
    if dtype != "BF16" and st_handle is not None:
        return st_handle.get_tensor(name)
    np_dtype = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype]
    if math.prod(shape) == 0:
        raw = np.zeros(shape, np_dtype)
    else:
        raw = np.memmap(path, dtype=np_dtype, mode="r", offset=data_start + begin,
                        shape=tuple(shape))
    return Bf16Bits(raw) if dtype == "BF16" else raw


def _differ(a, b) -> bool:
    """Whether two stored tensors, (file, data start, entry) each, hold different values; read
    through read-only memory maps a block of rows at a time, whatever the stored types."""
    (fa, sa, ea), (fb, sb, eb) = a, b
    if ea[1] != eb[1]:
        return True
    return head_differs(_read_tensor(fa, sa, _HEAD, ea, None),
                        _read_tensor(fb, sb, _EMBED, eb, None))


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


def open_checkpoint(path) -> "Checkpoint":
    """The checkpoint in directory `path`, checked whole before anything is allocated from it:
    config.json (607/609/601-603 for what the session cannot hold), every safetensors header
    against the file it sits in, and every tensor's name and shape against the config (a 2 KB
    checkpoint whose config.json claims an 8B model is refused, not answered with a 33 GB
    allocation). ``.config`` is the session config; ``.tensors(progress)`` yields the (name,
    tensor) pairs in file order."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a checkpoint directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise _refuse(f"{root}: no config.json")
    cfg = session_config(parse_hf_config(read_json_file(cfg_path, "config.json")))
    files = _shard_files(root)

    # The shape itself first (601-603 from the contract), then every header, name and shape.
    st, why = _c.residentk_shape_check(cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff,
                                       cfg.n_layers, cfg.vocab)
    if st != _c.RESIDENT_OK:
        raise ResidentError(f"config.json declares a model shape the session refuses: {why}", st)
    shapes = expected_shapes(cfg)
    headers = []
    seen = {}
    total = 0
    stored = {}  # name -> (file, data start, entry), of the two tensors a tie may join
    for f in files:
        entries, start = read_header(f)
        keep = {}
        for name, e in entries.items():
            if name in seen:
                raise _refuse(f"tensor '{name}' appears in both {seen[name]} and {f.name}")
            seen[name] = f.name
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name in (_HEAD, _EMBED):
                stored[name] = (f, start, e)
            if name == _HEAD and cfg.tie_word_embeddings:
                continue  # decided below, once every header is read
            want = shapes.get(name)
            if want is None:
                raise _refuse(f"{f.name}: tensor '{name}' is not part of a "
                              f"{cfg.family.get('arch', 'qwen3')} model with this config")
            if e[1] != want:
                raise _refuse(f"{f.name}: tensor '{name}' has shape {list(e[1])}, config.json "
                              f"declares {list(want)}")
            keep[name] = e
            total += e[3] - e[2]
        headers.append((f, start, keep))
    if cfg.tie_word_embeddings and _HEAD in stored and _EMBED in stored \
            and _differ(stored[_HEAD], stored[_EMBED]):
        cfg = type(cfg)(**{**dict(cfg), "tie_word_embeddings": False})
        f, start, e = stored[_HEAD]
        want = expected_shapes(cfg)[_HEAD]
        if e[1] != want:
            raise _refuse(f"{f.name}: tensor '{_HEAD}' has shape {list(e[1])}, config.json "
                          f"declares {list(want)}")
        next(k for g, _, k in headers if g == f)[_HEAD] = e
        total += e[3] - e[2]
        warn_untied_head("the checkpoint ships", stacklevel=2)
        shapes = expected_shapes(cfg)
    found = {n for _, _, k in headers for n in k}
    missing = [n for n in shapes if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _refuse(f"checkpoint lacks tensor '{missing[0]}'{more}")
    return Checkpoint(root, cfg, total, headers)


class Checkpoint:
    """A checked checkpoint directory: ``.config`` (the session config), ``.total_bytes`` (of
    tensor data the session takes) and ``.tensors(progress)``."""

    def __init__(self, root, config, total_bytes, headers):
        self.path, self.config, self.total_bytes, self._headers = root, config, total_bytes, headers

    def tensors(self, progress=None):
        """(name, tensor) in file order, each read only when the consumer asks for it, with the
        safetensors package's own refusals (stricter than the header checks: trailing bytes,
        gaps or overlaps between tensors) turned into a 607 naming the file."""
        try:
            from safetensors import safe_open
        except ImportError:
            safe_open = None
        bar = _Progress(self.total_bytes, progress)
        try:
            for f, start, keep in self._headers:
                handle = None
                if safe_open is not None and any(e[0] != "BF16" for e in keep.values()):
                    handle = _wrapped(f, lambda: safe_open(str(f), framework="numpy"))
                for name, e in sorted(keep.items(), key=lambda kv: kv[1][2]):  # file order
                    yield name, _wrapped(f, lambda: _read_tensor(f, start, name, e, handle), name)
                    bar.add(e[3] - e[2], name)
                handle = None  # closes the file before the next shard opens
        finally:
            bar.close()

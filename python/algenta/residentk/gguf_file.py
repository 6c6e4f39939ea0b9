"""The GGUF container, read strictly: ``read_gguf(path)`` checks a whole file's header, metadata
and tensor table against the file's real size before anything is allocated from it, and gives
the metadata as Python values and each tensor as a read-only view of one memory map.

Layout (GGUF versions 2 and 3, little-endian): "GGUF", uint32 version, uint64 tensor count,
uint64 metadata count; each metadata entry a string key, a uint32 value type and the value (a
string is a uint64 length and its UTF-8 bytes; an array a uint32 element type, a uint64 count and
the elements); each tensor a string name, uint32 n_dims, n_dims uint64 dimensions (ggml's order:
the row length first), uint32 ggml type and a uint64 offset into the data section, which starts
at the next multiple of ``general.alignment`` (default 32) after the tensor table.

What is refused (ResidentError 607, one line naming the file and what is wrong): a file too short
for what its header declares, a wrong magic or version, counts or lengths the remaining bytes
cannot hold, nested arrays and unknown value types, keys or names that are not UTF-8 or appear
twice, a tensor of an unknown ggml type or one the session does not read, dimensions that are
zero or whose product passes 2**62, a row length that is not a whole number of blocks, an offset
off the alignment, a tensor past the file's end or overlapping another. Every length is checked
against the bytes left before it is used, so a hostile file cannot make the reader allocate more
than the file holds.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ..errors import ResidentError

_WEIGHT = 607
MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml's type ids (ggml.h) this reader takes -> (short name as the core's DTYPES spells it,
# bytes per block, values per block); the session widens or keeps each (_core.DTYPES).
GGML_TYPES = {
    0: ("f32", 4, 1), 1: ("f16", 2, 1), 30: ("bf16", 2, 1),
    8: ("q8_0", 34, 32), 2: ("q4_0", 18, 32), 12: ("q4_k", 144, 256), 14: ("q6_k", 210, 256),
}
# The rest of ggml's types, named in the refusal of a file that uses one.
GGML_OTHER = {3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K",
              15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
              21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64",
              28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

# Metadata value types: id -> (struct format, size) of the scalar ones.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_ELEMS = 1 << 62


def _refuse(msg: str) -> ResidentError:
    return ResidentError(msg, _WEIGHT)


class _Cursor:
    """Reads little-endian fields from a bytes-like object, every length checked against what is
    left (a 607 naming the file and what was being read)."""

    def __init__(self, buf, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > len(self.buf) - self.pos:
            raise _refuse(f"{self.name}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                          f"the file has {len(self.buf) - self.pos} left")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what):
        return self.scalar("<I", 4, what)

    def u64(self, what):
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _refuse(f"{self.name}: {what} is not UTF-8") from None

    def value(self, vtype: int, what: str, in_array: bool = False):
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and not in_array:
            etype = self.u32(f"the element type of {what}")
            count = self.u64(f"the length of {what}")
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize
                self.need(count * size, what)  # before the array is made
                a = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos).copy()
                self.pos += count * size
                return a.astype(bool) if etype == 7 else a
            if etype == _STRING:
                self.need(count * 8, what)  # every string is at least its length field
                return [self.string(f"{what}[{i}]") for i in range(count)]
            if etype == _ARRAY:
                raise _refuse(f"{self.name}: {what} is an array of arrays, which GGUF readers "
                              "(llama.cpp's included) do not take")
            raise _refuse(f"{self.name}: {what} has an unknown element type {etype}")
        raise _refuse(f"{self.name}: {what} has an unknown value type {vtype}")


class GgufTensor:
    """One tensor of a GGUF file: ``name``, ``dtype`` (the short type name: "f32", "q8_0",
    ...), ``shape`` in NumPy's order (rows first: ggml's dimensions reversed), ``nbytes`` and
    ``data``, a read-only uint8 view of the file's memory map (rows of whole blocks)."""

    def __init__(self, name, dtype, shape, offset, nbytes, mm):
        self.name, self.dtype, self.shape = name, dtype, shape
        self.offset, self.nbytes, self._mm = offset, nbytes, mm

    @property
    def data(self) -> np.ndarray:
        return self._mm[self.offset:self.offset + self.nbytes]

    def array(self) -> np.ndarray:
        """f32 / f16 data as a NumPy array of its shape; bf16 as uint16 bit patterns; a block
        type as (rows, bytes per row) uint8."""
        raw = self.data
        if self.dtype in ("f32", "f16", "bf16"):
            np_dtype = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[self.dtype]
            return raw.view(np_dtype).reshape(self.shape)
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        return raw.reshape(rows, self.nbytes // rows)

    def __repr__(self):
        return f"GgufTensor({self.name!r}, {self.dtype}, {list(self.shape)})"


class GgufFile:
    """A checked GGUF file: ``version``, ``metadata`` (key -> int, float, bool, str, a NumPy
    array or a list of str), ``tensors`` (name -> GgufTensor, in the file's order) and
    ``alignment``."""

    def __init__(self, path, version, metadata, tensors, alignment):
        self.path, self.version, self.metadata = path, version, metadata
        self.tensors, self.alignment = tensors, alignment

    def get(self, key, default=None, kind=None):
        """metadata[key] (default when absent), refused (607) when it is not of `kind`: int,
        float (an int is taken), str or bool."""
        if key not in self.metadata:
            return default
        v = self.metadata[key]
        ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
              float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
              str: lambda x: isinstance(x, str), bool: lambda x: isinstance(x, bool),
              None: lambda x: True}[kind]
        if not ok(v):
            raise _refuse(f"{self.path.name}: metadata {key} is {type(v).__name__}, "
                          f"expected {kind.__name__}")
        return float(v) if kind is float else v


def read_gguf(path) -> GgufFile:
    """Parse and check the GGUF file at `path` (see the module's docstring for what is refused).
    The file is memory-mapped read-only; nothing is copied but the metadata."""
    path = Path(path)
    size = path.stat().st_size
    name = path.name
    if size < 24:
        raise _refuse(f"{name}: {size} bytes, too short for a GGUF header")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), name)  # memoryview slices: no NumPy object per string
    magic = bytes(cur.buf[:4])
    if magic != MAGIC:
        raise _refuse(f"{name}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        raise _refuse(f"{name}: GGUF version {version}; versions {VERSIONS} are read")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    # The smallest metadata entry is 8 + 4 + 1 bytes, the smallest tensor entry 8 + 4 + 8 + 4 + 8.
    if n_kv * 13 > size - cur.pos or n_tensors * 32 > size - cur.pos:
        raise _refuse(f"{name}: declares {n_tensors} tensors and {n_kv} metadata entries, more "
                      f"than its {size} bytes can hold")
    metadata = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in metadata:
            raise _refuse(f"{name}: metadata key {key!r} appears twice")
        vtype = cur.u32(f"the type of {key}")
        metadata[key] = cur.value(vtype, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1
            or alignment > (1 << 20) or alignment & (alignment - 1)):
        raise _refuse(f"{name}: general.alignment {alignment!r} is not a power of two "
                      "up to 1 MiB")
    infos = []
    seen = set()
    for i in range(n_tensors):
        tname = cur.string(f"tensor name {i}")
        if tname in seen:
            raise _refuse(f"{name}: tensor {tname!r} appears twice")
        seen.add(tname)
        n_dims = cur.u32(f"the rank of {tname}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _refuse(f"{name}: tensor {tname!r} has {n_dims} dimensions; 1 to {_MAX_DIMS} "
                          "are read")
        dims = [cur.u64(f"dimension {d} of {tname}") for d in range(n_dims)]
        gtype = cur.u32(f"the type of {tname}")
        offset = cur.u64(f"the offset of {tname}")
        infos.append((tname, dims, gtype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    if data_start > size:
        raise _refuse(f"{name}: truncated: the data section would start at {data_start}, past "
                      f"the file's {size} bytes")
    tensors = {}
    spans = []
    for tname, dims, gtype, offset in infos:
        if gtype not in GGML_TYPES:
            what = GGML_OTHER.get(gtype)
            kinds = ", ".join(sorted(t.upper() for t, _, _ in GGML_TYPES.values()))
            raise _refuse(f"{name}: tensor {tname!r} is stored as "
                          f"{what or f'unknown ggml type {gtype}'}; the session reads {kinds}")
        dtype, block_bytes, block = GGML_TYPES[gtype]
        elems = 1
        for d in dims:
            if d < 1 or d > _MAX_ELEMS // elems:
                raise _refuse(f"{name}: tensor {tname!r} has dimensions {dims}: zero, or more "
                              f"than 2**62 elements")
            elems *= d
        if dims[0] % block:
            raise _refuse(f"{name}: tensor {tname!r} rows of {dims[0]} values are not whole "
                          f"{dtype.upper()} blocks of {block}")
        nbytes = elems // block * block_bytes
        if offset % alignment:
            raise _refuse(f"{name}: tensor {tname!r} offset {offset} is not a multiple of the "
                          f"alignment {alignment}")
        if offset > size - data_start or nbytes > size - data_start - offset:
            raise _refuse(f"{name}: tensor {tname!r} ({nbytes} bytes at data offset {offset}) "
                          f"runs past the end of the file")
        spans.append((offset, offset + nbytes, tname))
        tensors[tname] = GgufTensor(tname, dtype, tuple(int(d) for d in reversed(dims)),
                                    data_start + offset, nbytes, mm)
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise _refuse(f"{name}: tensors {a!r} and {b!r} overlap")
    return GgufFile(path, version, metadata, tensors, alignment)


__all__ = ["read_gguf", "GgufFile", "GgufTensor", "GGML_TYPES"]

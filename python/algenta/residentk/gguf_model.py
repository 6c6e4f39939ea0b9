"""A GGUF file as a model: ``open_gguf(path)`` reads llama.cpp's file (gguf_file.read_gguf) and
gives what a checkpoint directory gives (``.config``, ``.tensors(progress)``, ``.total_bytes``)
plus what the directory's other files hold: the tokenizer (``.tokenizer()``), the chat template,
bos/eos, and ``.stored_format``, the session format that holds the file's matrices as they are.

What llama.cpp's converter (convert_hf_to_gguf.py) changes, undone here as data:
- names: ``token_embd``, ``blk.N.attn_q`` ... for transformers' ``model.embed_tokens``,
  ``model.layers.N.self_attn.q_proj`` ... (_LAYER);
- hyperparameters: ``{arch}.embedding_length`` ... for config.json's keys (_HPARAMS); RoPE's base
  defaults to 10000 as llama.cpp's does; a tied head is a file without ``output.weight``;
- Llama-family q and k rows: permuted for ggml's interleaved RoPE (pairs (2i, 2i+1) where
  transformers rotates (i, i + Dh/2)); the rows are put back, which a block format allows because
  a block never spans rows.
Families read: qwen3, qwen2, llama (Llama and Mistral). Others are refused by name (607).

Formats: F32, F16 and BF16 matrices are handed over as they are stored. Block types are handed
over as blocks and the engine widens each row and stores it in its own format. Held as int8, a
Q8_0 file written by llama.cpp keeps its exact values (each nonzero block reaches +-127, so the
session's amax / 127 rule finds the file's scale and codes again: tests/test_gguf.py); held as
q4_0, a Q4_0 file does (the session quantizes by ggml's own Q4_0 rule, which maps a block it
wrote back onto itself). Q4_K and Q6_K are widened exactly and then held in the format the
caller names; holding them as their own blocks is not built yet, so a file with them (Q4_K_M)
needs ``weights=`` (see docs/gguf.md).
"""

from __future__ import annotations

import numpy as np

from .._dtypes import Bf16Bits
from .config import parse_hf_config, session_config
from .gguf_file import _refuse, read_gguf
from .loader import _Progress
from .weights import EMBED, HEAD, BlockTensor, expected_shapes

# GGUF architecture -> (transformers model_type, its class, whether q/k rows were permuted).
_ARCHS = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "llama": ("llama", "LlamaForCausalLM", True),
}
# config.json key <- GGUF key under the architecture's prefix, and whether it must be present.
_HPARAMS = (
    ("hidden_size", "embedding_length", True), ("intermediate_size", "feed_forward_length", True),
    ("num_hidden_layers", "block_count", True), ("num_attention_heads", "attention.head_count",
                                                 True),
    ("num_key_value_heads", "attention.head_count_kv", False),
    ("head_dim", "attention.key_length", False),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", True),
    ("rope_theta", "rope.freq_base", False),
    ("max_position_embeddings", "context_length", False),
)
_MODEL = {EMBED: "token_embd", "model.norm.weight": "output_norm.weight", HEAD: "output"}
_LAYER = {  # transformers' name inside model.layers.N -> llama.cpp's inside blk.N
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# The session format that holds each stored matrix type as it is.
_KEEPS = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "int8", "q4_0": "q4_0"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a transformers tensor name of the families read here."""
    if hf_name in _MODEL:
        base = _MODEL[hf_name]
        return base if base.endswith(".weight") else base + ".weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] in ("weight", "bias"):
        key = ".".join(parts[3:-1])
        if key in _LAYER:
            return f"blk.{int(parts[2])}.{_LAYER[key]}.{parts[-1]}"
    raise KeyError(f"no GGUF name for {hf_name!r}")


def _hf_config(g) -> tuple[dict, str]:
    """config.json's dict for the file's metadata, and the GGUF architecture."""
    name = g.path.name
    arch = g.get("general.architecture", kind=str)
    if arch is None:
        raise _refuse(f"{name}: no general.architecture")
    if arch not in _ARCHS:
        raise _refuse(f"{name}: architecture {arch!r} is not one the session reads from GGUF "
                      f"({', '.join(_ARCHS)})")
    model_type, cls, _ = _ARCHS[arch]
    hf = {"model_type": model_type, "architectures": [cls]}
    for key, gkey, required in _HPARAMS:
        kind = float if key in ("rms_norm_eps", "rope_theta") else int
        v = g.get(f"{arch}.{gkey}", kind=kind)
        if v is None and required:
            raise _refuse(f"{name}: metadata {arch}.{gkey} is missing")
        if v is not None:
            hf[key] = v
    hf.setdefault("rope_theta", 10000.0)  # llama.cpp's default when the converter wrote none
    d_head = hf.get("head_dim") or hf["hidden_size"] // max(hf["num_attention_heads"], 1)
    v_len = g.get(f"{arch}.attention.value_length", kind=int)
    if v_len is not None and v_len != d_head:
        raise _refuse(f"{name}: value_length {v_len} differs from key_length {d_head}")
    rot = g.get(f"{arch}.rope.dimension_count", kind=int)
    if rot is not None and rot != d_head:
        raise _refuse(f"{name}: RoPE rotates {rot} of {d_head} head dimensions; partial "
                      "rotation is not computed")
    scaling = g.get(f"{arch}.rope.scaling.type", "none", kind=str)
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear",
                              "factor": g.get(f"{arch}.rope.scaling.factor", kind=float)}
    elif scaling != "none":
        raise _refuse(f"{name}: RoPE scaling {scaling!r} is not read from GGUF (linear is)")
    if "rope_freqs.weight" in g.tensors:
        raise _refuse(f"{name}: holds rope_freqs.weight (Llama 3's RoPE frequency factors), "
                      "which is not read from GGUF yet: load the safetensors checkpoint")
    if arch == "qwen2":
        hf["use_sliding_window"] = False  # llama.cpp's qwen2 attends over the whole context
    embd = g.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise _refuse(f"{name}: no 2-D token_embd.weight")
    hf["vocab_size"] = embd.shape[0]
    hf["tie_word_embeddings"] = "output.weight" not in g.tensors
    return hf, arch


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's q/k permutation: within each head, row 2i + s (s = 0, 1) of the file
    is transformers' row s * Dh/2 + i. Works on any per-row data (values or block bytes)."""
    r = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(n_head, r // n_head // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape))


class GgufCheckpoint:
    """A checked GGUF file as a model (see the module's docstring)."""

    def __init__(self, g, hf, arch):
        self.file, self.path, self._arch = g, g.path, arch
        self.config = session_config(parse_hf_config(hf))
        c = self.config
        shapes = expected_shapes(c)
        self._names = {}
        extra = set(g.tensors)
        for hf_name, shape in shapes.items():
            gname = gguf_name(hf_name)
            t = g.tensors.get(gname)
            if t is None:
                raise _refuse(f"{self.path.name}: tensor {gname!r} ({hf_name}) is missing")
            if t.shape != tuple(shape):
                raise _refuse(f"{self.path.name}: tensor {gname!r} has shape {list(t.shape)}, "
                              f"the metadata declares {list(shape)}")
            if len(shape) == 1 and t.dtype != "f32":
                raise _refuse(f"{self.path.name}: vector {gname!r} is stored as "
                              f"{t.dtype.upper()}; llama.cpp writes norms and biases as F32")
            self._names[hf_name] = t
            extra.discard(gname)
        if extra:
            raise _refuse(f"{self.path.name}: tensor {sorted(extra)[0]!r} is not part of a "
                          f"{arch} model with this metadata")
        self.total_bytes = sum(t.nbytes for t in self._names.values())
        kinds = {t.dtype for t in self._names.values() if len(t.shape) == 2}
        self.matrix_types = tuple(sorted(kinds))
        self.stored_format = _KEEPS[kinds.pop()] if len(kinds) == 1 and \
            next(iter(kinds)) in _KEEPS else None

    def check_format(self, weights):
        """The session format to hold the matrices in: `weights` when given, else the one that
        keeps them as stored; a file whose matrices no one format keeps (4-bit, or mixed types)
        needs `weights` (607 naming the types and the choices)."""
        if weights is not None:
            return weights
        if self.stored_format is None:
            types = ", ".join(t.upper() for t in self.matrix_types)
            raise _refuse(f"{self.path.name} stores its matrices as {types}, which no session "
                          "format holds as they are (Q4_K and Q6_K blocks are not held as such "
                          "yet): pass weights='q4_0' (4-bit blocks, requantized), 'int8' (8-bit "
                          "blocks), 'bf16', 'f16' or 'f32'")
        return self.stored_format

    def tensors(self, progress=None):
        """(transformers name, tensor) in file order: f32/f16 arrays and Bf16Bits over the
        memory map; block types as BlockTensor; q and k rows of the Llama family put back."""
        permute = _ARCHS[self._arch][2]
        c = self.config
        bar = _Progress(self.total_bytes, progress)  # the checkpoint loader's progress line
        try:
            for hf_name, t in sorted(self._names.items(), key=lambda kv: kv[1].offset):
                a = t.array()
                if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    a = _unpermute(a, c.h_q if "q_proj" in hf_name else c.h_kv)
                if t.dtype == "bf16":
                    a = Bf16Bits(a)
                elif t.dtype not in ("f32", "f16"):
                    a = BlockTensor(a, t.dtype, t.shape)
                yield hf_name, a
                bar.add(t.nbytes, hf_name)
        finally:
            bar.close()

    # -- what a checkpoint directory's other files hold -----------------------------------
    @property
    def chat_template(self):
        return self.file.get("tokenizer.chat_template", kind=str)

    def special_text(self, key: str) -> str:
        """The text of tokenizer.ggml.<key>_token_id ('bos', 'eos'), '' when absent."""
        i = self.file.get(f"tokenizer.ggml.{key}_token_id", kind=int)
        toks = self.file.metadata.get("tokenizer.ggml.tokens")
        return toks[i] if i is not None and isinstance(toks, list) and 0 <= i < len(toks) else ""

    def eos_ids(self) -> set:
        """The ids that end a generation: eos and eot where the file names them."""
        ids = set()
        for key in ("eos", "eot", "eom"):
            i = self.file.get(f"tokenizer.ggml.{key}_token_id", kind=int)
            if i is not None:
                ids.add(i)
        return ids

    def tokenizer(self):
        """The file's vocabulary as a ``tokenizers`` Tokenizer (gguf_tokenizer)."""
        from .gguf_tokenizer import build_tokenizer

        return build_tokenizer(self.file)


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (by its magic; a directory is not)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (IsADirectoryError, FileNotFoundError, PermissionError, NotADirectoryError):
        return False


def gguf_hf_config(path) -> dict:
    """config.json's dict for the GGUF file at `path` (its metadata and tensor table checked,
    no tensor read): what ``algenta plan --config model.gguf`` sizes."""
    return _hf_config(read_gguf(path))[0]


def open_gguf(path) -> GgufCheckpoint:
    """The GGUF file at `path`, checked whole (the container, the metadata, every tensor's name,
    type and shape against the architecture) before anything is allocated from it."""
    g = read_gguf(path)
    hf, arch = _hf_config(g)
    return GgufCheckpoint(g, hf, arch)


__all__ = ["open_gguf", "is_gguf", "gguf_name", "gguf_hf_config", "GgufCheckpoint"]

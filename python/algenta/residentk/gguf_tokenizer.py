"""A GGUF file's vocabulary (``tokenizer.ggml.*``) as a ``tokenizers`` Tokenizer, so the server
and ``algenta generate`` read a ``.gguf`` as they read a directory's tokenizer.json.

Read: byte-level BPE vocabularies (``tokenizer.ggml.model`` "gpt2": Qwen2/3, Llama 3, ...) with
the pre-tokenizer ``tokenizer.ggml.pre`` names, in the split rules transformers' tokenizer.json
of those models spells out: "qwen2" (with NFC, as Qwen's tokenizer.json normalizes), "llama-bpe"
(Llama 3, merges ignored for whole-vocabulary words) and "gpt-2"/"default" (GPT-2's own rule).
Token types CONTROL (3) become special added tokens and USER_DEFINED (4) plain added tokens, both
matched whole in text (``<|im_start|>``, ``<think>``); ``tokenizer.ggml.add_bos_token`` prefixes
bos. SentencePiece vocabularies ("llama") and other pre-tokenizers are refused by name (607):
their ids would not be the model's.
"""

from __future__ import annotations

import numpy as np

from .gguf_file import _refuse
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex or None for GPT-2's built-in rule, NFC, ignore_merges)
PRE = {"qwen2": (_QWEN2, True, False), "llama-bpe": (_LLAMA3, False, True),
       "gpt-2": (None, False, False), "default": (None, False, False)}
_CONTROL, _USER_DEFINED = 3, 4


def build_tokenizer(g):
    """The Tokenizer of GgufFile `g` (607 for a vocabulary that cannot be read as its model's)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.processors import TemplateProcessing

    name = g.path.name
    model = g.get("tokenizer.ggml.model", kind=str)
    if model != "gpt2":
        raise _refuse(f"{name}: tokenizer model {model!r} is not read (byte-level BPE, 'gpt2', "
                      "is): pass token ids, or serve the checkpoint directory")
    pre = g.get("tokenizer.ggml.pre", "default", kind=str)
    if pre not in PRE:
        raise _refuse(f"{name}: pre-tokenizer {pre!r} is not read ({', '.join(PRE)} are)")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    merges = g.metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise _refuse(f"{name}: tokenizer.ggml.tokens and .merges must be arrays of strings")
    types = g.metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.ones(len(tokens), np.int32)
    if not isinstance(types, np.ndarray) or types.shape != (len(tokens),):
        raise _refuse(f"{name}: tokenizer.ggml.token_type must be one integer per token")
    vocab = {}
    for i, t in enumerate(tokens):
        if vocab.setdefault(t, i) != i:
            raise _refuse(f"{name}: token {t!r} appears twice in tokenizer.ggml.tokens")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab:
            raise _refuse(f"{name}: merge {m!r} is not two tokens of the vocabulary")
        pairs.append((a, b))
    regex, nfc, ignore_merges = PRE[pre]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges,
                        fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=int(k) == _CONTROL, normalized=False)
             for t, k in zip(tokens, types) if int(k) in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)
    bos = g.get("tokenizer.ggml.bos_token_id", kind=int)
    if g.get("tokenizer.ggml.add_bos_token", False, kind=bool) and bos is not None:
        if not 0 <= bos < len(tokens):
            raise _refuse(f"{name}: bos token id {bos} is outside the vocabulary")
        tok.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return tok


__all__ = ["build_tokenizer", "PRE"]

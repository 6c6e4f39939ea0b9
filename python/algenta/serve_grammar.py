"""Structured output for ``algenta serve``: ``response_format`` ``json_object`` and
``json_schema`` enforced while sampling, by llguidance (Microsoft's grammar engine, the one
vLLM and SGLang offer too): a Rust library with no Python dependencies and a token mask in
tens of microseconds, where xgrammar would bring torch with it. Each output has its own
matcher; its mask changes only its own row of logits, so the other sequences of a batched
step keep their bits."""

from __future__ import annotations

import threading

import numpy as np

# JSON as clients parse it: compact separators and no free whitespace, so that a sampled
# output cannot spend its tokens on blanks (llguidance's default allows any).
_COMPILE = {"whitespace_flexible": False}


class Grammars:
    """The llguidance tokenizer of a server (built once, at the first structured request:
    about a second for a 150k vocabulary) and the grammar of each request."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self.tok, self.vocab, self.eos = tokenizer, int(vocab), sorted(int(t) for t in eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(
                    self.tok.to_str(), n_vocab=self.vocab, eos_token=self.eos or None)
            return self._lltok

    def compile(self, response_format: dict):
        """A checked grammar for ``response_format`` (json_object or json_schema), or None for
        text; raises ValueError with the reason for a schema llguidance cannot enforce."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        try:
            import llguidance
        except ImportError:
            raise ValueError("structured output needs the llguidance package (the serve "
                             "extra: pip install \"algenta[serve]\")") from None
        if kind == "json_object":
            schema = {"type": "object"}
        else:  # json_schema
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("schema", {}), dict) or \
                    not isinstance(spec.get("strict", False), (bool, type(None))):
                raise ValueError("json_schema must be {'name': str, 'schema': object, "
                                 "'strict': bool}")
            schema = spec.get("schema", {})
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE)
        except ValueError as e:
            raise ValueError(f"the schema is not valid: {e}") from None
        tok = self._tokenizer()
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(f"the schema cannot be enforced: {err}")
        return grammar

    def compile_lark(self, lark: str) -> str:
        """A checked grammar of a Lark text (llguidance's dialect, ``%json`` inside)."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        err = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if err and not err.startswith("WARNING"):
            raise ValueError(f"the tool call cannot be enforced: {err}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self._tokenizer(), grammar, self.vocab)


class Constraint:
    """One output's matcher, as the scheduler applies it (``Job.constraint``)."""

    def __init__(self, lltok, grammar: str, vocab: int):
        import llguidance

        self.m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self.vocab = vocab
        if self.m.is_error():
            raise ValueError(self.m.get_error())

    def mask(self, logits) -> np.ndarray:
        bits = np.frombuffer(self.m.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        x = np.asarray(logits, np.float64).copy()
        # the lowest finite value, not -inf: the sampler refuses non-finite logits
        x[~allowed] = np.finfo(np.float64).min
        return x

    def advance(self, token: int) -> bool:
        return self.m.consume_token(int(token))

    def finished(self) -> bool:
        """The grammar is complete: only an eos could follow, so the output ends here (also
        for a checkpoint without eos ids, which would otherwise have nothing left to sample)."""
        return self.m.is_stopped()

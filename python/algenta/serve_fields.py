"""The request fields of ``algenta serve``: which are honoured, which only inform, which are
known but accepted only at the value that asks for nothing (``NOT_YET``), and the checks of
each value. Every refusal is an :class:`ApiError` (OpenAI's error shape) naming the field."""

from __future__ import annotations

import math
import numbers

MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param=None, code=None, headers=None,
                 resident=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.resident = resident  # the residentk status code behind a refusal, when one is

    _TYPES = {400: "invalid_request_error", 401: "authentication_error",
              404: "not_found_error", 405: "invalid_request_error",
              408: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error"}

    def body(self) -> dict:
        err = {"message": self.message, "type": self._TYPES.get(self.status, "server_error"),
               "param": self.param, "code": self.code}
        if self.resident is not None:  # beside OpenAI's fields: clients ignore what they
            err["status"] = self.resident  # do not know
        return {"error": err}


def opt_number(body, name, default, lo, hi, *, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, f"'{name}' must lie in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                       param=name)
    return float(v)


def opt_int(body, name, default, lo):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", param=name)
    return v


def stop_strings(body):
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(v) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
    return v


# Every request field, by what this server does with it (docs/serving.md lists them). None
# is ever ignored: a field not named here is refused with a 400 naming it, as OpenAI refuses an
# unrecognized argument, and a field this server does not honour yet is accepted only at the
# value that asks for nothing. JSON null is the field's absence, as in OpenAI's API.
HONOURED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
            "seed", "stream", "stream_options", "stop", "n", "logit_bias", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_p", "stop_token_ids"}
HONOURED_COMPLETIONS = {"prompt", "logprobs", "echo"}
HONOURED_CHAT = {"messages", "logprobs", "top_logprobs", "response_format", "tools",
                 "tool_choice", "parallel_tool_calls"}
INFORMATIONAL = {"user", "metadata", "store"}  # accepted: they change nothing generated


def _int_at(v, lo, hi, neutral):
    """True: the neutral value; False: a valid value that asks for something; None: invalid."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return None
    return v == neutral


def _equal_to(kind, neutral):
    return lambda v: (v == neutral) if isinstance(v, kind) else None


# Known, not honoured yet: name -> (the endpoint that knows it, or None for both; the neutral
# test (True neutral, False a value asking for something, None invalid); the valid values;
# the value this server accepts).
NOT_YET = {
    "best_of": ("completions", lambda v: _int_at(v, 1, 20, 1), "an integer in [1, 20]", "1"),
    "suffix": ("completions", _equal_to(str, ""), "a string", "absent"),
    "functions": ("chat", _equal_to(list, []), "a list", "absent"),
    "function_call": ("chat", lambda v: (v == "none") if isinstance(v, (str, dict)) else None,
                      "a string or an object", "absent or 'none'"),
    "modalities": ("chat", _equal_to(list, ["text"]), "a list", "['text']"),
}


def logprob_fields(body, chat: bool):
    """(k, echo): k None when no log-probabilities are asked for, else how many alternatives
    each token carries. Chat: ``logprobs`` a boolean, ``top_logprobs`` 0-20 with it;
    completions: ``logprobs`` 0-20 (0: the chosen token's alone), ``echo`` a boolean."""
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
                raise ApiError(400, "'top_logprobs' must be an integer in [0, 20]",
                               param="top_logprobs")
            if not lp:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true",
                               param="top_logprobs")
        return ((top or 0) if lp else None), False
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20):
        raise ApiError(400, "'logprobs' must be an integer in [0, 20]", param="logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be a boolean", param="echo")
    return lp, bool(echo)


def logit_bias_field(body, vocab) -> dict:
    """OpenAI's ``logit_bias``: {token id (a JSON key, so a string): bias in [-100, 100]}."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias",
                       param="logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not 0 <= t < vocab or str(t) != str(k).strip():
            raise ApiError(400, f"'logit_bias': {k!r} is not a token id in [0, {vocab})",
                           param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not -100 <= b <= 100:
            raise ApiError(400, f"'logit_bias': the bias of {k} must be a number in "
                                f"[-100, 100], got {b!r}", param="logit_bias")
        out[t] = float(b)
    return out


def token_id_list(body, name, vocab) -> list:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < vocab for t in v):
        raise ApiError(400, f"'{name}' must be a list of token ids in [0, {vocab})", param=name)
    return v


def check_fields(body, chat: bool):
    """Refuses, with a 400 naming it, a field this endpoint does not know or does not honour at
    the value given (see NOT_YET)."""
    known = HONOURED | INFORMATIONAL | (HONOURED_CHAT if chat else HONOURED_COMPLETIONS)
    for name, v in body.items():
        if name in known or v is None:
            continue
        entry = NOT_YET.get(name)
        if entry is None or entry[0] == ("completions" if chat else "chat"):
            raise ApiError(400, f"unrecognized request field '{name}' for "
                                f"{'/v1/chat/completions' if chat else '/v1/completions'}",
                           param=name)
        _, neutral, valid, accepted = entry
        ok = neutral(v)
        if ok is None:
            raise ApiError(400, f"'{name}' must be {valid}, got {str(v)[:80]}", param=name)
        if not ok:
            raise ApiError(400, f"'{name}' = {str(v)[:80]} is not supported by this server: it "
                                f"takes {accepted}", param=name)
    if body.get("tool_choice") is not None and not body.get("tools"):
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given",
                       param="tool_choice")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage"} or \
                not isinstance(so.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options' must be {'include_usage': bool}",
                           param="stream_options")
        if not body.get("stream"):
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           param="stream_options")

"""An OpenAI-compatible HTTP server over a resident session's slots (``algenta serve``).

``build_app(scheduler, tokenizer, ...)`` returns an ASGI application (Starlette) with
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models`` and ``GET /health``. Requests are decoded by a
:class:`algenta.residentk.batch.Scheduler`: every slot steps together, a new prompt is prefilled
in chunks between steps, a cached prefix is reused. Starlette and uvicorn (the ``serve`` extra):
the ASGI toolkit and server FastAPI itself runs on, maintained together, with streaming
responses that notice a client leaving; the request validation is ours, so it answers in
OpenAI's error shape and FastAPI's model layer would add nothing but a dependency.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: malformed
JSON or a wrong type 400, a prompt plus ``max_tokens`` past a slot's context 400 (status 606
named), an unknown model 404, a body past ``max_body`` bytes 413, a missing or wrong bearer
token 401 (with ``api_key``), all slots busy and the wait queue full 429 with ``Retry-After``.
A client that disconnects frees its slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import numbers
import time
import uuid

from .errors import ResidentError
from .residentk.batch import QueueFull, Scheduler

MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param=None, code=None, headers=None,
                 resident=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.resident = resident  # the residentk status code behind a refusal, when one is

    _TYPES = {400: "invalid_request_error", 401: "authentication_error",
              404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}

    def body(self) -> dict:
        err = {"message": self.message, "type": self._TYPES.get(self.status, "server_error"),
               "param": self.param, "code": self.code}
        if self.resident is not None:  # beside OpenAI's fields: clients ignore what they
            err["status"] = self.resident  # do not know
        return {"error": err}


# ---- text -----------------------------------------------------------------------------------
class TextStream:
    """Generated ids -> text as it becomes final. A byte-level token can end mid-character
    (decoded as U+FFFD until the next completes it), and text that could be the start of a
    stop string is held back until it is known not to be one. ``push`` returns (new text,
    stopped); after a stop string nothing more is emitted and the text ends before it."""

    def __init__(self, tokenizer, stops=()):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.ids = []
        self.sent = 0  # characters of the text already returned
        self.text = ""
        self.stopped = False
        # Incremental decoding: only the ids from `prefix` on are decoded per token, and the
        # text they gave up to `read` is the part already appended (decoding a window with one
        # token of left context keeps a word's leading space; a whole-sequence decode per
        # token would cost O(n) each).
        self.prefix = self.read = 0

    def push(self, token_id: int):
        if self.stopped:
            return "", True
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return "", False  # mid-character, or nothing visible yet
        self.prefix, self.read = self.read, len(self.ids)
        return self._advance(self.text + now[len(before):], final=False)

    def finish(self) -> str:
        """What is left once no more tokens come: the held-back tail, and any text the last
        ids gave (the whole sequence decoded once more); nothing after a stop string."""
        if self.stopped:
            return ""
        full = self.tok.decode(self.ids)
        return self._advance(full if full.startswith(self.text[:self.sent]) else self.text,
                             final=True)[0]

    def _advance(self, text: str, final: bool):
        """The text is now `text`: return (what can be sent, stopped)."""
        self.text = text
        cut = None
        for s in self.stops:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            return self._take(max(cut, self.sent)), True
        hold = 0
        for s in ([] if final else self.stops):  # the longest tail that starts a stop string
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return self._take(max(len(text) - hold, self.sent)), False

    def _take(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = end
        return out


def render_chat(template: str, messages, *, bos_token="", eos_token="") -> str:
    """A checkpoint's chat template (tokenizer_config.json's Jinja) rendered for ``messages``
    with the generation prompt, in a sandbox, with the names templates expect."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ApiError(400, f"the chat template refused the messages: {msg}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **k: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ApiError(400, f"the chat template failed on these messages: {e}",
                       param="messages") from None


# ---- request fields -------------------------------------------------------------------------
def _opt_number(body, name, default, lo, hi, *, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, f"'{name}' must lie in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                       param=name)
    return float(v)


def _opt_int(body, name, default, lo):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", param=name)
    return v


def _stops(body):
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


def _unsupported(body):
    if _opt_int(body, "n", 1, 1) != 1:
        raise ApiError(400, "'n' > 1 is not supported: send one request per completion",
                       param="n")
    if _opt_int(body, "best_of", 1, 1) != 1:
        raise ApiError(400, "'best_of' > 1 is not supported", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
        v = body.get(name)
        if v not in (None, False, 0, {}, []):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


# ---- the application ------------------------------------------------------------------------
class Server:
    """What the routes share: the scheduler, the tokenizer and the model's name."""

    def __init__(self, scheduler: Scheduler, tokenizer, *, model_name: str, eos_ids=(),
                 chat_template=None, bos_token="", eos_token="", api_key=None,
                 max_body=1 << 20):
        self.sched = scheduler
        self.tok = tokenizer
        self.model = model_name
        self.eos = frozenset(int(t) for t in eos_ids)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.api_key = api_key
        self.max_body = int(max_body)
        self.created = int(time.time())

    # -- request parsing -----------------------------------------------------------------------
    async def read_json(self, request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise ApiError(400, "bad Content-Length header") from None
            if n > self.max_body:
                raise ApiError(413, f"the request body of {n} bytes exceeds the limit of "
                                    f"{self.max_body}")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"the request body exceeds the limit of {self.max_body} "
                                    f"bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string naming the model", param="model")
        if model != self.model:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves "
                                f"'{self.model}')", param="model", code="model_not_found")
        return body

    def encode(self, text: str, *, special: bool) -> list:
        return list(self.tok.encode(text, add_special_tokens=special).ids)

    def prompt_ids(self, body) -> list:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            ids = self.encode(p, special=True)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p):
            ids = list(p)
        elif isinstance(p, list) and len(p) > 1:
            raise ApiError(400, "a list of several prompts is not supported: send one request "
                                "per prompt", param="prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids",
                           param="prompt")
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    def chat_ids(self, body) -> list:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string 'role'",
                               param="messages")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                if not all(isinstance(x, dict) and x.get("type") == "text"
                           and isinstance(x.get("text"), str) for x in c):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                c = "".join(x["text"] for x in c)
            if c is None:
                c = ""
            if not isinstance(c, str):
                raise ApiError(400, f"messages[{i}].content must be a string",
                               param="messages")
            clean.append({"role": m["role"], "content": c})
        if not self.chat_template:
            raise ApiError(400, "this checkpoint has no chat template (tokenizer_config.json's "
                                "'chat_template'): use /v1/completions", param="messages")
        text = render_chat(self.chat_template, clean, bos_token=self.bos_token,
                           eos_token=self.eos_token)
        ids = self.encode(text, special=False)  # the template wrote its special tokens
        if not ids:
            raise ApiError(400, "the messages render to no tokens", param="messages")
        return ids

    def submit(self, ids, body, *, default_max, on_event):
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if max_tokens is None:
            max_tokens = default_max(len(ids))
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, f"'{name}' must be an integer >= 1", param=name)
        temperature = _opt_number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = body.get("top_k")
        if top_k in (None, -1, 0):
            top_k = None
        else:
            top_k = _opt_int(body, "top_k", None, 1)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "'seed' must be an integer", param="seed")
        if seed is not None and seed < 0:
            seed = seed % (1 << 64)  # OpenAI accepts any int64; numpy takes non-negative seeds
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        stops = _stops(body)
        _unsupported(body)
        max_ctx = self.sched.session.max_ctx
        if len(ids) + max_tokens > max_ctx:
            raise ApiError(400, f"this model's context per request is {max_ctx} tokens; the "
                                f"prompt of {len(ids)} tokens plus {name}={max_tokens} asks "
                                f"for {len(ids) + max_tokens} (status 606, "
                                f"resident_context_full)", param=name,
                           code="context_length_exceeded", resident=606)
        try:
            job = self.sched.submit(ids, max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=None if top_p == 1.0 else top_p, seed=seed,
                                    stop_ids=self.eos, on_event=on_event)
        except QueueFull as e:
            raise ApiError(429, f"the server is at capacity: {e}; retry shortly",
                           headers={"Retry-After": "1"}) from None
        except ResidentError as e:
            raise ApiError(400, str(e), resident=e.status) from None
        except RuntimeError as e:  # closed: shutting down
            raise ApiError(503, str(e), headers={"Retry-After": "5"}) from None
        return job, stops, stream


def build_app(scheduler: Scheduler, tokenizer, *, model_name: str, eos_ids=(),
              chat_template=None, bos_token="", eos_token="", api_key=None, max_body=1 << 20):
    """The ASGI application (see the module docstring). ``tokenizer``: a ``tokenizers``
    Tokenizer (``encode(text, add_special_tokens=...)``, ``decode(ids)``)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    srv = Server(scheduler, tokenizer, model_name=model_name, eos_ids=eos_ids,
                 chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                 api_key=api_key, max_body=max_body)

    def error_response(e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_key(request):
        if srv.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {srv.api_key}":
            raise ApiError(401, "a valid API key is needed: 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def health(request):
        return JSONResponse({"status": "ok", "model": srv.model, **srv.sched.load()})

    async def models(request):
        try:
            check_key(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": srv.model, "object": "model", "created": srv.created, "owned_by": "algenta"}]})

    async def generate(request, chat: bool):
        try:
            check_key(request)
            body = await srv.read_json(request)
            ids = srv.chat_ids(body) if chat else srv.prompt_ids(body)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def on_event(ev):  # on the scheduler's thread
                loop.call_soon_threadsafe(events.put_nowait, ev)

            ctx = srv.sched.session.max_ctx
            job, stops, stream = srv.submit(
                ids, body, on_event=on_event,
                default_max=(lambda n: max(1, ctx - n)) if chat else (lambda n: 16))
        except ApiError as e:
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        text = TextStream(srv.tok, stops)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
            if isinstance(body.get("stream_options"), dict) else False

        def usage():
            n = len(text.ids)  # the tokens the text took (none past a stop string)
            return {"prompt_tokens": len(ids), "completion_tokens": n,
                    "total_tokens": len(ids) + n}

        def finish_reason(reason):
            return "length" if reason == "length" else "stop"

        def on(ev):
            """An event of the job -> ("piece", text, "stop" when a stop string ended it),
            ("done", reason) or ("error", ApiError)."""
            if ev[0] == "token":
                piece, stopped = text.push(ev[1])
                if stopped:
                    job.cancel()  # frees the slot; the "cancelled" that follows is ignored
                    return ("piece", piece, "stop")
                return ("piece", piece, None)
            if ev[0] == "error":
                return ("error", ApiError(500, f"decoding failed: {ev[1]}"))
            if ev[1] == "cancelled":  # not by this response: the server is shutting down
                return ("error", ApiError(503, "the server is shutting down; the request was "
                                               "cancelled", headers={"Retry-After": "5"}))
            return ("done", ev[1])

        async def next_event():
            return on(await events.get())

        def chunk(delta_text, reason=None, *, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({"content": delta_text} if delta_text or reason is None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta_text, "logprobs": None,
                          "finish_reason": reason}
                obj = "text_completion"
            out = {"id": rid, "object": obj, "created": created, "model": srv.model,
                   "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return "data: " + json.dumps(out, ensure_ascii=False) + "\n\n"

        if stream:
            async def sse():
                try:
                    if chat:
                        yield chunk("", role=True)
                    while True:
                        ev = await next_event()
                        if ev[0] == "piece":
                            if ev[1]:
                                yield chunk(ev[1])
                            if ev[2]:
                                reason = ev[2]
                                break
                        elif ev[0] == "done":
                            tail = text.finish()
                            if tail:
                                yield chunk(tail)
                            reason = finish_reason(ev[1])
                            break
                        else:  # the status line is sent: the error goes in the stream
                            yield "data: " + json.dumps(ev[1].body()) + "\n\n"
                            return
                    yield chunk("", reason)
                    if include_usage:
                        yield "data: " + json.dumps(
                            {"id": rid, "object": "chat.completion.chunk" if chat
                             else "text_completion", "created": created, "model": srv.model,
                             "choices": [], "usage": usage()}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    job.cancel()  # a client gone mid-stream frees its slot now

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        # not streamed: wait, watching for the client leaving (one pending get, never
        # cancelled, so no event can be lost to a timeout)
        parts = []
        getter = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter}, timeout=0.25)
                if not done:
                    if await request.is_disconnected():
                        job.cancel()
                        return JSONResponse({}, status_code=499)  # nginx's "client closed request"
                    continue
                ev, getter = on(getter.result()), None
                if ev[0] == "piece":
                    parts.append(ev[1])
                    if ev[2]:
                        reason = ev[2]
                        break
                elif ev[0] == "done":
                    parts.append(text.finish())
                    reason = finish_reason(ev[1])
                    break
                else:
                    return error_response(ev[1])
        finally:
            job.cancel()
            if getter is not None:
                getter.cancel()
        out_text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out_text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": out_text, "logprobs": None, "finish_reason": reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat
                             else "text_completion", "created": created, "model": srv.model,
                             "choices": [choice], "usage": usage()})

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped accepting and let the open responses finish (or cancelled them
        # past its graceful timeout): cancel what is left and stop the worker.
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: scheduler.close(cancel=True))

    from starlette.exceptions import HTTPException

    async def http_error(request, exc):  # an unknown route or method, in OpenAI's shape
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    async def internal_error(request, exc):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app = Starlette(exception_handlers={HTTPException: http_error, Exception: internal_error},
                    routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan)
    app.state.server = srv
    return app

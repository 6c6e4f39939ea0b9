"""An OpenAI-compatible HTTP server over a resident session's slots (``algenta serve``).

``build_app(scheduler, tokenizer, ...)`` returns an ASGI application (Starlette) with
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus). Requests are decoded by a
:class:`algenta.residentk.batch.Scheduler`: every slot steps together, a new prompt is prefilled
in chunks between steps, a cached prefix is reused. Starlette and uvicorn (the ``serve`` extra):
the ASGI toolkit and server FastAPI itself runs on, maintained together, with streaming
responses that notice a client leaving; the request validation is ours, so it answers in
OpenAI's error shape and FastAPI's model layer would add nothing but a dependency.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: malformed
JSON or a wrong type 400, a field this server does not know or does not honour at the value
given 400 naming it (``NOT_YET``: never silently ignored), a prompt plus ``max_tokens`` past a
slot's context 400 (status 606 named), an unknown model 404, a body not in within
``body_timeout`` seconds 408, a body past ``max_body`` bytes 413, a missing or wrong bearer
token 401 (with ``api_key``), all slots busy and the wait queue full 429 with ``Retry-After``.
A client that disconnects, streamed or not, frees its slot at once. Tokenizing and template
rendering run on a thread pool, and stop strings are matched by automata, so no request's
size stalls the event loop for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import logging
import uuid

from .errors import ResidentError
from .serve_fields import (ApiError, check_fields, logit_bias_field, logprob_fields, opt_int,
                           opt_number, stop_strings, token_id_list)
from .serve_text import TextStream, ThinkSplit, logprobs_object
from .serve_tools import call_grammar, check_tools, clean_message, parse_calls, tool_format
from .residentk.batch import QueueFull, Scheduler

MAX_CHOICES = 16  # n: each choice takes a slot
log = logging.getLogger("algenta.serve")


class ClientGone(Exception):
    """The client disconnected before its request was read: nobody to answer."""


def render_chat(template: str, messages, *, bos_token="", eos_token="", tools=None) -> str:
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
                                                bos_token=bos_token, eos_token=eos_token,
                                                tools=tools)
    except jinja2.TemplateError as e:
        raise ApiError(400, f"the chat template failed on these messages: {e}",
                       param="messages") from None


# ---- the application ------------------------------------------------------------------------
class Server:
    """What the routes share: the scheduler, the tokenizer and the model's name."""

    def __init__(self, scheduler: Scheduler, tokenizer, *, model_name: str, eos_ids=(),
                 chat_template=None, bos_token="", eos_token="", api_key=None,
                 max_body=1 << 20, body_timeout=30.0):
        self.sched = scheduler
        self.tok = tokenizer
        self.model = model_name
        self.eos = frozenset(int(t) for t in eos_ids)
        self.chat_template = chat_template
        # what the template writes, read once: its tool-call format, and whether it is a
        # thinking model's (reasoning split from content)
        self.tool_format = tool_format(chat_template)
        self.thinking = ThinkSplit.OPEN in (chat_template or "")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.api_key = api_key
        self.max_body = int(max_body)
        self.body_timeout = float(body_timeout)
        self.created = int(time.time())
        # Tokenizing, rendering templates and building stop-string automata run here, off the
        # event loop: a megabyte prompt must not stall the streams of everyone else. Two
        # threads: the work is in Rust (encode_batch releases the GIL) or short.
        from concurrent.futures import ThreadPoolExecutor
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="algenta-tokenize")
        from .serve_grammar import Grammars
        self.grammars = Grammars(tokenizer, scheduler.session.config.vocab, self.eos)

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
        from starlette.requests import ClientDisconnect

        raw = bytearray()

        async def read():
            async for part in request.stream():
                raw.extend(part)
                if len(raw) > self.max_body:
                    raise ApiError(413, f"the request body exceeds the limit of "
                                        f"{self.max_body} bytes")

        try:  # a client trickling its body holds a connection, not the server
            await asyncio.wait_for(read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} "
                                f"s") from None
        except ClientDisconnect:
            raise ClientGone() from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        for name, v in body.items():  # JSON may carry lone surrogates, which no text can hold
            try:
                json.dumps(v, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"'{name}' holds a lone surrogate (an unpaired \\ud800-"
                                    f"\\udfff escape), which is not text", param=name) from None
            except RecursionError:
                raise ApiError(400, f"'{name}' is nested too deeply", param=name) from None
        if body.get("stream") is None:
            body.pop("stream", None)  # null is absence, as everywhere in OpenAI's API
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string naming the model", param="model")
        if model != self.model:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves "
                                f"'{self.model}')", param="model", code="model_not_found")
        return body

    def encode(self, text: str, *, special: bool) -> list:
        # encode_batch, not encode: it releases the GIL while the Rust tokenizer runs
        return list(self.tok.encode_batch([text], add_special_tokens=special)[0].ids)

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

    def chat_ids(self, body, tools_of=(None, "none")) -> list:
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
            clean.append(clean_message({**m, "content": c}, i))
        if not self.chat_template:
            raise ApiError(400, "this checkpoint has no chat template (tokenizer_config.json's "
                                "'chat_template'): use /v1/completions", param="messages")
        tools, choice = tools_of
        text = render_chat(self.chat_template, clean, bos_token=self.bos_token,
                           eos_token=self.eos_token,
                           tools=tools if choice != "none" else None)
        ids = self.encode(text, special=False)  # the template wrote its special tokens
        if not ids:
            raise ApiError(400, "the messages render to no tokens", param="messages")
        return ids, text.rstrip().endswith(ThinkSplit.OPEN)

    def parse(self, body, chat: bool) -> dict:
        """A request, every field checked (the cheap checks first), its prompt tokenized and
        its stop strings compiled: run on the pool, off the event loop."""
        check_fields(body, chat)
        logprobs, echo = logprob_fields(body, chat)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = body.get(name)
        least = 0 if echo else 1  # echo with max_tokens 0: the prompt's log-probs alone
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < least):
            raise ApiError(400, f"'{name}' must be an integer >= {least}", param=name)
        temperature = opt_number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = body.get("top_k")
        top_k = None if top_k in (None, -1, 0) else opt_int(body, "top_k", None, 1)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "'seed' must be an integer", param="seed")
        if seed is not None and seed < 0:
            seed = seed % (1 << 64)  # OpenAI accepts any int64; numpy takes non-negative seeds
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        if echo and stream:
            raise ApiError(400, "'echo' is not supported with 'stream'", param="echo")
        stops = stop_strings(body)
        vocab = self.sched.session.config.vocab
        penalties = {"presence_penalty": opt_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                     "frequency_penalty": opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                     "repetition_penalty": opt_number(body, "repetition_penalty", 1.0, 0.0,
                                                       math.inf, lo_open=True),
                     "min_p": opt_number(body, "min_p", 0.0, 0.0, 1.0),
                     "logit_bias": logit_bias_field(body, vocab)}
        stop_token_ids = token_id_list(body, "stop_token_ids", vocab)
        n = opt_int(body, "n", 1, 1)
        if n > MAX_CHOICES:
            raise ApiError(400, f"'n' must be at most {MAX_CHOICES}, got {n}", param="n")
        if n > 1 and temperature == 0:
            raise ApiError(400, "'n' > 1 with temperature 0 would return n equal choices: "
                                "sample (temperature > 0) or send n = 1", param="n")
        grammar = None
        rf = body.get("response_format")
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object",
                                                                   "json_schema"):
                raise ApiError(400, "'response_format' must be an object whose type is text, "
                                    "json_object or json_schema", param="response_format")
            try:
                grammar = self.grammars.compile(rf)
            except ValueError as e:
                raise ApiError(400, f"'response_format': {e}", param="response_format") from None
        tools, choice = check_tools(body) if chat else (None, "none")
        fmt = self.tool_format
        if tools and choice != "none":
            if fmt is None:
                raise ApiError(400, "'tools': this checkpoint's chat template writes no tool-call "
                                    "format this server parses (hermes <tool_call> or Llama 3 "
                                    "JSON)", param="tools")
            if choice != "auto":  # "required" or a named function: a grammar enforces it
                if fmt != "hermes":
                    raise ApiError(400, f"'tool_choice' {choice!r} is enforced for <tool_call> "
                                        f"templates only", param="tool_choice")
                if grammar is not None:
                    raise ApiError(400, "'response_format' and a required tool call cannot "
                                        "both shape the output", param="response_format")
                try:
                    grammar = self.grammars.compile_lark(call_grammar(tools, choice))
                except ValueError as e:
                    raise ApiError(400, f"'tools': {e}", param="tools") from None
        ids, opened = self.chat_ids(body, (tools, choice)) if chat else \
            (self.prompt_ids(body), False)
        thinking = chat and self.thinking
        max_ctx = self.sched.session.max_ctx
        if max_tokens is None:  # chat: the rest of the context; completions: OpenAI's 16
            max_tokens = max(1, max_ctx - len(ids)) if chat else 16
        if len(ids) + max_tokens > max_ctx:
            raise ApiError(400, f"this model's context per request is {max_ctx} tokens; the "
                                f"prompt of {len(ids)} tokens plus {name}={max_tokens} asks "
                                f"for {len(ids) + max_tokens} (status 606, "
                                f"resident_context_full)", param=name,
                           code="context_length_exceeded", resident=606)
        prompt_text = None
        if echo:
            p = body["prompt"][0] if isinstance(body["prompt"], list) and \
                len(body["prompt"]) == 1 and isinstance(body["prompt"][0], (str, list)) \
                else body["prompt"]
            prompt_text = p if isinstance(p, str) else self.tok.decode(ids)
        return dict(ids=ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                    top_p=None if top_p == 1.0 else top_p, seed=seed, stream=stream,
                    logprobs=logprobs, echo=echo, prompt_text=prompt_text, n=n,
                    penalties=penalties, stop_token_ids=frozenset(stop_token_ids),
                    texts=[TextStream(self.tok, stops) for _ in range(n)],
                    constraints=[grammar and self.grammars.constraint(grammar)
                                 for _ in range(n)],
                    tool_format=fmt if tools and choice != "none" else None,
                    thinking=thinking, think_opened=opened)

    def submit(self, req: dict, on_event_of) -> list:
        """The request's n jobs, all queued or none. Choice i samples with its own generator:
        seed + i * 0x9e3779b97f4a7c15 (mod 2^64) when a seed is given, so choice 0 is what
        n = 1 gives and each choice is reproducible; the later choices follow the first, whose
        prefilled prompt they copy."""
        jobs = []
        try:
            for i in range(req["n"]):
                seed = req["seed"]
                if seed is not None:
                    seed = (seed + i * 0x9E3779B97F4A7C15) % (1 << 64)
                jobs.append(self.sched.submit(
                    req["ids"], req["max_tokens"], temperature=req["temperature"],
                    top_k=req["top_k"], top_p=req["top_p"], seed=seed,
                    stop_ids=self.eos | req["stop_token_ids"], on_event=on_event_of(i),
                    logprobs=req["logprobs"], echo=req["echo"],
                    follows=jobs[0] if jobs and not req["echo"] else None,
                    constraint=req["constraints"][i], **req["penalties"]))
        except QueueFull as e:
            err = ApiError(429, f"the server is at capacity: {e}; retry shortly",
                           headers={"Retry-After": "1"})
        except ResidentError as e:
            err = ApiError(400, str(e), resident=e.status)
        except RuntimeError as e:  # closed: shutting down
            err = ApiError(503, str(e), headers={"Retry-After": "5"})
        else:
            return jobs
        for j in jobs:  # all of a request's choices, or none
            j.cancel()
        raise err


def finish_reason(reason):
    return "length" if reason == "length" else "stop"


class Choice:
    """One of a request's ``n`` outputs: its job, its text and log-probabilities so far."""

    def __init__(self, index, job, req, srv, chat, t0):
        self.index, self.job, self.req, self.srv, self.chat = index, job, req, srv, chat
        self.last = t0  # when the request arrived, then when the last token came
        self.text = req["texts"][index]  # built on the pool: stop automata cost O(length)
        self.parts = []          # the text returned so far (not streamed)
        self.reason = None       # finish_reason once decided
        self.closed = False      # a stream's final chunk of this choice sent
        self.eos_seen = 0        # an eos id ends the output: counted, never shown as text
        # log-probabilities of the generated tokens, (id, (logprob, top)); how many went out
        # in chunks; the prompt's with echo
        self.lp_items, self.lp_sent, self.prompt_lp = [], 0, []
        self.think = ThinkSplit(req["think_opened"]) if req["thinking"] else None

    def completion_tokens(self) -> int:
        return len(self.text.ids) + self.eos_seen  # none past a stop string

    def on(self, ev):
        """An event of the job -> ("piece", text, "stop" when a stop string ended it),
        ("done", reason) or ("error", ApiError)."""
        if ev[0] == "prompt_logprobs":
            self.prompt_lp[:] = ev[1]
            return ("piece", "", None)
        if ev[0] == "token":
            now, m = time.monotonic(), self.srv.metrics
            (m.itl if self.text.ids or self.eos_seen else m.ttft).observe(now - self.last)
            self.last = now
            m.generation_tokens.inc()
            if self.req["logprobs"] is not None and not self.text.stopped:
                self.lp_items.append((ev[1], ev[2]))
            if ev[1] in self.srv.eos or ev[1] in self.req["stop_token_ids"]:
                self.eos_seen += not self.text.stopped
                return ("piece", "", None)
            piece, stopped = self.text.push(ev[1])
            if stopped:
                self.job.cancel()  # frees the slot; the "cancelled" that follows is ignored
                return ("piece", piece, "stop")
            return ("piece", piece, None)
        if ev[0] == "error":
            return ("error", ApiError(500, f"decoding failed: {ev[1]}"))
        if ev[1] == "cancelled":  # not by this response: the server is shutting down
            return ("error", ApiError(503, "the server is shutting down; the request was "
                                           "cancelled", headers={"Retry-After": "5"}))
        return ("done", ev[1])

    def take_logprobs(self, final=False):
        """The logprobs object of the tokens not yet sent (a stream's chunk), or None."""
        if self.req["logprobs"] is None or (self.lp_sent == len(self.lp_items) and not final):
            return None
        a, self.lp_sent = self.lp_sent, len(self.lp_items)
        ids = self.req["ids"]
        before = self.lp_items[a - 1][0] if a else ids[-1]
        return logprobs_object(self.srv.tok, self.lp_items[a:], chat=self.chat, before=before)

    def final(self):
        """(text, logprobs, tool calls) of a choice returned whole (or a stream's buffered
        choice); a stop with calls becomes finish_reason "tool_calls"."""
        text, lps, calls = "".join(self.parts), None, []
        self.reasoning = None
        if self.think is not None:  # a whole output's reasoning and content
            split = self.think.push(text) + self.think.finish()
            self.reasoning = "".join(t for k, t in split if k == "reasoning")
            text = "".join(t for k, t in split if k == "content")
        if self.req["tool_format"] is not None:
            text, calls = parse_calls(self.req["tool_format"], text)
            if calls and self.reason == "stop":
                self.reason = "tool_calls"
        if self.req["logprobs"] is not None:
            lps = self.take_logprobs(final=True)
            if self.req["echo"]:  # the prompt's tokens first, the first with no context
                pre = logprobs_object(self.srv.tok, list(zip(self.req["ids"], self.prompt_lp)),
                                      chat=False)
                n = len(self.req["prompt_text"])
                lps = {k: pre[k] + (lps[k] if k != "text_offset" else
                                    [n + o for o in lps["text_offset"]]) for k in pre}
        if self.req["echo"]:
            text = self.req["prompt_text"] + text
        return text, lps, calls


def build_app(scheduler: Scheduler, tokenizer, *, model_name: str, eos_ids=(),
              chat_template=None, bos_token="", eos_token="", api_key=None, max_body=1 << 20,
              body_timeout=30.0):
    """The ASGI application (see the module docstring). ``tokenizer``: a ``tokenizers``
    Tokenizer (``encode_batch(texts, add_special_tokens=...)``, ``decode(ids)``)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from .serve_metrics import Metrics

    srv = Server(scheduler, tokenizer, model_name=model_name, eos_ids=eos_ids,
                 chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                 api_key=api_key, max_body=max_body, body_timeout=body_timeout)

    srv.metrics = metrics = Metrics(scheduler, model_name)

    def counted(route, handler):  # requests by route and status (a stream: its 200)
        async def run(request):
            response = await handler(request)
            metrics.requests.labels(route=route, status=str(response.status_code)).inc()
            return response
        return run

    async def scrape(request):
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

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
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            check_key(request)
            body = await srv.read_json(request)
            req = await loop.run_in_executor(srv.pool, srv.parse, body, chat)
            events: asyncio.Queue = asyncio.Queue()

            def on_event_of(i):
                def on_event(ev):  # on the scheduler's thread
                    loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                return on_event

            jobs = srv.submit(req, on_event_of)
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            log.warning("a client disconnected while sending its request body")
            return Response(status_code=499)  # nginx's "client closed request"
        ids, stream = req["ids"], req["stream"]
        choices = [Choice(i, job, req, srv, chat, t0) for i, job in enumerate(jobs)]
        srv.metrics.prompt_tokens.inc(len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def usage():
            n = sum(c.completion_tokens() for c in choices)
            return {"prompt_tokens": len(ids), "completion_tokens": n,
                    "total_tokens": len(ids) + n}

        def cancel_all():
            for c in choices:
                c.job.cancel()

        def chunk(c, delta_text, reason=None, *, role=False, delta=None, lps=None):
            lps = lps if lps is not None or role or delta is not None else c.take_logprobs()
            if chat:
                delta = delta if delta is not None else \
                    {"role": "assistant", "content": ""} if role else \
                    ({"content": delta_text} if delta_text or reason is None else {})
                choice = {"index": c.index, "delta": delta, "logprobs": lps,
                          "finish_reason": reason}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": c.index, "text": delta_text, "logprobs": lps,
                          "finish_reason": reason}
                obj = "text_completion"
            out = {"id": rid, "object": obj, "created": created, "model": srv.model,
                   "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return "data: " + json.dumps(out, ensure_ascii=False) + "\n\n"

        def pieces(c, text, final=False):
            """A stream's chunks of new text: content, or a thinking model's reasoning."""
            if c.think is None:
                return [chunk(c, text)]
            parts = c.think.push(text) + (c.think.finish() if final else [])
            return [chunk(c, t) if k == "content" else
                    chunk(c, "", delta={"reasoning_content": t}) for k, t in parts]

        if stream:
            async def sse():
                try:
                    if chat:
                        for c in choices:
                            yield chunk(c, "", role=True)
                    live = len(choices)
                    while live:
                        i, raw = await events.get()
                        c = choices[i]
                        if c.closed:
                            continue  # the "cancelled" after its stop string
                        ev = c.on(raw)
                        # with tools, a choice's text is held until it ends: its calls are
                        # parsed from the whole output and sent as one delta each
                        buffered = req["tool_format"] is not None
                        if ev[0] == "piece":
                            if ev[1]:
                                if buffered:
                                    c.parts.append(ev[1])
                                else:
                                    for out in pieces(c, ev[1]):
                                        yield out
                            if ev[2]:
                                c.reason = ev[2]
                        elif ev[0] == "done":
                            tail = c.text.finish()
                            if tail and buffered:
                                c.parts.append(tail)
                            elif tail:
                                for out in pieces(c, tail):
                                    yield out
                            c.reason = finish_reason(ev[1])
                        elif ev[0] == "error":  # the status line is sent: it goes in the stream
                            yield "data: " + json.dumps(ev[1].body()) + "\n\n"
                            return
                        if c.reason is not None and not c.closed:
                            c.closed = True
                            live -= 1
                            if c.think is not None and not buffered:
                                for out in pieces(c, "", final=True):
                                    yield out
                            if buffered:
                                text, lps, calls = c.final()
                                if c.reasoning:
                                    yield chunk(c, "", delta={"reasoning_content": c.reasoning})
                                if text:
                                    yield chunk(c, text, lps=lps)
                                for k, call in enumerate(calls):
                                    yield chunk(c, "", delta={"tool_calls": [{"index": k,
                                                                              **call}]})
                            yield chunk(c, "", c.reason)
                        # a backlog of events must not hold the loop: other requests run
                        # between two chunks (a queued get returns without yielding)
                        await asyncio.sleep(0)
                    if include_usage:
                        yield "data: " + json.dumps(
                            {"id": rid, "object": "chat.completion.chunk" if chat
                             else "text_completion", "created": created, "model": srv.model,
                             "choices": [], "usage": usage()}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    cancel_all()  # a client gone mid-stream frees its slots now

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        # Not streamed: wait for the events and, beside them, for the ASGI server's
        # "http.disconnect", which it sends when the client leaves (one pending get, never
        # cancelled while waiting, so no event is lost).
        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        getter = None
        try:
            live = len(choices)
            while live:
                getter = getter or asyncio.ensure_future(events.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    cancel_all()
                    return Response(status_code=499)  # nobody is there to read it
                (i, raw), getter = getter.result(), None
                c = choices[i]
                if c.reason is not None:
                    continue  # the "cancelled" after a stop string
                ev = c.on(raw)
                if ev[0] == "piece":
                    c.parts.append(ev[1])
                    if ev[2]:
                        c.reason = ev[2]
                elif ev[0] == "done":
                    c.parts.append(c.text.finish())
                    c.reason = finish_reason(ev[1])
                else:
                    return error_response(ev[1])
                live -= c.reason is not None
        finally:
            cancel_all()
            watcher.cancel()
            if getter is not None:
                getter.cancel()
        out = []
        for c in choices:
            text, lps, calls = c.final()
            if chat:
                msg = {"role": "assistant", "content": text}
                if c.think is not None:
                    msg["reasoning_content"] = c.reasoning
                if calls:
                    msg["tool_calls"] = calls
                out.append({"index": c.index, "message": msg, "logprobs": lps,
                            "finish_reason": c.reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lps,
                            "finish_reason": c.reason})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat
                             else "text_completion", "created": created, "model": srv.model,
                             "choices": out, "usage": usage()})

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
        srv.pool.shutdown(wait=False, cancel_futures=True)

    from starlette.exceptions import HTTPException

    async def http_error(request, exc):  # an unknown route or method, in OpenAI's shape
        metrics.requests.labels(route="unmatched", status=str(exc.status_code)).inc()
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    async def internal_error(request, exc):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app = Starlette(exception_handlers={HTTPException: http_error, Exception: internal_error},
                    routes=[
        Route("/health", health, methods=["GET"]),
        Route("/metrics", scrape, methods=["GET"]),
        Route("/v1/models", counted("/v1/models", models), methods=["GET"]),
        Route("/v1/completions", counted("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", counted("/v1/chat/completions", chat_completions),
              methods=["POST"]),
    ], lifespan=lifespan)
    app.state.server = srv
    return app

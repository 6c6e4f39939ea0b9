"""Tool calls on ``algenta serve``'s chat: ``tools`` checked and given to the checkpoint's chat
template, the calls parsed out of the output in the format of the model's family, and
``tool_choice`` "required" or a named function enforced by a grammar (llguidance).

Formats, told apart by what the chat template writes:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number,
  with text around them (Qwen2, Qwen2.5, Qwen3, Hermes);
- ``llama3_json``: the whole output one ``{"name": ..., "parameters": {...}}`` object (Llama
  3.1 and 3.2 with JSON tool calling).

Mistral's ``[TOOL_CALLS]`` is a special token the decoded text drops: not parsed yet, so
``tools`` on such a checkpoint is refused rather than answered with calls left as text."""

from __future__ import annotations

import json
import re
import uuid

from .serve_fields import ApiError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def tool_format(template):
    """The tool-call format a chat template writes, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def check_tools(body):
    """(tools, choice) of a chat request: tools a list of OpenAI function tools (or None),
    choice "auto", "none", "required" or a function's name."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, "none"
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                           param="tools")
        if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' "
                                f"or '-'", param="tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise ApiError(400, "'tools' names a function twice", param="tools")
    c = body.get("tool_choice", "auto")
    if c is None:
        c = "auto"
    if isinstance(c, dict):
        f = c.get("function") if c.get("type") == "function" else None
        if not isinstance(f, dict) or f.get("name") not in names:
            raise ApiError(400, "'tool_choice' must be 'auto', 'none', 'required' or "
                                "{'type': 'function', 'function': {'name': <one of tools>}}",
                           param="tool_choice")
        return tools, f["name"]
    if c not in ("auto", "none", "required"):
        raise ApiError(400, "'tool_choice' must be 'auto', 'none', 'required' or a function",
                       param="tool_choice")
    return tools, c


def clean_message(m, i):
    """A chat message as templates take it: role, content, and an assistant's tool_calls (their
    arguments as objects, the convention of transformers' templates) or a tool result's
    tool_call_id and name."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls: a list, on an assistant message",
                           param="messages")
        out["tool_calls"] = []
        for c in calls:
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls: each must be {{'id', 'type': "
                                    f"'function', 'function': {{'name', 'arguments'}}}}",
                               param="messages")
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ApiError(400, f"messages[{i}].tool_calls: arguments of "
                                        f"{f['name']} is not JSON", param="messages") from None
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": f["name"], "arguments": args}})
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def call_grammar(tools, choice) -> str:
    """A Lark grammar (llguidance's dialect) for one hermes tool call of the functions
    ``choice`` allows: every function ("required") or the one named."""
    alts = []
    for t in tools:
        f = t["function"]
        if choice in ("required", f["name"]):
            params = f.get("parameters") or {"type": "object"}
            alts.append({"type": "object", "additionalProperties": False,
                         "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": params}})
    schema = {"anyOf": alts, "x-guidance": {"whitespace_flexible": False}}
    return 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)


def parse_calls(fmt, text):
    """(content or None, [OpenAI tool calls]) of an output; text that is not a well-formed call
    stays content."""
    calls = []

    def call(obj, key):
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = obj.get(key, obj.get("arguments", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
        return True

    if fmt == "hermes":
        rest, last = [], 0
        for m in _HERMES.finditer(text):
            try:
                ok = call(json.loads(m.group(1)), "arguments")
            except ValueError:
                ok = False
            if ok:
                rest.append(text[last:m.start()])
                last = m.end()
        rest.append(text[last:])
        content = "".join(rest).strip()
        return (content or None) if calls else text, calls
    if fmt == "llama3_json":
        try:
            if call(json.loads(text.strip()), "parameters"):
                return None, calls
        except ValueError:
            pass
    return text, calls

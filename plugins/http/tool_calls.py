"""OpenAI tool calls over any chat template: validation, prompt rendering, forcing, and parsing.

A template that renders ``tools`` gets them (the model then sees the format it was trained on);
for one that does not, the tools are described in a system message in the Hermes format (the one
Qwen, Hermes and many fine-tunes use), and tool calls and results in the history are written as
text in that same format, so any chat model can call tools. Whatever the template, replies are
parsed for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or a reply that is
nothing but such a JSON object (or a list of them). "required" and a named ``tool_choice`` are
forced by pre-filling the assistant reply with the opening of a call (and the name, when it is
known); on an engine that can constrain sampling with a grammar (``EngineCapabilities.grammars``)
the rest of the call is also constrained by a GBNF grammar built from the tools' ``parameters``
schemas (see :func:`call_grammar`), so the reply is exactly one valid call. Elsewhere the model
writes the rest unconstrained. See docs/api.md, "Tool calls"."""

from __future__ import annotations

import json
import logging
import re
import uuid

import attrs

from superfluid.core.chat import render_chat, template_caps
from superfluid.core.errors import InvalidRequest

log = logging.getLogger("superfluid.http")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DECODER = json.JSONDecoder()

SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _bad(message: str, param: str, code: str = "invalid_value"):
    return InvalidRequest(message, param=param, code=code)


@attrs.define(frozen=True)
class ToolPlan:
    """What one chat request does with tools. ``active``: tools are offered and replies parsed."""

    tools: tuple[dict, ...] = ()
    choice: str = "none"  # "none" | "auto" | "required" | "function" (forced to ``name``)
    name: str | None = None
    parallel: bool = True
    grammar: str | None = None  # GBNF for what follows the pre-fill of a forced call (see call_grammar)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def prefill(self) -> str:
        """The start of the assistant reply, written for the model: the opening of a call. With a
        grammar it stops before the arguments (or the name), which the grammar then writes."""
        if self.grammar is not None:
            if self.choice == "function":
                return f'{OPEN}\n{{"name": {json.dumps(self.name, ensure_ascii=False)}, "arguments":'
            return f'{OPEN}\n{{"name":'
        if self.choice == "function":
            return f'{OPEN}\n{{"name": {json.dumps(self.name, ensure_ascii=False)}, "arguments": {{'
        if self.choice == "required":
            return f'{OPEN}\n{{"name": "'
        return ""

    @property
    def stop(self) -> tuple[str, ...]:
        """One call only: stop at its closing tag instead of letting the model ramble on."""
        return (CLOSE,) if self.active and (self.choice == "function" or not self.parallel) else ()


# ---- validation -----------------------------------------------------------------------------

def plan(body: dict, grammars: bool = False) -> ToolPlan:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``: a 400 naming the field.
    ``grammars``: the engine can constrain sampling, so a forced call gets a grammar."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools must be a list of tools", "tools", "invalid_type")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise _bad(f"tools may hold at most {MAX_TOOLS} tools", "tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type must be \"function\"", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object", f"{where}.function",
                       "missing_required_parameter" if fn is None else "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                       f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}.function.name: duplicate tool name {name!r}", f"{where}.function.name")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description",
                       "invalid_type")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{where}.function.parameters")
        clean = {"name": name}
        for key in ("description", "parameters"):
            if fn.get(key) is not None:
                clean[key] = fn[key]
        tools.append({"type": "function", "function": clean})

    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls", "invalid_type")
    choice, name = _choice(body.get("tool_choice"), seen)
    if choice == "required" and len(tools) == 1:
        choice, name = "function", tools[0]["function"]["name"]  # one tool: required names it
    grammar = None
    if grammars and choice in ("function", "required"):
        grammar = call_grammar([t for t in tools if choice == "required" or t["function"]["name"] == name])
    return ToolPlan(tools=tuple(tools), choice=choice, name=name, parallel=parallel is not False,
                    grammar=grammar)


def _check_schema(schema, where: str) -> None:
    """A function's ``parameters``: a JSON Schema for an object. What would make it no schema at
    all is a 400 naming the field; what the grammar builder cannot express is not (it falls back
    to any JSON object)."""
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON Schema object", where, "invalid_type")
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise _bad(f"{where}.type must be \"object\": a function takes an object of arguments", where)
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise _bad(f"{where}.properties must map names to JSON Schemas", where, "invalid_type")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _bad(f"{where}.required must be a list of property names", where, "invalid_type")


# ---- grammar ------------------------------------------------------------------------------------

_ANY_OBJECT = {"type": "object"}
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def _gbnf_literal(text: str) -> str:
    return json.dumps(text)  # a GBNF literal escapes as a JSON string does (ASCII: \\uXXXX)


def _arguments_rule(converter, schema: dict | None, rule: str) -> str:
    """Add the rules for an arguments object matching ``schema`` under the name ``rule``; the
    rule's name (any JSON object where the schema is beyond the converter)."""
    schema = schema or _ANY_OBJECT
    rules = dict(converter._rules)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), rule)
        return converter.visit(resolved, rule)
    except Exception as exc:  # noqa: BLE001 - unsupported keywords, remote refs, bad patterns
        log.info("tool schema not expressible as a grammar (%s); forcing any JSON object", exc)
        converter._rules = rules
        return converter.visit(_ANY_OBJECT, rule)


def call_grammar(tools: list[dict]) -> str:
    """GBNF for the rest of a forced call after the pre-fill (:attr:`ToolPlan.prefill`): for one
    tool, `` {arguments}}`` then ``\n</tool_call>``; for several, the name first (one of theirs),
    then its arguments. The arguments follow the tool's ``parameters`` schema, through llama.cpp's
    own JSON-Schema-to-GBNF converter (llama-cpp-python's port of it)."""
    from llama_cpp.llama_grammar import SchemaConverter  # the llama.cpp engine's dependency

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        args = _arguments_rule(converter, fn.get("parameters"), f"tool{i}-arguments")
        if len(tools) == 1:
            alternatives.append(args)
        else:
            head = _gbnf_literal(f' {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ')
            alternatives.append(f"{head} {args}")
    body = f'" " {alternatives[0]}' if len(tools) == 1 else "( " + " | ".join(alternatives) + " )"
    converter._rules["root"] = f'{body} "}}" {_gbnf_literal(chr(10) + CLOSE)}'
    if "char" in converter._rules:  # as llama.cpp's own: no raw control characters in a string
        converter._rules["char"] = _JSON_CHAR
    return converter.format_grammar()


def _choice(raw, names: set[str]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise _bad(f"tool_choice must be \"none\", \"auto\", \"required\" or a function, got {raw!r}",
                       "tool_choice")
        if raw == "required" and not names:
            raise _bad("tool_choice \"required\" needs tools", "tool_choice")
        return (raw if names else "none"), None
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                   "tool_choice", "invalid_type")
    if fn["name"] not in names:
        raise _bad(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
    return "function", fn["name"]


def check_messages(messages: list[dict]) -> list[dict]:
    """Validate the tool fields of the history (assistant ``tool_calls``, ``tool_call_id``)."""
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg["role"] == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise _bad(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id",
                       "missing_required_parameter")
        if "tool_calls" not in msg:
            continue
        calls = msg["tool_calls"]
        if msg["role"] != "assistant":
            raise _bad(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        if calls is None:
            del msg["tool_calls"]
            continue
        if not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or call.get("type", "function") != "function":
                raise _bad(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           f"\"arguments\"}}}}", at, "invalid_type")
            if not isinstance(call.get("id"), str):
                raise _bad(f"{at}.id must be a string", f"{at}.id", "invalid_type")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _bad(f"{at}.function.name must be a non-empty string", f"{at}.function.name",
                           "invalid_type")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise _bad(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments",
                           "invalid_type")
    return messages


# ---- prompt ---------------------------------------------------------------------------------

def _arguments(raw) -> object:
    """A call's arguments as an object where they parse (JSON text otherwise, kept as a string)."""
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return raw


def call_text(name: str, arguments) -> str:
    """One call as the model is asked to write it: the canonical form of the history."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _as_text(messages: list[dict], caps, native: bool) -> list[dict]:
    """History the template cannot render, rewritten deterministically as Hermes text."""
    out: list[dict] = []
    for msg in messages:
        if msg.get("tool_calls") and not (native and caps.tool_calls):
            calls = "\n".join(call_text(c["function"]["name"], c["function"].get("arguments"))
                              for c in msg["tool_calls"])
            text = f"{msg['content']}\n{calls}" if msg["content"] else calls
            msg = {k: v for k, v in msg.items() if k != "tool_calls"} | {"content": text}
        elif msg.get("tool_calls") and caps.object_arguments:
            msg = msg | {"tool_calls": [c | {"function": c["function"] | {
                "arguments": _arguments(c["function"].get("arguments"))}} for c in msg["tool_calls"]]}
        elif msg["role"] == "tool" and not (native and caps.tool_role):
            result = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if not caps.tool_role:  # as a user turn; consecutive results share one
                if out and out[-1].get("_results"):
                    out[-1]["content"] += "\n" + result
                    continue
                out.append({"role": "user", "content": result, "_results": True})
                continue
            msg = msg | {"content": result}
        out.append(msg)
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def render_prompt(template: str | None, messages: list[dict], tools: ToolPlan, **kw) -> str:
    """The prompt text: the template's own tool rendering where it has one, else the Hermes system
    message; then the forced opening of a call, if any."""
    caps = template_caps(template) if template else None
    if caps is None:
        return render_chat(template, messages, **kw)  # raises: no template
    native = caps.tools
    has_tool_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if has_tool_history:
        messages = _as_text(messages, caps, native)
    if tools.active and native:
        text = render_chat(template, messages, tools=list(tools.tools), **kw)
    else:
        if tools.active:
            block = SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools))
            if messages[0]["role"] == "system":
                messages = [messages[0] | {"content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": block}, *messages]
        text = render_chat(template, messages, **kw)
    return text + (tools.prefill if tools.active else "")


# ---- output ---------------------------------------------------------------------------------

@attrs.define
class Parsed:
    content: str | None
    calls: list[dict]
    finish_reason: str


def new_call(name: str, arguments: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call(obj, tools: ToolPlan) -> dict | None:
    """A parsed JSON value as a call to a declared tool, or None."""
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    if tools.choice == "function" and obj["name"] != tools.name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return new_call(obj["name"], args) if isinstance(args, dict) else None


def _tagged(text: str, tools: ToolPlan):
    """(outside text, calls) for ``<tool_call>`` blocks, or None if any block is not a valid call."""
    outside, calls, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        i = start + len(OPEN)
        i += len(text[i:]) - len(text[i:].lstrip())
        try:
            obj, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj, tools)
        if call is None:
            return None
        calls.append(call)
        rest = text[i:].lstrip()
        pos = len(text) - len(rest) + len(CLOSE) if rest.startswith(CLOSE) else i
    outside.append(text[pos:])
    return "".join(outside), calls


def _bare(text: str, tools: ToolPlan) -> list[dict] | None:
    """A reply that is nothing but a call object, or a list of them (Llama 3 style)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    calls = [_call(o, tools) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else None


def parse(text: str, finish_reason: str, tools: ToolPlan) -> Parsed:
    """Split a reply (the pre-fill included) into content and calls. A reply whose calls do not
    parse, or name an undeclared tool, is returned whole as content: never an error."""
    whole = Parsed(text, [], finish_reason)
    if OPEN in text:
        found = _tagged(text, tools)
        if found is None:
            return whole
        content, calls = found
    elif text.lstrip()[:1] in ("{", "["):
        calls, content = _bare(text.strip(), tools), ""
        if calls is None:
            return whole
    else:
        return whole
    if not tools.parallel:
        calls = calls[:1]
    content = content.rstrip() or None
    return Parsed(content, calls, "tool_calls" if finish_reason == "stop" else finish_reason)


class StreamParser:
    """Streams a reply's content as it comes and holds back whatever may turn out to be a call:
    from the first ``<tool_call>`` (or the start of one) on, or all of a reply that begins like a
    bare JSON call. What it emits is always a prefix of ``parse(...).content``, so the streamed
    reply assembles to exactly the non-streamed one."""

    def __init__(self, tools: ToolPlan):
        self.tools = tools
        self.text = tools.prefill
        self.sent = 0

    def _safe(self) -> int:
        text = self.text
        head = text.lstrip()
        if not head or head[0] in "{[":
            return 0
        cut = text.find(OPEN)
        if cut < 0:
            cut = len(text)
            for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
                if text.endswith(OPEN[:k]):
                    cut -= k
                    break
        return len(text[:cut].rstrip())

    def feed(self, delta: str) -> str:
        self.text += delta
        safe = self._safe()
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self, finish_reason: str) -> tuple[str, Parsed]:
        """(content not yet sent, the parsed reply)."""
        parsed = parse(self.text, finish_reason, self.tools)
        content = parsed.content or ""
        return content[self.sent:], parsed


def stream_deltas(calls: list[dict]) -> list[dict]:
    """``delta.tool_calls`` entries: one per call, whole (clients concatenate by ``index``)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]

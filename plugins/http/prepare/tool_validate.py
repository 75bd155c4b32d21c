"""Validation of a chat body's tool fields: ``tools``, ``tool_choice``, ``parallel_tool_calls``
and the tool parts of the history. Every mistake is a 400 naming the field, before a prompt is
rendered; what passes becomes a :class:`~.tool_format.ToolPlan`."""

from __future__ import annotations

import re

from superfluid.core.errors import InvalidRequest

from .tool_format import ToolPlan, forced_rest

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _bad(message: str, param: str, code: str = "invalid_value"):
    return InvalidRequest(message, param=param, code=code)


def plan(body: dict, grammars: bool = False) -> ToolPlan:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``: a 400 naming the field.
    ``grammars``: the engine can constrain sampling, so a forced call carries its schema."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools must be a list of tools", "tools", "invalid_type")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise _bad(f"tools may hold at most {MAX_TOOLS} tools", "tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        tools.append(_tool(tool, f"tools[{i}]", seen))

    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls", "invalid_type")
    choice, name = _choice(body.get("tool_choice"), seen)
    if choice == "required" and len(tools) == 1:
        choice, name = "function", tools[0]["function"]["name"]  # one tool: required names it
    constraint = None
    if grammars and choice in ("function", "required"):
        constraint = forced_rest([t for t in tools if choice == "required" or t["function"]["name"] == name])
    return ToolPlan(tools=tuple(tools), choice=choice, name=name, parallel=parallel is not False,
                    constraint=constraint)


def _tool(tool, where: str, seen: set[str]) -> dict:
    """One entry of ``tools``, checked and reduced to the fields we use; its name joins ``seen``."""
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
    return {"type": "function", "function": clean}


def _check_schema(schema, where: str) -> None:
    """A function's ``parameters``: a JSON Schema for an object. What would make it no schema at
    all is a 400 naming the field; what an engine cannot express as a constraint is not (it falls
    back to any JSON object)."""
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
            _check_call(call, f"{where}.tool_calls[{j}]")
    return messages


def _check_call(call, at: str) -> None:
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

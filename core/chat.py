"""Chat templates: the model's own Jinja template, rendered in a sandbox.

Engines report the template string (GGUF metadata or the tokenizer config); rendering it here keeps
every engine's chat identical to what the model was trained with."""

from __future__ import annotations

import datetime
import functools
from typing import NamedTuple

import jinja2
import jinja2.sandbox

from .errors import InvalidRequest


def _raise(message: str):
    raise InvalidRequest(f"chat template: {message}", param="messages")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(value, indent=None, ensure_ascii=False, **_):
    import json
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def render_chat(template: str | None, messages: list[dict], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True,
                tools: list | None = None, **extra) -> str:
    """The prompt text for ``messages``; a model without a template cannot chat."""
    if not template:
        raise InvalidRequest("this model has no chat template; use /v1/completions with a raw prompt",
                             param="messages", code="chat_template_missing")
    try:
        return _compile(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         **extra)
    except InvalidRequest:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from None


class TemplateCaps(NamedTuple):
    """What a chat template renders of OpenAI's tool fields; the rest is converted to text."""

    tools: bool             # the ``tools`` list (so the model knows its own tool format)
    tool_calls: bool        # assistant messages' ``tool_calls``
    tool_role: bool         # messages of role "tool"
    object_arguments: bool  # tool_calls want ``arguments`` as an object, not a JSON string


_NEEDLE = "superfluid_probe_7f3a"


def _probe(template: str, messages: list[dict], tools: list | None = None) -> str:
    try:
        return _compile(template).render(messages=messages, tools=tools, add_generation_prompt=False,
                                         bos_token="", eos_token="")
    except Exception:  # a template that raises on what it does not know does not support it
        return ""


@functools.lru_cache(maxsize=16)
def template_caps(template: str | None) -> TemplateCaps:
    """Probe by rendering: a field the template supports shows its needle in the output (what
    llama.cpp's minja does too; templates declare nothing, so rendering is the only honest test)."""
    if not template:
        return TemplateCaps(False, False, False, False)
    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": _NEEDLE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    tools = _NEEDLE in _probe(template, [user], [tool])

    def call(arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": _NEEDLE, "arguments": arguments}}]}

    as_string = _probe(template, [user, call('{"%s_arg": 1}' % _NEEDLE)])
    as_object = _probe(template, [user, call({_NEEDLE + "_arg": 1})])
    string_ok = f'"{_NEEDLE}_arg"' in as_string and f'\\"{_NEEDLE}_arg' not in as_string
    object_ok = f'"{_NEEDLE}_arg"' in as_object
    response = {"role": "tool", "tool_call_id": "call_1", "content": _NEEDLE + "_result"}
    tool_role = _NEEDLE + "_result" in _probe(template, [user, call({}), response])
    return TemplateCaps(tools=tools, tool_calls=string_ok or object_ok, tool_role=tool_role,
                        object_arguments=object_ok and not string_ok)

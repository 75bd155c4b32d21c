"""Chat templates: the model's own Jinja template, rendered in a sandbox.

Engines report the template string (GGUF metadata or the tokenizer config); rendering it here keeps
every engine's chat identical to what the model was trained with."""

from __future__ import annotations

import datetime
import functools
import json
import types
from typing import NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from .errors import InvalidRequest


def _raise(message: str):
    raise InvalidRequest(f"chat template: {message}", param="messages")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the assistant's own text, which transformers
    tracks for training masks; rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """The template compiled in the environment transformers' ``apply_chat_template`` uses, so
    that every model renders exactly as its makers render it. Two differences, both where
    transformers refuses to render at all: lists may be changed (Kimi K2's templates call
    ``list.append``, which transformers' immutable sandbox refuses, while llama.cpp's engine
    runs them), and ``tojson`` takes what a ``map`` filter returns (llama.cpp's DeepSeek R1
    template). The sandbox still refuses unsafe attributes and callables."""
    env = jinja2.sandbox.SandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson``: JSON as ``json.dumps`` writes it (non-ASCII kept), with its
    ``indent``, ``separators`` and ``sort_keys``; unlike jinja2's own, nothing HTML-escaped. A
    generator (what jinja2's ``map`` gives) is written as the list it yields."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_listed)


def _listed(value):
    if isinstance(value, (types.GeneratorType, map, filter)) or hasattr(value, "__next__"):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def render_chat(template: str | None, messages: list[dict], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True,
                tools: list | None = None, documents: list | None = None,
                continue_final_message: bool = False, **extra) -> str:
    """The prompt text for ``messages``, as transformers' ``apply_chat_template`` renders it:
    ``tools``, ``documents``, ``add_generation_prompt`` and every extra variable (a request's
    ``chat_template_kwargs``) are the template's; ``continue_final_message`` ends the text where
    the last message's content ends, so that the model goes on writing it. A model without a
    template cannot chat: the error names the options that give it one."""
    if not template:
        raise InvalidRequest("this model has no chat template: start it with --chat-template-file PATH or "
                             "--chat-template NAME (see `superfluid template list`), or use /v1/completions "
                             "with a raw prompt", param="messages", code="chat_template_missing")
    try:
        text = _compile(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=documents, **extra)
    except InvalidRequest:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        raise InvalidRequest(f"chat template failed on these messages: {exc}", param="messages") from None
    if continue_final_message:
        text = _cut_after_final(text, messages)
    return text


def _cut_after_final(text: str, messages: list[dict]) -> str:
    """The rendered text up to the end of the last message's content (transformers' rule)."""
    last = messages[-1].get("content") if messages else None
    if isinstance(last, list):
        last = "".join(p.get("text", "") for p in last if isinstance(p, dict))
    if not last:
        return text
    cut = text.rfind(last.strip())
    if cut < 0:
        raise InvalidRequest("continue_final_message: the template does not render the last message's "
                             "content as sent", param="messages")
    end = cut + len(last.strip())
    if text[end:end + len(last) - len(last.rstrip())] == last[len(last.rstrip()):]:
        end += len(last) - len(last.rstrip())
    return text[:end]


class TemplateCaps(NamedTuple):
    """What a chat template renders of OpenAI's tool fields; the rest is converted to text."""

    tools: bool             # the ``tools`` list (so the model knows its own tool format)
    tool_calls: bool        # assistant messages' ``tool_calls``
    tool_role: bool         # messages of role "tool"
    object_arguments: bool  # tool_calls want ``arguments`` as an object, not a JSON string
    short_ids: bool = False  # call ids must be 9 letters and digits (Mistral's templates refuse others)


_NEEDLE = "superfluid_probe_7f3a"
_LONG_ID, _SHORT_ID = "call_superfluidprobe0001", "sfprobe01"


def _probe(template: str, messages: list[dict], tools: list | None = None) -> str:
    try:
        return _compile(template).render(messages=messages, tools=tools, add_generation_prompt=False,
                                         bos_token="", eos_token="")
    except Exception:  # a template that raises on what it does not know does not support it
        return ""


@functools.lru_cache(maxsize=16)
def template_caps(template: str | None) -> TemplateCaps:
    """Probe by rendering: a field the template supports shows its needle in the output (what
    llama.cpp's minja does too; templates declare nothing, so rendering is the only honest test).
    Calls are probed with arguments as an object and as a JSON string, with a long id and a
    9-character one: a template that writes the argument's name only from an object wants
    objects (XML-parameter and most newer templates), one that writes it only from the string
    wants strings; a template that renders calls only with a short id wants short ids."""
    if not template:
        return TemplateCaps(False, False, False, False)
    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": _NEEDLE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    tools = _NEEDLE in _probe(template, [user], [tool])
    arg = _NEEDLE + "_arg"

    def call(arguments, call_id):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": _NEEDLE, "arguments": arguments}}]}

    def renders(arguments) -> tuple[bool, bool]:
        """(renders the call's argument with a long id, with a short one)."""
        got = []
        for call_id in (_LONG_ID, _SHORT_ID):
            text = _probe(template, [user, call(arguments, call_id)])
            got.append(arg in text and f'\\"{arg}' not in text)
        return got[0], got[1]

    object_long, object_short = renders({arg: 1})
    string_long, string_short = renders('{"%s": 1}' % arg)
    object_ok, string_ok = object_long or object_short, string_long or string_short
    short_ids = not (object_long or string_long) and (object_short or string_short)
    call_id = _SHORT_ID if short_ids else _LONG_ID
    response = {"role": "tool", "tool_call_id": call_id, "content": _NEEDLE + "_result"}
    tool_role = _NEEDLE + "_result" in _probe(
        template, [user, call({arg: 1} if object_ok else '{"%s": 1}' % arg, call_id), response])
    return TemplateCaps(tools=tools, tool_calls=string_ok or object_ok, tool_role=tool_role,
                        object_arguments=object_ok and not string_ok, short_ids=short_ids)

"""Chat templates: the model's own Jinja template, rendered in a sandbox.

Engines report the template string (GGUF metadata or the tokenizer config); rendering it here keeps
every engine's chat identical to what the model was trained with."""

from __future__ import annotations

import datetime
import functools

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

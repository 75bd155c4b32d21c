"""One request's plan for tools, and the Hermes text the history falls back to.

Validation builds a :class:`ToolPlan` (:mod:`.tool_plan`, from a request checked by
:mod:`..openai.chat_protocol`): which tools are offered, whether a call is forced, and in which
family's syntax the model writes calls (:class:`~superfluid.core.formats.family.ToolFormat`).
The prompt is rendered from it (:mod:`.tool_render`) and replies are read with that format
(:mod:`.reply_read`). A forced call ("required" or a named ``tool_choice``) is pre-filled with
the opening of a call in the family's syntax; on an engine that can constrain sampling, the rest
is held to the tools' ``parameters`` schemas (:mod:`superfluid.core.formats.forced`). See
docs/api.md, "Tool calls".

A template that renders no tools gets them described in the Hermes format in its system message
(:mod:`.tool_render`), and calls in its history written as Hermes text (:func:`call_text`): then
the model is read with the Hermes format."""

from __future__ import annotations

import json

import attrs

from superfluid.core.request import JsonConstraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}  # the arguments of a tool that declares no parameters


@attrs.define(frozen=True)
class ToolPlan:
    """What one chat request does with tools. ``active``: tools are offered and replies read for
    calls, in ``fmt``'s syntax. ``prefill``: the start of the reply written for the model (a
    forced call's opening); ``constraint``: the forced call's rest; ``stop``: where a reply that
    may make one call ends, without a constraint."""

    tools: tuple[dict, ...] = ()
    choice: str = "none"  # "none" | "auto" | "required" | "function" (forced to ``name``)
    name: str | None = None
    parallel: bool = True
    fmt: object = None  # the ToolFormat replies are read with (None: no family writes calls)
    prefill: str = ""
    constraint: JsonConstraint | None = None
    stop: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none" and self.fmt is not None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.active and self.choice in ("function", "required")


def arguments(raw) -> object:
    """A call's arguments as an object where they parse (JSON text otherwise, kept as a string)."""
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return raw


def call_text(name: str, args) -> str:
    """One call in the Hermes format: how a call in the history is written for a template that
    renders no calls of its own."""
    body = json.dumps({"name": name, "arguments": arguments(args)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"

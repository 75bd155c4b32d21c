"""The tool-call format every part of the tool path agrees on, and one request's plan for it.

Calls are written in the Hermes format (the one Qwen, Hermes and many fine-tunes use):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. Validation builds a
:class:`ToolPlan` (:mod:`.tool_plan`, from a request checked by :mod:`..openai.chat_protocol`), the prompt is rendered from it (:mod:`.tool_render`),
and replies are parsed against it (:mod:`.tool_parse`). "required" and a named ``tool_choice``
are forced by pre-filling the assistant reply with the opening of a call; on an engine that can
constrain sampling, the rest of the call is also held to the tools' ``parameters`` schemas, which
the plan describes engine-neutrally (:func:`forced_rest`) and the engine turns into its own
grammar. See docs/api.md, "Tool calls"."""

from __future__ import annotations

import json

import attrs

from superfluid.core.request import JsonChoice, JsonConstraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}  # the arguments of a tool that declares no parameters


@attrs.define(frozen=True)
class ToolPlan:
    """What one chat request does with tools. ``active``: tools are offered and replies parsed."""

    tools: tuple[dict, ...] = ()
    choice: str = "none"  # "none" | "auto" | "required" | "function" (forced to ``name``)
    name: str | None = None
    parallel: bool = True
    constraint: JsonConstraint | None = None  # the forced call's rest after the pre-fill

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def prefill(self) -> str:
        """The start of the assistant reply, written for the model: the opening of a call. With a
        constraint it stops before the arguments (or the name), which the constraint then holds."""
        if self.constraint is not None:
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
        """One call only: stop at its closing tag instead of letting the model ramble on. Not
        under a constraint: its grammar ends the call with the tag itself, and a stop string would
        also match the tag written inside an argument's string value, cutting the call short."""
        if self.constraint is not None:
            return ()
        return (CLOSE,) if self.active and (self.choice == "function" or not self.parallel) else ()


def forced_rest(tools: list[dict]) -> JsonConstraint:
    """What follows the constrained pre-fill (:attr:`ToolPlan.prefill`) of a forced call: for one
    tool `` {arguments}`` then ``}\\n</tool_call>``; for several, the name first (one of theirs),
    then that tool's arguments. The arguments follow the tool's ``parameters`` schema."""
    def schema(fn: dict) -> dict:
        return fn.get("parameters") or ANY_OBJECT

    fns = [t["function"] for t in tools]
    if len(fns) == 1:
        choices = (JsonChoice(" ", schema(fns[0])),)
    else:
        choices = tuple(JsonChoice(f' {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ', schema(fn))
                        for fn in fns)
    return JsonConstraint(choices=choices, tail="}\n" + CLOSE)


def arguments(raw) -> object:
    """A call's arguments as an object where they parse (JSON text otherwise, kept as a string)."""
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return raw


def call_text(name: str, args) -> str:
    """One call as the model is asked to write it: the canonical form of the history."""
    body = json.dumps({"name": name, "arguments": arguments(args)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"

"""Cohere Command R: R7B's action blocks and Command R+'s ``Action:`` code block.

Command R7B (12-2024) writes ``<|START_THINKING|>...<|END_THINKING|>`` (its reasoning format
below), then either ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters":
{...}}, ...]<|END_ACTION|>`` or ``<|START_RESPONSE|>answer<|END_RESPONSE|>``. The ``tool_call_id``
it writes is a counter over the conversation ("0", "1"...), which the template recomputes from the
calls' positions, so it is not kept: calls get server ids, unique across turns.

Command R+ (tool_use template) writes ``Action:`` then a fenced JSON list of ``{"tool_name": ...,
"parameters": {...}}`` objects. Its template cannot be round-tripped: it reads each parameter's
``description`` (the check's tools have none) and always ends the conversation with a system turn
asking for the next ``Action:``, so a rendered assistant turn is never the generation prompt's
continuation; the syntax here is what that turn renders."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ReasoningFormat, ToolFormat, partial_marker, safe_content
from superfluid.core.formats.jsonscan import skip_ws

from ._json_list import BROKEN, OPEN, JsonListCalls, read_list

START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
START_RESPONSE, END_RESPONSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
ACTION, FENCE = "Action:", "```"


class CommandR7B(JsonListCalls):
    name = "command-r7b"
    description = '<|START_ACTION|>[{"tool_name": ..., "parameters": {...}}]<|END_ACTION|> (Command R7B)'
    reasoning = "command-r7b"
    open, close = START_ACTION, END_ACTION
    name_keys, argument_keys, id_keys = ("tool_name",), ("parameters",), ()
    object_lead = '\n    {"tool_call_id": "0", "tool_name": '
    name_tail = ', "parameters": '
    list_end = "\n]"

    def detect(self, template: str) -> int:
        return 30 if START_ACTION in template else 0

    def parse(self, text: str, partial: bool):
        action, response = text.find(START_ACTION), text.find(START_RESPONSE)
        if action >= 0 and (response < 0 or action < response):
            return self.read_calls(text, action, partial)
        if response < 0:
            return safe_content(text, partial, START_ACTION, START_RESPONSE), []
        # the answer is what the response block holds; text after its end is not part of it
        inner = text[response + len(START_RESPONSE):]
        end = inner.find(END_RESPONSE)
        if end >= 0:
            inner = inner[:end]
        elif partial:
            inner = inner[:len(inner) - partial_marker(inner, END_RESPONSE)]
        return text[:response].rstrip() + inner, []


class CommandRPlus(ToolFormat):
    name = "command-r-plus"
    description = 'Action: ```json [{"tool_name": ..., "parameters": {...}}]``` (Command R+)'
    call_tail = "\n    }\n]" + FENCE
    call_stop = ""

    def detect(self, template: str) -> int:
        evidence = ACTION in template and FENCE + "json" in template and '"tool_name"' in template
        return 25 if evidence and START_ACTION not in template else 0

    def call_lead(self, name: str) -> str:
        return (f'{ACTION}\n{FENCE}json\n[\n    {{\n        "tool_name": {json.dumps(name, ensure_ascii=False)},'
                f'\n        "parameters": ')

    def _start(self, text: str, partial: bool) -> tuple[int, int | None]:
        """(where the action block starts, where its list starts): the list None when there is
        none; the start is where a partial read must stop while the block may still be one."""
        at = text.find(ACTION)
        while at >= 0:
            pos = skip_ws(text, at + len(ACTION))
            if partial and (FENCE + "json").startswith(text[pos:]):
                return at, None  # the fence is still being written
            fence = FENCE + "json" if text.startswith(FENCE + "json", pos) else FENCE
            if text.startswith(fence, pos):
                return at, pos + len(fence)
            at = text.find(ACTION, at + 1)
        return len(text) - partial_marker(text, ACTION) if partial else len(text), None

    def parse(self, text: str, partial: bool):
        start, body = self._start(text, partial)
        content = text[:start]
        if body is None:
            return (content.rstrip() if partial else content), []
        verdict, calls, _ = read_list(text, body, partial, name_keys=("tool_name",),
                                      argument_keys=("parameters",), id_keys=())
        if verdict == BROKEN or (verdict == OPEN and not partial):
            return content, None
        return safe_content(content, partial), calls


COMMAND_R7B_THINKING = ReasoningFormat("command-r7b", "<|START_THINKING|>", "<|END_THINKING|>",
                                       "<|START_THINKING|>...<|END_THINKING|> (Command R7B)")

FORMATS = (CommandR7B(), CommandRPlus(), COMMAND_R7B_THINKING)

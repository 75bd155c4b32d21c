"""plugins/http/prepare/tool_format.py and tool_plan.py: a forced call's rest described as JSON Schemas
between literal text (the engine-neutral form the llama.cpp plugin turns into its grammar)."""

from __future__ import annotations

import json

from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams
from superfluid.plugins.http.prepare.tool_format import ANY_OBJECT, CLOSE, ToolPlan, call_text, forced_rest
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.prepare import tool_plan
from superfluid.plugins.http.typed import parse

ARGS = {"type": "object", "properties": {"q": {"type": "string"}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": ARGS}}
NOW = {"type": "function", "function": {"name": "now"}}


def plan(fields: dict, grammars: bool = False) -> ToolPlan:
    """The tool plan of a chat request holding ``fields``."""
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})
    return tool_plan.plan(req, grammars=grammars)


def test_one_tool_leads_with_a_space_several_with_their_names():
    one = forced_rest([SEARCH])
    assert one == JsonConstraint((JsonChoice(" ", ARGS),), tail="}\n" + CLOSE)
    several = forced_rest([SEARCH, NOW])
    assert [c.lead for c in several.choices] == [' "search", "arguments": ', ' "now", "arguments": ']
    assert several.choices[1].schema == ANY_OBJECT  # no parameters: any object


def test_the_plan_carries_the_constraint_only_when_asked():
    named = {"tools": [SEARCH, NOW], "tool_choice": {"type": "function", "function": {"name": "search"}}}
    assert plan(named).constraint is None
    forced = plan(named, grammars=True)
    assert forced.constraint == forced_rest([SEARCH])
    assert forced.prefill + ' {"q": "x"}}' == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}'
    assert plan({"tools": [SEARCH, NOW], "tool_choice": "auto"}, grammars=True).constraint is None
    assert plan({"tools": [SEARCH, NOW], "tool_choice": "required"}, grammars=True).prefill == '<tool_call>\n{"name":'
    assert ToolPlan().prefill == "" and ToolPlan().stop == ()


def test_constraints_hash_and_compare_by_schema():
    a, b = forced_rest([SEARCH]), forced_rest([SEARCH])
    other = forced_rest([{"type": "function", "function": {"name": "search", "parameters": ANY_OBJECT}}])
    assert a == b and hash(a) == hash(b) and a != other
    params = SamplingParams(json_schema=a)
    assert params.constrained and not SamplingParams().constrained
    hash(params)


def test_call_text_is_the_canonical_history_form():
    assert call_text("search", '{"q": "x"}') == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert json.loads(call_text("now", None).split("\n")[1]) == {"name": "now", "arguments": {}}

"""plugins/http/prepare/tool_format.py and tool_plan.py with core/formats/forced.py: a forced call
in the family's syntax, its pre-fill and its rest described as JSON Schemas between literal text
(the engine-neutral form every engine turns into its grammar)."""

from __future__ import annotations

import json

from superfluid.core import constrain
from superfluid.core.formats.forced import forced_call
from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.prepare import tool_plan
from superfluid.plugins.http.prepare.tool_format import CLOSE, ToolPlan, call_text
from superfluid.plugins.http.typed import parse

from .fakes import format_registry

ARGS = {"type": "object", "properties": {"q": {"type": "string"}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": ARGS}}
SEEK = {"type": "function", "function": {"name": "seek"}}
HERMES = format_registry().tool_format("hermes")


def plan(fields: dict, grammars: bool = False, opened: str = "") -> ToolPlan:
    """The tool plan of a chat request holding ``fields``, read as Hermes."""
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})
    return tool_plan.plan(req, HERMES, grammars=grammars, opened=opened)


def test_one_tool_is_prefilled_to_its_arguments_several_stop_before_their_names():
    one = forced_call(HERMES, [SEARCH["function"]], grammars=True)
    assert one.prefill == '<tool_call>\n{"name": "search", "arguments":'  # the space is the grammar's
    assert one.constraint == JsonConstraint((JsonChoice(" ", ARGS),), tail="}\n" + CLOSE)
    several = forced_call(HERMES, [SEARCH["function"], SEEK["function"]], grammars=True)
    # "search" and "seek" share "se": the pre-fill must not begin either name
    assert several.prefill == '<tool_call>\n{"name":'
    assert [c.lead for c in several.constraint.choices] == [' "search", "arguments": ', ' "seek", "arguments": ']
    assert several.constraint.choices[1].schema == {"type": "object"}  # no parameters: any object
    for forced in (one, several):
        constrain.check(SamplingParams(json_schema=forced.constraint))


def test_the_plan_carries_the_constraint_only_when_asked():
    named = {"tools": [SEARCH, SEEK], "tool_choice": {"type": "function", "function": {"name": "search"}}}
    assert plan(named).constraint is None and plan(named).stop == (CLOSE,)
    forced = plan(named, grammars=True)
    assert forced.constraint == forced_call(HERMES, [SEARCH["function"]], True).constraint
    assert forced.prefill + ' {"q": "x"}}' == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}'
    assert plan({"tools": [SEARCH, SEEK], "tool_choice": "auto"}, grammars=True).constraint is None
    assert plan({"tools": [SEARCH, SEEK], "tool_choice": "required"}, grammars=True).prefill == '<tool_call>\n{"name":'
    assert ToolPlan().prefill == "" and ToolPlan().stop == () and not ToolPlan().active


def test_a_forced_call_after_an_opened_reasoning_span_closes_it_first():
    forced = plan({"tools": [SEARCH], "tool_choice": "required"}, grammars=True, opened="</think>")
    assert forced.prefill.startswith("</think>\n\n<tool_call>")


def test_constraints_hash_and_compare_by_schema():
    a = forced_call(HERMES, [SEARCH["function"]], True).constraint
    b = forced_call(HERMES, [SEARCH["function"]], True).constraint
    other = forced_call(HERMES, [{"name": "search"}], True).constraint
    assert a == b and hash(a) == hash(b) and a != other
    params = SamplingParams(json_schema=a)
    assert params.constrained and not SamplingParams().constrained
    hash(params)


def test_call_text_is_the_canonical_history_form():
    assert call_text("search", '{"q": "x"}') == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert json.loads(call_text("now", None).split("\n")[1]) == {"name": "now", "arguments": {}}

"""plugins/llamacpp/grammar.py: a request's JSON constraint as GBNF text (llama-cpp-python's
converter, no model needed; test_tool_calls.py runs the grammars through llama.cpp's sampler)."""

from __future__ import annotations

import logging

import pytest

from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams

pytest.importorskip("llama_cpp.llama_grammar")

from superfluid.plugins.llamacpp import grammar  # noqa: E402

ARGS = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}


def rules(text: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in text.splitlines() if " ::= " in line)


def test_one_choice_is_lead_value_tail():
    got = rules(grammar.gbnf(JsonConstraint((JsonChoice(" ", ARGS),), tail="}\n</tool_call>")))
    assert got["root"] == '" " choice0 "}\\n</tool_call>"'
    assert got["choice0-n-kv"] == '"\\"n\\"" space ":" space integer'
    assert got["char"].startswith('[^"\\\\\\x7F\\x00-\\x1F]')  # no raw control characters


def test_several_choices_alternate_and_empty_literals_are_left_out():
    got = rules(grammar.gbnf(JsonConstraint((JsonChoice("a", ARGS), JsonChoice("", {"type": "string"})))))
    assert got["root"] == '( "a" choice0 | string )'  # a bare string: the converter's primitive rule


def test_a_schema_beyond_the_converter_is_any_object(caplog):
    odd = {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}
    with caplog.at_level(logging.INFO, "superfluid.llamacpp"):
        got = rules(grammar.gbnf(JsonConstraint((JsonChoice("", odd),))))
    assert got["choice0"] == "object" and "not expressible" in caplog.text


def test_the_sampler_takes_the_requests_own_grammar_first_and_survives_a_converter_failure(monkeypatch):
    constraint = JsonConstraint((JsonChoice("", ARGS),))
    assert grammar.grammar_text(SamplingParams()) is None
    assert grammar.grammar_text(SamplingParams(grammar='root ::= "x"', json_schema=constraint)) == 'root ::= "x"'
    assert grammar.grammar_text(SamplingParams(json_schema=constraint)) is grammar.gbnf(constraint)  # cached

    def boom(_):
        raise RuntimeError("converter bug")

    monkeypatch.setattr(grammar, "gbnf", boom)
    assert grammar.grammar_text(SamplingParams(json_schema=constraint)) is None

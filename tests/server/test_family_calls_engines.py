"""Forced calls in a family's own syntax on every engine that constrains sampling: basert with
the default model, MLX with the tiny model its tests build, each served under real templates
(../shared/templates) whose call syntax is not Hermes: Qwen3-Coder's XML parameters (a grammar
piece per parameter, string values as plain text) and Mistral's ``[TOOL_CALLS]name[ARGS]``. The
llama.cpp engine is covered by test_family_forced_calls.py. The string parameters have a
``maxLength``: the MLX model is random, and a plain-text value ends where the model's text does
(or at the schema's bound)."""

from __future__ import annotations

import json
import pathlib

import pytest

from .test_basert_server import BASERT
from .test_mlx import tiny, tiny_path  # noqa: F401  the MLX tests' tiny model

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
FAMILIES = {"Qwen3-Coder": "qwen3-coder", "Mistral-Small-3.2-24B-Instruct-2506": "mistral", "GLM-4.6": "glm-4.5"}
BASERT_FAMILIES = ["Qwen3-Coder", "Mistral-Small-3.2-24B-Instruct-2506"]
# Mistral Small's default system prompt alone fills the tiny model's context (its vocabulary is
# letters): MLX is served under GLM's template instead, another tagged-parameter syntax
MLX_FAMILIES = ["Qwen3-Coder", "GLM-4.6"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def client(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)


def check_calls(srv, model: str, family: str, max_tokens: int = 48) -> None:
    models = srv.get_json("/v1/models")["data"]
    assert models[0]["meta"]["tool_call_parser"] == family
    c = client(srv)
    named = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=max_tokens,
                                      temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls, (named.choices[0].finish_reason, named.choices[0].message.content)
    (call,) = named.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    assert isinstance(args["city"], str) and isinstance(args["days"], int), args
    required = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                         max_tokens=max_tokens, temperature=0, tool_choice="required")
    (call,) = required.choices[0].message.tool_calls
    wanted = {"get_weather": {"city", "days"}, "get_time": {"timezone"}}[call.function.name]
    assert set(json.loads(call.function.arguments)) == wanted
    assert not (required.choices[0].message.content or "").strip()


@pytest.mark.parametrize("stem", BASERT_FAMILIES)
def test_basert_forced_calls_in_the_family_syntax(start_server, stem):
    srv = start_server(*BASERT, "--max-batch", "2", "--chat-template-file", str(TEMPLATES / f"{stem}.jinja"))
    check_calls(srv, "smollm2", FAMILIES[stem])


@pytest.mark.parametrize("stem", MLX_FAMILIES)
def test_mlx_forced_calls_in_the_family_syntax(start_server, tiny_path, stem):  # noqa: F811
    srv = start_server("--model", tiny_path, "--model-name", "tiny", "--engine", "mlx", "--max-batch", "2",
                       "--chat-template-file", str(TEMPLATES / f"{stem}.jinja"))
    check_calls(srv, "tiny", FAMILIES[stem], max_tokens=200)  # the tiny model's tokens are letters

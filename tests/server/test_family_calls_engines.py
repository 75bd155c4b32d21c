"""Forced calls in a family's own syntax on every engine that constrains sampling: basert with
the default model, MLX with the tiny model its tests build, each served under real templates
(../shared/templates) whose call syntax is not Hermes: Qwen3-Coder's XML parameters (a grammar
piece per parameter, string values as plain text) and Mistral's ``[TOOL_CALLS]name[ARGS]``. The
llama.cpp engine is covered by test_family_forced_calls.py. The string parameters have a
``maxLength``: the MLX model is random, and a plain-text value ends where the model's text does
(or at the schema's bound). One server per engine serves the model once per template, each
under the template's name."""

from __future__ import annotations

import json
import pathlib

import pytest

from .conftest import TEST_CONTEXT
from .serverproc import ServerProcess
from .test_basert_server import BASERT
from .test_mlx import tiny, tiny_path  # noqa: F401  the MLX tests' tiny model

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

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
    (entry,) = [m for m in srv.get_json("/v1/models")["data"] if m["id"] == model]
    assert entry["meta"]["tool_call_parser"] == family
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


def serve_each_template(tmp: pathlib.Path, engine: str, path: str, stems: list[str], **top) -> ServerProcess:
    """One server (one start, and for basert one torch import) serving ``path`` once per template,
    each a model named after its template's stem ([[models]] tables), so each model's calls are
    in its own family's syntax."""
    head = "".join(f"{k.replace('_', '-')} = {v}\n" for k, v in top.items())
    tables = "".join(f'\n[[models]]\nname = "{stem}"\npath = "{path}"\n'
                     f'chat-template-file = "{TEMPLATES / f"{stem}.jinja"}"\n' for stem in stems)
    cfg = tmp / "superfluid.toml"
    cfg.write_text(f'engine = "{engine}"\nmax-batch = 2\n{head}{tables}')
    return ServerProcess(["--config", str(cfg)], tmp / "server.log", startup_timeout=300)  # loads them in turn


@pytest.fixture(scope="module")
def basert_srv(tmp_path_factory, model_path):
    flags = dict(zip(BASERT[::2], BASERT[1::2]))  # the basert tests' flags, in TOML
    srv = serve_each_template(tmp_path_factory.mktemp("basert"), flags["--engine"], model_path, BASERT_FAMILIES,
                              threads=flags["--threads"], max_context=TEST_CONTEXT)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mlx_srv(tmp_path_factory, tiny_path):  # noqa: F811
    srv = serve_each_template(tmp_path_factory.mktemp("mlx"), "mlx", tiny_path, MLX_FAMILIES, max_context=TEST_CONTEXT)
    yield srv
    srv.stop()


@pytest.mark.parametrize("stem", BASERT_FAMILIES)
def test_basert_forced_calls_in_the_family_syntax(basert_srv, stem):
    check_calls(basert_srv, stem, FAMILIES[stem])


@pytest.mark.parametrize("stem", MLX_FAMILIES)
def test_mlx_forced_calls_in_the_family_syntax(mlx_srv, stem):
    check_calls(mlx_srv, stem, FAMILIES[stem], max_tokens=200)  # the tiny model's tokens are letters

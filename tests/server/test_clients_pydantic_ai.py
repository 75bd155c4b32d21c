"""pydantic-ai agents (OpenAIChatModel over the openai SDK) against a real server on SmolLM2.

instructor would be the other choice, but instructor 1.17 pins jiter<0.15 while openai 3.x needs
jiter>=0.16, so the two cannot share an environment; pydantic-ai exercises the same paths
(structured output as a forced output tool and as response_format json_schema, tool calls
and their results in an agent loop, streamed partial output) and installs without torch.

SmolLM2-135M writes poor text: the checks are on protocol and structure (validated output
objects, the messages of the run, usage), never on content quality."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

pytest.importorskip("pydantic_ai")
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from pydantic_ai import Agent, NativeOutput  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.embeddings import Embedder  # noqa: E402
from pydantic_ai.embeddings.openai import OpenAIEmbeddingModel  # noqa: E402
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

MODEL = "smollm2"
ASK_CITY = "Name a city in France and say whether it is the capital."
HI = "Say hello in three words."
STRUCTURED = {"max_tokens": 48, "temperature": 0}


class City(BaseModel):
    """A city and whether it is its country's capital."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    is_capital: bool


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-batch", "4", shared=True)  # chats only: the same server as the other clients


def provider(srv) -> OpenAIProvider:
    """A fresh provider (and AsyncOpenAI client) per test: a client is bound to the event loop it
    first ran in."""
    return OpenAIProvider(base_url=srv.base + "/v1", api_key="unused")


def model(srv) -> OpenAIChatModel:
    return OpenAIChatModel(MODEL, provider=provider(srv))


def responses(result) -> list[ModelResponse]:
    return [m for m in result.all_messages() if isinstance(m, ModelResponse)]


def test_run_text(srv):
    result = Agent(model(srv), model_settings={"max_tokens": 16, "temperature": 0}).run_sync(HI)
    assert isinstance(result.output, str) and result.output
    assert result.usage.requests == 1 and 0 < result.usage.output_tokens <= 16
    [resp] = responses(result)
    assert resp.model_name == MODEL and resp.finish_reason in ("stop", "length")
    assert [type(p) for p in resp.parts] == [TextPart]


def test_output_tool_default(srv):
    """The default structured output: a forced `final_result` tool whose arguments are the model."""
    result = Agent(model(srv), output_type=City, model_settings=STRUCTURED, retries=0).run_sync(ASK_CITY)
    assert isinstance(result.output, City)
    [resp] = responses(result)
    assert resp.finish_reason == "tool_call"
    [call] = [p for p in resp.parts if isinstance(p, ToolCallPart)]
    assert call.tool_name == "final_result" and call.tool_call_id.startswith("call_")
    assert City.model_validate_json(call.args) == result.output


def test_output_native_json_schema(srv):
    """NativeOutput: response_format json_schema, the reply's text is the object."""
    result = Agent(model(srv), output_type=NativeOutput(City), model_settings=STRUCTURED,
                   retries=0).run_sync(ASK_CITY)
    assert isinstance(result.output, City)
    [resp] = responses(result)
    assert resp.finish_reason == "stop"
    [text] = [p for p in resp.parts if isinstance(p, TextPart)]
    assert json.loads(text.content) == result.output.model_dump()


@dataclass
class ForceToolThenOutput(AbstractCapability):
    """Step 1 must call get_weather; step 2 must give the final result (a tiny model left to
    choose may call the tool forever)."""

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step == 1 else ["final_result"]}


def test_agent_loop_tool_then_output(srv):
    agent = Agent(model(srv), output_type=City, model_settings=STRUCTURED, retries=0,
                  capabilities=[ForceToolThenOutput()])
    cities: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return "sunny, 21 C"

    result = agent.run_sync("What is the weather in Paris? Then name the city.")
    assert isinstance(result.output, City)
    assert len(cities) == 1 and isinstance(cities[0], str)
    parts = [(type(p).__name__, p.tool_name) for m in result.all_messages() for p in m.parts
             if isinstance(p, (ToolCallPart, ToolReturnPart))]
    assert parts == [("ToolCallPart", "get_weather"), ("ToolReturnPart", "get_weather"),
                     ("ToolCallPart", "final_result"), ("ToolReturnPart", "final_result")]
    assert result.usage.requests == 2 and result.usage.tool_calls == 1
    # the second request carried the first turn (call + result) as history
    assert result.usage.input_tokens > 2 * responses(result)[0].usage.input_tokens


def test_stream_text_matches_run(srv):
    settings = {"max_tokens": 16, "temperature": 0}

    async def main():
        agent = Agent(model(srv), model_settings=settings)
        async with agent.run_stream(HI) as res:
            deltas = [t async for t in res.stream_text(delta=True, debounce_by=None)]
            usage = res.usage
        whole = await agent.run(HI)
        return deltas, usage, whole

    deltas, usage, whole = asyncio.run(main())
    assert len(deltas) >= 2 and "".join(deltas) == whole.output
    assert usage.output_tokens == whole.usage.output_tokens and usage.requests == 1


@pytest.mark.parametrize("kind", ["tool", "native"])
def test_stream_structured_output(srv, kind):
    output_type = City if kind == "tool" else NativeOutput(City)

    async def main():
        agent = Agent(model(srv), output_type=output_type, model_settings=STRUCTURED, retries=0)
        async with agent.run_stream(ASK_CITY) as res:
            partials = [o async for o in res.stream_output(debounce_by=None)]
            return partials, await res.get_output()

    partials, final = asyncio.run(main())
    assert partials and all(isinstance(p, City) for p in partials)
    assert isinstance(final, City) and partials[-1] == final


def test_embeddings(srv):
    embedder = Embedder(OpenAIEmbeddingModel(MODEL, provider=provider(srv)))
    docs = embedder.embed_documents_sync(["Paris is in France.", "The cat sat on the mat."])
    assert len(docs.embeddings) == 2 and all(len(e) == 576 for e in docs.embeddings)
    assert docs.embeddings[0] != docs.embeddings[1] and docs.usage.input_tokens > 0
    query = Embedder(OpenAIEmbeddingModel(MODEL, provider=provider(srv))).embed_query_sync("Paris is in France.")
    assert query.embeddings[0] == pytest.approx(docs.embeddings[0], rel=1e-5, abs=1e-6)

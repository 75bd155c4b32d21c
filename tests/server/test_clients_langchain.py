"""langchain-openai's ChatOpenAI and OpenAIEmbeddings against a real server on SmolLM2.

SmolLM2-135M writes poor text, so the checks are on protocol and structure: chunks that
concatenate to the reply, usage metadata, tool calls (forced) whose args validate against the
tool's schema, structured output parsed into the pydantic model, embedding shapes."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAIEmbeddings  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

MODEL = "smollm2"


class City(BaseModel):
    """A city and whether it is its country's capital."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    is_capital: bool


class GetWeather(BaseModel):
    """Get the current weather in a city."""
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)


@tool
def get_time(timezone: str) -> str:
    """Get the current time in a timezone."""
    return "12:00"


ASK_WEATHER = [HumanMessage("What is the weather in Paris?")]
ASK_CITY = [SystemMessage("Answer in JSON."),
            HumanMessage("Name a city in France and say whether it is the capital.")]
HI = [HumanMessage("Say hello in three words.")]


def check_time_args(args):
    """Valid against the schema langchain sends for get_time (which allows extra keys)."""
    assert "additionalProperties" not in convert_to_openai_tool(get_time)["function"]["parameters"]
    get_time.args_schema.model_validate(args)  # the model langchain made that schema from
    assert isinstance(args["timezone"], str)


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-batch", "4", shared=True)  # chats only: the same server as the other clients


def chat(srv, **kw) -> ChatOpenAI:
    kw = {"temperature": 0, "max_tokens": 16, **kw}
    return ChatOpenAI(base_url=srv.base + "/v1", api_key="unused", model=MODEL, timeout=120, max_retries=0, **kw)


def test_invoke(srv):
    msg = chat(srv).invoke(HI)
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str) and msg.content
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.response_metadata["model_name"] == MODEL
    u = msg.usage_metadata
    assert u["input_tokens"] > 0 and 0 < u["output_tokens"] <= 16
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert msg.tool_calls == []


def test_stream_concatenates_with_usage(srv):
    model = chat(srv, stream_usage=True)
    whole = model.invoke(HI)
    chunks = list(model.stream(HI))
    assert len(chunks) >= 3 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == whole.content
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == whole.content
    assert total.usage_metadata is not None
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert total.usage_metadata[key] == whole.usage_metadata[key]
    assert total.response_metadata.get("finish_reason") == whole.response_metadata["finish_reason"]


def test_async_batch_and_astream(srv):
    import asyncio

    async def main():
        model = chat(srv, max_tokens=8)
        batch = await model.abatch([HI, [HumanMessage("Name a colour.")]])
        alone = await model.ainvoke(HI)
        chunks = [c async for c in model.astream(HI)]
        return batch, alone, chunks

    batch, alone, chunks = asyncio.run(main())
    assert len(batch) == 2 and all(isinstance(m, AIMessage) and isinstance(m.content, str) for m in batch)
    assert all(m.usage_metadata["output_tokens"] <= 8 for m in batch)
    assert "".join(c.content for c in chunks) == alone.content


def test_bind_tools_named_pydantic(srv):
    msg = chat(srv, max_tokens=48).bind_tools([GetWeather, get_time], tool_choice="GetWeather").invoke(ASK_WEATHER)
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert len(msg.tool_calls) == 1 and msg.invalid_tool_calls == []
    call = msg.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"].startswith("call_") and call["type"] == "tool_call"
    GetWeather.model_validate(call["args"])


def test_bind_tools_named_tool_function(srv):
    msg = chat(srv, max_tokens=48).bind_tools([GetWeather, get_time], tool_choice="get_time").invoke(
        [HumanMessage("What time is it in London?")])
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_time"
    check_time_args(msg.tool_calls[0]["args"])
    assert get_time.invoke(msg.tool_calls[0]).tool_call_id == msg.tool_calls[0]["id"]


def test_bind_tools_any(srv):
    """tool_choice="any" is OpenAI's "required": a call to one of the tools."""
    msg = chat(srv, max_tokens=48).bind_tools([GetWeather, get_time], tool_choice="any").invoke(ASK_WEATHER)
    assert len(msg.tool_calls) == 1 and msg.invalid_tool_calls == []
    call = msg.tool_calls[0]
    assert call["name"] in ("GetWeather", "get_time")
    if call["name"] == "GetWeather":
        GetWeather.model_validate(call["args"])
    else:
        check_time_args(call["args"])


def test_stream_tool_call_chunks(srv):
    model = chat(srv, max_tokens=48).bind_tools([GetWeather], tool_choice="GetWeather")
    total = None
    for c in model.stream(ASK_WEATHER):
        total = c if total is None else total + c
    assert len(total.tool_calls) == 1 and total.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(total.tool_calls[0]["args"])


def test_agent_loop_tool_result(srv):
    """The agent loop: a forced call, its ToolMessage result, then a plain answer."""
    llm = chat(srv, max_tokens=48)
    first = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(ASK_WEATHER)
    assert len(first.tool_calls) == 1
    history = [*ASK_WEATHER, first, ToolMessage('{"temp_c": 21}', tool_call_id=first.tool_calls[0]["id"])]
    second = chat(srv, max_tokens=8).bind_tools([GetWeather], tool_choice="none").invoke(history)
    assert isinstance(second, AIMessage) and second.tool_calls == [] and isinstance(second.content, str)
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] // 3


@pytest.mark.parametrize("method", ["json_schema", "default", "function_calling"])
def test_with_structured_output(srv, method):
    kw = {} if method == "default" else {"method": method}
    model = chat(srv, max_tokens=48).with_structured_output(City, include_raw=True, **kw)
    out = model.invoke(ASK_CITY)
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], City)


def test_with_structured_output_json_mode(srv):
    """json_mode sends response_format json_object and no schema: any JSON object parses."""
    out = chat(srv, max_tokens=48).with_structured_output(None, method="json_mode", include_raw=True).invoke(ASK_CITY)
    assert out["raw"].response_metadata["finish_reason"] == "stop", out["raw"]
    assert out["parsing_error"] is None and isinstance(out["parsed"], dict)


def test_with_structured_output_json_schema_dict(srv):
    schema = {"title": "verdict", "description": "A yes/no answer.", "type": "object",
              "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    got = chat(srv, max_tokens=24).with_structured_output(schema, method="json_schema").invoke(
        [HumanMessage("Is Paris in France?")])
    assert got == {"answer": "yes"} or got == {"answer": "no"}


def test_embeddings(srv):
    emb = OpenAIEmbeddings(base_url=srv.base + "/v1", api_key="unused", model=MODEL,
                           check_embedding_ctx_length=False, max_retries=0)
    q = emb.embed_query("Where is Paris?")
    docs = emb.embed_documents(["Paris is in France.", "The cat sat on the mat."])
    assert len(q) == 576 and all(isinstance(x, float) for x in q)
    assert len(docs) == 2 and all(len(d) == 576 for d in docs) and docs[0] != docs[1]
    assert emb.embed_query("Paris is in France.") == pytest.approx(docs[0], rel=1e-5, abs=1e-6)

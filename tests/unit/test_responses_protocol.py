"""plugins/http/responses without a server: the typed request (what is honored, left out or
refused, and the field a 400 names), its mapping onto a chat request, and the wire's
translation of OpenAI chat objects into a response object and its stream of events, checked
against the ``openai`` SDK's own models and its stream accumulator."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from superfluid.core.errors import InvalidRequest, SuperfluidError
from superfluid.core.formats.template_messages import template_messages
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.openai.replies import Shape
from superfluid.plugins.http.responses.mapping import chat_request
from superfluid.plugins.http.responses.objects import ResponseShape
from superfluid.plugins.http.responses.protocol import ResponsesInputTokensRequest, ResponsesRequest
from superfluid.plugins.http.responses.wire import ResponsesWire
from superfluid.plugins.http.typed import parse

openai_types = pytest.importorskip("openai.types.responses")

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# what Codex sends, trimmed: developer and user messages as parts, tools of three types, and
# fields the server ignores
CODEX = {
    "model": "smollm2", "stream": True, "store": False, "parallel_tool_calls": False, "tool_choice": "auto",
    "instructions": None, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-abc",
    "client_metadata": {"x-codex-turn": "1"}, "reasoning": {"effort": "medium", "summary": "auto"},
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]}],
    "tools": [{"type": "function", "name": "shell", "description": "run a command", "strict": False,
               "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                           "items": {"type": "string"}}}}},
              {"type": "namespace", "name": "mcp__docs", "description": "docs",
               "tools": [{"type": "function", "name": "search"}]},
              {"type": "web_search", "external_web_access": False}],
}


def refused(body: dict, cls=ResponsesRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(cls, body)
    return info.value


# ---- the request -------------------------------------------------------------------------------

def test_what_codex_sends_is_accepted_and_its_other_tools_are_left_out():
    req = parse(ResponsesRequest, CODEX)
    chat = chat_request(req)
    assert isinstance(chat, ChatCompletionRequest)
    assert template_messages(chat.conversation) == [{"role": "system", "content": "Be terse."},
                                                     {"role": "user", "content": "List files."}]
    assert [t.function.name for t in chat.tools] == ["shell"]  # namespace and web_search left out
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False and chat.stream is True


@pytest.mark.parametrize("body, param, code", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type", "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].image_url", "missing_required_parameter"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "bogus"}]}, "input[0].type", "invalid_value"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "missing_required_parameter"),
    ({"input": 7}, "input", "invalid_type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "invalid_value"),
    ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name", "invalid_value"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools[0].parameters", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "unsupported_value"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}}, "text.format.name",
     "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "X"}}}, "text.format.schema", "missing_required_parameter"),
    ({"text": {"format": {"type": "text"}, "colour": "red"}}, "text.colour", "unknown_parameter"),
    ({"background": True}, "background", "unsupported_value"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_value"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_value"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"seed": 1}, "seed", "unknown_parameter"),
    ({"previous_response_id": ""}, "previous_response_id", "invalid_value"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param, code):
    exc = refused({"input": "hi", **body} if "input" not in body else body)
    assert (exc.param.split(".")[0] if param == "metadata" else exc.param, exc.code) == (param, code), exc.message
    assert exc.message.startswith(param.split(".")[0]) or exc.message.startswith("Unrecognized"), exc.message


def test_input_tokens_takes_the_prompt_fields_only():
    parse(ResponsesInputTokensRequest, {"input": "hi", "instructions": "x", "tools": [WEATHER], "personality": "p"})
    assert refused({"input": "hi", "max_output_tokens": 5}, ResponsesInputTokensRequest).code == "unknown_parameter"


# ---- the mapping -------------------------------------------------------------------------------

def test_items_map_onto_messages_and_calls_join_the_reply_before_them():
    req = parse(ResponsesRequest, {"instructions": "Use tools.", "tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": "{}"},
    ]})
    messages = template_messages(chat_request(req).conversation)
    call = lambda cid, args: {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    assert messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [call("call_a", '{"city": "Paris"}'), call("call_b", '{"city": "Rome"}')]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_b"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_c", "{}")]},
    ]


def test_fields_map_onto_chat_fields():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    req = parse(ResponsesRequest, {"input": "hi", "max_output_tokens": 9, "temperature": 0, "top_p": 0.5,
                                   "text": {"format": {"type": "json_schema", "name": "N", "schema": schema,
                                                       "strict": True}, "verbosity": "low"},
                                   "tools": [WEATHER, {"type": "file_search"}],
                                   "tool_choice": {"type": "function", "name": "get_weather"},
                                   "superfluid": {"qos": "background"}})
    chat = chat_request(req)
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (9, 0, 0.5)
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert chat.tool_choice.function.name == "get_weather" and len(chat.tools) == 1
    assert chat.superfluid.qos == "background"
    assert chat_request(parse(ResponsesRequest, {"input": "x", "text": {"format": {"type": "json_object"}}})
                        ).response_format.type == "json_object"


def test_allowed_tools_offer_only_those_listed_with_its_mode_as_the_choice():
    other = {**WEATHER, "name": "get_time"}
    req = parse(ResponsesRequest, {"input": "hi", "tools": [WEATHER, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"},
                                                               {"type": "web_search"}]}})
    chat = chat_request(req)
    assert [t.function.name for t in chat.tools] == ["get_time"] and chat.tool_choice == "required"


def test_a_request_with_nothing_to_answer_is_a_400_on_input():
    with pytest.raises(InvalidRequest) as info:
        chat_request(parse(ResponsesRequest, {"input": [{"type": "reasoning"}]}))
    assert (info.value.param, info.value.code) == ("input", "missing_required_parameter")
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    chat = chat_request(parse(ResponsesRequest, {"input": "next", "instructions": "sys"}), history)
    assert [m.text for m in chat.conversation.messages] == ["sys", "earlier", "reply", "next"]


# ---- the wire ----------------------------------------------------------------------------------

RESPONSE = TypeAdapter(openai_types.Response)
EVENT = TypeAdapter(openai_types.ResponseStreamEvent)
CHAT_USAGE = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
              "prompt_tokens_details": {"cached_tokens": 12}}
CALLS = [{"id": "call_x1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]


class _Prep:  # what the wire reads of a prepared request
    class runtime:
        name = "smollm2"


def wire_for(body: dict, kept: list | None = None) -> ResponsesWire:
    wire = ResponsesWire(ResponseShape(parse(ResponsesRequest, body)), on_response=kept.append if kept is not None else None)
    wire.prepared(_Prep())
    return wire


def events(raw: list[bytes]) -> list[dict]:
    out = []
    for block in raw:
        head, data = block.decode().rstrip("\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append(json.loads(data[6:]))
        assert out[-1]["type"] == head[7:]
    return out


def stream(wire: ResponsesWire, chunks: list[dict], usage=CHAT_USAGE) -> list[dict]:
    raw = wire.opening()
    for chunk in chunks:
        raw += wire.chunk(chunk)
    raw += wire.closing({"usage": usage, "choices": []})
    return events(raw)


def chat_chunks(texts: list[str], calls: list | None = None, finish: str = "stop") -> list[dict]:
    shape = Shape("chat", "smollm2")
    out = [shape.chunk(role=True)] + [shape.chunk(text=t) for t in texts]
    for piece in call_pieces(calls):  # each call as it streams: name and half its arguments, then the rest
        out.append(shape.chunk(tool_calls=[piece]))
    return out + [shape.chunk(finish=finish)]


def call_pieces(calls) -> list[dict]:
    """Chat's ``delta.tool_calls`` entries for ``calls`` as a stream sends them: a call's first
    piece with its id, name and the first half of its arguments, then the rest of them."""
    out = []
    for i, call in enumerate(calls or ()):
        args = call["function"]["arguments"]
        half = len(args) // 2
        out.append({"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": args[:half]}})
        out.append({"index": i, "function": {"arguments": args[half:]}})
    return out


def accumulated(evs: list[dict], tools=()) -> object:
    """The openai SDK's own stream accumulator (what client.responses.stream runs) over the events."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    state = ResponseStreamState(input_tools=list(tools), text_format=omit)
    for ev in evs:
        state.handle_event(EVENT.validate_python(ev))
    return state


def test_a_text_stream_is_the_events_in_order_numbered_from_zero():
    kept = []
    wire = wire_for({"input": "hi", "metadata": {"run": "7"}}, kept)
    evs = stream(wire, chat_chunks(["Hel", "lo", ""]))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["delta"] for e in evs if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["metadata"] == {"run": "7"} and final["model"] == "smollm2"
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["status"] == "completed"
    assert final["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 12, "cache_write_tokens": 0},
                              "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 25}
    assert kept == [final] and final["id"].startswith("resp_") and final["output"][0]["id"].startswith("msg_")
    RESPONSE.validate_python(final)
    state = accumulated(evs)
    assert state._completed_response.output_text == "Hello"


def test_function_calls_stream_as_items_after_the_text():
    evs = stream(wire_for({"input": "hi", "tools": [WEATHER]}), chat_chunks(["Let me check."], CALLS, "tool_calls"))
    assert [e["type"] for e in evs][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added = evs[8]
    assert added["output_index"] == 1 and added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    final = evs[-1]["response"]
    call = final["output"][1]
    assert (call["type"], call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "function_call", "call_x1", "get_weather", '{"city": "Oslo"}', "completed")
    assert call["id"].startswith("fc_") and evs[9]["delta"] + evs[10]["delta"] == call["arguments"]
    RESPONSE.validate_python(final)
    state = accumulated(evs, tools=[{**WEATHER, "strict": True}])
    assert state._completed_response.output[1].parsed_arguments == {"city": "Oslo"}


def test_a_reply_cut_by_the_limit_ends_incomplete_and_an_empty_one_is_one_empty_message():
    evs = stream(wire_for({"input": "hi"}), chat_chunks(["a b"], finish="length"))
    assert evs[-1]["type"] == "response.incomplete"
    final = evs[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    RESPONSE.validate_python(final)
    evs = stream(wire_for({"input": "hi"}), chat_chunks([]))
    assert [e["type"] for e in evs][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_cancelled_stream_ends_with_status_cancelled_and_a_failure_with_response_failed():
    evs = stream(wire_for({"input": "hi"}), chat_chunks(["par"], finish="cancelled"))
    assert evs[-1]["type"] == "response.incomplete" and evs[-1]["response"]["status"] == "cancelled"
    kept = []
    wire = wire_for({"input": "hi"}, kept)
    raw = wire.opening() + wire.chunk(chat_chunks(["part"])[1])
    raw += wire.stream_error(SuperfluidError("the engine failed"))
    evs = events(raw)
    assert evs[-1]["type"] == "response.failed" and kept == []  # a failed response is not kept
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the engine failed"
    assert "error" not in evs[-1]  # a top-level error would make the SDK raise instead of yielding the event
    RESPONSE.validate_python(failed)


def test_a_whole_reply_is_one_response_object():
    kept = []
    wire = wire_for({"input": "hi", "instructions": "sys", "tools": [WEATHER, {"type": "web_search"}],
                     "store": False}, kept)
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "smollm2",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": CALLS},
                         "finish_reason": "tool_calls"}], "usage": CHAT_USAGE}
    final = json.loads(wire.whole(body).text)
    assert [item["type"] for item in final["output"]] == ["function_call"]  # no text: no message item
    assert final["instructions"] == "sys" and final["store"] is False and final["tool_choice"] == "auto"
    assert [t["type"] for t in final["tools"]] == ["function", "web_search"]  # echoed as sent
    assert kept == [final]
    parsed = RESPONSE.validate_python(final)
    assert parsed.usage.input_tokens_details.cached_tokens == 12
    body["choices"][0].update(message={"role": "assistant", "content": "Hi"}, finish_reason="length")
    final = json.loads(wire_for({"input": "hi"}).whole(body).text)
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Hi"
    assert RESPONSE.validate_python(final).output_text == "Hi"


# ---- stored responses on sessions ----------------------------------------------------------------

def test_stored_responses_are_session_turns_that_survive_a_restart(tmp_path):
    from types import SimpleNamespace

    from superfluid.core.sessions import SessionConflict, SessionStore
    from superfluid.plugins.http.keys.auth import KEY
    from superfluid.plugins.http.responses.chains import Chains, ResponseNotFound

    alice, bob = {KEY: SimpleNamespace(name="alice", admin=False)}, {KEY: SimpleNamespace(name="bob", admin=False)}
    store = SessionStore(str(tmp_path))
    chains = Chains(store)
    turn = dict(model="smollm2", qos="agent", reply={"role": "assistant", "content": "hi"}, prompt_tokens=[1, 2])
    first = {"id": "resp_1", "object": "response"}
    session = chains.record(alice, None, new=[{"role": "user", "content": "a"}], response=first, **turn)
    assert (session.owner, session.system, session.turns) == ("alice", None, 1)
    assert chains.latest(alice, "resp_1", idle=True) is session
    second = {"id": "resp_2", "object": "response"}
    assert chains.record(alice, session, new=[{"role": "user", "content": "b"}], response=second, **turn) is session
    with pytest.raises(InvalidRequest) as info:  # an older response does not continue its conversation
        chains.latest(alice, "resp_1", idle=True)
    assert info.value.param == "previous_response_id" and "resp_2" in info.value.message
    with pytest.raises(ResponseNotFound):  # another key's response is not there
        chains.find(bob, "resp_2")
    session.busy = True
    with pytest.raises(SessionConflict):
        chains.latest(alice, "resp_2", idle=True)
    assert chains.latest(alice, "resp_2", idle=False) is session  # an unstored continuation only reads it
    session.busy = False
    chains.delete(alice, "resp_1")  # an older one: forgotten, the session stays open
    assert session.state == "open" and session.turns == 2
    # a restart: the responses come back from the session's log, the deleted one does not
    again = SessionStore(str(tmp_path))
    again.recover()
    restored = Chains(again)
    assert restored.find(alice, "resp_2")[1:] == (2, second)
    with pytest.raises(ResponseNotFound):
        restored.find(alice, "resp_1")
    restored.delete(alice, "resp_2")  # the latest: its session closes
    assert again.sessions[session.id].state == "closed"
    with pytest.raises(ResponseNotFound):
        restored.find(alice, "resp_2")

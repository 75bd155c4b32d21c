"""The Messages front end without a server: parsing (every field decided), the mapping onto a
chat request (the billing-header block last), the wire's translation of the chat run's objects
into Anthropic's message and events, and Anthropic's error shape."""

from __future__ import annotations

import json

import pytest

from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.conversation import ImageRef, Message
from superfluid.plugins.http.anthropic.mapping import chat_request, conversation, system_parts
from superfluid.plugins.http.anthropic.protocol import CountTokensRequest, MessagesRequest
from superfluid.plugins.http.anthropic.wire import AnthropicWire, anthropic_error
from superfluid.plugins.http.typed import parse

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def req(**fields) -> MessagesRequest:
    return parse(MessagesRequest, {"model": "m", "max_tokens": 16, "messages": USER, **fields})


def test_claude_code_fields_parse_and_unknown_ones_are_refused():
    r = req(thinking={"type": "enabled", "budget_tokens": 1024}, context_management={"edits": []},
            output_config={"effort": "high"}, metadata={"user_id": "u1"}, service_tier="auto",
            system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}])
    assert r.metadata.user_id == "u1"
    with pytest.raises(InvalidRequest) as exc:
        req(bogus=1)
    assert "bogus" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        parse(MessagesRequest, {"model": "m", "messages": USER})
    assert exc.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        req(max_tokens=0)
    with pytest.raises(InvalidRequest):
        req(temperature=1.5)  # Anthropic's range is 0..1


def test_tool_choice_must_name_an_offered_function():
    with pytest.raises(InvalidRequest) as exc:
        req(tools=[TOOL], tool_choice={"type": "tool", "name": "other"})
    assert exc.value.param == "tool_choice"
    with pytest.raises(InvalidRequest):
        req(tool_choice={"type": "any"})
    with pytest.raises(InvalidRequest):
        req(tools=[{"name": "x"}])  # a function tool needs input_schema


def test_server_tools_are_left_out_not_refused():
    r = req(tools=[TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])
    chat = chat_request(r)
    assert [t.function.name for t in chat.tools] == ["get_weather"]


def test_image_blocks_become_image_parts_where_they_were():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    r = req(messages=[{"role": "user", "content": [{"type": "text", "text": "Look:"}, image,
                                                   {"type": "text", "text": "What is it?"}]}])
    parts = chat_request(r).conversation.messages[-1].parts
    assert [isinstance(p, ImageRef) for p in parts] == [False, True, False]
    assert parts[1].ref.url == "data:image/png;base64,iVBORw0KGgo="
    assert parts[1].where == "messages[0].content[1].source"  # an error about it names the block
    assert chat_request(r).messages == []  # no chat messages are written for the chat path to parse
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert chat_request(req(messages=[{"role": "user", "content": [url]}])).conversation.messages[-1].parts[0]\
        .ref.url == "https://example.com/a.png"


@pytest.mark.parametrize("source, words", [
    ({"type": "base64"}, "media_type and data"),
    ({"type": "base64", "media_type": "image/tiff", "data": "AAAA"}, "media_type must be"),
    ({"type": "file", "file_id": "file_1"}, "Files API"),
])
def test_bad_image_sources_are_refused(source, words):
    with pytest.raises(InvalidRequest) as exc:
        req(messages=[{"role": "user", "content": [{"type": "image", "source": source}]}])
    assert words in exc.value.message and exc.value.param.startswith("messages[0].content[0].source")


def test_the_billing_header_block_goes_after_the_conversation():
    r = req(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                    {"type": "text", "text": "You are Claude Code."}])
    assert system_parts(r) == ("You are Claude Code.", "x-anthropic-billing-header: cc_version=1; cch=abc;")
    messages = conversation(r).messages
    assert messages[0] == Message.plain("system", "You are Claude Code.")
    assert messages[-1].role == "system" and messages[-1].text.startswith("x-anthropic-billing-header")
    first = conversation(r, trailing_system=False).messages
    assert first[0].text.startswith("x-anthropic-billing-header")  # a template that refuses it at the end


def test_tool_use_and_tool_result_become_calls_and_tool_messages():
    r = req(tools=[TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "and tomorrow?"}]}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
        metadata={"user_id": "u"}, top_k=5)
    chat = chat_request(r)
    messages = chat.conversation.messages
    roles = [m.role for m in messages]
    assert roles == ["user", "assistant", "tool", "tool", "user"]
    assistant = messages[1]
    assert assistant.text == "Let me look."  # the thinking block is left out
    assert assistant.tool_calls[0].arguments == {"city": "Paris"} and assistant.tool_calls[0].id == "toolu_1"
    assert json.loads(assistant.tool_calls[0].text) == {"city": "Paris"}
    assert [m.tool_call_id for m in messages[2:4]] == ["toolu_1", "toolu_2"]
    assert messages[3].text == "Error: timeout" and messages[4].text == "and tomorrow?"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.user == "u" and chat.top_k == 5 and chat.max_tokens == 16


def test_count_tokens_takes_no_generation_fields():
    parse(CountTokensRequest, {"model": "m", "messages": USER})
    with pytest.raises(InvalidRequest):
        parse(CountTokensRequest, {"model": "m", "messages": USER, "max_tokens": 3})


def _events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        out.append((head[len("event: "):], json.loads(data[len("data: "):])))
    return out


def _chunk(delta=None, finish=None, stop=None):
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop
    return {"choices": [choice]}


def test_the_stream_is_anthropics_event_order():
    wire = AnthropicWire("smollm2")
    out = wire.chunk(_chunk({"role": "assistant", "content": ""}))
    out += wire.chunk(_chunk({"content": "Hel"})) + wire.chunk(_chunk({"content": "lo"}))
    out += wire.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                               "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}))
    out += wire.chunk(_chunk(finish="tool_calls"))
    out += wire.closing({"usage": {"prompt_tokens": 10, "completion_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 6}}})
    events = _events(out)
    assert [name for name, _ in events] == [
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert events[5][1]["delta"] == {"type": "input_json_delta", "partial_json": "{\"a\": 1}"}
    delta = events[7][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 6,
                              "output_tokens": 4}


def test_a_stop_string_is_a_stop_sequence_and_a_cut_is_max_tokens():
    wire = AnthropicWire("m")
    wire.chunk(_chunk(finish="stop", stop="END"))
    assert _events(wire.closing(None))[0][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    wire = AnthropicWire("m")
    wire.chunk(_chunk(finish="length"))
    assert _events(wire.closing(None))[0][1]["delta"]["stop_reason"] == "max_tokens"


def test_the_whole_reply_is_a_message():
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
        "role": "assistant", "content": "ok", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1]}"}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}
    message = json.loads(AnthropicWire("alias").whole(body).text)
    assert message["model"] == "alias" and message["stop_reason"] == "tool_use"
    assert message["content"] == [{"type": "text", "text": "ok"},
                                   {"type": "tool_use", "id": "call_9", "name": "f", "input": {"x": [1]}}]
    assert message["usage"]["input_tokens"] == 7 and message["usage"]["output_tokens"] == 3


def test_error_shape():
    body = {"error": {"message": "must be at least 1", "type": "invalid_request_error", "param": "max_tokens",
                      "code": "invalid_value"}}
    assert anthropic_error(400, body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: must be at least 1"}}
    assert anthropic_error(429, {"error": {"message": "slow down"}})["error"]["type"] == "rate_limit_error"
    assert anthropic_error(503, {"error": {"message": "busy"}})["error"]["type"] == "overloaded_error"
    assert anthropic_error(500, {"error": {"message": "boom"}})["error"]["type"] == "api_error"

"""Ollama's wire (plugins/http/ollama/wire.py) and mapping: OpenAI objects become Ollama's NDJSON
lines and whole replies (tool calls with object arguments, thinking, counters); Ollama messages
become chat messages (a tool message answers the earliest call of its tool)."""

from __future__ import annotations

import json
import time

from superfluid.plugins.http.ollama.mapping import chat_messages, chat_request, generate_request
from superfluid.plugins.http.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest
from superfluid.plugins.http.ollama.wire import OllamaWire, ollama_error
from superfluid.plugins.http.typed import parse


def lines(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c) for c in chunks]


def test_streamed_chat_lines_then_the_counters():
    wire = OllamaWire("m:latest", True, time.monotonic())
    text = lines(wire.chunk({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}))
    calls = lines(wire.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        "finish_reason": "tool_calls"}]}))
    last = lines(wire.closing({"usage": {"prompt_tokens": 7, "completion_tokens": 3},
                               "timings": {"prompt_ms": 2.0, "predicted_ms": 5.0}}))[0]
    assert text == [{**text[0], "model": "m:latest", "message": {"role": "assistant", "content": "Hi"}, "done": False}]
    assert calls[0]["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"x": 1}}}]
    assert last["done"] and last["done_reason"] == "stop" and last["prompt_eval_count"] == 7
    assert last["eval_count"] == 3 and last["eval_duration"] == 5_000_000 and last["prompt_eval_duration"] == 2_000_000


def test_a_generate_stream_reads_completion_text_and_chat_content():
    wire = OllamaWire("m", False, time.monotonic())
    assert lines(wire.chunk({"choices": [{"index": 0, "text": "a"}]}))[0]["response"] == "a"
    assert lines(wire.chunk({"choices": [{"index": 0, "delta": {"content": "b"}}]}))[0]["response"] == "b"


def test_errors_are_one_string_naming_the_field():
    body = {"error": {"message": "must be at least 1", "param": "options.num_predict", "code": "invalid_value"}}
    assert ollama_error(400, body) == {"error": "options.num_predict: must be at least 1"}


def test_tool_messages_answer_the_earliest_call_of_their_tool():
    req = parse(OllamaChatRequest, {"model": "m", "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {"q": 1}}},
                                                            {"function": {"name": "b", "arguments": {}}}]},
        {"role": "tool", "tool_name": "b", "content": "B"}, {"role": "tool", "tool_name": "a", "content": "A"}]})
    out = chat_messages(req.messages)
    ids = [c.id for c in out[0].tool_calls]
    assert [m.tool_call_id for m in out[1:]] == [ids[1], ids[0]]
    assert out[0].tool_calls[0].arguments == {"q": 1} and json.loads(out[0].tool_calls[0].text) == {"q": 1}


def test_options_format_and_images_map_onto_chat():
    req = parse(OllamaChatRequest, {"model": "m", "format": {"type": "object"}, "options": {
        "temperature": 0, "num_predict": 5, "stop": ["x"], "top_k": 3},
        "messages": [{"role": "user", "content": "hi", "images": ["iVBORw0KGgo="]}]})
    chat = chat_request(req, "m", stream=False)
    assert chat.temperature == 0 and chat.max_tokens == 5 and chat.stop == ["x"] and chat.top_k == 3
    assert chat.response_format.type == "json_schema"
    parts = chat.conversation.messages[0].parts
    assert [type(p).__name__ for p in parts] == ["ImageRef", "TextPart"]
    assert parts[0].ref.url == "data:image/png;base64,iVBORw0KGgo=" and parts[0].where == "messages[0].images[0]"
    raw = generate_request(parse(OllamaGenerateRequest, {"model": "m", "prompt": "1,", "raw": True}), "m", True)
    assert raw.prompt == "1," and raw.max_tokens > 1 << 20  # until the context ends (cut there)

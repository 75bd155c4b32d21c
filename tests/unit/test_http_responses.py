"""plugins/http/openai/replies.py: the bodies clients parse, built without a server."""

from __future__ import annotations

import json

from superfluid.core.errors import InvalidRequest
from superfluid.core.lane import LaneEvent
from superfluid.plugins.http.openai.replies import Shape, error_body, server_timings, sse, status_of
from superfluid.plugins.http.prepare.reply_read import Parsed

FINISHED = LaneEvent("finished", "r", finish_reason="stop", prompt_tokens=5, completion_tokens=3, cached_tokens=2,
                     timings={"arrived": 1.0, "admitted_at": 1.5, "first_token_at": 2.0, "finished_at": 3.0,
                              "prefilled": 5})


def test_chat_whole_with_calls_and_timings():
    shape = Shape("chat", "m")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    got = shape.whole("raw", FINISHED, Parsed(None, [call], "tool_calls"))
    assert list(got) == ["id", "object", "created", "model", "choices", "usage", "timings"]
    assert got["id"].startswith("chatcmpl-") and got["object"] == "chat.completion"
    assert got["choices"] == [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                               "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    assert got["timings"] == {"queued_ms": 500.0, "ttft_ms": 1000.0, "prompt_n": 5, "prompt_ms": 500.0,
                              "predicted_n": 3, "predicted_ms": 1000.0}


def test_chunks_share_the_id_and_end_with_usage():
    shape = Shape("completion", "m")
    first, last = shape.chunk(text="a"), shape.chunk(finish="stop", event=FINISHED)
    assert first["id"] == last["id"] == shape.id and first["object"] == "text_completion"
    assert first["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    assert last["choices"][0]["finish_reason"] == "stop"
    usage = shape.usage_chunk(FINISHED)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 8
    chat = Shape("chat", "m")
    assert chat.chunk(role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk(tool_calls=[{"index": 0}])["choices"][0]["delta"] == {"tool_calls": [{"index": 0}]}


def test_infill_is_llama_cpp_shaped():
    shape = Shape("infill", "m")
    assert shape.chunk(text="x") == {"content": "x", "stop": False}
    assert shape.chunk(finish="stop", event=FINISHED) == {"content": "", "stop": True, "finish_reason": "stop",
                                                          "tokens_predicted": 3, "tokens_evaluated": 5}
    assert shape.whole("mid", FINISHED)["content"] == "mid"


def test_sse_framing_and_errors():
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert json.loads(sse({"b": 1})[len(b"data: "):]) == {"b": 1}
    assert error_body(RuntimeError("boom")) == {"error": {"message": "boom", "type": "server_error",
                                                          "param": None, "code": None}}
    bad = InvalidRequest("no", param="p", code="c")
    assert status_of(bad) == 400 and status_of(RuntimeError()) == 500
    assert error_body(bad)["error"]["param"] == "p"
    assert server_timings(LaneEvent("finished", "r"))["ttft_ms"] is None

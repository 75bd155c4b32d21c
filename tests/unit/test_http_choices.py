"""plugins/http/openai/choices.py: each choice of a reply shaped from its own lane's events (n > 1
interleaved in a stream, echo, prompt scoring, logprobs per chunk), without a server."""

from __future__ import annotations

import json

import attrs

from superfluid.core.lane import LaneEvent
from superfluid.core.request import Request
from superfluid.core.tick import TokenLogprob
from superfluid.plugins.http.openai.choices import Choice
from superfluid.plugins.http.openai.replies import Shape
from superfluid.plugins.http.prepare.logprob_format import TokenText
from superfluid.plugins.http.prepare.preparer import Prepared
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.prepare import reply_read, tool_plan
from superfluid.plugins.http.typed import parse

from .fakes import format_registry

HERMES = format_registry().tool_format("hermes")

PIECES = {1: b"Hi", 2: b" there", 3: b"!", 7: b"<s>"}
TEXT = TokenText(lambda t: PIECES.get(t, b""))
FINISHED = dict(prompt_tokens=3, cached_tokens=0, timings={})


def prep(kind="chat", n=1, **kw) -> Prepared:
    reqs = tuple(Request(prompt_tokens=[7, 1, 2], max_tokens=4, sink=None) for _ in range(n))
    return Prepared(kind=kind, runtime=None, requests=reqs, **kw)


def delta(*tokens, text=None, lps=True):
    logprobs = tuple(TokenLogprob(t, -0.5, ((t, -0.5), (3, -2.0))) for t in tokens) if lps else ()
    return LaneEvent("delta", "r", text=text if text is not None else b"".join(PIECES[t] for t in tokens).decode(),
                     token_ids=tokens, logprobs=logprobs)


def finished(completion, reason="stop", scores=()):
    return LaneEvent("finished", "r", finish_reason=reason, completion_tokens=completion, prompt_logprobs=scores,
                     **FINISHED)


def test_a_stream_of_two_chat_choices_interleaves_by_index_with_their_own_logprobs():
    p, shape = prep(n=2, stream=True, logprobs=1), Shape("chat", "m")
    choices = [Choice(i, p, shape, TEXT) for i in range(2)]
    out = [c for ch in choices for c in ch.opening()]
    out += choices[1].delta(delta(1)) + choices[0].delta(delta(2)) + choices[1].finish(finished(1))
    out += choices[0].delta(delta(text="", lps=False)) + choices[0].finish(finished(1, "length"))
    got = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in out]
    assert got == [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None),
                   (1, {"content": "Hi"}, None), (0, {"content": " there"}, None), (1, {}, "stop"),
                   (0, {}, "length")]
    assert out[2]["choices"][0]["logprobs"] == {"content": [
        {"token": "Hi", "logprob": -0.5, "bytes": list(b"Hi"),
         "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": list(b"Hi")}]}], "refusal": None}
    assert out[4]["choices"][0]["logprobs"] is None  # the finish chunk carries none
    usage = shape.usage_chunk([c.event for c in choices])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert [c.generated for c in choices] == [1, 1]


def test_whole_chat_choices_with_logprobs():
    p, shape = prep(n=2, logprobs=0), Shape("chat", "m")
    choices = [Choice(i, p, shape, TEXT) for i in range(2)]
    for i, c in enumerate(choices):
        assert c.delta(delta(1, 3)) == []
        c.finish(finished(2))
    body = shape.replies([c.whole() for c in choices], [c.event for c in choices])
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 4
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "Hi!"}
    content = body["choices"][1]["logprobs"]["content"]
    assert [(e["token"], e["top_logprobs"]) for e in content] == [("Hi", []), ("!", [])]
    assert body["timings"]["predicted_n"] == 4


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing():
    p, shape = prep("completion", logprobs=1, echo="<s>Hi there", score_only=True), Shape("completion", "m")
    choice = Choice(0, p, shape, TEXT)
    assert choice.delta(delta(3)) == []  # the token run to score the prompt is dropped
    scores = (TokenLogprob(1, -4.0, ((2, -1.0),)), TokenLogprob(2, -0.25, ((2, -0.25),)))
    choice.finish(finished(1, "stop", scores))
    got = choice.whole(scores)
    assert got["text"] == "<s>Hi there" and got["finish_reason"] == "length"
    assert got["logprobs"] == {"tokens": ["<s>", "Hi", " there"], "token_logprobs": [None, -4.0, -0.25],
                               "top_logprobs": [None, {" there": -1.0}, {" there": -0.25}],
                               "text_offset": [0, 3, 5]}
    body = shape.replies([got], [choice.event])
    assert body["usage"]["completion_tokens"] == 0 and choice.generated == 0
    json.dumps(body)


def test_a_streamed_completion_echoes_its_scored_prompt_first_and_carries_offsets_per_chunk():
    p, shape = prep("completion", stream=True, logprobs=0, echo="<s>Hi there"), Shape("completion", "m")
    choice = Choice(0, p, shape, TEXT)
    assert choice.opening() == [] and choice.echo_waits_for_scores  # the prompt waits for its scores
    scores = (TokenLogprob(1, -1.0), TokenLogprob(2, -2.0))
    first = choice.echo_chunk(scores)["choices"][0]
    assert first["text"] == "<s>Hi there"
    assert first["logprobs"] == {"tokens": ["<s>", "Hi", " there"], "token_logprobs": [None, -1.0, -2.0],
                                 "top_logprobs": [None, {}, {}], "text_offset": [0, 3, 5]}
    a = choice.delta(delta(2))[0]["choices"][0]["logprobs"]
    b = choice.delta(delta(3))[0]["choices"][0]["logprobs"]
    assert a == {"tokens": [" there"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [11]}
    assert b["text_offset"] == [17]


def test_a_streamed_echo_without_logprobs_opens_with_the_prompt():
    p, shape = prep("completion", stream=True, echo="Hi"), Shape("completion", "m")
    choice = Choice(0, p, shape, TEXT)
    assert not choice.echo_waits_for_scores
    first = choice.opening()[0]["choices"][0]
    assert (first["text"], first["logprobs"]) == ("Hi", None)


def test_a_forced_call_is_parsed_per_choice():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = tool_plan.plan(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                        "tools": [tool], "tool_choice": "required"}), HERMES)
    assert plan.prefill == '<tool_call>\n{"name": "f", "arguments": {'  # no grammar: the object is opened
    p, shape = prep(n=1, tools=plan, reader=reply_read.reader(plan)), Shape("chat", "m")
    choice = Choice(0, p, shape, TEXT)
    choice.delta(LaneEvent("delta", "r", text='"x": 1}}\n</tool_call>', token_ids=(1,)))
    choice.finish(finished(1))
    got = choice.whole()
    assert got["finish_reason"] == "tool_calls" and got["message"]["tool_calls"][0]["function"]["name"] == "f"
    assert attrs.evolve(choice.event).completion_tokens == 1

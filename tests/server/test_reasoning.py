"""Reasoning models' replies split into reasoning and answer, on a real server with the real
default model (SmolLM2, which does not reason): its output is forced into a ``<think>`` span by
llama-server's ``grammar`` field, or its prompt opens the span (a copy of the GGUF whose chat
template has Qwen3's ``enable_thinking`` switch and ends the generation prompt with
``<think>\\n``). Through the openai, anthropic and ollama clients and the Responses API, whole
and streamed."""

from __future__ import annotations

import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")

THINK = 'root ::= "<think>" [a-z ]{5,40} "</think>" [a-zA-Z ,.]{3,30}'
INSIDE = 'root ::= [a-z ]{5,40} "</think>" [a-zA-Z ,.]{3,30}'
ASK = [{"role": "user", "content": "What is two plus two?"}]

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def thinking_copy(model_path: str, out) -> str:
    """The default GGUF with :data:`TEMPLATE` as its chat template."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(model_path)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(out), bytes(arch.parts[arch.data[0]]).decode(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, TEMPLATE)}, [])
    return str(out)


@pytest.fixture(scope="module")
def think_srv(start_server):
    """The default model, its replies parsed for a <think> span (its template has none)."""
    return start_server("--max-batch", "4", "--reasoning-parser", "think")


@pytest.fixture(scope="module")
def inside_srv(start_server, model_path, tmp_path_factory):
    """The copy with the thinking template: its parser chosen from the template (auto)."""
    path = thinking_copy(model_path, tmp_path_factory.mktemp("thinking") / "smollm2-thinking.gguf")
    return start_server("--max-batch", "4", model=path)


def oai(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)


def post(srv, path, body):
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def check_split(reasoning: str, content: str) -> None:
    assert reasoning and content
    for piece in ("<", ">", "<think", "think>"):
        assert piece not in content
    assert "<" not in reasoning and ">" not in reasoning


def test_the_marker_is_several_tokens(think_srv):
    tokens = post(think_srv, "/tokenize", {"content": "<think>"})["tokens"]
    assert len(tokens) > 1  # so a streamed reply splits it across deltas


def test_chat_whole_and_streamed(think_srv):
    client = oai(think_srv)
    whole = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                           extra_body={"grammar": THINK})
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    check_split(reasoning, msg.content)
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.completion_tokens
    parts, thoughts = [], []
    stream = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"grammar": THINK})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                thoughts.append(extra["reasoning_content"])
                assert "<" not in extra["reasoning_content"] and ">" not in extra["reasoning_content"]
            if c.delta.content:
                parts.append(c.delta.content)
                assert "<" not in c.delta.content and ">" not in c.delta.content
    assert len(thoughts) > 1  # streamed as it came
    assert "".join(thoughts) == reasoning and "".join(parts) == msg.content
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_without_a_parser_the_span_is_content(server):
    """The default model's own template has no <think>: its replies are unchanged."""
    whole = oai(server).chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                                extra_body={"grammar": THINK})
    msg = whole.choices[0].message
    assert msg.content.startswith("<think>") and "</think>" in msg.content
    assert "reasoning_content" not in (msg.model_extra or {})
    assert whole.usage.completion_tokens_details is None


def test_grammar_refused_with_response_format_and_forced_tools(think_srv):
    client = oai(think_srv)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8, extra_body={"grammar": THINK},
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "grammar"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8, extra_body={"grammar": THINK},
                                       tools=[tool], tool_choice="required")
    assert err.value.body["param"] == "grammar"
    # a completion follows a grammar too
    done = client.completions.create(model="smollm2", prompt="Say:", max_tokens=20, temperature=0,
                                     extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert done.choices[0].text in ("yes", "no")


def test_responses_whole_and_streamed(think_srv):
    client = oai(think_srv)
    whole = client.responses.create(model="smollm2", input="What is two plus two?", temperature=0,
                                    max_output_tokens=80, extra_body={"grammar": THINK})
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"]
    reasoning = whole.output[0].content[0].text
    check_split(reasoning, whole.output_text)
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="smollm2", input="What is two plus two?", temperature=0,
                                          max_output_tokens=80, stream=True, extra_body={"grammar": THINK}))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == reasoning
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == reasoning
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == whole.output_text


def test_starts_inside_from_the_template(inside_srv):
    """The template's generation prompt opens the span: the parser is chosen from it (auto) and
    the reply starts inside; enable_thinking false renders the closed span instead."""
    client = oai(inside_srv)
    whole = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                           extra_body={"grammar": INSIDE})
    msg = whole.choices[0].message
    check_split(msg.model_extra["reasoning_content"], msg.content)
    on = whole.usage.prompt_tokens
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        off = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=12,
                                             extra_body=extra)
        # the prompt ends with an empty span: more tokens, and the reply is all content
        assert off.usage.prompt_tokens > on
        assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})
    high = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=12,
                                          reasoning_effort="high")
    assert high.usage.prompt_tokens == on
    # history's reasoning (either name) is given to the template, which renders this one
    history = [*ASK, {"role": "assistant", "content": "Four.", "reasoning_content": "two and two"},
               {"role": "user", "content": "And three?"}]
    plain = [*ASK, {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"}]
    renamed = [*ASK, {"role": "assistant", "content": "Four.", "reasoning": "two and two"},
               {"role": "user", "content": "And three?"}]
    counts = [client.chat.completions.create(model="smollm2", messages=m, max_tokens=1).usage.prompt_tokens
              for m in (history, plain, renamed)]
    assert counts[0] == counts[2] > counts[1]


def test_anthropic_thinking_blocks(inside_srv):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=inside_srv.base, api_key="unused", max_retries=0, timeout=120)
    whole = client.messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body={"temperature": 0},
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with client.messages.stream(model="smollm2", max_tokens=24, messages=ASK, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == whole.content[0].thinking
    off = client.messages.create(model="smollm2", max_tokens=12, messages=ASK,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    def prompt(u):  # Anthropic's split of the prompt, summed
        return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert prompt(off.usage) > prompt(whole.usage)


def test_ollama_thinking(inside_srv):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=inside_srv.base)
    options = {"temperature": 0, "num_predict": 24}
    whole = client.chat(model="smollm2", messages=ASK, options=options, think=True)
    assert whole.message.thinking and not whole.message.content
    streamed = list(client.chat(model="smollm2", messages=ASK, options=options, think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in streamed) == whole.message.thinking
    gen = client.generate(model="smollm2", prompt="What is two plus two?", options=options)
    assert gen.thinking and not gen.response
    gen_streamed = list(client.generate(model="smollm2", prompt="What is two plus two?", options=options,
                                        stream=True))
    assert "".join(c.thinking or "" for c in gen_streamed) == gen.thinking
    off = client.chat(model="smollm2", messages=ASK, options={"temperature": 0, "num_predict": 8}, think=False)
    assert off.message.content and not off.message.thinking
    assert off.prompt_eval_count > whole.prompt_eval_count


def test_reasoning_field_option(start_server):
    srv = start_server("--max-batch", "2", "--reasoning-parser", "think", "--reasoning-field", "reasoning")
    body = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "temperature": 0, "grammar": THINK})
    msg = body["choices"][0]["message"]
    assert "reasoning_content" not in msg
    check_split(msg["reasoning"], msg["content"])


# ---- the thinking budget ----------------------------------------------------------------------------

def test_a_thinking_budget_ends_the_span_within_its_tokens_and_the_answer_follows(inside_srv):
    """SmolLM2 never closes a span by itself: without a budget it thinks until max_tokens; with
    16, the scheduler's sampling closes it within 16 tokens and an answer follows."""
    client = oai(inside_srv)
    free = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens_details.reasoning_tokens == 60 and not free.choices[0].message.content
    held = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                          extra_body={"thinking_budget": 16, "ignore_eos": True})
    msg = held.choices[0].message
    thought = held.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought <= 16 + 4 and msg.content  # the span and its closing marker, then the answer
    assert "</think>" not in msg.content and msg.reasoning_content


def test_anthropic_budget_tokens_holds_thinking_to_its_budget(inside_srv):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=inside_srv.base, api_key="x", max_retries=0)
    msg = client.messages.create(model="smollm2", max_tokens=60, messages=ASK,
                                 thinking={"type": "enabled", "budget_tokens": 16},
                                 extra_body={"temperature": 0})
    assert msg.content[0].type == "thinking"
    thought = post(inside_srv, "/tokenize", {"content": msg.content[0].thinking})["tokens"]
    assert len(thought) <= 16 + 1 and msg.stop_reason == "end_turn"  # closed by the budget, not max_tokens
    streamed = client.messages.create(model="smollm2", max_tokens=60, messages=ASK, stream=True,
                                      thinking={"type": "enabled", "budget_tokens": 16}, extra_body={"temperature": 0})
    events = [e.type for e in streamed]
    assert "content_block_delta" in events and events[-1] == "message_stop"

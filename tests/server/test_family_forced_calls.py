"""Forced tool calls in each model family's own syntax, on real servers.

SmolLM2 with ``--chat-template-file`` set to a real model's template (Llama 3.1, Mistral Small 3.2,
gpt-oss, GLM 4.6, Qwen3-Coder): the server detects the family's tool-call format from the template,
pre-fills a forced call (a named tool, or ``required`` with two tools offered) in that family's
syntax and holds it to the tool's schema with a grammar, so even this tiny model answers with a
valid call. Each API reads it back: /v1/chat/completions (the ``openai`` client), Anthropic Messages
(``anthropic``), Responses (``openai``), whole and streamed; Ollama (``ollama``), which has no
tool_choice, answers a chat with tools and, when the model calls, the call parses. /v1/models
names the detected ``tool_call_parser``.

One server serving SmolLM2 once per template (each a model of its own, 4 lanes), greedy and short
replies."""

from __future__ import annotations

import json
import pathlib

import pytest

from .conftest import TEST_CONTEXT
from .serverproc import ServerProcess

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
NAME = "smollm2"  # the served model's name, before its family's
MAX_TOKENS = 64

# template file → (the tool_call_parser the server detects from it, the pre-fill ending the prompt of
# a call forced by name (get_weather), of one that is only required)
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3", '{"name": "get_weather", "parameters":', '{"name":'),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", "[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]"),
    "openai-gpt-oss-120b.jinja": ("gpt-oss",
                                  "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                                  "<|channel|>commentary to=functions."),
    "GLM-4.6.jinja": ("glm-4.5", "<tool_call>get_weather", "<tool_call>"),
    "Qwen3-Coder.jinja": ("qwen3-coder", "<tool_call>\n<function=get_weather>", "<tool_call>\n<function="),
}
# the families' own call syntax: none of it may reach a client as text
MARKERS = ("[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>", "<|call|>", "<tool_call>", "</tool_call>",
           "<arg_key>", "<arg_value>", "<function=", "<parameter=", "<|python_tag|>", "<|eom_id|>")

SCHEMAS = {
    "get_weather": ("Get the current weather in a city",
                    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    "get_time": ("Get the current time in a timezone",
                 {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}),
}
BOTH = tuple(SCHEMAS)
ASK = "What is the weather in Paris right now?"
CHOICES = ["named", "required"]  # a forced named call (get_weather), or required with both tools


def openai_tools():
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
            for n, (d, p) in SCHEMAS.items()]


def anthropic_tools():
    return [{"name": n, "description": d, "input_schema": p} for n, (d, p) in SCHEMAS.items()]


def responses_tools():
    return [{"type": "function", "name": n, "description": d, "parameters": p} for n, (d, p) in SCHEMAS.items()]


def expected(choice: str) -> tuple[str, ...]:
    return ("get_weather",) if choice == "named" else BOTH


def check_call(name: str, args, choice: str) -> None:
    """The call names a forced tool and its arguments (an object, or its JSON) fit that tool's schema:
    every required key present with a string value, no undeclared key."""
    assert name in expected(choice), name
    if isinstance(args, str):
        args = json.loads(args)
    assert isinstance(args, dict), args
    schema = SCHEMAS[name][1]
    for key in schema["required"]:
        assert isinstance(args.get(key), str), (name, args)
    assert set(args) <= set(schema["properties"]), (name, args)


def clean(text: str | None) -> None:
    for marker in MARKERS:
        assert marker not in (text or ""), (marker, text)


def model_name(template: str) -> str:
    """The model serving SmolLM2 under ``template``: named after the parser it is detected as."""
    return f"{NAME}-{FAMILIES[template][0]}"


@pytest.fixture(scope="module")
def every_template(tmp_path_factory, model_path):
    """One server (4 lanes a model) serving SmolLM2 once per template found, each a model of its
    own ([[models]] tables, each with its --chat-template-file): one start instead of five."""
    tmp = tmp_path_factory.mktemp("templates")
    tables = "".join(f'\n[[models]]\nname = "{model_name(t)}"\npath = "{model_path}"\n'
                     f'chat-template-file = "{SHARED / t}"\n' for t in FAMILIES if (SHARED / t).exists())
    if not tables:
        pytest.skip(f"{SHARED} has none of the templates (the shared templates)")
    cfg = tmp / "superfluid.toml"
    cfg.write_text(f"max-batch = 4\nmax-context = {TEST_CONTEXT}\n{tables}")
    srv = ServerProcess(["--config", str(cfg)], tmp / "server.log", startup_timeout=300)  # loads them in turn
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=list(FAMILIES), ids=[f.split(".jinja")[0] for f in FAMILIES])
def family(request, every_template):
    """(template file name, the server, the model served under that template)."""
    path = SHARED / request.param
    if not path.exists():
        pytest.skip(f"{path} is missing (the shared templates)")
    return request.param, every_template, model_name(request.param)


@pytest.fixture
def srv(family):
    return family[1]


@pytest.fixture
def model(family):
    return family[2]


def fail_with_log(srv, what: str):
    return f"{what}\n--- server log ---\n{srv.log()[-3000:]}"


# ---- the detected format -------------------------------------------------------------------------


def test_models_names_the_detected_parser(family):
    name, srv, model = family
    (entry,) = [m for m in srv.get_json("/v1/models")["data"] if m["id"] == model]
    assert entry["meta"]["tool_call_parser"] == FAMILIES[name][0]
    assert entry["meta"]["tool_call_parser_source"] == "auto"
    assert entry["meta"]["chat_template_source"] == f"file:{SHARED / name}"


@pytest.mark.parametrize("choice", CHOICES)
def test_the_forced_prompt_ends_in_the_family_pre_fill(family, choice):
    name, srv, model = family
    body = {k: v for k, v in chat_args(model, choice).items() if k in ("model", "messages", "tools", "tool_choice")}
    status, out = srv.call("POST", "/apply-template", body)
    assert status == 200, out
    lead = FAMILIES[name][1 if choice == "named" else 2]
    assert out["prompt"].rstrip().endswith(lead), out["prompt"][-200:]


# ---- /v1/chat/completions ------------------------------------------------------------------------


def chat_args(model: str, choice: str) -> dict:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    return dict(model=model, messages=[{"role": "user", "content": ASK}], tools=openai_tools(),
                tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS)


def oai(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_whole(srv, model, choice):
    r = oai(srv).chat.completions.create(**chat_args(model, choice))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", fail_with_log(srv, repr(r))
    assert msg.tool_calls and len(msg.tool_calls) >= 1, repr(msg)
    clean(msg.content)
    for call in msg.tool_calls:
        assert call.type == "function" and call.id
        check_call(call.function.name, call.function.arguments, choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_streamed(srv, model, choice):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai(srv).chat.completions.create(**chat_args(model, choice), stream=True):
        if not chunk.choices:
            continue
        choice0 = chunk.choices[0]
        clean(choice0.delta.content)
        for d in choice0.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: its id and name
                assert d.id and d.function and d.function.name, repr(d)
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:  # later ones: pieces of its arguments
                assert not d.id and not (d.function and d.function.name), repr(d)
                calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice0.finish_reason or finish
    assert finish == "tool_calls", fail_with_log(srv, repr(calls))
    assert calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        check_call(call["name"], call["arguments"], choice)


# ---- Anthropic Messages --------------------------------------------------------------------------


def messages_args(model: str, choice: str) -> dict:
    tool_choice = {"type": "tool", "name": "get_weather"} if choice == "named" else {"type": "any"}
    return dict(model=model, max_tokens=MAX_TOKENS, tools=anthropic_tools(), tool_choice=tool_choice,
                messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})


def claude(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def check_message(srv, msg, choice: str) -> None:
    assert msg.stop_reason == "tool_use", fail_with_log(srv, repr(msg))
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses, repr(msg)
    for block in msg.content:
        if block.type == "text":
            clean(block.text)
    for use in uses:
        assert use.id
        check_call(use.name, use.input, choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_messages_whole(srv, model, choice):
    check_message(srv, claude(srv).messages.create(**messages_args(model, choice)), choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_messages_streamed(srv, model, choice):
    pieces: dict[int, str] = {}  # a tool_use block's input, assembled from its input_json_deltas
    with claude(srv).messages.stream(**messages_args(model, choice)) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                if event.delta.type == "text_delta":
                    clean(event.delta.text)
                elif event.delta.type == "input_json_delta":
                    pieces[event.index] = pieces.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    check_message(srv, final, choice)
    assert pieces, "no input_json_delta"
    for index, text in pieces.items():
        assert final.content[index].type == "tool_use" and json.loads(text) == final.content[index].input


# ---- Responses -----------------------------------------------------------------------------------


def responses_args(model: str, choice: str) -> dict:
    tool_choice = {"type": "function", "name": "get_weather"} if choice == "named" else "required"
    return dict(model=model, input=[{"role": "user", "content": ASK}], tools=responses_tools(),
                tool_choice=tool_choice, temperature=0, max_output_tokens=MAX_TOKENS, store=False)


def check_response(srv, response, choice: str) -> None:
    calls = [o for o in response.output if o.type == "function_call"]
    assert calls, fail_with_log(srv, repr(response))
    for item in response.output:
        if item.type == "message":
            for part in item.content:
                clean(getattr(part, "text", None))
    for call in calls:
        assert call.status == "completed" and call.call_id
        check_call(call.name, call.arguments, choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_whole(srv, model, choice):
    check_response(srv, oai(srv).responses.create(**responses_args(model, choice)), choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_streamed(srv, model, choice):
    final = None
    done_items = []
    pieces: dict[int, str] = {}  # a function_call item's arguments, assembled from their deltas
    for event in oai(srv).responses.create(**responses_args(model, choice), stream=True):
        if event.type == "response.output_text.delta":
            clean(event.delta)
        elif event.type == "response.function_call_arguments.delta":
            pieces[event.output_index] = pieces.get(event.output_index, "") + event.delta
        elif event.type == "response.output_item.done":
            done_items.append(event.item)
        elif event.type == "response.completed":
            final = event.response
    assert final is not None
    check_response(srv, final, choice)
    assert [i.type for i in done_items] == [o.type for o in final.output]
    assert pieces, "no response.function_call_arguments.delta"
    for index, text in pieces.items():
        assert final.output[index].type == "function_call"
        assert json.loads(text) == json.loads(final.output[index].arguments)


# ---- Ollama (no tool_choice) ---------------------------------------------------------------------


def ollama_calls(parts) -> list[tuple[str, dict]]:
    """(name, arguments) of the calls in an Ollama reply's messages, each checked against its tool."""
    calls = [(c.function.name, dict(c.function.arguments)) for p in parts for c in (p.message.tool_calls or [])]
    for name, args in calls:
        check_call(name, args, "required")
    return calls


def test_ollama_whole_and_streamed(srv, model):
    """Ollama has no tool_choice: the model may answer in text (SmolLM2 free-writes, in this family's
    markers or not), and a call it makes parses to a declared tool with fitting arguments."""
    client = ollama.Client(host=srv.base)
    args = dict(model=model, messages=[{"role": "user", "content": ASK}], tools=openai_tools(),
                options={"temperature": 0, "num_predict": MAX_TOKENS})
    whole = client.chat(**args)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.content or whole.message.tool_calls
    ollama_calls([whole])
    parts = list(client.chat(**args, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    ollama_calls(parts)

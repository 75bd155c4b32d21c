"""Chat formats of Functionary, Command R, Granite, Apertus, Apriel, Nemotron, LFM2, Solar Open,
Gemma 4 and GigaChat (plugins/formats/<family>.py), checked on the real templates in
shared/templates: detection, the round trip (whole and a character at a time), partial reads that
hold back a marker, broken calls read as content, and forced calls that read back.

Where a template cannot be round-tripped by plugins/formats/roundtrip.py, the test says why and
reads the text the template does render for a reply instead."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from superfluid.core.chat import render_chat
from superfluid.core.formats.forced import forced_call
from superfluid.core.formats.reader import ReplyReader
from superfluid.core.formats.registry import Detected, FormatRegistry
from superfluid.core.formats.stream import StreamReader
from superfluid.plugins.formats import builtin_registry, roundtrip

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
MINE = {"functionary-v3.1", "functionary-v3.2", "command-r7b", "command-r-plus", "granite", "apertus",
        "nemotron-v2", "lfm2", "solar-open", "gemma4", "gigachat3", "gigachat3.1"}
WEATHER, TIME = roundtrip.WEATHER["function"], roundtrip.TIME["function"]
SEARCH = {"name": "search", "parameters": {"type": "object", "required": ["query"], "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}}}}
OPTIONS = {"name": "options", "parameters": {"type": "object", "properties": {
    "alpha": {"type": "number"}, "beta": {"type": "array", "items": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def reg() -> FormatRegistry:
    """Every built-in format."""
    return builtin_registry()


def template(stem: str) -> str:
    if not TEMPLATES.is_dir():
        pytest.skip(f"no template corpus at {TEMPLATES}")
    return (TEMPLATES / f"{stem}.jinja").read_text()


def reader(reg, tool: str | None, reasoning: str | None = None, **kw) -> ReplyReader:
    return ReplyReader(reg.tool_format(tool) if tool else None,
                       reg.reasoning_format(reasoning) if reasoning else None, **kw)


def calls_of(reply) -> list[tuple[str, object]]:
    return [(c.name, c.arguments_object()) for c in reply.calls]


def assert_prefix_reads(rd: ReplyReader, text: str):
    """Every partial read of a prefix of ``text`` is a prefix of the whole read (content,
    reasoning, each call's name and arguments), and streaming it assembles the whole read."""
    whole = rd.read(text)
    for i in range(len(text) + 1):
        part = rd.read(text[:i], partial=True)
        where = repr(text[:i])
        assert whole.content.startswith(part.content), where
        assert whole.reasoning.startswith(part.reasoning), where
        assert len(part.calls) <= len(whole.calls), where
        for got, final in zip(part.calls, whole.calls):
            assert got.name == final.name and final.arguments.startswith(got.arguments), where
    stream = StreamReader(rd)
    deltas = [stream.feed(ch) for ch in text]
    last, read = stream.finish()
    deltas.append(last)
    assert "".join(d.content for d in deltas) == whole.content == read.content
    assert "".join(d.reasoning for d in deltas) == whole.reasoning == read.reasoning
    args: dict[int, str] = {}
    for d in deltas:
        for c in d.calls:
            args[c.index] = args.get(c.index, "") + c.arguments
    assert [args[i] for i in sorted(args)] == [c.arguments for c in whole.calls]
    return whole


# ---- detection -----------------------------------------------------------------------------------

DETECTED = [
    ("meetkai-functionary-medium-v3.1", "functionary-v3.1", None),
    ("meetkai-functionary-medium-v3.2", "functionary-v3.2", None),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command-r7b", "command-r7b"),
    ("CohereForAI-c4ai-command-r-plus-tool_use", "command-r-plus", None),
    ("ibm-granite-granite-3.3-2B-Instruct", "granite", "granite"),
    ("ibm-granite-granite-4.0", "hermes", None),
    ("Apertus-8B-Instruct", "apertus", "apertus"),
    ("Apriel-1.6-15b-Thinker-fixed", "apriel", "apriel"),
    ("unsloth-Apriel-1.5", "apriel", "apriel"),
    ("NVIDIA-Nemotron-Nano-v2", "nemotron-v2", "think"),
    ("LFM2-8B-A1B", "lfm2", None),
    ("LFM2.5-8B-A1B", "lfm2", "think"),
    ("upstage-Solar-Open-100B", "solar-open", "solar-open"),
    ("google-gemma-4-31B-it", "gemma4", "gemma4"),
    ("google-gemma-4-31B-it-interleaved", "gemma4", "gemma4"),
    ("GigaChat3-10B-A1.8B", "gigachat3", None),
    ("GigaChat3.1-10B-A1.8B", "gigachat3.1", None),
    ("Bielik-11B-v3.0-Instruct", "hermes", "think"),
]


@pytest.mark.parametrize("stem,tool,reasoning", DETECTED)
def test_detection_picks_the_familys_formats(reg, stem, tool, reasoning):
    found = reg.resolve(template(stem))
    assert found.tool_format is not None and found.tool_format.name == tool
    assert (found.reasoning.name if found.reasoning else None) == reasoning


@pytest.mark.parametrize("stem", ["NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "stepfun-ai-Step-3.5-Flash",
                                  "Qwen3-Coder", "ByteDance-Seed-OSS", "meta-llama-Llama-3.1-8B-Instruct"])
def test_other_families_templates_are_not_taken(reg, stem):
    """Nemotron 3 and Step 3.5 write Qwen3-Coder's XML calls (``<function=`` with ``<parameter=``),
    which functionary-v3.1 must not claim; Llama 3.1's ``<|python_tag|>`` is not Functionary's."""
    found = reg.resolve(template(stem))
    assert found.tool_format is None or found.tool_format.name not in MINE


# ---- the round trip ------------------------------------------------------------------------------

ROUND_TRIPS = [
    ("meetkai-functionary-medium-v3.1", (1, 2), None),
    ("meetkai-functionary-medium-v3.2", (1, 2), None),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", (1, 2), None),
    ("Apertus-8B-Instruct", (1, 2), None),
    ("unsloth-Apriel-1.5", (1, 2), None),
    ("Apriel-1.6-15b-Thinker-fixed", (1, 2), None),
    ("LFM2.5-8B-A1B", (1, 2), None),
    ("upstage-Solar-Open-100B", (1, 2), None),
    # Gemma 4's generation prompt closes an empty thought channel unless thinking is on
    ("google-gemma-4-31B-it", (1, 2), {"enable_thinking": True}),
    ("google-gemma-4-31B-it-interleaved", (1, 2), {"enable_thinking": True}),
    # one call per reply: the templates render tool_calls[0] alone
    ("GigaChat3-10B-A1.8B", (1,), None),
    ("GigaChat3.1-10B-A1.8B", (1,), None),
    ("ibm-granite-granite-4.0", (1, 2), None),
    ("Bielik-11B-v3.0-Instruct", (1, 2), None),
]


@pytest.mark.parametrize("stem,counts,kwargs", ROUND_TRIPS)
@pytest.mark.parametrize("stream", [None, "chars"])
def test_round_trip(reg, stem, counts, kwargs, stream):
    text = template(stem)
    found = reg.resolve(text)
    for calls in counts:
        got = roundtrip.check(text, found, calls=calls, kwargs=kwargs, stream=stream)
        assert got.ok, (calls, got.note, got.output, got.expected, got.got)


@pytest.mark.parametrize("stem,kwargs", [
    ("meetkai-functionary-medium-v3.1", None), ("meetkai-functionary-medium-v3.2", None),
    # R7B's prompt closes an empty thinking span unless thinking is on; an answer's turn has none
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", {"enable_thinking": True}),
    ("Apertus-8B-Instruct", None), ("LFM2.5-8B-A1B", None), ("GigaChat3.1-10B-A1.8B", None)])
def test_a_plain_answer_round_trips(reg, stem, kwargs):
    text = template(stem)
    for stream in (None, "chars"):
        got = roundtrip.check(text, reg.resolve(text), calls=0, stream=stream, kwargs=kwargs)
        assert got.ok, (got.note, got.output, got.got)


@pytest.mark.parametrize("stem", ["meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2",
                                  "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "Apertus-8B-Instruct",
                                  "unsloth-Apriel-1.5", "LFM2.5-8B-A1B", "upstage-Solar-Open-100B",
                                  "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B"])
def test_round_trip_outputs_read_as_prefixes(reg, stem):
    text = template(stem)
    found = reg.resolve(text)
    for calls in (1, 2):
        got = roundtrip.check(text, found, calls=calls)
        if got.output:
            assert_prefix_reads(ReplyReader(found.tool_format, found.reasoning), got.output)


# ---- templates the round trip cannot check, and why -----------------------------------------------

def rendered_turn(text: str, reply: dict, history: list[dict], **kwargs) -> tuple[str, str]:
    """(generation prompt, the text the model writes for ``reply``) for a template whose
    generation prompt writes text that its rendered turn leaves out (Apriel 1.6's "Here are my
    reasoning steps:", Nemotron v2's ``<think></think>``): the rendered turn after the lines it
    shares with the generation prompt."""
    def render(messages, generation):
        return render_chat(text, messages, bos_token="", eos_token="", add_generation_prompt=generation,
                           tools=roundtrip.TOOLS, **kwargs)
    base, prompt, full = render(history, False), render(history, True), render([*history, reply], False)
    assert prompt.startswith(base) and full.startswith(base) and not full.startswith(prompt)
    opened, turn = prompt[len(base):], full[len(base):]
    shared = os.path.commonprefix([opened, turn])
    shared = shared[:shared.rfind("\n") + 1]
    return prompt, roundtrip.end_of_turn_cut(turn[len(shared):])


def call_reply(calls: int, as_object: bool = True) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": roundtrip.REASONING,
            "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": name, "arguments": args if as_object else json.dumps(args)}}
                for name, args, cid in roundtrip.CALLS[:calls]]}


@pytest.mark.parametrize("calls", [1, 2])
def test_apriel_16_reads_the_reasoning_its_prompt_opens(reg, calls):
    """Apriel 1.6's generation prompt ends with "Here are my reasoning steps:\n", which its
    rendered turn leaves out: the model's text is the reasoning, ``[BEGIN FINAL RESPONSE]`` and
    the calls, read with the span opened by the prompt."""
    text = template("Apriel-1.6-15b-Thinker-fixed")
    found = reg.resolve(text)
    reply = call_reply(calls)
    prompt, output = rendered_turn(text, reply, [roundtrip.SYSTEM, roundtrip.USER])
    assert found.reasoning.opened_by(prompt)
    assert output.startswith(roundtrip.REASONING + "\n[BEGIN FINAL RESPONSE]\n")
    expected = roundtrip.expected_message(reply, output)
    assert expected["reasoning_content"] == roundtrip.REASONING
    for pieces in (None, list(output)):
        assert roundtrip.read_message(found, prompt, output, pieces=pieces) == expected


@pytest.mark.parametrize("calls", [1, 2])
def test_nemotron_v2_reads_its_rendered_turn(reg, calls):
    """Nemotron Nano v2's generation prompt opens ``<think>`` (or writes ``<think></think>`` after
    /no_think) but its rendered turn drops the reasoning and the tags, so the rendered reply does
    not continue the prompt that opened the span. With /no_think, the turn after the shared header
    is the model's text."""
    text = template("NVIDIA-Nemotron-Nano-v2")
    found = reg.resolve(text)
    reply = call_reply(calls)
    history = [{"role": "system", "content": "You are a helpful assistant. /no_think"}, roundtrip.USER]
    prompt, output = rendered_turn(text, reply, history)
    assert prompt.endswith("<think></think>") and output.startswith("<TOOLCALL>[")
    expected = roundtrip.expected_message(reply, output)
    for pieces in (None, list(output)):
        assert roundtrip.read_message(found, prompt, output, pieces=pieces) == expected
    # thinking on: the prompt opened the span, the model closes it before its calls
    rd = ReplyReader(found.tool_format, found.reasoning, inside=found.reasoning.opened_by("x<think>\n"))
    whole = assert_prefix_reads(rd, "plan it\n</think>\n\n" + output)
    assert whole.reasoning == "plan it" and calls_of(whole) == [(n, a) for n, a, _ in roundtrip.CALLS[:calls]]


def test_command_r_plus_reads_its_rendered_turn(reg):
    """Command R+'s template reads each parameter's ``description`` (the round trip's tools have
    none: rendering fails) and always ends with a system turn asking for the next ``Action:``, so
    a rendered reply never continues the generation prompt. The turn it renders reads back."""
    text = template("CohereForAI-c4ai-command-r-plus-tool_use")
    found = reg.resolve(text)
    assert not roundtrip.check(text, found, calls=1).ok
    with pytest.raises(Exception, match="description"):
        render_chat(text, [roundtrip.USER], tools=roundtrip.TOOLS, add_generation_prompt=True)
    tools = [{"type": "function", "function": {**t["function"], "parameters": {
        **t["function"]["parameters"], "properties": {k: {**v, "description": k} for k, v in
                                                      t["function"]["parameters"]["properties"].items()}}}}
             for t in roundtrip.TOOLS]
    for calls in (1, 2):
        reply = {**call_reply(calls), "content": "I will look it up."}
        history = [roundtrip.SYSTEM, roundtrip.USER]
        prompt = render_chat(text, history, tools=tools, add_generation_prompt=True, bos_token="", eos_token="")
        full = render_chat(text, [*history, reply], tools=tools, add_generation_prompt=False, bos_token="",
                           eos_token="")
        assert not full.startswith(prompt)
        turn = full.split("<|CHATBOT_TOKEN|>")[-1].split("<|START_OF_TURN_TOKEN|>")[0]
        whole = assert_prefix_reads(ReplyReader(found.tool_format), turn)
        assert whole.content == "I will look it up."
        assert calls_of(whole) == [(n, a) for n, a, _ in roundtrip.CALLS[:calls]]


@pytest.mark.parametrize("stem,tool", [("ibm-granite-granite-3.3-2B-Instruct", "granite"), ("LFM2-8B-A1B", "lfm2")])
def test_templates_that_drop_calls(reg, stem, tool):
    """Granite 3.3 and LFM2 render an assistant turn as its content alone: the calls (and with
    LFM2 the turn's reasoning) are not written back, so the round trip has nothing to read."""
    text = template(stem)
    found = reg.resolve(text)
    assert found.tool_format.name == tool
    assert roundtrip.check(text, found, calls=1).note.startswith("the template renders no call")
    rendered = roundtrip.model_output(text, call_reply(1))
    assert rendered is not None and "get_weather" not in rendered[1]


def test_granite_reads_calls_reasoning_and_response(reg):
    rd = reader(reg, "granite", "granite")
    whole = assert_prefix_reads(rd, '<think>The user asks.</think><response>It is sunny.</response>')
    assert (whole.reasoning, whole.content, whole.calls) == ("The user asks.", "It is sunny.", ())
    text = 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
           '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]'
    whole = assert_prefix_reads(rd, text)
    assert whole.content == "Checking."
    assert calls_of(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]
    assert rd.read("<respo", partial=True).content == "" and rd.read("<respo").content == "<respo"


def test_lfm2_reads_python_literals_and_json(reg):
    rd = reader(reg, "lfm2")
    text = ("Let me check.<|tool_call_start|>[search(query='it\\'s, (odd)', limit=3, exact=True), "
            'search(query="x", exact=false, extra={"a": [1, null]})]<|tool_call_end|>')
    whole = assert_prefix_reads(rd, text)
    assert whole.content == "Let me check."
    assert calls_of(whole) == [("search", {"query": "it's, (odd)", "limit": 3, "exact": True}),
                               ("search", {"query": "x", "exact": False, "extra": {"a": [1, None]}})]
    part = rd.read("<|tool_call_start|>[search(query='x', limit=", partial=True)
    assert [(c.name, c.arguments) for c in part.calls] == [("search", '{"query": "x"')]
    assert rd.read("<|tool_call_start|>[sea", partial=True).calls == ()


def test_gemma4_reads_its_value_syntax(reg):
    rd = reader(reg, "gemma4", "gemma4")
    text = ('<|channel>thought\nplan<channel|>Sure.<|tool_call>call:search{exact:true,extra:{a:[1,<|"|>b, c<|"|>],'
            'b:None},limit:2.5,query:<|"|>a "quoted" {text}<|"|>}<tool_call|><|tool_response>')
    whole = assert_prefix_reads(rd, text)
    assert (whole.reasoning, whole.content) == ("plan", "Sure.")
    assert calls_of(whole) == [("search", {"exact": True, "extra": {"a": [1, "b, c"], "b": None}, "limit": 2.5,
                                           "query": 'a "quoted" {text}'})]
    part = rd.read('<|tool_call>call:search{exact:true,query:<|"|>a', partial=True)
    assert [(c.name, c.arguments) for c in part.calls] == [("search", '{"exact": true')]


def test_solar_reads_reasoning_content_and_ids(reg):
    rd = reader(reg, "solar-open", "solar-open")
    whole = assert_prefix_reads(rd, "<|think|>plan<|end|><|begin|>assistant<|content|>The answer.<|end|>")
    assert (whole.reasoning, whole.content) == ("plan", "The answer.")
    text = ('<|think|>plan<|end|><|begin|>assistant<|content|>Let me check.\n<|flush|><|begin|>assistant<|tool_calls|>'
            '<|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Paris"}'
            '<|tool_call:end|><|calls|>')
    whole = assert_prefix_reads(rd, text)
    assert (whole.reasoning, whole.content) == ("plan", "Let me check.")
    assert [(c.name, c.id) for c in whole.calls] == [("get_weather", "a1b2c3d4e5")]


def test_command_r7b_reads_thinking_and_response(reg):
    rd = reader(reg, "command-r7b", "command-r7b")
    whole = assert_prefix_reads(rd, "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Hi there."
                                    "<|END_RESPONSE|>")
    assert (whole.reasoning, whole.content, whole.calls) == ("plan", "Hi there.", ())
    action = ('<|START_THINKING|>plan<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": '
              '"get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>')
    whole = assert_prefix_reads(rd, action)
    assert calls_of(whole) == [("get_weather", {"city": "Paris"})] and whole.calls[0].id is None


def test_apriel_reasoning_spans(reg):
    rd = reader(reg, "apriel", "apriel")
    text = ("Here are my reasoning steps:\nplan\n[BEGIN FINAL RESPONSE]\nIt is sunny.\n[END FINAL RESPONSE]\n"
            '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>')
    whole = assert_prefix_reads(rd, text)
    assert (whole.reasoning, whole.content) == ("plan", "It is sunny.")
    assert calls_of(whole) == [("get_weather", {"city": "Paris"})]
    assert rd.read("Here are my reas", partial=True).content == ""
    inside = reader(reg, "apriel", "apriel", inside=True)
    assert inside.read("plan\n[BEGIN FINAL RESP", partial=True).reasoning == "plan"
    assert reg.reasoning_format("apriel").opened_by("<|begin_assistant|>\nHere are my reasoning steps:\n")


def test_functionary_python_tag_and_code(reg):
    v31 = reader(reg, "functionary-v3.1")
    whole = assert_prefix_reads(v31, "Running it.<|python_tag|>print('hi')\nx = 1\n")
    assert whole.content == "Running it." and calls_of(whole) == [("python", {"code": "print('hi')\nx = 1"})]
    whole = assert_prefix_reads(v31, '<function=get_weather>{"city": "Paris"}</function><|python_tag|>{"code": "1"}')
    assert calls_of(whole) == [("get_weather", {"city": "Paris"}), ("python", {"code": "1"})]
    v32 = reader(reg, "functionary-v3.2")
    whole = assert_prefix_reads(v32, 'all\nLet me check.>>>python\nprint(2)>>>get_time\n{"timezone": "UTC"}')
    assert whole.content == "Let me check."
    assert calls_of(whole) == [("python", {"code": "print(2)"}), ("get_time", {"timezone": "UTC"})]
    assert v32.read("Hello there, how are you?").content == "Hello there, how are you?"


# ---- partial markers and broken calls ------------------------------------------------------------

HELD_BACK = [
    ("functionary-v3.1", "It is <funct"), ("functionary-v3.1", "It is <|python_t"),
    ("functionary-v3.1", "It is <function=get_wea"), ("functionary-v3.2", "all\nIt is >>"),
    ("command-r7b", "It is <|START_ACT"), ("command-r-plus", "It is\nAction:\n``"),
    ("granite", "It is <|tool_ca"), ("apertus", "It is <|tools_pre"), ("nemotron-v2", "It is <TOOLC"),
    ("lfm2", "It is <|tool_call_st"), ("solar-open", "<|content|>It is <|tool_ca"), ("gemma4", "It is <|tool_"),
    ("gigachat3", "It is<|message_sep|>\n\nfunction ca"), ("gigachat3.1", "It is <|function_c"),
]


@pytest.mark.parametrize("tool,text", HELD_BACK)
def test_a_partial_marker_is_held_back(reg, tool, text):
    rd = reader(reg, tool)
    part = rd.read(text, partial=True)
    assert part.content == "It is" and part.calls == ()
    whole = rd.read(text)
    assert whole.calls == () and "It is" in whole.content and len(whole.content) > len("It is")


BROKEN = [
    ("functionary-v3.1", 'It is <function=get_weather>{"city": }</function>'),
    ("functionary-v3.2", 'get_weather\n{"city": >>>all\nno'),
    ("command-r7b", '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": ]<|END_ACTION|>'),
    ("command-r-plus", 'Action:\n```json\n[{"tool_name": "get_weather", "parameters": "x"}]```'),
    ("granite", 'It is <|tool_call|>[{"arguments": {"city": "Paris"}}]'),
    ("apertus", '<|tools_prefix|>[{"get_weather": [1]}]<|tools_suffix|>'),
    ("nemotron-v2", '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}} {"name"]</TOOLCALL>'),
    ("lfm2", "<|tool_call_start|>[get_weather(city=Paris)]<|tool_call_end|>"),
    ("lfm2", "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>"),
    ("solar-open", '<|tool_calls|><|tool_call:begin|>x<|tool_call:name|>get_weather<|tool_call:args|>{"city"'),
    ("gemma4", "<|tool_call>call:get_weather{city:Paris}<tool_call|>"),
    ("gigachat3", 'It is<|message_sep|>\n\nfunction call<|role_sep|>\n{"arguments": {}}'),
    ("gigachat3.1", 'It is<|function_call|>{"name": "get_weather", "arguments": {"city": "Par'),
]


@pytest.mark.parametrize("tool,text", BROKEN)
def test_a_broken_call_stays_content(reg, tool, text):
    whole = reader(reg, tool).read(text)
    assert (whole.content, whole.calls) == (text, ())
    part = reader(reg, tool).read(text, partial=True)
    assert text.startswith(part.content)


def test_a_call_of_a_tool_not_offered_stays_content(reg):
    text = "<|tool_call_start|>[rm(path='/')]<|tool_call_end|>"
    whole = reader(reg, "lfm2", tools=frozenset({"get_weather"})).read(text)
    assert (whole.content, whole.calls) == (text, ())


# ---- forced calls --------------------------------------------------------------------------------

WRITTEN = [(fmt, fn, args) for fmt in sorted(MINE) for fn, args in (
    (WEATHER, {"city": "Paris"}), (SEARCH, {"query": "a \"b\", (c)", "exact": True}),
    (SEARCH, {"query": "x", "limit": 2}), (OPTIONS, {"beta": ["x", "y"]}), (OPTIONS, {}),
    ({"name": "now"}, {}))]


@pytest.mark.parametrize("tool,function,args", WRITTEN)
def test_a_written_call_reads_back(reg, tool, function, args):
    fmt = reg.tool_format(tool)
    text = roundtrip.written_call(fmt, function, args)
    whole = assert_prefix_reads(ReplyReader(fmt), text)
    assert calls_of(whole) == [(function["name"], args)], text
    # and through the forced call's pre-fill, as the server reads a forced reply
    forced = forced_call(fmt, [function], True)
    assert text.startswith(forced.prefill)
    rd = ReplyReader(fmt, prefill=forced.prefill, forced=function["name"])
    assert calls_of(rd.read(text[len(forced.prefill):])) == [(function["name"], args)]
    # an engine without grammars: the pre-fill alone, the reply cut at the stop string
    plain = forced_call(fmt, [function], False)
    assert text.startswith(plain.prefill) and plain.constraint is None
    cut = text[:text.index(plain.stop[0])] if plain.stop else text
    rd = ReplyReader(fmt, prefill=plain.prefill, forced=function["name"])
    assert calls_of(rd.read(cut[len(plain.prefill):])) == [(function["name"], args)]


@pytest.mark.parametrize("tool", sorted(MINE))
def test_forced_call_grammars_compile(reg, tool):
    pytest.importorskip("llguidance")
    from superfluid.core import constrain
    from superfluid.core.request import SamplingParams

    fmt = reg.tool_format(tool)
    for functions in ([WEATHER], [WEATHER, TIME, SEARCH, OPTIONS, {"name": "now"}]):
        constrain.check(SamplingParams(json_schema=forced_call(fmt, functions, True).constraint))


def test_detected_formats_are_resolvable_by_name(reg):
    for name in MINE:
        assert reg.resolve(None, name, "none") == Detected(reg.tool_format(name), None, "option", "option")

"""Tool-call formats of Qwen3-Coder (XML parameters), Llama 3.x, Firefunction v2, Mistral (Nemo's
JSON list, Small 3.2's and Ministral 3's ``[TOOL_CALLS]NAME[ARGS]``, the ``[THINK]`` span) and
Apriel 1.5: each family's real templates round-trip, are detected as theirs, and their replies
read the same whole and streamed; forced calls written as the grammar writes them read back."""

from __future__ import annotations

import json
import pathlib

import pytest

from superfluid.core.formats.forced import forced_call
from superfluid.core.formats.reader import ReplyReader
from superfluid.core.formats.stream import StreamReader
from superfluid.core.request import TEXT_VALUE
from superfluid.plugins.formats import builtin_registry, roundtrip

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"


REG = builtin_registry()
FIRE_KWARGS = {"functions": json.dumps([t["function"] for t in roundtrip.TOOLS]), "datetime": "2024-07-26"}


def template(stem: str) -> str:
    path = TEMPLATES / f"{stem}.jinja"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path.read_text()


def fmt(name: str):
    return REG.tool_format(name)


def read(name: str, text: str, partial: bool = False, reasoning: str | None = None):
    reader = ReplyReader(fmt(name), REG.reasoning_format(reasoning) if reasoning else None)
    return reader.read(text, partial)


def streamed(name: str, text: str, reasoning: str | None = None):
    """(content, reasoning, [(name, arguments, id)]) that a character-by-character stream sums to."""
    stream = StreamReader(ReplyReader(fmt(name), REG.reasoning_format(reasoning) if reasoning else None))
    deltas = [stream.feed(c) for c in text] + [stream.finish()[0]]
    content = "".join(d.content for d in deltas)
    thought = "".join(d.reasoning for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.calls:
            entry = calls.setdefault(c.index, [c.name, "", c.id])
            entry[1] += c.arguments
    return content, thought, [tuple(calls[i]) for i in sorted(calls)]


def assert_prefix_reads(name: str, text: str, reasoning: str | None = None):
    """Every partial read of every prefix of ``text`` is a prefix of the whole read."""
    whole = read(name, text, reasoning=reasoning)
    for n in range(len(text) + 1):
        part = read(name, text[:n], partial=True, reasoning=reasoning)
        assert whole.content.startswith(part.content), (n, part.content)
        assert whole.reasoning.startswith(part.reasoning), (n, part.reasoning)
        assert len(part.calls) <= len(whole.calls), n
        for got, full in zip(part.calls, whole.calls):
            assert got.name == full.name and full.arguments.startswith(got.arguments), (n, got, full)
    return whole


# ---- round trips over the real templates --------------------------------------------------------

#: a reasoning format another family module owns: whichever is detected
ANY = object()
# (template, format, reasoning, most calls the template renders, template kwargs)
ROUND_TRIPS = [
    ("Qwen3-Coder", "qwen3-coder", None, 2, None),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "qwen3-coder", "think", 2, None),
    ("stepfun-ai-Step-3.5-Flash", "qwen3-coder", "think", 2, None),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3", None, 1, None),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3", None, 1, None),
    # a built-in tool: <|python_tag|>get_weather.call(city="Paris")
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3", None, 1, {"builtin_tools": ["get_weather"]}),
    ("fireworks-ai-llama-3-firefunction-v2", "firefunction-v2", None, 2, FIRE_KWARGS),
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", None, 2, None),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral", "mistral", 2, None),
    ("unsloth-Apriel-1.5", "apriel", ANY, 2, None),
]


@pytest.mark.parametrize("stem,tool,reasoning,most,kwargs", ROUND_TRIPS)
def test_template_is_detected_and_round_trips(stem, tool, reasoning, most, kwargs):
    source = template(stem)
    detected = REG.resolve(source)
    assert detected.tool_format.name == tool
    if reasoning is not ANY:
        assert (detected.reasoning.name if detected.reasoning else None) == reasoning
    for calls in range(1, most + 1):
        for stream in (None, "chars"):
            result = roundtrip.check(source, detected, calls=calls, stream=stream, kwargs=kwargs)
            assert result.ok, (calls, stream, result)


def test_llama3_templates_refuse_two_calls():
    """Meta's templates raise on parallel calls, so only one call can round-trip."""
    source = template("meta-llama-Llama-3.1-8B-Instruct")
    assert not roundtrip.check(source, REG.resolve(source), calls=2).ok


def test_mistral_nemo_round_trips_without_a_system_message():
    """Nemo's template puts the system message in the last user turn, so the prompt of a
    conversation with one is not a prefix of the conversation with the reply; without it, it is."""
    source = template("mistralai-Mistral-Nemo-Instruct-2407")
    detected = REG.resolve(source)
    assert detected.tool_format.name == "mistral-nemo"
    for calls in (1, 2):
        reply = next(roundtrip.assistant_variants(calls, reasoning=False))
        prompt, output = roundtrip.model_output(source, reply, history=[roundtrip.USER])
        assert output.startswith("[TOOL_CALLS][{")
        expected = roundtrip.expected_message(reply, output)
        for pieces in (None, list(output)):
            assert roundtrip.read_message(detected, prompt, output, pieces=pieces) == expected
        ids = [c.id for c in read("mistral-nemo", output).calls]
        assert ids == [cid for _, _, cid in roundtrip.CALLS[:calls]]


def test_families_that_share_markers_keep_their_own_detection():
    """The new formats do not take templates from Hermes (which Qwen3 and QwQ use)."""
    for stem in ("Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct"):
        assert REG.resolve(template(stem)).tool_format.name == "hermes", stem
    # Apriel 1.6 writes its calls as 1.5 does
    assert REG.resolve(template("Apriel-1.6-15b-Thinker-fixed")).tool_format.name == "apriel"
    # Seed-OSS writes <function=/<parameter= but inside <seed:tool_call>: not this XML family
    assert fmt("qwen3-coder").detect(template("ByteDance-Seed-OSS")) == 0
    # Functionary v3.1 is Llama 3 with its own markers: Llama 3's evidence is not there
    assert fmt("llama3").detect(template("meetkai-functionary-medium-v3.1")) == 0


# ---- Qwen3-Coder's XML parameters ---------------------------------------------------------------

XML_TWO = ("I will look.\n<tool_call>\n<function=search>\n<parameter=query>\nrust <b>async</b>\nand more\n"
           "</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{\"lang\": [\"en\"]}\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


def test_xml_values_are_text_unless_json_and_stream_a_parameter_at_a_time():
    whole = assert_prefix_reads("qwen3-coder", XML_TWO)
    assert whole.content == "I will look."
    assert [(c.name, c.arguments_object()) for c in whole.calls] == [
        ("search", {"query": "rust <b>async</b>\nand more", "limit": 5, "filters": {"lang": ["en"]}}),
        ("get_time", {})]
    assert [(n, a) for n, a, _ in streamed("qwen3-coder", XML_TWO)[2]] == [(c.name, c.arguments) for c in whole.calls]
    # before its first parameter is complete, a call's arguments are empty
    cut = XML_TWO.index("rust")
    assert read("qwen3-coder", XML_TWO[:cut], partial=True).calls[0].arguments == ""


def test_xml_partial_markers_are_held_back_and_broken_calls_stay_content():
    assert read("qwen3-coder", "Let me check <tool_ca", partial=True).content == "Let me check"
    assert read("qwen3-coder", "Let me check <function", partial=True).content == "Let me check"
    assert read("qwen3-coder", "<tool_call>\n<function=sea", partial=True).calls == ()
    broken = "Sure <tool_call>\n{\"name\": \"search\"}\n</tool_call>"
    assert read("qwen3-coder", broken).content == broken and read("qwen3-coder", broken).calls == ()
    unclosed = "<tool_call>\n<function=search>\n<parameter=query>\nrust"
    assert read("qwen3-coder", unclosed).calls == ()


def test_xml_call_stopped_before_its_closing_tag_still_reads():
    """Without a grammar a forced call stops at ``</function>`` (call_stop), which the reply lacks."""
    text = "<tool_call>\n<function=search>\n<parameter=query>\nrust\n</parameter>\n"
    assert fmt("qwen3-coder").call_stop and not text.endswith(fmt("qwen3-coder").call_stop)
    assert [(c.name, c.arguments_object()) for c in read("qwen3-coder", text).calls] == [("search", {"query": "rust"})]


# ---- Llama 3.x -----------------------------------------------------------------------------------

def test_llama3_reads_the_bare_object_the_python_tag_and_builtin_tools():
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert [(c.name, c.arguments_object()) for c in assert_prefix_reads("llama3", bare).calls] == [
        ("get_weather", {"city": "Paris"})]
    tagged = 'Searching.<|python_tag|>{"type": "function", "name": "get_time", "parameters": {"timezone": "UTC"}}'
    whole = assert_prefix_reads("llama3", tagged)
    assert whole.content == "Searching." and whole.calls[0].name == "get_time"
    builtin = '<|python_tag|>brave_search.call(query="weather in Paris", count=3, safe=True)'
    whole = assert_prefix_reads("llama3", builtin)
    assert [(c.name, c.arguments_object()) for c in whole.calls] == [
        ("brave_search", {"query": "weather in Paris", "count": 3, "safe": True})]
    two = bare + '; {"name": "get_time", "parameters": {"timezone": "UTC"}}'
    assert [c.name for c in assert_prefix_reads("llama3", two).calls] == ["get_weather", "get_time"]


def test_llama3_partial_markers_and_broken_calls():
    assert read("llama3", "One moment <|python_t", partial=True).content == "One moment"
    assert read("llama3", '{"na', partial=True).content == ""  # may be a call: nothing is sent yet
    not_a_call = '{"answer": 42}'
    assert read("llama3", not_a_call).content == not_a_call and not read("llama3", not_a_call).calls
    assert read("llama3", "<|python_tag|>print(1)").calls == ()
    assert read("llama3", "The JSON {\"name\": \"x\"} is an example.").calls == ()  # not at the start


# ---- Mistral ------------------------------------------------------------------------------------

def test_mistral_ids_come_back_whole_and_streamed():
    small = ('[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}'
             '[TOOL_CALLS]get_time[CALL_ID]ghiJKL456[ARGS]{"timezone": "UTC"}')
    nemo = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, '
            '{"name": "get_time", "arguments": {"timezone": "UTC"}, "id": "ghiJKL456"}]')
    for name in ("mistral", "mistral-nemo"):
        for text in (small, nemo):
            whole = assert_prefix_reads(name, text)
            assert [(c.name, c.id) for c in whole.calls] == [("get_weather", "abcDEF123"), ("get_time", "ghiJKL456")]
            assert [(n, i) for n, _, i in streamed(name, text)[2]] == [("get_weather", "abcDEF123"),
                                                                       ("get_time", "ghiJKL456")]


def test_ministral_thinks_in_brackets_then_calls():
    text = '[THINK]Paris needs the weather tool.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    whole = assert_prefix_reads("mistral", text, reasoning="mistral")
    assert (whole.reasoning, whole.content) == ("Paris needs the weather tool.", "Checking.")
    assert [(c.name, c.arguments_object(), c.id) for c in whole.calls] == [("get_weather", {"city": "Paris"}, None)]
    content, thought, calls = streamed("mistral", text, reasoning="mistral")
    assert (thought, content, [(n, a) for n, a, _ in calls]) == (
        whole.reasoning, whole.content, [("get_weather", '{"city": "Paris"}')])


def test_mistral_partial_markers_and_broken_calls():
    for name in ("mistral", "mistral-nemo"):
        assert read(name, "Let me see [TOOL_CA", partial=True).content == "Let me see"
        assert read(name, "[TOOL_CALLS]get_weather[CALL_", partial=True).calls == ()
        assert read(name, "[TOOL_CALLS]get_weather[ARGS]", partial=True).calls[0].arguments == ""
        for broken in ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get_weather[ARGS]nope",
                       '[TOOL_CALLS][{"name": "get_weather", "arguments": {}]', "[TOOL_CALLS]get_weather"):
            got = read(name, broken)
            assert (got.content, got.calls) == (broken, ()), (name, broken)


# ---- Firefunction and Apriel 1.5 ----------------------------------------------------------------

def test_json_list_families_read_content_then_calls():
    fire = 'Let me check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
           '{"name": "get_time", "arguments": {"timezone": "UTC"}}]'
    apriel = 'Let me check.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
             '{"name": "get_time", "arguments": {"timezone": "UTC"}}]</tool_calls>'
    for name, text in (("firefunction-v2", fire), ("apriel", apriel)):
        whole = assert_prefix_reads(name, text)
        assert whole.content == "Let me check."
        assert [c.name for c in whole.calls] == ["get_weather", "get_time"]
        assert [(n, a) for n, a, _ in streamed(name, text)[2]] == [(c.name, c.arguments) for c in whole.calls]
    assert read("firefunction-v2", "Hmm functool", partial=True).content == "Hmm"
    assert read("apriel", "Hmm <tool_ca", partial=True).content == "Hmm"
    for name, broken in (("firefunction-v2", "functools[nope]"), ("apriel", "<tool_calls>{\"name\": 1}")):
        assert read(name, broken).content == broken and not read(name, broken).calls


# ---- forced calls --------------------------------------------------------------------------------

SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["query"]}}
MINE = ("qwen3-coder", "llama3", "firefunction-v2", "mistral-nemo", "mistral", "apriel")


def grammar_text(fmt_, function: dict, args: dict) -> str:
    """What the grammar of ``fmt_.call_choice`` lets a model write, closings of every piece
    included (its ``rest`` read in depth), JSON as json.dumps lays it out."""
    def fill(choice, value) -> str:
        text = choice.lead
        if choice.schema == TEXT_VALUE:
            text += value
        elif choice.schema is not None:
            text += json.dumps(value, ensure_ascii=False)
        for part in choice.rest:
            key = part.lead[len("<parameter="):-2] if part.lead.startswith("<parameter=") else None
            if key is None:
                text += fill(part, None)
            elif key in args:
                text += fill(part, args[key])
            else:
                assert part.optional, key
        return text
    return fill(fmt_.call_choice(function), args) + fmt_.call_tail


@pytest.mark.parametrize("name", MINE)
def test_a_forced_call_reads_back(name):
    f = fmt(name)
    for args in ({"query": "rust async", "limit": 5, "tags": ["a", "b"]}, {"query": "rust"}):
        for text in (roundtrip.written_call(f, SEARCH, args), grammar_text(f, SEARCH, args)):
            whole = ReplyReader(f, tools=frozenset({"search"}), forced="search").read(text)
            assert [(c.name, c.arguments_object()) for c in whole.calls] == [("search", args)], text


def test_xml_forced_call_holds_strings_as_text_and_the_rest_to_their_schemas():
    choice = fmt("qwen3-coder").call_choice(SEARCH)
    assert choice.lead == "<tool_call>\n<function=search>\n"
    assert [(p.lead, p.schema, p.optional) for p in choice.rest] == [
        ("<parameter=query>\n", TEXT_VALUE, False), ("<parameter=limit>\n", {"type": "integer"}, True),
        ("<parameter=tags>\n", SEARCH["parameters"]["properties"]["tags"], True)]
    assert all(p.rest[0].lead == "\n</parameter>\n" for p in choice.rest)


@pytest.mark.parametrize("name", MINE)
def test_forced_call_grammar_compiles(name):
    pytest.importorskip("llguidance")
    from superfluid.core import constrain
    from superfluid.core.request import SamplingParams

    for functions in ([SEARCH], [SEARCH, roundtrip.WEATHER["function"]]):
        forced = forced_call(fmt(name), functions, True)
        constrain.check(SamplingParams(json_schema=forced.constraint))

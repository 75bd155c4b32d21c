"""Tool-call formats of DeepSeek (R1, V3.1, V3.2's DSML), gpt-oss (harmony channels), GLM-4.5/4.6,
Kimi-K2, MiniMax-M2 and Seed-OSS (with its ``<seed:think>`` span): each family's real templates
round-trip, are detected as theirs, read the same whole and streamed (a partial read never lets a
marker's beginning into the content), leave broken calls as content, and read back a forced call
as its grammar writes it."""

from __future__ import annotations

import json
import os
import pathlib

import jinja2
import pytest

from superfluid.core.chat import render_chat
from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.forced import forced_call
from superfluid.core.formats.reader import ReplyReader
from superfluid.core.request import TEXT_VALUE
from superfluid.plugins.formats import builtin_registry, roundtrip

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"


REG = builtin_registry()


def template(stem: str) -> str:
    path = TEMPLATES / f"{stem}.jinja"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path.read_text()


def fmt(name: str):
    return REG.tool_format(name)


def reader(name: str, reasoning: str | None = None, inside: bool = False, **kw) -> ReplyReader:
    return ReplyReader(fmt(name), REG.reasoning_format(reasoning) if reasoning else None, inside=inside, **kw)


def read(name: str, text: str, partial: bool = False, reasoning: str | None = None, inside: bool = False):
    return reader(name, reasoning, inside).read(text, partial)


def assert_prefix_reads(name: str, text: str, reasoning: str | None = None, inside: bool = False):
    """Every partial read of every prefix of ``text`` is a prefix of the whole read (content,
    reasoning, each call's arguments), as streaming needs."""
    whole = read(name, text, reasoning=reasoning, inside=inside)
    for n in range(len(text) + 1):
        part = read(name, text[:n], partial=True, reasoning=reasoning, inside=inside)
        assert whole.content.startswith(part.content), (n, part.content, whole.content)
        assert whole.reasoning.startswith(part.reasoning), (n, part.reasoning)
        assert len(part.calls) <= len(whole.calls), n
        for got, full in zip(part.calls, whole.calls):
            assert got.name == full.name and got.id == full.id, (n, got, full)
            assert full.arguments.startswith(got.arguments), (n, got, full)
    return whole


# ---- round trips over the real templates --------------------------------------------------------

# (template, tool format, reasoning format, most calls the template renders, template kwargs)
ROUND_TRIPS = [
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v3.1", "think", 2, {}),
    # V3.2's generation prompt without thinking ends <think></think> but its history writes only
    # </think>, so the prompt is no prefix of the conversation: the round trip is made thinking
    ("deepseek-ai-DeepSeek-V3.2", "deepseek-v3.2", "think", 2, {"thinking": True}),
    ("GLM-4.6", "glm-4.5", "think", 2, {}),
    ("MiniMax-M2", "minimax-m2", "think", 2, {}),
    ("ByteDance-Seed-OSS", "seed-oss", "seed-think", 2, {}),
    ("moonshotai-Kimi-K2", "kimi-k2", None, 2, {}),
    ("openai-gpt-oss-120b", "gpt-oss", None, 1, {}),  # harmony: one call per message
]


@pytest.mark.parametrize("stem,tool,think,most,kwargs", ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_template_round_trips(stem, tool, think, most, kwargs):
    text = template(stem)
    detected = REG.resolve(text)
    assert (detected.tool_format.name, detected.reasoning.name if detected.reasoning else None) == (tool, think)
    for calls in range(most + 1):
        for stream in (None, "chars"):
            result = roundtrip.check(text, detected, calls=calls, kwargs=kwargs, stream=stream)
            assert result.ok, (calls, stream, result.output, result.expected, result.got, result.note)


def test_gpt_oss_renders_one_call_per_message_and_reads_its_thinking():
    text = template("openai-gpt-oss-120b")
    detected = REG.resolve(text)
    assert not roundtrip.check(text, detected, calls=2).ok  # the template writes tool_calls[0] only
    reply = next(r for r in roundtrip.assistant_variants(1, True) if "thinking" in r)
    prompt, output = roundtrip.model_output(text, reply)
    assert "<|channel|>analysis<|message|>" in output
    for pieces in (None, list(output)):
        got = roundtrip.read_message(detected, prompt, output, pieces=pieces)
        assert got == roundtrip.expected_message(reply, output)
        assert got["reasoning_content"] == roundtrip.REASONING


def test_deepseek_v32_needs_thinking_for_the_harness():
    """Documents why ROUND_TRIPS passes ``thinking``: without it the prompt is no prefix."""
    reply = next(roundtrip.assistant_variants(1, True))
    assert roundtrip.model_output(template("deepseek-ai-DeepSeek-V3.2"), reply) is None


def diverging_output(text: str, reply: dict) -> tuple[str, str]:
    """(shared prompt, model text) where the generation prompt is no prefix of the conversation,
    as llama.cpp's tests take them: the text after the longest common prefix, backed off to the
    start of a marker it would cut. (R1 templates end their prompt ``<think>\\n`` but write a
    past call without it.) Rendered without tools: the distill never shows them, and llama.cpp's
    R1 template pipes a ``map`` generator to ``tojson``, which transformers' filter (and ours)
    cannot serialise."""
    prompt = render_chat(text, [roundtrip.SYSTEM, roundtrip.USER])
    full = render_chat(text, [roundtrip.SYSTEM, roundtrip.USER, reply], add_generation_prompt=False)
    k = len(os.path.commonprefix([prompt, full]))
    if full.rfind("<", 0, k) > full.rfind(">", 0, k):
        k = full.rfind("<", 0, k)
    return full[:k], roundtrip.end_of_turn_cut(full[k:])


@pytest.mark.parametrize("stem", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1"])
def test_deepseek_r1_templates_read_back_their_calls(stem):
    text = template(stem)
    detected = REG.resolve(text)
    assert (detected.tool_format.name, detected.reasoning.name) == ("deepseek-r1", "think")
    for calls in (1, 2):
        reply = next(r for r in roundtrip.assistant_variants(calls, True)
                     if all(name in diverging_output(text, r)[1] for name, _, _ in roundtrip.CALLS[:calls]))
        prompt, output = diverging_output(text, reply)
        assert output.startswith("<｜tool▁calls▁begin｜>")
        for pieces in (None, list(output)):
            got = roundtrip.read_message(detected, prompt, output, pieces=pieces)
            assert got == roundtrip.expected_message(reply, output), (output, got)


def test_deepseek_r1_reads_a_thinking_reply_after_its_prompt():
    prompt = render_chat(template("llama-cpp-deepseek-r1"), [roundtrip.USER])
    assert REG.reasoning_format("think").opened_by(prompt)
    output = ("I should look it up.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
              'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    whole = assert_prefix_reads("deepseek-r1", output, "think", inside=True)
    assert (whole.reasoning, whole.content) == ("I should look it up.", "")
    assert [(c.name, c.arguments_object()) for c in whole.calls] == [("get_weather", {"city": "Paris"})]


def _unsandboxed(text: str, messages: list[dict], generation: bool) -> str:
    """What transformers would render if its sandbox allowed ``list.append`` (Kimi's templates)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False)
    return env.from_string(text).render(messages=messages, tools=roundtrip.TOOLS, add_generation_prompt=generation)


@pytest.mark.parametrize("stem,think", [("Kimi-K2-Instruct", None), ("Kimi-K2-Thinking", "think")])
def test_kimi_templates_render_in_our_sandbox_and_their_calls_read_back(stem, think):
    # transformers' immutable sandbox refuses their list.append; ours lets lists change, so a
    # render through render_chat must equal a render without any sandbox
    text = template(stem)
    detected = REG.resolve(text)
    assert (detected.tool_format.name, detected.reasoning.name if detected.reasoning else None) == ("kimi-k2", think)
    history = [roundtrip.SYSTEM, roundtrip.USER]
    reply = next(roundtrip.assistant_variants(2, True))
    prompt = _unsandboxed(text, history, True)
    full = _unsandboxed(text, [*history, reply], False)
    assert render_chat(text, [*history, reply], tools=roundtrip.TOOLS, add_generation_prompt=False) == full
    assert full.startswith(prompt)
    output = roundtrip.end_of_turn_cut(full[len(prompt):])
    for pieces in (None, list(output)):
        got = roundtrip.read_message(detected, prompt, output, pieces=pieces)
        assert got == roundtrip.expected_message(reply, output), (output, got)
    calls = ReplyReader(detected.tool_format, detected.reasoning).read(output).calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


# ---- detection ------------------------------------------------------------------------------------

DETECTED = [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-r1", "think"),
    ("llama-cpp-deepseek-r1", "deepseek-r1", "think"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v3.1", "think"),
    ("deepseek-ai-DeepSeek-V3.2", "deepseek-v3.2", "think"),
    ("openai-gpt-oss-120b", "gpt-oss", None),
    ("GLM-4.6", "glm-4.5", "think"),
    ("Kimi-K2-Instruct", "kimi-k2", None),
    ("Kimi-K2-Thinking", "kimi-k2", "think"),
    ("moonshotai-Kimi-K2", "kimi-k2", None),
    ("MiniMax-M2", "minimax-m2", "think"),
    ("ByteDance-Seed-OSS", "seed-oss", "seed-think"),
]


@pytest.mark.parametrize("stem,tool,think", DETECTED, ids=[d[0] for d in DETECTED])
def test_detection(stem, tool, think):
    detected = REG.resolve(template(stem))
    assert detected.tool_format.name == tool
    assert (detected.reasoning.name if detected.reasoning else None) == think


def test_detection_beats_the_lookalike_families():
    glm, seed = template("GLM-4.6"), template("ByteDance-Seed-OSS")
    assert fmt("glm-4.5").detect(glm) > fmt("hermes").detect(glm) > 0
    for other in ("qwen3-coder", "hermes"):
        if other in REG.tool_formats:
            assert fmt("seed-oss").detect(seed) > 20 >= REG.tool_formats[other].detect(seed)
    assert REG.reasoning_formats["seed-think"].detect(seed) > REG.reasoning_formats["think"].detect(seed)
    # no format of this group claims a template of another family
    for stem in ("Qwen-Qwen3-0.6B", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "Qwen3-Coder"):
        path = TEMPLATES / f"{stem}.jinja"
        if path.exists():
            assert REG.resolve(path.read_text()).tool_format.name not in {s[0] for s in SAMPLES}


# ---- streaming: prefixes, markers held back -------------------------------------------------------

# (format, reasoning, a reply in the family's syntax, expected calls)
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"timezone": "Europe/Paris"})
SAMPLES = [
    ("deepseek-r1", "think", "Checking.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
     '```json\n{"timezone": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [WEATHER, TIME]),
    ("deepseek-v3.1", "think", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "Europe/Paris"}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [WEATHER, TIME]),
    ("deepseek-v3.2", "think", 'Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="timezone" string="true">Europe/Paris'
     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", [WEATHER, TIME]),
    ("kimi-k2", "think", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
     '<|tool_call_argument_begin|>{"timezone": "Europe/Paris"}<|tool_call_end|><|tool_calls_section_end|>',
     [WEATHER, TIME]),
    ("glm-4.5", "think", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "</tool_call>\n<tool_call>get_time\n<arg_key>timezone</arg_key>\n<arg_value>Europe/Paris</arg_value>\n"
     "</tool_call>",
     [WEATHER, TIME]),
    ("minimax-m2", "think", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
     '</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="timezone">Europe/Paris</parameter>\n'
     '</invoke>\n'
     "</minimax:tool_call>", [WEATHER, TIME]),
    ("seed-oss", "seed-think", "Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
     "</parameter>\n"
     "</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n<parameter=timezone>Europe/Paris"
     "</parameter>\n</function>\n</seed:tool_call>", [WEATHER, TIME]),
    ("gpt-oss", None, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant to=functions.'
     'get_time<|channel|>commentary json<|message|>{"timezone": "Europe/Paris"}<|call|>', [WEATHER, TIME]),
]
OPENERS = {"deepseek-r1": "<｜tool▁calls▁begin｜>", "deepseek-v3.1": "<｜tool▁calls▁begin｜>",
           "deepseek-v3.2": "<｜DSML｜function_calls>", "kimi-k2": "<|tool_calls_section_begin|>",
           "glm-4.5": "<tool_call>", "minimax-m2": "<minimax:tool_call>", "seed-oss": "<seed:tool_call>"}


@pytest.mark.parametrize("name,think,text,calls", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_every_prefix_reads_as_a_prefix_of_the_whole(name, think, text, calls):
    whole = assert_prefix_reads(name, text, think)
    assert whole.content == "Checking."
    assert [(c.name, c.arguments_object()) for c in whole.calls] == calls
    with_thinking = {"think": "<think>Hmm.</think>", "seed-think": "<seed:think>Hmm.</seed:think>", None: ""}[think]
    if with_thinking:
        again = assert_prefix_reads(name, with_thinking + text, think)
        assert (again.reasoning, again.content, again.calls) == ("Hmm.", "Checking.", whole.calls)


@pytest.mark.parametrize("name", sorted(OPENERS))
def test_a_partial_opener_never_reaches_the_content(name):
    opener = OPENERS[name]
    for k in range(1, len(opener)):
        got = read(name, "Sure." + opener[:k], partial=True)
        assert (got.content, got.calls) == ("Sure.", ()), (k, got)
    # whole, the same text is content: the marker never came
    assert read(name, "Sure." + opener[:-1]).content == "Sure." + opener[:-1]


def test_gpt_oss_holds_back_its_markers():
    for text in ("<|channel|>final<|message|>It is sunny.<|en", "<|channel|>final<|message|>It is sunny.<|",
                 "<|channel|>final<|message|>It is sunny.", "<|channel|>final<|message|>It is sunny.<|end|><|st"):
        got = read("gpt-oss", text, partial=True)
        assert (got.content, got.calls) == ("It is sunny.", ()), text
    for text in ("<|chan", " t", "<|channel|>commentary to=functions.get_wea"):
        got = read("gpt-oss", text, partial=True)
        assert (got.content, got.reasoning, got.calls) == ("", "", ()), text
    call = read("gpt-oss", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Pa', partial=True)
    assert [(c.name, c.arguments) for c in call.calls] == [("get_weather", '{"city": "Pa')]
    before = read("gpt-oss", " to=functions.get_weather<|channel|>commentary json<|message|>", partial=True)
    assert [(c.name, c.arguments) for c in before.calls] == [("get_weather", "")]


def test_gpt_oss_reads_channels():
    text = ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>"
            "It is sunny.<|return|>")
    whole = assert_prefix_reads("gpt-oss", text)
    assert (whole.reasoning, whole.content, whole.calls) == ("Think first.", "It is sunny.", ())
    # the prompt opened the analysis message; plain text without a header is content
    inside = read("gpt-oss", "Still thinking.<|end|><|start|>assistant<|channel|>final<|message|>Done.", inside=True)
    assert (inside.reasoning, inside.content) == ("Still thinking.", "Done.")
    assert read("gpt-oss", "Just text.").content == "Just text."
    # arguments the template wrote as a JSON string read as the object inside it
    quoted = read("gpt-oss", " to=functions.get_weather<|channel|>commentary json<|message|>"
                             '"{\\"city\\": \\"Paris\\"}"')
    assert [(c.name, c.arguments_object()) for c in quoted.calls] == [WEATHER]


# ---- values, ids, broken calls --------------------------------------------------------------------

def test_kimi_keeps_the_call_id():
    calls = read("kimi-k2", SAMPLES[3][2]).calls
    assert [(c.name, c.id) for c in calls] == [("get_weather", "functions.get_weather:0"),
                                               ("get_time", "functions.get_time:1")]


def test_tagged_values_are_text_for_strings_and_json_otherwise():
    glm = read("glm-4.5", "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>l</arg_key>\n"
                          '<arg_value>["a", 1]</arg_value>\n<arg_key>s</arg_key>\n<arg_value>two words</arg_value>\n'
                          "<arg_key>x</arg_key>\n<arg_value>NaN</arg_value>\n</tool_call>").calls
    assert glm[0].arguments_object() == {"n": 3, "l": ["a", 1], "s": "two words", "x": "NaN"}
    dsml = read("deepseek-v3.2", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
                                 '<｜DSML｜parameter name="zip" string="true">75001</｜DSML｜parameter>\n'
                                 '<｜DSML｜parameter name="n" string="false">75001</｜DSML｜parameter>\n'
                                 "</｜DSML｜invoke>\n</｜DSML｜function_calls>").calls
    assert dsml[0].arguments_object() == {"zip": "75001", "n": 75001}
    seed = read("seed-oss", "<seed:tool_call>\n<function=f>\n<parameter=b>True</parameter>\n<parameter=d>{'k': None}"
                            "</parameter>\n<parameter=s>print('x')</parameter>\n</function>\n</seed:tool_call>").calls
    assert seed[0].arguments_object() == {"b": True, "d": {"k": None}, "s": "print('x')"}


BROKEN = [
    ("deepseek-r1", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": '),
    ("deepseek-v3.1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>not json<｜tool▁call▁end｜>"),
    ("deepseek-v3.2", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">'
                      "abc</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    ("kimi-k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1, 2]"
                "<|tool_call_end|><|tool_calls_section_end|>"),
    ("glm-4.5", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"),
    ("minimax-m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\noops'),
    ("seed-oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"),
    ("seed-oss", "<seed:tool_call>\nno function here"),
]


@pytest.mark.parametrize("name,text", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_a_broken_call_stays_content(name, text):
    got = read(name, "Let me see. " + text)
    assert (got.content, got.calls) == ("Let me see. " + text, ())


def test_a_broken_gpt_oss_call_stays_content():
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": '
    got = read("gpt-oss", "<|channel|>analysis<|message|>Let me see.<|end|>" + call)
    assert (got.reasoning, got.content, got.calls) == ("Let me see.", call.strip(), ())
    for args in ("[1, 2]", '{"city": "Paris"} trailing'):
        got = read("gpt-oss", " to=functions.get_weather<|channel|>commentary json<|message|>" + args)
        assert got.calls == () and args in got.content


# ---- forced calls ---------------------------------------------------------------------------------

SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["query"]}}
JSON_FAMILIES = ("deepseek-r1", "deepseek-v3.1", "kimi-k2", "gpt-oss")
TAGGED_FAMILIES = ("deepseek-v3.2", "glm-4.5", "minimax-m2", "seed-oss")
ARGS = ({"query": "rust async", "limit": 5, "tags": ["a", "b"]}, {"query": "rust"})


def grammar_text(fmt_, function: dict, args: dict) -> str:
    """What the grammar of ``fmt_.call_choice`` lets a model write: every piece's ``rest`` (a
    parameter's closing tag) included, JSON as json.dumps lays it out, text values as they are.
    (roundtrip.written_call does not write a piece's own ``rest``, so the closings are missing.)"""
    def fill(choice, value) -> str:
        text = choice.lead
        if choice.schema == TEXT_VALUE:
            text += value
        elif choice.schema is not None:
            text += json.dumps(value, ensure_ascii=False)
        for part in choice.rest:
            key = next((k for k in function["parameters"]["properties"]
                        if any(f"{a}{k}{b}" in part.lead for a, b in ((">", "<"), ("=", ">"), ('"', '"')))), None)
            if key is None:
                text += fill(part, None)
            elif key in args:
                text += fill(part, args[key])
            else:
                assert part.optional, key
        return text
    return fill(fmt_.call_choice(function), args) + fmt_.call_tail


@pytest.mark.parametrize("name", JSON_FAMILIES + TAGGED_FAMILIES)
def test_a_forced_call_reads_back(name):
    f = fmt(name)
    for args in ARGS:
        texts = [grammar_text(f, SEARCH, args)]
        if name in JSON_FAMILIES:
            texts.append(roundtrip.written_call(f, SEARCH, args))
            assert texts[0] == texts[1]
        # an engine without grammars stops at call_stop, which the reply does not hold
        texts.append(texts[0][:texts[0].index(f.call_stop)])
        for text in texts:
            whole = ReplyReader(f, tools=frozenset({"search"}), forced="search").read(text)
            assert [(c.name, c.arguments_object()) for c in whole.calls] == [("search", args)], text
            assert whole.content == "", text


def test_tagged_forced_calls_hold_strings_as_text_and_the_rest_to_their_schemas():
    choice = fmt("minimax-m2").call_choice(SEARCH)
    assert choice.lead == '<minimax:tool_call>\n<invoke name="search">'
    assert [(p.lead, p.schema, p.optional) for p in choice.rest] == [
        ('\n<parameter name="query">', TEXT_VALUE, False), ('\n<parameter name="limit">', {"type": "integer"}, True),
        ('\n<parameter name="tags">', SEARCH["parameters"]["properties"]["tags"], True)]
    assert all(p.rest[0].lead == "</parameter>" for p in choice.rest)
    leads = [p.lead for p in fmt("deepseek-v3.2").call_choice(SEARCH).rest]
    assert leads[0].endswith('"query" string="true">') and leads[1].endswith('"limit" string="false">')


@pytest.mark.parametrize("name", JSON_FAMILIES + TAGGED_FAMILIES)
def test_forced_call_grammar_compiles(name):
    pytest.importorskip("llguidance")
    from superfluid.core import constrain
    from superfluid.core.request import SamplingParams

    for functions in ([SEARCH], [SEARCH, roundtrip.WEATHER["function"]]):
        forced = forced_call(fmt(name), functions, True)
        constrain.check(SamplingParams(json_schema=forced.constraint))


def test_detected_formats_are_ours():
    """Every format this group adds is registered once, under the name the tests use."""
    names = {s[0] for s in SAMPLES}
    assert names <= set(REG.tool_formats) and "seed-think" in REG.reasoning_formats
    assert all(REG.tool_formats[n].description for n in names)

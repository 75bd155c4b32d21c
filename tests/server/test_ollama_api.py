"""Ollama's API against the real server and model, through the ``ollama`` Python client and
LangChain's ``ChatOllama`` (what Open WebUI-style tools and editor plugins speak): chat and
generate, streamed and whole, tools, format with a schema, embed, list, show, ps, version, the
probes, errors in Ollama's shape, keys and an alias's class, and 8 clients at once on 8 lanes."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

ollama = pytest.importorskip("ollama")

KEY = "sk-ollama-test"
POLICY = f'[keys.tester]\nsha256 = "{hash_secret(KEY)}"\n'
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    policy = tmp_path_factory.mktemp("ollama-keys") / "keys.toml"
    policy.write_text(POLICY)
    return start_server("--key-policy", str(policy), "--max-batch", "8",
                        "--model-alias", "title-model=smollm2@background")


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.base, headers={"Authorization": f"Bearer {KEY}"})


def keyed(srv, path: str):
    req = urllib.request.Request(srv.base + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def openai_text(srv, messages, max_tokens=12) -> str:
    req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps({
        "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_chat_whole_and_streamed_equal_the_openai_route(client, srv):
    messages = [{"role": "user", "content": "Say hi."}]
    whole = client.chat(model="smollm2", messages=messages, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count > 5 and whole.total_duration > whole.eval_duration > 0
    streamed = list(client.chat(model="smollm2:latest", messages=messages, options=GREEDY, stream=True))
    assert [c.done for c in streamed].count(True) == 1 and streamed[-1].done and streamed[-1].eval_count == 12
    assert "".join(c.message.content for c in streamed) == whole.message.content == openai_text(srv, messages)


def test_generate_templated_raw_and_streamed(client):
    whole = client.generate(model="smollm2", prompt="Name a colour.", system="Be brief.", options=GREEDY)
    streamed = "".join(c.response for c in client.generate(model="smollm2", prompt="Name a colour.",
                                                           system="Be brief.", options=GREEDY, stream=True))
    assert whole.response and whole.response == streamed and whole.done_reason in ("stop", "length")
    raw = client.generate(model="smollm2", prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    assert raw.response.strip().startswith("5") and raw.prompt_eval_count < whole.prompt_eval_count  # no template


def test_format_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
              "additionalProperties": False}
    r = client.chat(model="smollm2", messages=[{"role": "user", "content": "Give me a name as JSON."}],
                    format=schema, options={"temperature": 0, "num_predict": 200})
    assert set(json.loads(r.message.content)) == {"name"}
    r = client.generate(model="smollm2", prompt="A name as JSON, please.", format=schema,
                        options={"temperature": 0, "num_predict": 200})
    assert set(json.loads(r.response)) == {"name"}
    r = client.generate(model="smollm2", prompt="A JSON object, please.", format="json",
                        options={"temperature": 0, "num_predict": 8})
    assert r.response.lstrip().startswith("{")  # json_object: an object from the first token


def test_tools_history_round_trips(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "18 C and sunny"}]
    r = client.chat(model="smollm2", messages=messages, tools=tools, options=GREEDY)
    assert r.done and r.prompt_eval_count > 40  # the call and its result are in the prompt


def test_embed_list_show_ps_version(client, srv):
    one = client.embed(model="smollm2", input="hello")
    two = client.embed(model="smollm2", input=["hello", "world"])
    assert len(one.embeddings) == 1 and len(two.embeddings) == 2 and one.embeddings[0] == two.embeddings[0]
    assert client.embeddings(model="smollm2", prompt="hello").embedding == pytest.approx(one.embeddings[0])
    names = {m.model for m in client.list().models}
    assert names == {"smollm2", "title-model"}
    show = client.show("smollm2")
    assert "completion" in show.capabilities and show.details.format == "gguf" and show.template
    ps = client.ps().models
    assert {m.name for m in ps} == names and ps[0].context_length == 2048
    with urllib.request.urlopen(srv.base + "/api/version", timeout=10) as r:  # a public probe
        assert json.loads(r.read())["version"]
    with urllib.request.urlopen(srv.base + "/", timeout=10) as r:
        assert r.read() == b"Ollama is running"


def test_load_and_unload_requests_answer_at_once(client):
    assert client.generate(model="smollm2", prompt="").done_reason == "load"
    assert client.chat(model="smollm2", messages=[], keep_alive=0).done_reason == "unload"


def test_errors_in_ollama_shape(client, srv):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "no-such-model" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}], options={"num_ctx": 100000})
    assert info.value.status_code == 400 and "num_ctx" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
    assert info.value.status_code == 400 and "mirostat" in info.value.error
    req = urllib.request.Request(srv.base + "/api/chat", data=b"{", headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as exc:  # no key: 401, as {"error": ...}
        assert exc.code == 401 and set(json.loads(exc.read())) == {"error"}


def test_an_alias_with_a_class_runs_at_that_class(client, srv):
    def background_requests() -> float:
        return sum(float(line.rpartition(" ")[2]) for line in keyed(srv, "/metrics").splitlines()
                   if line.startswith("superfluid_ttft_seconds_count") and 'qos="background"' in line)

    before = background_requests()
    client.chat(model="title-model", messages=[{"role": "user", "content": "A title, please."}], options=GREEDY)
    time.sleep(0.3)
    assert background_requests() == before + 1


def test_langchain_chat_ollama(srv):
    lc = pytest.importorskip("langchain_ollama")
    llm = lc.ChatOllama(model="smollm2", base_url=srv.base, temperature=0, num_predict=12,
                        client_kwargs={"headers": {"Authorization": f"Bearer {KEY}"}})
    text = llm.invoke("Say hi.").content
    assert text and text == "".join(chunk.content for chunk in llm.stream("Say hi."))


def test_eight_clients_at_once_get_eight_lanes(client, srv):
    busiest = []

    def run(i):
        return client.chat(model="smollm2", messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
                           options={"temperature": 0, "num_predict": 64})

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(8)]
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            slots = keyed(srv, "/slots")["models"]["smollm2"]["slots"]
            busiest.append(sum(s["state"] != "free" for s in slots))
            time.sleep(0.05)
        replies = [f.result(timeout=120) for f in futures]
    assert all(r.eval_count == 64 for r in replies)
    assert max(busiest) == 8  # all eight ran at once, where Ollama's default runs one

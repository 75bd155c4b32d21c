"""The Anthropic Messages API against the real server and model, driven by the ``anthropic`` SDK:
create (sync and async), the streaming helpers, a forced tool and a tool_result loop, stop
sequences, count_tokens, Anthropic-shaped errors (bad input, over-long prompts, keys), a
Claude-Code-shaped body, and the billing-header block that must not defeat the prefix cache.
With them, on the same server: model aliases (served by their model at their class on every
API, listed with the context window) and /metrics' per-route counts.

One server for the module (a key policy with one key capped at 64 reply tokens, /metrics open),
short replies."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

anthropic = pytest.importorskip("anthropic")

KEY = "sk-claude-test"
# The key's reply cap stands for a deployment's: Claude Code asks 32000 tokens of any model, and
# without a cap a 2048-token test context would be filled by each such request (minutes on 2 cores).
POLICY = f'[keys.claude]\nsha256 = "{hash_secret(KEY)}"\nmax-tokens = 64\n'
WEATHER = {"name": "get_weather", "description": "Get the weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
# a system prompt long enough that the cached prefix dominates the prompt
SYSTEM = ("You are a coding assistant working in a small repository. Read files before editing them, keep "
          "changes small and explain what you did. " * 12).strip()


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    policy = tmp_path_factory.mktemp("anthropic-keys") / "keys.toml"
    policy.write_text(POLICY)
    return start_server("--key-policy", str(policy), "--http-open-probes", "--max-batch", "4",
                        "--model-alias", "claude-haiku=smollm2@background", "--model-alias", "plain=smollm2")


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0, timeout=120)


def raw(srv, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "x-api-key": KEY, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_create_sync_and_async(client, srv):
    msg = client.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "Say hello."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "smollm2"
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1 and (msg.usage.input_tokens + msg.usage.cache_read_input_tokens
                                           + msg.usage.cache_creation_input_tokens) > 5

    async def run():
        async with anthropic.AsyncAnthropic(base_url=srv.base, api_key=KEY, max_retries=0) as aclient:
            return await aclient.messages.create(model="smollm2", max_tokens=4, extra_body={"temperature": 0},
                                                 messages=[{"role": "user", "content": "Say hello."}])
    again = asyncio.run(run())
    assert again.content[0].text[:4] == msg.content[0].text[:4]  # greedy: the same start


def test_stream_helpers_match_the_whole_reply(client):
    kwargs = dict(model="smollm2", max_tokens=12, extra_body={"temperature": 0}, system=SYSTEM,
                  messages=[{"role": "user", "content": "Name a colour."}])
    # Both replies below read the prompt from the prefix cache: a cold prefill and a cached one
    # differ in the last bits of the logits (llama.cpp's batch shapes), which flips this model's
    # near-tie first token ("The" 31.38 against "A" 31.38), so warm the cache first.
    client.messages.create(**kwargs)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_forced_tool_then_tool_result_loop(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.messages.create(model="smollm2", max_tokens=60, tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"}, messages=asked)
    assert call.stop_reason == "tool_use"
    use = [b for b in call.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and isinstance(use[0].input.get("city"), str)
    answer = client.messages.create(model="smollm2", max_tokens=12, tools=[WEATHER], messages=[
        *asked, {"role": "assistant", "content": call.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "Sunny, 21 C"}]}])
    assert answer.content and answer.content[0].type in ("text", "tool_use")
    # the history (the call as generated) was served from the cache
    assert answer.usage.cache_read_input_tokens > 0


def test_streamed_tool_call_is_an_input_json_delta(client):
    with client.messages.stream(model="smollm2", max_tokens=60, tools=[WEATHER],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"


def test_stop_sequence_is_reported(client):
    msg = client.messages.create(model="smollm2", max_tokens=60, extra_body={"temperature": 0}, stop_sequences=[" "],
                                 messages=[{"role": "user", "content": "Write a sentence about cats."}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == " "


def test_count_tokens_is_the_prompt_usage_counts(client):
    kwargs = dict(model="smollm2", system=SYSTEM, messages=[{"role": "user", "content": "Count me."}])
    counted = client.messages.count_tokens(**kwargs).input_tokens
    used = client.messages.create(max_tokens=2, **kwargs).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens + used.cache_creation_input_tokens


def test_errors_are_anthropic_shaped(client, srv):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "x " * 3000}])
    assert "prompt is too long" in exc.value.body["error"]["message"]  # what Claude Code compacts on
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    status, body = raw(srv, {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    status, body = raw(srv, {"model": "smollm2", "max_tokens": 4, "bogus": 1,
                             "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "bogus" in body["error"]["message"]
    status, body = raw(srv, {"model": "smollm2", "max_tokens": "4", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    bad = anthropic.Anthropic(base_url=srv.base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"]["type"] == "authentication_error"
    # the key also works as a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN)
    bearer = anthropic.Anthropic(base_url=srv.base, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="smollm2", max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}]).usage.output_tokens >= 1


def claude_code_body(cch: str, question: str = "What is 2 + 3?") -> dict:
    """A body shaped like Claude Code's: the billing header first, system blocks, tools, thinking,
    context_management, output_config, metadata, a 32000-token ceiling, streamed."""
    tool = {"name": "Read", "description": "Read a file.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
    tools = [dict(tool, name=f"Tool{i}") for i in range(11)] + [tool]
    return {"model": "smollm2", "max_tokens": 32000, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli;"
                                                f" cch={cch};"},
                       {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
            "tools": tools, "thinking": {"type": "disabled"}, "metadata": {"user_id": "user_123"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "medium"}}


def _stream(srv, body: dict) -> list[str]:
    req = urllib.request.Request(srv.base + "/v1/messages?beta=true", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                                          "anthropic-version": "2023-06-01",
                                          "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [line[7:] for line in r.read().decode().splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    return events


def test_claude_code_body_streams_and_its_changing_checksum_keeps_the_prefix_warm(srv):
    def prefill() -> float:
        return srv.settled_metric("superfluid_prefill_tokens_total")

    before = prefill()
    _stream(srv, claude_code_body("a1b2c"))
    first = prefill() - before
    before = prefill()
    _stream(srv, claude_code_body("f9e8d"))  # only the checksum differs
    second = prefill() - before
    assert first > 300, first
    assert second <= 0.25 * first, (first, second)


def test_side_requests_run_at_the_alias_class(client):
    reply = client.messages.with_raw_response.create(model="claude-haiku", max_tokens=4,
                                                     messages=[{"role": "user", "content": "Title?"}])
    assert reply.headers["x-superfluid-qos"] == "background"
    assert reply.parse().model == "claude-haiku"


def chat(srv, model, headers=None):
    body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_models_lists_aliases_with_the_context_window(srv):
    listed = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert set(listed) == {"smollm2", "claude-haiku", "plain"}
    for entry in listed.values():
        assert entry["context_length"] == entry["context_window"] == entry["max_input_tokens"] == 2048
    alias = listed["claude-haiku"]["meta"]
    assert alias["alias_of"] == "smollm2" and alias["qos"] == "background"


def test_an_alias_runs_on_its_model_at_its_class_on_every_api(srv):
    status, body, headers = chat(srv, "claude-haiku")
    assert status == 200 and headers["x-superfluid-qos"] == "background", body
    status, body, headers = chat(srv, "plain")
    assert status == 200 and headers["x-superfluid-qos"] == "agent"  # no class of its own: the default
    status, body, headers = chat(srv, "claude-haiku", {"x-superfluid-qos": "agent"})
    assert status == 200 and headers["x-superfluid-qos"] == "agent"  # what the request asks wins (within the key's class)


def test_metrics_count_requests_by_route_pattern_and_status(srv):
    def count(route, status, method="POST"):
        key = f'superfluid_http_requests_total{{method="{method}",route="{route}",status="{status}"}}'
        return srv.metrics().get(key, 0)

    ok, missing = count("/v1/messages", 200), count("/v1/chat/completions", 404)
    raw(srv, {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    chat(srv, "nope")
    assert count("/v1/messages", 200) == ok + 1
    assert count("/v1/chat/completions", 404) == missing + 1
    nowhere = count("(no route)", 404, "GET")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(srv.base + "/v1/no-such-route",
                                                      headers={"Authorization": f"Bearer {KEY}"}), timeout=10)
    assert count("(no route)", 404, "GET") == nowhere + 1
    assert "no route serves this path" in srv.log()

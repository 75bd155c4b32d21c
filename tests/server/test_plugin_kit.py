"""The plugin kit's two examples, installed (tools/dev/setup.sh) and served for real:

(a) the echo engine, selected by ``engine = "echo"`` in a TOML file, answers the openai SDK with
    the prompt echoed back, streamed or not, ending by EOS or max_tokens; and, in process on the
    real scheduler, a lane preempted mid-echo resumes with its echo exact;
(b) fair-share on the real default model with a key policy of four keys: one key floods (eight
    requests queued on two lanes), then three others send one each. With ``fair-share = true``
    in the TOML the three get their first tokens before the flood's backlog drains; without the
    line they wait behind it, first come first served."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

from .serverproc import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("echo")
    (tmp / "echo.toml").write_text('[[models]]\nname = "echo"\npath = "echo"\nengine = "echo"\nmax-batch = 4\n')
    srv = ServerProcess(["--config", str(tmp / "echo.toml")], tmp / "server.log")
    yield srv
    srv.stop()


def test_echo_engine_echoes_through_the_openai_sdk(echo_server):
    client = openai.OpenAI(base_url=echo_server.base + "/v1", api_key="unused", timeout=30, max_retries=0)
    prompt = "Plugins in an afternoon: ünïcödé too."
    done = client.completions.create(model="echo", prompt=prompt, max_tokens=200)
    assert done.choices[0].text == prompt and done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens == len(prompt.encode()) == done.usage.completion_tokens
    cut = client.completions.create(model="echo", prompt=prompt, max_tokens=7)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("Plugins", "length")

    chat = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "echo me"}])
    assert chat.choices[0].message.content == "echo me" and chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "stream me back"}],
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "stream me back"
    assert len([c for c in chunks if c.choices[0].delta.content]) > 1, "streamed as one chunk"
    assert chunks[-1].choices[0].finish_reason == "stop"

    echo = echo_server.get_json("/slots")["models"]["echo"]
    # the pool as of the last tick: at most the last lane's cells (prompt and echo), which the next
    # tick releases
    assert echo["kv_capacity"] == 4 * 4096 and echo["kv_used"] <= 2 * len(b"stream me back")
    assert len(echo["slots"]) == 4 and all(s["state"] == "free" for s in echo["slots"])
    assert echo_server.get_json("/health")["models"]["echo"]["engine"] == "echo"


@pytest.fixture(scope="module")
def plugin_hook():
    from superfluid.core.plugins import make_plugin_manager
    return make_plugin_manager().hook


def test_echo_engine_resumes_a_preempted_lane_exactly(plugin_hook):
    """In process, no server: the real scheduler and qos plugin on the echo engine, one lane. An
    interactive request preempts an agent mid-echo; the agent resumes (its prompt and generated
    tokens fed again, the generation replayed one token per step) and its echo is still exact."""
    from superfluid.core.config import ModelConfig
    from superfluid.core.loop import ModelLoop
    from superfluid.core.request import Request, SamplingParams
    from superfluid.core.settings import SchedulerSettings
    from superfluid_echo_engine import EchoEngine

    engine = EchoEngine(model=ModelConfig("echo", "echo", "echo", {"max-batch": 1, "max-context": 2048}),
                        config=None)
    # Small budgets: prompts prefill in chunks and each tick decodes a few tokens, so the chat
    # arrives mid-echo whatever the measured costs.
    loop = ModelLoop("echo-unit", engine, plugin_hook, SchedulerSettings(
        max_batch=1, context_length=2048, prefill_budget=64, tick_decode_budget=8))
    events: dict[str, list] = {"agent": [], "chat": []}

    def ask(name, text, qos):
        req = Request(prompt_tokens=engine.tokenize(text), max_tokens=1000, sink=events[name].append, qos=qos,
                      sampling=SamplingParams(temperature=0.0))
        loop.submit(req)

    agent_text = "".join(f"line {i}: the quick brown fox. " for i in range(20))
    ask("agent", agent_text, "agent")
    for _ in range(200):
        loop.step()
        if sum(len(e.text) for e in events["agent"] if e.kind == "delta") > 100:
            break
    ask("chat", "hi there", "interactive")
    for _ in range(2000):
        if not loop.busy():
            break
        loop.step()
    assert "paused" in [e.kind for e in events["agent"]] and "resumed" in [e.kind for e in events["agent"]]
    for name, want in (("agent", agent_text), ("chat", "hi there")):
        assert events[name][-1].kind == "finished" and events[name][-1].finish_reason == "stop"
        assert "".join(e.text for e in events[name] if e.kind == "delta") == want


# ---- (b) fair-share on the real model ---------------------------------------------------------

KEYS = ("flood", "a", "b", "c")
LANES, FLOOD = 2, 8


def serve_with_keys(tmp, model_path, fair: bool) -> tuple[ServerProcess, dict]:
    secrets = {k: f"sk-sf-test-{k}" for k in KEYS}
    (tmp / "keys.toml").write_text("".join(f'[keys.{k}]\nsha256 = "{hash_secret(s)}"\nclass = "agent"\n\n'
                                           for k, s in secrets.items()))
    (tmp / "serve.toml").write_text("fair-share = true\n" if fair else "")
    srv = ServerProcess(["--config", str(tmp / "serve.toml"), "--model", model_path, "--model-name", "smollm2",
                         "--key-policy", str(tmp / "keys.toml"), "--max-batch", str(LANES),
                         "--max-context", "1024", "--threads", "1"], tmp / "server.log")
    return srv, secrets


def queued(srv, secret) -> int:
    req = urllib.request.Request(srv.base + "/slots", headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["models"]["smollm2"]["queued"]


async def first_token_order(srv, secrets) -> list[str]:
    """Flood first, then a, b, c one at a time once each is queued: keys in first-token order."""
    order: list[str] = []

    async def ask(key: str, i: int) -> None:
        client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key=secrets[key], timeout=120, max_retries=0)
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Count to ten, {key} {i}."}],
            max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:  # its first token
                order.append(key)
                break
        async for _ in stream:
            pass
        await client.close()

    async def until_queued(n: int) -> None:
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(queued, srv, secrets["a"]) < n:
            assert time.monotonic() < deadline, f"never {n} queued"
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(ask("flood", i)) for i in range(FLOOD)]
    await until_queued(FLOOD - LANES)
    for n, key in enumerate(KEYS[1:], start=1):
        tasks.append(asyncio.create_task(ask(key, 0)))
        await until_queued(FLOOD - LANES + n)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return order


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "default"])
def test_fair_share_lets_three_keys_past_a_flood(tmp_path, model_path, fair):
    srv, secrets = serve_with_keys(tmp_path, model_path, fair)
    try:
        order = asyncio.run(first_token_order(srv, secrets))
    finally:
        srv.stop()
    assert sorted(order) == sorted(["flood"] * FLOOD + ["a", "b", "c"]), order
    last_of_three = max(order.index(k) for k in "abc")
    flood_before = order[:last_of_three].count("flood")
    if fair:
        # Two flood lanes were running; one more flood turn may come first, then a, b, c in turn.
        assert flood_before <= LANES + 2, order
    else:
        assert order == ["flood"] * FLOOD + ["a", "b", "c"], order

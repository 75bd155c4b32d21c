"""Media lanes beside urgent work, and images encoded off the tick, on a real server serving the
tiny SmolVLM on llama.cpp (tools/fixtures/tiny_vlm.py), through the ``openai`` client:

- while background requests with images hold every lane they may (``--urgent-lanes``, default 1),
  one lane stays for the urgent classes: an interactive chat is admitted into it and answered
  while every media lane still runs, with nothing preempted and every media reply whole;
- ``--urgent-lanes 0`` lets the media requests take every lane (what the rule prevents);
- images encoded on the engine's background thread (the default, ``image-encoding = admission``)
  and on the tick (``--image-encoding tick``) give the same replies, alone and side by side.

The time a chat's first token takes beside media lanes is tools/bench/images.py's
(``--promise``), not a test's."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from tools.fixtures.tiny_vlm import build

from . import vision_cases as cases

openai = pytest.importorskip("openai")
MODEL = "vlm"
LANES = 3
LONG = 1900  # tokens: the tiny model decodes fast, and the chat must arrive while these run
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]


@pytest.fixture(scope="module")
def vlm():
    return build()


@pytest.fixture(scope="module")
def srv(start_server, vlm):
    return start_server("--model-name", MODEL, "--max-batch", str(LANES), model=str(vlm["gguf"]))


def _media_request(srv, rgb, out: list, tokens: int = LONG) -> threading.Thread:
    body = {"model": MODEL, "messages": cases.image_messages(rgb), "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}

    def run():
        req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "x-superfluid-qos": "background"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out.append((json.loads(r.read()), time.monotonic()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _slots(srv) -> dict:
    return srv.get_json("/slots")["models"][MODEL]


def _busy_with_images(view: dict) -> list[dict]:
    return [s for s in view["slots"] if s.get("images") and s.get("generated_tokens", 0) > 0]


def _wait_for(predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the server's state")


def test_a_chat_takes_the_lane_media_lanes_leave_while_they_all_run(srv):
    preempted_before = srv.settled_metric("superfluid_preemptions_total")
    done: list = []
    threads = [_media_request(srv, rgb, done) for rgb in COLOURS[:LANES]]
    # every media request but one decodes; the last waits in the queue, a lane stays free
    def settled():
        v = _slots(srv)
        return v if len(_busy_with_images(v)) == LANES - 1 and v["queued"] == 1 else None

    view = _wait_for(settled)
    assert sum(1 for s in view["slots"] if s["state"] != "free") == LANES - 1
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Quick question."}],
                                          max_tokens=4, temperature=0,
                                          extra_headers={"x-superfluid-qos": "interactive"})
    chat_done = time.monotonic()
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    assert not done, "a media lane had to finish before the chat was answered"
    for t in threads:
        t.join(600)
    assert len(done) == LANES and all(reply["usage"]["completion_tokens"] == LONG for reply, _ in done)
    assert all(at > chat_done for _, at in done)
    assert srv.settled_metric("superfluid_preemptions_total") == preempted_before  # nothing preempted


def test_urgent_lanes_zero_lets_media_lanes_take_every_lane(start_server, vlm):
    srv = start_server("--model-name", MODEL, "--max-batch", "2", "--urgent-lanes", "0", model=str(vlm["gguf"]))
    done: list = []
    threads = [_media_request(srv, rgb, done, tokens=400) for rgb in COLOURS[:2]]
    _wait_for(lambda: len(_busy_with_images(_slots(srv))) == 2)
    for t in threads:
        t.join(600)
    assert len(done) == 2


@pytest.fixture(scope="module")
def on_tick(start_server, vlm):
    return start_server("--model-name", MODEL, "--max-batch", str(LANES), "--image-encoding", "tick",
                        model=str(vlm["gguf"]))


def test_images_encoded_off_the_tick_answer_as_on_it(srv, on_tick):
    clients = [openai.OpenAI(base_url=s.base + "/v1", api_key="x", timeout=120, max_retries=0) for s in (srv, on_tick)]
    messages = [cases.image_messages(rgb, "Describe it.") for rgb in COLOURS]
    alone = [[cases.ask(c, MODEL, m).choices[0].message.content for m in messages] for c in clients]
    assert alone[0] == alone[1]
    assert len(set(alone[0])) > 1  # the images move the replies
    together: dict = {}

    def run(i):
        together[i] = cases.ask(clients[0], MODEL, messages[i]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(LANES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(LANES)] == alone[0][:LANES]

"""superfluid fleet for real: two `superfluid serve` nodes on the default model, the fleet head
(and the SMG it runs) in front, real clients. The tests run in order and share the fleet; the
ones that kill a node or SMG come last and leave the fleet whole again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest

from superfluid.core import lifeline

from . import serverproc
from .conftest import TEST_CONTEXT
from .serverproc import ServerProcess, free_port
from superfluid.plugins.http.keys.policy import new_key

pytest.importorskip("smg")
openai = pytest.importorskip("openai")

MODEL = "smollm2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


OTHER = "smol-b"  # the same file served under another name: a node of another model


def node_args(model_path: str, name: str = MODEL) -> list[str]:
    # one engine thread each: three nodes share CI's two cores
    return ["--model", model_path, "--model-name", name, "--max-context", TEST_CONTEXT, "--max-batch", "4",
            "--threads", "1"]


def start_node(model_path, log, port: int | None = None, name: str = MODEL, *extra: str) -> ServerProcess:
    if port is None:
        return ServerProcess(node_args(model_path, name) + list(extra), log)
    with mock.patch.object(serverproc, "free_port", return_value=port):  # back on the same URL
        return ServerProcess(node_args(model_path, name) + list(extra), log)


def call(base: str, method: str, path: str, body=None, headers=None, timeout=60):
    """(status, headers, parsed JSON or raw text); HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, raw = exc.code, exc.headers, exc.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


# what a test's fleet head runs with: SMG stopped without its grace period (see Fleet)
SMG_QUICK_STOP = {"SUPERFLUID_TEST_SMG_GRACE_S": "0"}


def wait_for(what, check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


class Fleet:
    """A real `superfluid fleet` process in front of the given nodes (stopped by its PID)."""

    def __init__(self, nodes: list[str], log_path, *extra: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "superfluid.core.cli", "fleet", "--port", str(self.port),
               "--policy", "round_robin", *[a for n in nodes for a in ("--node", n)], *extra]
        # SMG's shutdown grace 0: idle, SMG waits half of it when stopped (2.5 s of the default 5 s)
        self.proc = lifeline.popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **SMG_QUICK_STOP))
        try:
            wait_for("the fleet's /health answers 200", lambda: self.health()[0] == 200, 60)
        except AssertionError:
            self.stop()
            raise AssertionError(f"fleet not ready:\n{self.log()}") from None

    def health(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"the fleet head exited with {self.proc.returncode}:\n{self.log()}")
        try:
            status, _, body = call(self.base, "GET", "/health", timeout=5)
            return status, body
        except OSError:
            return None, None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_path):
    logs = tmp_path_factory.mktemp("fleet")
    keys = logs / "keys.toml"  # the other model's node checks keys: the head passes them through
    secret = new_key(str(keys), "agent-key", "agent")
    with ThreadPoolExecutor(3) as pool:  # the nodes load at the same time
        futures = [pool.submit(start_node, model_path, logs / f"node{i}.log") for i in range(2)]
        futures.append(pool.submit(start_node, model_path, logs / "other.log", None, OTHER,
                                   "--key-policy", str(keys)))
        started = []
        try:
            started = [f.result() for f in futures]
        finally:
            if len(started) < 3:
                for f in futures:
                    if f.exception() is None:
                        f.result().stop()
    nodes, other = started[:2], started[2]
    other.secret = secret
    head = None
    try:
        head = Fleet([n.base for n in nodes], logs / "fleet.log")
        yield head, nodes, other
    finally:
        try:
            if head is not None:
                assert head.stop() == 0, head.log()
        finally:
            with ThreadPoolExecutor(3) as pool:  # each takes a moment to shut down: all at once
                list(pool.map(ServerProcess.stop, [*nodes, other]))


def client(head) -> "openai.OpenAI":
    return openai.OpenAI(base_url=head.base + "/v1", api_key="unused", timeout=60, max_retries=0)


def ttft_count(node: ServerProcess, qos: str | None = None) -> float:
    """Generations (of class ``qos``) the node has started: its TTFT histogram's count."""
    return sum(v for k, v in node.metrics().items()
               if k.startswith("superfluid_ttft_seconds_count") and (qos is None or f'qos="{qos}"' in k))


def test_chat_completion_and_stream_through_the_head(fleet):
    head, nodes, _ = fleet
    c = client(head)
    reply = c.chat.completions.create(**CHAT)
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(**CHAT, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks)
    completion = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=3)
    assert completion.choices[0].text
    status, body = head.health()
    assert status == 200 and body["smg"]["state"] == "up"
    assert {n.base for n in nodes} == set(body["nodes"])
    assert all(v["state"] == "healthy" and v["routed"] and v["models"] == [MODEL] for v in body["nodes"].values())


def test_models_unknown_model_and_bad_input(fleet):
    head, _, _ = fleet
    c = client(head)
    assert [m.id for m in c.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as exc:
        c.chat.completions.create(**{**CHAT, "model": "no-such-model"})
    assert exc.value.body["code"] == "model_not_found"
    status, _, body = call(head.base, "GET", "/v1/models/no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = call(head.base, "POST", "/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert body["error"]["message"].startswith("request body is not valid JSON")  # the node's own words
    status, _, body = call(head.base, "POST", "/v1/chat/completions", {**CHAT, "bogus_field": 1})
    assert status == 400 and body["error"]["code"] == "unknown_parameter" and body["error"]["param"] == "bogus_field"


def test_tokenize_and_detokenize_through_the_head(fleet):
    head, nodes, _ = fleet
    body = {"model": MODEL, "content": "The sky is blue."}
    status, _, direct = call(nodes[0].base, "POST", "/tokenize", body)
    assert status == 200 and direct["tokens"]
    status, _, via = call(head.base, "POST", "/tokenize", body)
    assert status == 200 and via == direct
    status, _, text = call(head.base, "POST", "/detokenize", {"model": MODEL, "tokens": direct["tokens"]})
    assert status == 200 and "The sky is blue." in text["content"]
    status, _, err = call(head.base, "POST", "/tokenize", {"model": "no-such-model", "content": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"  # a node's own answer
    status, _, err = call(head.base, "POST", "/tokenize", b'{"content": ')
    assert status == 400 and err["error"]["code"] == "invalid_json"


def test_qos_class_reaches_the_node_from_header_and_body(fleet):
    head, nodes, _ = fleet
    before = {q: sum(ttft_count(n, q) for n in nodes) for q in ("background", "completion")}
    status, headers, body = call(head.base, "POST", "/v1/chat/completions", CHAT,
                                 headers={"x-superfluid-qos": "background"})
    assert status == 200, body
    assert headers["x-superfluid-qos"] == "background"  # the class the node applied, relayed back
    status, headers, body = call(head.base, "POST", "/v1/chat/completions",
                                 {**CHAT, "superfluid": {"qos": "completion"}},
                                 headers={"x-superfluid-qos": "background"})  # the body wins, as on a node
    assert status == 200 and headers["x-superfluid-qos"] == "completion"
    wait_for("both classes counted on the nodes", lambda: all(
        sum(ttft_count(n, q) for n in nodes) == before[q] + 1 for q in ("background", "completion")), 5)
    status, _, body = call(head.base, "POST", "/v1/chat/completions", CHAT, headers={"x-superfluid-qos": "nope"})
    assert status == 400 and body["error"]["code"] == "invalid_qos_class"  # the node validates it


def sessions_on(node: ServerProcess) -> dict[str, dict]:
    return {s["id"]: s for s in node.get_json("/v1/sessions")["data"]}


def turn(head, sid: str, text: str):
    return call(head.base, "POST", f"/v1/sessions/{sid}/turns",
                {"messages": [{"role": "user", "content": text}], "max_tokens": 3})


def test_the_heads_dashboard_shows_each_nodes_page(fleet):
    head, nodes, _ = fleet
    status, _, index = call(head.base, "GET", "/dashboard")
    assert status == 200 and all(n.base in index for n in nodes)
    link = re.search(r'href="(nodes/[0-9a-f]+/dashboard)"', index).group(1)
    status, _, page = call(head.base, "GET", "/" + link)
    assert status == 200 and "EventSource" in page  # the node's own page, unchanged
    events = head.base + "/" + link.replace("/dashboard", "/events")
    with urllib.request.urlopen(events, timeout=30) as r:  # the node's stream, through the head
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [r.readline() for _ in range(2)]
    assert lines[0].strip() == b"event: hello" and json.loads(lines[1][6:])["models"] == [MODEL]
    status, _, err = call(head.base, "GET", "/nodes/00000000/events")
    assert status == 404 and err["error"]["code"] == "node_not_found"


def test_sessions_stick_to_their_node(fleet):
    head, nodes, _ = fleet
    wait_for("both nodes idle in the head's view (sessions go to the least busy)",
             lambda: all(v["busy"] == 0 for v in head.health()[1]["nodes"].values()), 10)
    sids = []
    for _ in range(2):
        status, _, body = call(head.base, "POST", "/v1/sessions", {"model": MODEL, "system": "Be brief."})
        assert status == 201, body
        sids.append(body["id"])
    for i in range(2):
        for sid in sids:
            status, _, body = turn(head, sid, f"turn {i}")
            assert status == 200 and body["choices"][0]["message"]["content"], body
    held = [sessions_on(n) for n in nodes]
    for sid in sids:  # each on exactly one node, with all its turns
        owners = [i for i, h in enumerate(held) if sid in h]
        assert len(owners) == 1 and held[owners[0]][sid]["turns"] == 2
    assert {i for i, h in enumerate(held) for sid in sids if sid in h} == {0, 1}  # one on each node
    status, _, body = call(head.base, "GET", "/v1/sessions")
    assert status == 200 and set(sids) <= {s["id"] for s in body["data"]}
    status, _, body = call(head.base, "GET", "/v1/sessions/sess_nosuch")
    assert status == 404 and body["error"]["code"] == "session_not_found"


BURST = 10


def slots(node: ServerProcess) -> dict:
    with urllib.request.urlopen(node.base + "/slots", timeout=10) as r:
        return json.loads(r.read())["models"][MODEL]


def read_stream(base: str) -> dict:
    """One streamed chat read to its end: when its headers came (the head sends them with the
    first token), the node that served it, its text, whether it ended with an error event."""
    body = {**CHAT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=90) as r:
        out = {"headers_at": time.time(), "node": r.headers.get("x-smg-routed-worker-id"),
               "text": "", "error": None, "done": False}
        for line in r:
            data = line.decode().strip()[6:] if line.startswith(b"data: ") else None
            if data == "[DONE]":
                out["done"] = True
            elif data:
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]
                for choice in event.get("choices") or []:
                    out["text"] += (choice.get("delta") or {}).get("content") or ""
    return out


def test_a_killed_node_is_reported_routed_around_and_back(fleet, tmp_path, model_path):
    head, nodes, _ = fleet
    sids = {s: i for i, n in enumerate(nodes) for s in sessions_on(n)}
    victim, survivor = nodes[1], nodes[0]
    mine = next(s for s, i in sids.items() if i == 0)
    theirs = next(s for s, i in sids.items() if i == 1)
    # a long stream on the victim, cut by its death, ends with an error event and [DONE]
    req = urllib.request.Request(head.base + "/v1/chat/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({**CHAT, "max_tokens": 400, "stream": True,
                                                  "messages": [{"role": "user", "content": "Tell a long story."}]}).encode())
    streams = []
    for _ in range(4):  # round robin: one of the next streams lands on the victim
        r = urllib.request.urlopen(req, timeout=60)
        streams.append(r)
        if r.headers.get("x-smg-routed-worker-id") == victim.base:
            break
    cut = streams[-1]
    assert cut.headers.get("x-smg-routed-worker-id") == victim.base
    for r in streams[:-1]:  # the survivor's: left open, each would take a lane and its one thread from the burst
        r.close()
    assert cut.readline().startswith(b"data: ")  # it has started
    # a burst of streams: round robin puts half on the victim, whose 4 lanes fill, so some wait
    # in its queue; those have given their client nothing when it dies, and complete elsewhere
    with ThreadPoolExecutor(BURST) as pool:
        burst = [pool.submit(read_stream, head.base) for _ in range(BURST)]
        wait_for("streams queued on the victim", lambda: slots(victim)["queued"] >= 1, 30)
        killed_at = time.time()
        killed = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        victim.stop()  # closes its log; its engine worker follows its parent down
        rest = cut.read().decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), rest[-500:]
        wait_for("the head reports the killed node unhealthy",
                 lambda: head.health()[1]["nodes"][victim.base]["state"] == "unhealthy", 5)
        assert time.monotonic() - killed < 6
        results = [f.result(timeout=120) for f in burst]
    for r in streams:
        r.close()
    late = [r for r in results if r["headers_at"] > killed_at]  # not started when the victim died
    assert late, results  # the queued ones
    for r in late:  # each one completed, whole, on the survivor
        assert r["done"] and not r["error"] and r["text"] and r["node"] == survivor.base, r
    for r in results:  # and none hung: every stream ended with [DONE]
        assert r["done"], r
    status, body = head.health()
    assert status == 200 and body["nodes"][victim.base]["last_error"]
    c = client(head)
    for _ in range(4):  # all on the survivor now
        assert c.chat.completions.create(**CHAT).choices[0].message.content
    status, _, body = turn(head, mine, "still there?")
    assert status == 200, body
    status, _, body = turn(head, theirs, "hello?")
    assert status == 503 and body["error"]["code"] == "node_unavailable" and victim.base in body["error"]["message"]

    back = start_node(model_path, tmp_path / "node-back.log", port=victim.port)
    nodes[1] = back
    wait_for("the restarted node is routed to again",
             lambda: head.health()[1]["nodes"][back.base]["routed"], 10)
    served = 0
    for _ in range(4):
        status, headers, _ = call(head.base, "POST", "/v1/chat/completions", CHAT)
        assert status == 200
        served += headers.get("x-smg-routed-worker-id") == back.base
    assert served >= 1 and ttft_count(back) >= 1


def test_smg_killed_is_restarted(fleet):
    head, _, _ = fleet
    status, body = head.health()
    pid = body["smg"]["pid"]
    req = urllib.request.Request(head.base + "/v1/chat/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({**CHAT, "max_tokens": 400, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")
        os.kill(pid, signal.SIGKILL)  # SMG dies under the stream: the head ends it
        events = [line[6:] for line in stream.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "upstream_stream_cut"
    reply = client(head).chat.completions.create(**CHAT)  # waits for the restarted SMG
    assert reply.choices[0].message.content
    status, body = wait_for("SMG up again", lambda: (lambda h: h if h[0] == 200 else None)(head.health()), 10)
    assert body["smg"]["restarts"] >= 1 and body["smg"]["pid"] != pid
    status, _, page = call(head.base, "GET", "/metrics")
    assert "superfluid_fleet_smg_restarts_total 1.0" in page
    assert 'superfluid_ttft_seconds_count{model="smollm2",node="' in page
    assert "smg_worker_health" in page
    assert "SMG (pid" in head.log() and "restarting it" in head.log()


def test_discovery_file_and_a_node_of_another_model(fleet, tmp_path):
    """A second head fed by a discovery file: a node added to the file is routed to, and SMG
    sends each model only to its own node."""
    _, nodes, other = fleet
    listing = tmp_path / "nodes.json"
    listing.write_text(json.dumps({"version": 1, "workers": [{"url": nodes[0].base}]}))
    head = Fleet([], tmp_path / "fleet2.log", "--discovery-file", str(listing))
    try:
        assert list(head.health()[1]["nodes"]) == [nodes[0].base]
        listing.write_text(json.dumps({"version": 1, "workers": [{"url": nodes[0].base}, {"url": other.base}]}))
        wait_for("the added node is routed to", lambda: head.health()[1]["nodes"].get(other.base, {}).get("routed"), 10)
        assert sorted(m.id for m in client(head).models.list().data) == sorted([MODEL, OTHER])
        auth = {"Authorization": f"Bearer {other.secret}", "x-superfluid-qos": "interactive"}
        for model, node in ((OTHER, other), (MODEL, nodes[0])) * 2:
            status, headers, body = call(head.base, "POST", "/v1/chat/completions", {**CHAT, "model": model},
                                         headers=auth if model == OTHER else None)
            assert status == 200 and body["model"] == model and headers["x-smg-routed-worker-id"] == node.base
            if model == OTHER:  # the key reached the node, which capped the class at the key's
                assert headers["x-superfluid-qos"] == "agent"
        status, _, body = call(head.base, "POST", "/v1/chat/completions", {**CHAT, "model": OTHER})
        assert status == 401, body  # no key: the node refuses it
        status, _, body = call(head.base, "POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
    finally:
        assert head.stop() == 0, head.log()


def test_refusal_through_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "fleet", "--node", "http://127.0.0.1:9",
                           "--no-http-qos-header"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--no-http-qos-header is a node setting" in proc.stderr and "superfluid serve" in proc.stderr

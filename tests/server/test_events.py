"""GET /events, /dashboard and `superfluid top` against the real server and the default model:
snapshots while requests run (lanes change state, queue counts match /slots), the key policy's
doors (401, 403, admin, the dashboard grant, ?key=, the secret in no log line), stalled readers
that never read while requests run (throughput and /health unaffected, a reading watcher still
served on time), and `superfluid top --once` as a subprocess."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

PROMPT = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
SECRETS = {"user": "sk-ev-user-1", "watcher": "sk-ev-watch-1", "admin": "sk-ev-admin-1"}
POLICY = f"""
[keys.user]
sha256 = "{hash_secret(SECRETS['user'])}"

[keys.watcher]
sha256 = "{hash_secret(SECRETS['watcher'])}"
dashboard = true

[keys.admin]
sha256 = "{hash_secret(SECRETS['admin'])}"
admin = true
"""


@pytest.fixture(scope="module")
def four(start_server):
    return start_server("--max-batch", "4")


@pytest.fixture(scope="module")
def keyed(start_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("evkeys") / "keys.toml"
    path.write_text(POLICY)
    return start_server("--key-policy", str(path), "--max-batch", "2")


def complete(base: str, max_tokens: int, qos: str = "agent", headers: dict | None = None) -> dict:
    req = urllib.request.Request(base + "/v1/completions", method="POST", data=json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "x-superfluid-qos": qos, **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


class Watcher:
    """Reads /events in a thread: every event as (type, data, monotonic time received)."""

    def __init__(self, base: str, query: str = "interval_ms=100", headers: dict | None = None):
        self.events: list[tuple[str, dict, float]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._resp = urllib.request.urlopen(urllib.request.Request(f"{base}/events?{query}", headers=headers or {}),
                                            timeout=30)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        kind, data = None, []
        try:
            for raw in self._resp:
                if self._stop.is_set():
                    return
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif not line and data:
                    self.events.append((kind, json.loads("".join(data)), time.monotonic()))
                    kind, data = None, []
        except Exception as exc:  # noqa: BLE001 - reported by snapshots()
            if not self._stop.is_set():
                self.error = exc

    def snapshots(self) -> list[dict]:
        assert self.error is None, self.error
        return [d for k, d, _ in self.events if k == "snapshot"]

    def wait(self, n: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.snapshots()) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.snapshots()

    def close(self):
        self._stop.set()
        self._resp.close()


def _queued(snap_model: dict) -> dict[str, int]:
    return {cls: q["count"] for cls, q in snap_model["queues"].items()}


def _slots_queued(slots: dict) -> dict[str, int]:
    out = {cls: 0 for cls in ("interactive", "completion", "agent", "background")}
    for q in slots["queue"]:
        out[q["qos"]] += 1
    return out


def test_snapshots_follow_the_requests_and_match_slots(four):
    watcher = Watcher(four.base)
    try:
        first = watcher.wait(1)[0]
        kind, hello, _ = watcher.events[0]
        assert kind == "hello" and hello["models"] == ["smollm2"] and hello["interval_ms"] == 100
        view = first["models"]["smollm2"]
        assert view["max_batch"] == 4  # four lanes run at most, in any of six KV buffers (two spare)
        assert [lane["state"] for lane in view["lanes"]] == ["free"] * 6
        with cf.ThreadPoolExecutor(6) as pool:
            jobs = [pool.submit(complete, four.base, 32, qos) for qos in
                    ("agent", "agent", "background", "background", "background", "agent")]
            matched = 0
            for _ in range(30):  # /slots between two snapshots: it matches one of them
                before = len(watcher.wait(len(watcher.snapshots()) + 1))
                slots = four.get_json("/slots?model=smollm2")["models"]["smollm2"]
                after = watcher.wait(before + 1)
                if len(after) <= before:
                    break
                pair = [_queued(s["models"]["smollm2"]) for s in after[before - 1:before + 1]]
                if sum(_slots_queued(slots).values()) and _slots_queued(slots) in pair:
                    matched += 1
                if all(j.done() for j in jobs):
                    break
            results = [j.result() for j in jobs]
        snaps = watcher.wait(len(watcher.snapshots()) + 2)
    finally:
        watcher.close()
    assert all(r["usage"]["completion_tokens"] == 32 for r in results)
    assert matched >= 1, "no snapshot's queue counts matched /slots while two requests waited"
    models = [s["models"]["smollm2"] for s in snaps]
    states = {lane["state"] for m in models for lane in m["lanes"]}
    assert {"decoding", "free"} <= states and (states & {"prefilling", "decoding"})
    assert max(sum(_queued(m).values()) for m in models) >= 1  # 6 requests, 4 lanes
    assert [s["seq"] for s in snaps] == list(range(snaps[0]["seq"], snaps[0]["seq"] + len(snaps)))
    ticks = [t for m in models for t in m["ticks"]]
    assert ticks and sum(t["decode_tokens"] for t in ticks) >= 6 * 32 - 6  # every tick, once, in the stream
    assert [t["seq"] for t in ticks] == sorted({t["seq"] for t in ticks})
    last = models[-1]
    assert last["requests_total"] >= 6 and last["ttft"]["background"]["count"] >= 3
    assert all(lane["state"] == "free" for lane in last["lanes"])
    busy = [lane for m in models for lane in m["lanes"] if lane["state"] == "decoding"]
    assert any(lane["tokens_per_s"] for lane in busy) and all(lane["qos"] for lane in busy)


def _status(url: str, headers: dict | None = None) -> tuple[int, dict | bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.readline()  # the first line of the stream (or page)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_key_policy(keyed):
    base = keyed.base
    status, body = _status(base + "/events")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _status(base + "/events", {"Authorization": f"Bearer {SECRETS['user']}"})
    assert status == 403 and body["error"]["code"] == "dashboard_not_allowed"
    for name in ("watcher", "admin"):
        assert _status(base + "/events", {"Authorization": f"Bearer {SECRETS[name]}"}) == (200, b"event: hello\n")
    assert _status(f"{base}/events?key={SECRETS['watcher']}") == (200, b"event: hello\n")
    assert _status(f"{base}/events?key={SECRETS['user']}")[0] == 403
    status, first = _status(f"{base}/dashboard?key={SECRETS['watcher']}")
    assert status == 200 and first.lower().startswith(b"<!doctype html")
    assert _status(f"{base}/v1/models?key={SECRETS['admin']}")[0] == 401  # ?key= only where EventSource needs it
    complete(base, 4, headers={"Authorization": f"Bearer {SECRETS['user']}"})
    watcher = Watcher(base, f"key={SECRETS['admin']}&interval_ms=100")
    try:
        snap = watcher.wait(1)[0]
    finally:
        watcher.close()
    assert snap["keys"]["user"]["requests"] == 1 and snap["keys"]["user"]["tokens"] > 4
    assert set(snap["keys"]) == {"user", "watcher", "admin"}
    log = keyed.log_path.read_text(errors="replace")
    assert "refused GET /events (no dashboard grant)" in log
    assert not any(secret in log for secret in SECRETS.values())  # the query string is never logged


def _stalled_reader(base: str) -> socket.socket:
    """An /events stream that is never read, behind a tiny receive buffer."""
    host, port = base.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /events?interval_ms=100 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock


def _workload(base: str) -> float:
    """Tokens per second of 4 concurrent 24-token generations."""
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: complete(base, 24), range(4)))
    assert all(d["usage"]["completion_tokens"] == 24 for d in done)
    return 96 / (time.perf_counter() - start)


def test_stalled_readers_slow_nothing(four):
    _workload(four.base)  # warm
    unwatched, watched, health, snaps, gaps = [], [], [], [], []
    for _ in range(3):  # interleaved: A B A B A B
        unwatched.append(_workload(four.base))
        stalled = [_stalled_reader(four.base) for _ in range(3)]
        watcher = Watcher(four.base)
        try:
            watched.append(_workload(four.base))
            t0 = time.perf_counter()
            assert four.get_json("/health")["status"] == "ok"
            health.append(time.perf_counter() - t0)
            snaps += watcher.wait(len(watcher.snapshots()) + 2)
            times = [t for k, _, t in watcher.events if k == "snapshot"]
            gaps += [b - a for a, b in zip(times, times[1:])]
        finally:
            watcher.close()
            for sock in stalled:
                sock.close()
    # best of each: the round least disturbed by whatever else shares the machine
    ratio = max(watched) / max(unwatched)
    print(f"tok/s unwatched {[round(x, 1) for x in unwatched]}, with 3 stalled readers and a watcher "
          f"{[round(x, 1) for x in watched]}: best-of ratio {ratio:.3f}")
    assert ratio > 0.75  # the precise number is tools/bench/watchers.py's; a shared CI core is noisy
    assert max(health) < 2.0
    assert all(s["coalesced"] == 0 for s in snaps)  # the reading watcher was never held back
    assert gaps and max(gaps) < 2.0


def test_top_once(four):
    cmd = [sys.executable, "-m", "superfluid.core.cli", "top", "--url", four.base, "--once"]
    with cf.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(complete, four.base, 60) for _ in range(2)]
        time.sleep(0.5)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        [j.result() for j in jobs]
    assert out.returncode == 0, out.stderr
    assert "smollm2" in out.stdout and "lanes" in out.stdout and "queues" in out.stdout
    assert "TTFT" in out.stdout and "KV" in out.stdout
    assert out.stdout.count("│") > 10  # a table was drawn
    down = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "top", "--url", "http://127.0.0.1:9",
                           "--once"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "cannot reach" in down.stderr


def test_top_follows_the_key_policy(keyed):
    cmd = [sys.executable, "-m", "superfluid.core.cli", "top", "--url", keyed.base, "--once"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "401" in refused.stderr and "--key" in refused.stderr
    forbidden = subprocess.run(cmd + ["--key", SECRETS["user"]], capture_output=True, text=True, timeout=60)
    assert forbidden.returncode == 1 and "403" in forbidden.stderr
    ok = subprocess.run(cmd + ["--key", SECRETS["watcher"]], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "keys" in ok.stdout and "watcher" in ok.stdout

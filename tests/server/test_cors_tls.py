"""Browsers and TLS against a real `superfluid serve` on the default model.

CORS: headless Chromium (Debian's, driven by playwright as in test_dashboard_browser.py) opens a
page served by a tiny http.server on another loopback port, and the page calls superfluid with
``fetch``: a POST /v1/chat/completions with JSON and an Authorization header (so the browser
sends a preflight first, which the key policy must let through) and a streamed one read from
``response.body``. From an allowed origin both succeed and the page can read the exposed
x-ratelimit-* headers; from an origin not listed the browser blocks both, and the POST never
reaches the server. /metrics shows the preflights the browser sent (204, and 403 for the other
origin).

TLS: a server started with a certificate the test makes (tests/tls_certs.py) answers the
``openai`` client over HTTPS through an httpx client that trusts the test CA, streamed too; a
client that does not trust it, and plain HTTP to the same port, fail. A mismatched key stops
``serve`` before a model loads. `superfluid fleet` then serves over HTTPS itself and reaches that
HTTPS node (``--ssl-cafile``)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from superfluid.core import lifeline
from superfluid.plugins.http.keys.policy import hash_secret
from tests.tls_certs import make_certs

from .conftest import TEST_CONTEXT
from .serverproc import ServerProcess, free_port

MODEL = "smollm2"
SECRET = "sk-browser-app"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ---- CORS in a real browser ---------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Two origins serving the same page: http://127.0.0.1:A (allowed) and http://127.0.0.1:B (not)."""
    root = tmp_path_factory.mktemp("pages")
    (root / "index.html").write_text("<!doctype html><meta charset=utf-8><title>a web app</title><p>app</p>\n")
    servers = []
    for _ in range(2):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


@pytest.fixture(scope="module")
def cors_server(start_server, pages, tmp_path_factory):
    policy = tmp_path_factory.mktemp("keys") / "keys.toml"
    policy.write_text(f'[keys.app]\nsha256 = "{hash_secret(SECRET)}"\nrequests-per-minute = 1000\n')
    # --http-open-probes: the test reads /metrics without a key
    return start_server("--key-policy", str(policy), "--http-open-probes", "--cors-origins", pages[0],
                        "--max-batch", "2")


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("SUPERFLUID_SKIP_BROWSER"):
        pytest.skip("SUPERFLUID_SKIP_BROWSER is set")
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), (f"{CHROMIUM} is not installed: tools/dev/setup.sh installs Debian's "
                                      "chromium (or set SUPERFLUID_SKIP_BROWSER=1)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


# What the page runs: the calls a browser chat app makes. Errors are returned, not thrown.
CALLS = """async ({base, key, model}) => {
  const headers = {"Content-Type": "application/json", "Authorization": "Bearer " + key};
  const out = {};
  try {
    const r = await fetch(base + "/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(
      {model, messages: [{role: "user", content: "Say hi."}], max_tokens: 8, temperature: 0})});
    const body = await r.json();
    out.chat = {status: r.status, content: body.choices[0].message.content,
                qos: r.headers.get("x-superfluid-qos"),
                remaining: r.headers.get("x-ratelimit-remaining-requests")};
  } catch (e) { out.chat = {error: String(e)}; }
  try {
    const r = await fetch(base + "/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(
      {model, messages: [{role: "user", content: "Count to five."}], max_tokens: 12, temperature: 0,
       stream: true})});
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let text = "", reads = 0;
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      reads += 1;
      text += decoder.decode(value, {stream: true});
    }
    out.stream = {status: r.status, type: r.headers.get("content-type"), reads,
                  events: text.split("\\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6))};
  } catch (e) { out.stream = {error: String(e)}; }
  try {
    const r = await fetch(base + "/health");  // a simple request: no preflight, only the answer's headers decide
    out.health = {status: r.status};
  } catch (e) { out.health = {error: String(e)}; }
  return out;
}"""


def _requests(srv, method: str, status: int | None = None, route: str = "/v1/chat/completions") -> float:
    total = 0.0
    for key, value in srv.metrics().items():
        if (key.startswith("superfluid_http_requests_total{") and f'route="{route}"' in key
                and f'method="{method}"' in key and (status is None or f'status="{status}"' in key)):
            total += value
    return total


def _run_page(browser, origin: str, srv) -> tuple[dict, list[str]]:
    page = browser.new_page()
    sent: list[str] = []
    page.on("request", lambda req: sent.append(f"{req.method} {req.url}"))
    page.goto(origin + "/index.html")
    out = page.evaluate(CALLS, {"base": srv.base, "key": SECRET, "model": MODEL})
    page.close()
    return out, [s for s in sent if s.split(" ", 1)[1].startswith(srv.base)]


def test_a_page_of_an_allowed_origin_calls_the_api(cors_server, pages, browser):
    srv = cors_server
    preflights, posts = _requests(srv, "OPTIONS", 204), _requests(srv, "POST", 200)
    out, sent = _run_page(browser, pages[0], srv)
    print(f"allowed origin {pages[0]}: page sent {sent}; got {json.dumps(out)[:400]}")
    assert out["chat"].get("status") == 200, out
    assert out["chat"]["content"]
    assert out["chat"]["qos"] == "agent"
    assert out["chat"]["remaining"] is not None and int(out["chat"]["remaining"]) > 0  # an exposed header
    stream = out["stream"]
    assert stream.get("status") == 200 and stream["type"].startswith("text/event-stream"), out
    assert stream["events"][-1] == "[DONE]" and len(stream["events"]) >= 3, stream
    chunks = [json.loads(e) for e in stream["events"][:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert out["health"] == {"status": 200}
    assert sent == [f"POST {srv.base}/v1/chat/completions"] * 2 + [f"GET {srv.base}/health"]
    # the browser asked first (the 204 is cached for Access-Control-Max-Age, so once or twice)
    print(f"preflights answered 204: {_requests(srv, 'OPTIONS', 204) - preflights:g}")
    assert _requests(srv, "OPTIONS", 204) - preflights >= 1
    assert _requests(srv, "POST", 200) - posts == 2


def test_a_page_of_another_origin_is_blocked(cors_server, pages, browser):
    srv = cors_server
    refused, posts = _requests(srv, "OPTIONS", 403), _requests(srv, "POST")
    health = _requests(srv, "GET", route="/health")
    out, sent = _run_page(browser, pages[1], srv)
    print(f"disallowed origin {pages[1]}: page sent {sent}; got {out}")
    for call in ("chat", "stream", "health"):
        assert "Failed to fetch" in out[call].get("error", ""), out
    # the preflights were refused (403) and the POSTs never sent; /health answered, unread by the page
    print(f"preflights answered 403: {_requests(srv, 'OPTIONS', 403) - refused:g}")
    assert _requests(srv, "OPTIONS", 403) - refused >= 1
    assert _requests(srv, "POST") == posts
    assert _requests(srv, "GET", route="/health") == health + 1


# ---- TLS ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


class TlsServer(ServerProcess):
    """A ServerProcess started with the test certificate: ready once /health answers over HTTPS."""

    def __init__(self, args, log_path, ca):
        self.ca = ca
        super().__init__(args, log_path)

    def _wait_ready(self, timeout: float) -> None:
        self.base = self.base.replace("http://", "https://")
        ctx = ssl.create_default_context(cafile=str(self.ca))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log()}")


@pytest.fixture(scope="module")
def tls_server(model_path, certs, tmp_path_factory):
    args = ["--model", model_path, "--model-name", MODEL, "--max-context", TEST_CONTEXT, "--max-batch", "2",
            "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    srv = TlsServer(args, tmp_path_factory.mktemp("tls") / "server.log", certs.ca)
    try:
        yield srv
    finally:
        srv.stop()


def test_openai_client_over_https(tls_server, certs):
    openai = pytest.importorskip("openai")
    import httpx

    srv = tls_server
    assert srv.base.startswith("https://127.0.0.1:")
    assert re.search(rf"serving {MODEL} on https://127\.0\.0\.1:{srv.port}\b", srv.log()), srv.log()
    trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(certs.ca)))
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", http_client=trusted, max_retries=0,
                           timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces)
    # a client that does not trust the test CA refuses the certificate
    untrusting = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
    # plain HTTP to the HTTPS port gets no answer
    plain = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.APIConnectionError):
        plain.models.list()
    trusted.close()


def test_a_key_that_does_not_match_stops_serve(certs, model_path):
    run = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model_path,
                          "--port", "0", "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.other_key)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "does not match the certificate" in run.stderr and str(certs.other_key) in run.stderr
    assert "loading" not in run.stdout.lower()  # refused before a model loaded


def test_fleet_over_https_to_an_https_node(tls_server, certs, tmp_path):
    pytest.importorskip("smg")
    openai = pytest.importorskip("openai")
    import httpx

    port = free_port()
    log_path = tmp_path / "fleet.log"
    with open(log_path, "wb") as log:
        proc = lifeline.popen([sys.executable, "-m", "superfluid.core.cli", "fleet", "--port", str(port),
                               "--policy", "round_robin", "--node", tls_server.base,
                               "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
                               "--ssl-cafile", str(certs.ca)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              # SMG stopped without its grace period: idle, it waits half of it (2.5 s)
                              env=dict(os.environ, PYTHONUNBUFFERED="1", SUPERFLUID_TEST_SMG_GRACE_S="0"))
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    base = f"https://127.0.0.1:{port}"
    try:
        deadline, health = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(base + "/health", timeout=2, context=ctx) as r:
                    health = json.loads(r.read())
                    if r.status == 200 and health.get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError(f"the fleet head never answered healthy over HTTPS: {health}\n"
                                 f"{log_path.read_text()[-4000:]}")
        assert f"serving on {base}" in log_path.read_text()
        with httpx.Client(verify=ctx) as trusted:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", http_client=trusted, max_retries=0,
                                   timeout=120)
            reply = None
            deadline = time.monotonic() + 30  # SMG routes once it has registered the node
            while reply is None:
                try:
                    reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                           messages=[{"role": "user", "content": "Say hi."}])
                except openai.APIStatusError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            assert reply.choices[0].message.content
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

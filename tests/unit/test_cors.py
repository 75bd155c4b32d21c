"""CORS (--cors-origins): the origin rules, the refusal of '*' on an open address without keys,
and what build_app's own application answers (preflights on known, unknown and keyed routes, a
disallowed origin's 403, the headers of replies, errors and streams, the per-route counts). A
stand-in daemon (no model); the real browser is tests/server/test_cors_tls.py."""

from __future__ import annotations

import asyncio
import types

import pytest
from aiohttp.test_utils import TestClient, TestServer

from superfluid.core.cli import load
from superfluid.core.errors import ConfigError
from superfluid.plugins.http.cors import ALLOW_HEADERS, Cors, parse_origin, wildcard_refusal
from superfluid.plugins.http.frontend import build_app
from superfluid.plugins.http.info.metrics import METRICS
from superfluid.plugins.http.keys.policy import PolicyFile, hash_secret

APP = "http://app.example.com"
EVIL = "http://evil.example.net"
SECRET = "sk-cors-user"


def test_origins_are_normalised_as_browsers_send_them():
    assert parse_origin("https://App.Example.com/") == "https://app.example.com"
    assert parse_origin("https://app.example.com:443") == "https://app.example.com"
    assert parse_origin("http://localhost:3000") == "http://localhost:3000"
    assert parse_origin("http://[::1]:8000") == "http://[::1]:8000"
    assert parse_origin("vscode-webview://abc123") == "vscode-webview://abc123"
    assert parse_origin(" * ") == "*"
    for bad in ("app.example.com", "https://app.example.com/path", "https://x.com?q=1", "null", "",
                "https://user@x.com", "https://x.com:99999", "https://"):
        with pytest.raises(ConfigError):
            parse_origin(bad)


def test_allowed_disallowed_and_wildcard():
    cors = Cors([parse_origin(APP), parse_origin("http://localhost:3000")])
    assert cors.allow_origin(APP) == APP
    assert cors.allow_origin("http://localhost:3000") == "http://localhost:3000"
    assert cors.allow_origin(EVIL) is None
    assert cors.allow_origin("http://localhost:3001") is None
    assert cors.allow_origin("https://app.example.com") is None  # another scheme is another origin
    assert cors.allow_origin(None) is None and cors.allow_origin("") is None
    assert Cors(["*"]).allow_origin(EVIL) == "*"
    assert not Cors([])


def test_wildcard_needs_keys_or_loopback():
    assert wildcard_refusal(["*"], "127.0.0.1", None) is None
    assert wildcard_refusal(["*"], "::1", None) is None
    assert wildcard_refusal(["*"], "localhost", None) is None
    assert wildcard_refusal(["*"], "0.0.0.0", "keys.toml") is None
    assert wildcard_refusal([APP], "0.0.0.0", None) is None  # a named origin is the operator's choice
    refusal = wildcard_refusal(["*"], "0.0.0.0", None)
    assert refusal and "--cors-origins '*'" in refusal and "--key-policy" in refusal
    assert wildcard_refusal(["*", APP], "192.168.1.5", None)


def test_serve_refuses_a_wildcard_on_an_open_address_without_keys(tmp_path):
    # --insecure opens the door to API clients; it does not open it to every web page
    with pytest.raises(ConfigError, match=r"refusing to start: --cors-origins '\*'"):
        load(["serve", "--host", "0.0.0.0", "--insecure", "--cors-origins", "*"])
    with pytest.raises(ConfigError, match="cors-origins"):
        load(["serve", "--cors-origins", "app.example.com"])
    toml = tmp_path / "s.toml"
    toml.write_text('cors-origins = ["https://A.example.com/", "*"]\n')
    config, _ = load(["serve", "--config", str(toml)])  # loopback: the wildcard is allowed
    from superfluid.plugins.http.options import OPTIONS
    assert OPTIONS.of(config).cors_origins == ["https://a.example.com", "*"]
    policy = tmp_path / "keys.toml"
    policy.write_text(f'[keys.user]\nsha256 = "{hash_secret(SECRET)}"\n')
    load(["serve", "--host", "0.0.0.0", "--key-policy", str(policy), "--cors-origins", "*"])


class _Daemon:
    def __init__(self):
        self.models = {}
        self.sessions = types.SimpleNamespace(sessions={})
        self.draining = False

    def model_states(self):
        return {}

    def get(self, name):
        return None


def _app(tmp_path, *flags, policy=True):
    config, _pm = load(["serve", *flags])
    keys = None
    if policy:
        path = tmp_path / "keys.toml"
        path.write_text(f'[keys.user]\nsha256 = "{hash_secret(SECRET)}"\ndashboard = true\n')
        keys = PolicyFile(str(path))
    return build_app(_Daemon(), config, keys=keys)


def _preflight(origin, method="POST", headers="authorization, content-type, x-stainless-os"):
    out = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        out["Access-Control-Request-Headers"] = headers
    return out


def _count(route: str, method: str, status: int) -> float:
    for metric in METRICS.registry.collect():
        for sample in metric.samples:
            if (sample.name == "superfluid_http_requests_total" and sample.labels.get("route") == route
                    and sample.labels.get("method") == method and sample.labels.get("status") == str(status)):
                return sample.value
    return 0.0


def test_preflights_pass_the_key_policy_and_replies_carry_the_headers(tmp_path):
    app = _app(tmp_path, "--cors-origins", APP, "--cors-origins", "http://localhost:3000")
    counted = _count("/v1/chat/completions", "OPTIONS", 204)

    async def go():
        async with TestClient(TestServer(app)) as client:
            # a preflight carries no key: the policy lets it through, on a keyed route
            r = await client.options("/v1/chat/completions", headers=_preflight(APP))
            assert r.status == 204, await r.text()
            assert r.headers["Access-Control-Allow-Origin"] == APP
            methods = {m.strip() for m in r.headers["Access-Control-Allow-Methods"].split(",")}
            assert methods == {"GET", "POST", "DELETE", "OPTIONS", "HEAD"}
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
            assert int(r.headers["Access-Control-Max-Age"]) > 0
            assert "Origin" in r.headers["Vary"]
            # no requested headers: what the APIs read
            r = await client.options("/v1/messages", headers=_preflight(APP, headers=None))
            assert r.status == 204 and r.headers["Access-Control-Allow-Headers"] == ALLOW_HEADERS
            for needed in ("authorization", "x-api-key", "anthropic-version", "x-superfluid-qos"):
                assert needed in ALLOW_HEADERS
            # an unknown path and an /admin route preflight too (the real request then gets its 404 / 401)
            for path in ("/no/such/route", "/admin/models"):
                r = await client.options(path, headers=_preflight("http://localhost:3000", "DELETE"))
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
            # a disallowed origin: 403, no CORS headers (the browser blocks the request)
            r = await client.options("/v1/chat/completions", headers=_preflight(EVIL))
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "cors_origin_not_allowed"
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
            # an OPTIONS that is no preflight (no Origin) is what it was before: not a 204
            r = await client.options("/v1/chat/completions")
            assert r.status in (401, 405) and "Access-Control-Allow-Origin" not in r.headers
            # the actual requests: an allowed origin reads the reply, its error too
            r = await client.get("/health", headers={"Origin": APP})  # 503 here: no model is loaded
            assert r.headers["Access-Control-Allow-Origin"] == APP
            exposed = r.headers["Access-Control-Expose-Headers"].lower()
            for name in ("x-ratelimit-remaining-requests", "x-ratelimit-reset-tokens", "retry-after",
                         "x-superfluid-qos", "x-request-id"):
                assert name in exposed
            assert "Origin" in r.headers["Vary"]
            r = await client.get("/v1/models", headers={"Origin": APP})
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == APP
            r = await client.get("/v1/models", headers={"Origin": APP, "Authorization": f"Bearer {SECRET}"})
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == APP
            r = await client.get("/v1/models", headers={"Origin": EVIL, "Authorization": f"Bearer {SECRET}"})
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            assert r.headers["Vary"] == "Origin"  # caches keep each origin's answer apart
            r = await client.get("/health")  # no Origin: a plain client, no CORS headers
            assert "Access-Control-Allow-Origin" not in r.headers
            # a stream (SSE, written with StreamResponse.prepare) carries them too
            async with client.get("/events", headers={"Origin": APP, "Authorization": f"Bearer {SECRET}"}) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                assert r.headers["Access-Control-Allow-Origin"] == APP
                assert (await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)).startswith(b"event: hello")

    asyncio.run(go())
    # /metrics counts the preflight under its route, like any request
    assert _count("/v1/chat/completions", "OPTIONS", 204) == counted + 1
    assert _count("/v1/chat/completions", "OPTIONS", 403) >= 1


def test_wildcard_answers_star(tmp_path):
    app = _app(tmp_path, "--cors-origins", "*")

    async def go():
        async with TestClient(TestServer(app)) as client:
            r = await client.options("/v1/completions", headers=_preflight(EVIL))
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
            r = await client.get("/health", headers={"Origin": EVIL})
            assert r.headers["Access-Control-Allow-Origin"] == "*"

    asyncio.run(go())


def test_no_origins_no_cors(tmp_path):
    app = _app(tmp_path, policy=False)

    async def go():
        async with TestClient(TestServer(app)) as client:
            r = await client.options("/v1/chat/completions", headers=_preflight(APP))
            assert r.status == 405  # as before: no preflight answer, the browser blocks the call
            assert "Access-Control-Allow-Origin" not in r.headers
            r = await client.get("/health", headers={"Origin": APP})
            assert "Access-Control-Allow-Origin" not in r.headers and "Vary" not in r.headers

    asyncio.run(go())

"""Who may watch: GET /events and /dashboard under a key policy (401 without a key, 403 without
the admin or dashboard grant, ``?key=`` on these two routes only, the secret never logged), and
open without one. The app is build_app's own with a stand-in daemon (no model); the real server
is tests/server/test_events.py."""

from __future__ import annotations

import asyncio
import logging
import types

from aiohttp.test_utils import TestClient, TestServer

from superfluid.core.cli import load
from superfluid.plugins.http.frontend import build_app
from superfluid.plugins.http.keys.policy import PolicyFile, hash_secret

SECRETS = {"user": "sk-user-x", "watcher": "sk-watch-x", "admin": "sk-admin-x"}
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


class _Daemon:
    def __init__(self):
        self.models = {}
        self.sessions = types.SimpleNamespace(sessions={})
        self.draining = False

    def model_states(self):
        return {}

    def get(self, name):  # the real one raises 503 for a model unloaded or loading; none is here
        return None


def _app(policy_path=None):
    config, _pm = load(["serve"])
    return build_app(_Daemon(), config, keys=PolicyFile(str(policy_path)) if policy_path else None)


async def _first_event(resp) -> bytes:
    return await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)


def test_key_policy_doors(tmp_path, caplog):
    path = tmp_path / "keys.toml"
    path.write_text(POLICY)

    async def go():
        async with TestClient(TestServer(_app(path))) as client:
            r = await client.get("/events")
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            r = await client.get("/events", headers={"Authorization": f"Bearer {SECRETS['user']}"})
            body = await r.json()
            assert r.status == 403 and body["error"]["code"] == "dashboard_not_allowed"
            for name in ("watcher", "admin"):
                async with client.get("/events", headers={"Authorization": f"Bearer {SECRETS[name]}"}) as r:
                    assert r.status == 200 and r.content_type == "text/event-stream"
                    hello = await _first_event(r)
                    assert hello.startswith(b"event: hello\ndata: ") and b'"keys":true' in hello
            async with client.get("/events", params={"key": SECRETS["watcher"], "interval_ms": "100"}) as r:
                assert r.status == 200
                await _first_event(r)
                snap = await _first_event(r)
                assert snap.startswith(b"event: snapshot\n") and b'"keys":{"user":' in snap
            r = await client.get("/events", params={"key": SECRETS["user"]})
            assert r.status == 403
            r = await client.get("/events", params={"key": "sk-wrong"})
            assert r.status == 401
            r = await client.get("/dashboard", params={"key": SECRETS["watcher"]})
            assert r.status == 200 and r.content_type == "text/html"
            assert r.headers["Referrer-Policy"] == "no-referrer"
            r = await client.get("/dashboard", params={"key": SECRETS["user"]})
            assert r.status == 403
            # ?key= is for the watching routes only: elsewhere it is no key at all
            r = await client.get("/v1/models", params={"key": SECRETS["admin"]})
            assert r.status == 401
            r = await client.get("/slots", params={"key": SECRETS["admin"]})
            assert r.status == 401

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
    # the server's own loggers (the real server runs without aiohttp's access log, which prints queries)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("superfluid"))
    assert "refused GET /events (no dashboard grant)" in logged
    assert not any(secret in logged for secret in SECRETS.values()) and "sk-wrong" not in logged


def test_open_without_a_policy_and_bad_queries():
    async def go():
        async with TestClient(TestServer(_app())) as client:
            async with client.get("/events") as r:
                assert r.status == 200
                hello = await _first_event(r)
                assert b'"keys":false' in hello and b'"interval_ms":500' in hello
                snap = await _first_event(r)
                assert snap.startswith(b"event: snapshot\n") and b'"keys"' not in snap
            for query, param in (({"interval_ms": "50"}, "interval_ms"), ({"interval_ms": "x"}, "interval_ms"),
                                 ({"since": "3"}, "since")):
                r = await client.get("/events", params=query)
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == param and body["error"]["type"]
            r = await client.get("/events", params={"model": "nope"})
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    asyncio.run(go())

"""Unloading a model under traffic and loading it again, against the real server and model."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

PROMPT = [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}]


async def stream_one(session: aiohttp.ClientSession, base: str) -> dict:
    """One streaming chat; how it ended: 'ok', or the error's status and code."""
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            err = await resp.json()
            return {"end": "error", "status": resp.status, "code": err["error"]["code"],
                    "retry_after": resp.headers.get("Retry-After")}
        finish = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"end": "error", "status": 200, "code": chunk["error"]["code"]}
            finish = chunk["choices"][0]["finish_reason"] or finish
        return {"end": "ok", "finish": finish}


async def unload_under_traffic(base: str) -> tuple[list[dict], dict, float]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(stream_one(session, base)) for _ in range(6)]
        await asyncio.sleep(1.0)  # two running, four queued
        started = time.monotonic()
        async with session.post(base + "/admin/models/smollm2/unload", json={"drain_timeout_s": 1}) as r:
            assert r.status == 200, await r.text()
            unloaded = await r.json()
        took = time.monotonic() - started
        results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        return results, unloaded, took


def test_unload_under_traffic_then_reload(start_server):
    srv = start_server("--max-batch", "2")
    results, unloaded, took = asyncio.run(unload_under_traffic(srv.base))
    assert unloaded == {"model": "smollm2", "state": "unloaded"}
    assert took < 15, took  # the drain timeout bounds it (plus engine shutdown)
    # Every client got an answer: a whole reply or a clear error; none hung, none got a 500.
    assert all(r["end"] == "ok" or r["code"] == "model_unloaded" for r in results), results
    assert any(r["end"] == "error" for r in results), results  # 200 tokens each can't all fit in 1 s
    refused = asyncio.run(_one(srv.base))
    assert refused["status"] == 503 and refused["code"] == "model_unloaded" and refused["retry_after"]
    assert srv.get_json("/admin/models") == {"models": {"smollm2": "unloaded"}}
    loaded = _post(srv, "/admin/models/smollm2/load")
    assert loaded == (200, {"model": "smollm2", "state": "ready"})
    again = asyncio.run(_one(srv.base))
    assert again["end"] == "ok", again
    slots = srv.get_json("/slots")["models"]["smollm2"]
    assert all(s["state"] == "free" for s in slots["slots"]) and slots["queued"] == 0
    assert srv.proc.poll() is None


async def _one(base: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await stream_one(session, base)


def _post(srv, path: str, body: dict | None = None) -> tuple[int, dict]:
    return srv.call("POST", path, body or {})


@pytest.mark.parametrize("path,body,status,code", [
    ("/admin/models/nope/unload", {}, 404, "model_not_found"),
    ("/admin/models/nope/load", {}, 404, "model_not_found"),
    ("/admin/models/smollm2/unload", {"drain_timeout_s": -1}, 400, "invalid_value"),
    ("/admin/models/smollm2/unload", {"drain_timeout_s": "soon"}, 400, "invalid_type"),  # as every route names a wrong type
    ("/admin/models/smollm2/unload", {"when": "now"}, 400, "unknown_parameter"),
])
def test_bad_admin_requests(server, path, body, status, code):
    got, err = _post(server, path, body)
    assert got == status and err["error"]["code"] == code, err
    assert server.get_json("/admin/models") == {"models": {"smollm2": "ready"}}

"""Shared pieces of the suite: outcomes, HTTP helpers over aiohttp, SSE streams, counters.

A scenario returns an :class:`Outcome` whose verdict is computed by code from the figures it
measured (``pass``/``fail``), ``n/a`` when the target has no way to run it, or ``error`` when the
run itself broke (a route the scenario needs answered 404/405: "not available")."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tools.bench.client import sse_data

PASS, FAIL, NA, ERROR = "pass", "fail", "n/a", "error"
SYMBOL = {PASS: "✓", FAIL: "✗", NA: "n/a", ERROR: "err"}


@dataclass
class Outcome:
    scenario: str
    target: str
    verdict: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "target": self.target, "verdict": self.verdict,
                "reason": self.reason, "figures": self.figures, "seconds": round(self.seconds, 2)}


class NotAvailable(RuntimeError):
    """A route the scenario needs is not there (404/405), or the target lacks the feature."""


class Unsupported(RuntimeError):
    """The target has no way to run this scenario: the verdict is n/a."""


def verdict(ok: bool, why_pass: str, why_fail: str) -> tuple[str, str]:
    return (PASS, why_pass) if ok else (FAIL, why_fail)


def _error_code(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("code")
    return None


def check_route(status: int, body: Any, route: str) -> None:
    """Raise NotAvailable when a route is missing (404/405 that is not about a model/session)."""
    if status in (404, 405) and _error_code(body) in (None, "not_found", "method_not_allowed"):
        raise NotAvailable(f"not available: {route} answered {status}")


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    seconds: float


async def call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
               headers: dict[str, str] | None = None, timeout: float = 120.0) -> Reply:
    t0 = time.monotonic()
    async with session.request(method, url, json=body, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        raw = await r.read()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        return Reply(r.status, data, dict(r.headers), time.monotonic() - t0)


@dataclass
class StreamResult:
    status: int
    sent: float          # monotonic instants
    first_token: float | None
    done: float
    text: str = ""
    chunks: int = 0
    usage: dict | None = None
    error: str | None = None
    body: Any = None     # the error body of a non-200 answer

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    def to_json(self, t0: float = 0.0) -> dict:
        return {"status": self.status, "sent": round(self.sent - t0, 3),
                "first_token": None if self.first_token is None else round(self.first_token - t0, 3),
                "done": round(self.done - t0, 3), "chunks": self.chunks, "usage": self.usage,
                "error": self.error}


def _delta_text(chunk: dict) -> str:
    out = []
    for c in chunk.get("choices") or ():
        if "text" in c and c["text"]:
            out.append(c["text"])
        d = c.get("delta") or {}
        if d.get("content"):
            out.append(d["content"])
        if d.get("reasoning_content"):
            out.append(d["reasoning_content"])
        if d.get("tool_calls"):
            out.append(json.dumps(d["tool_calls"]))
    return "".join(out)


async def stream(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None,
                 timeout: float = 600.0, on_chunk=None) -> StreamResult:
    """POST a streamed completion / chat completion and read it to its end."""
    body = {**body, "stream": True}
    sent = time.monotonic()
    res = StreamResult(status=0, sent=sent, first_token=None, done=sent)
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            res.status = r.status
            if r.status != 200:
                raw = await r.read()
                try:
                    res.body = json.loads(raw)
                except ValueError:
                    res.body = raw.decode(errors="replace")[:500]
                res.error = f"HTTP {r.status}: {str(res.body)[:300]}"
                res.done = time.monotonic()
                return res
            parts = []
            async for payload in sse_data(r.content):
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(chunk, dict) and chunk.get("error"):
                    res.error = f"stream error: {str(chunk['error'])[:300]}"
                    break
                if chunk.get("usage"):
                    res.usage = chunk["usage"]
                piece = _delta_text(chunk)
                if piece:
                    if res.first_token is None:
                        res.first_token = time.monotonic()
                    parts.append(piece)
                    res.chunks += 1
                    if on_chunk is not None:
                        on_chunk(res)
            res.text = "".join(parts)
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.done = time.monotonic()
    return res


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples as {"name{labels}": value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float] | None:
    try:
        async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_metrics(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def metric_sum(samples: dict[str, float] | None, name: str, **labels: str) -> float | None:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    if samples is None:
        return None
    total, seen = 0.0, False
    for key, value in samples.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
            seen = True
    return total if seen else None


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def rnd(x, nd=3):
    return None if x is None else round(x, nd)

"""One chat request of the fleet bench, with every read bounded, and what came of it.

SMG's OpenAI mode routes ``/v1/chat/completions`` only (its ``/v1/completions`` answers 501), so
the bench sends chats. An outcome is one of:

- ``completed``: a 200 with choices (a stream: content then ``data: [DONE]``);
- ``error``: a clear error, an HTTP error status with an OpenAI error body or a stream that ended
  with an ``error`` event; its message is kept;
- ``truncated``: a 200 stream that ended without ``[DONE]`` or an error event, or a broken
  connection: the client cannot tell a cut reply from a whole one;
- ``lost``: no answer within the timeout (a hang).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

OUTCOMES = ("completed", "error", "truncated", "lost")
WORKER_HEADER = "x-smg-routed-worker-id"


@dataclass
class Outcome:
    kind: str = "lost"
    status: int | None = None
    error: str | None = None  # the error's message (or the exception) of a failed request
    ttft: float | None = None  # seconds from send to the first content delta (streams)
    seconds: float = 0.0
    sent_at: float = 0.0  # monotonic
    stream: bool = False
    prompt_tokens: int | None = None
    events: int = 0  # data: events read (streams)
    worker: str | None = None  # the node SMG says served it (its x-smg-routed-worker-id header)
    code: str | None = None  # the error's code, when its body or event has one

    def to_json(self) -> dict:
        return asdict(self)


def error_message(data) -> str | None:
    """The message of an OpenAI-style error body or event, else None."""
    if isinstance(data, dict) and data.get("error") is not None:
        err = data["error"]
        if isinstance(err, dict):
            return str(err.get("message") or err.get("code") or err)[:300]
        return str(err)[:300]
    return None


def error_code(data) -> str | None:
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code is not None else None


def has_content(chunk) -> bool:
    if not isinstance(chunk, dict):
        return False
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())


@dataclass
class StreamState:
    """What an SSE body said so far: fed one line at a time (pure, so it is unit-tested)."""
    done: bool = False
    error: str | None = None
    code: str | None = None
    first_content: bool = False
    events: int = 0
    usage: dict | None = None
    bad: list[str] = field(default_factory=list)

    def feed(self, raw: bytes) -> bool:
        """Take one line; True when this line gave the first content delta."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False
        payload = line[5:].strip()
        self.events += 1
        if payload == b"[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.bad.append(payload[:120].decode(errors="replace"))
            return False
        msg = error_message(chunk)
        if msg is not None:
            self.error, self.code = msg, error_code(chunk)
            return False
        if isinstance(chunk, dict) and chunk.get("usage"):
            self.usage = chunk["usage"]
        if not self.first_content and has_content(chunk):
            self.first_content = True
            return True
        return False

    def outcome(self) -> str:
        if self.error is not None:
            return "error"
        return "completed" if self.done and self.first_content else "truncated"


def chat_body(model: str, messages: list[dict], max_tokens: int, stream: bool, qos: str | None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if qos:
        body["superfluid"] = {"qos": qos}
    return body


async def chat(session: aiohttp.ClientSession, base: str, body: dict, timeout: float,
               read_timeout: float, headers: dict | None = None) -> Outcome:
    """POST one chat; never raises for a server's failure, never waits past ``timeout``."""
    out = Outcome(stream=bool(body.get("stream")), sent_at=time.monotonic())
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers or {},
                                    timeout=aiohttp.ClientTimeout(total=timeout, sock_read=read_timeout)) as r:
                out.status = r.status
                out.worker = r.headers.get(WORKER_HEADER)
                if r.status != 200:
                    text = await r.text()
                    try:
                        data = json.loads(text)
                        out.error, out.code = error_message(data) or text[:300], error_code(data)
                    except ValueError:
                        out.error = text[:300] or f"HTTP {r.status}"
                    out.kind = "error"
                elif out.stream:
                    state = StreamState()
                    async for raw in r.content:
                        if state.feed(raw):
                            out.ttft = time.perf_counter() - t0
                        if state.done or state.error is not None:
                            break
                    out.kind, out.error, out.code, out.events = state.outcome(), state.error, state.code, state.events
                    out.prompt_tokens = (state.usage or {}).get("prompt_tokens")
                    if out.kind == "truncated":
                        out.error = "stream ended without [DONE] or an error event"
                else:
                    data = json.loads(await r.read())
                    if isinstance(data, dict) and data.get("choices"):
                        out.kind = "completed"
                        out.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
                    else:
                        out.kind, out.error = "error", error_message(data) or str(data)[:300]
    except (asyncio.TimeoutError, TimeoutError):
        out.kind, out.error = "lost", f"no answer within {timeout:g} s (read timeout {read_timeout:g} s)"
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        out.kind, out.error = "truncated", f"{type(exc).__name__}: {exc}"[:300]
    out.seconds = time.perf_counter() - t0
    return out


def tally(outcomes: list[Outcome]) -> dict:
    """Counts by outcome and the distinct error messages with how often each came."""
    counts = {k: sum(1 for o in outcomes if o.kind == k) for k in OUTCOMES}
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.kind != "completed" and o.error:
            code = f" [{o.code}]" if o.code else ""
            key = f"{o.kind}{' stream' if o.stream else ''}{code}: {o.error}"
            errors[key] = errors.get(key, 0) + 1
    return {"sent": len(outcomes), **counts, "errors": errors}

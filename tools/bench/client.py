"""HTTP requests of the method, over aiohttp: model discovery, one fixed-length
completion, one chat stream timed to its first content delta and to every delta after it
(the gaps between them are the stream's smoothness, see smoothness.py).

Each call returns the monotonic instants it observed so the caller, not the request,
decides what a round's wall time is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

GREEDY: dict[str, Any] = {"temperature": 0.0}
SAMPLED: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


class BenchError(RuntimeError):
    """A server answered in a way the method cannot use."""


@dataclass(frozen=True)
class Completion:
    completion_tokens: int
    sent: float
    done: float


@dataclass(frozen=True)
class Stream:
    ttft: float | None  # seconds from send to the first content delta; None if none came
    sent: float
    done: float
    deltas: tuple[float, ...] = ()  # arrival instants of the content deltas (perf_counter)
    completion_tokens: int | None = None  # the stream's usage, where the server sends it


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _error(resp: aiohttp.ClientResponse, what: str) -> BenchError:
    body = (await resp.text())[:500]
    return BenchError(f"{what}: HTTP {resp.status} from {resp.url}: {body}")


async def first_model(session: aiohttp.ClientSession, base: str, timeout: float) -> str:
    """The first id GET {base}/v1/models lists."""
    async with session.get(
        f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        if resp.status != 200:
            raise await _error(resp, "GET /v1/models")
        data = await resp.json(content_type=None)
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise BenchError(f"{base}/v1/models lists no model id: {str(data)[:300]}")
    return str(models[0]["id"])


async def complete(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: dict[str, Any],
    timeout: float,
) -> Completion:
    """One non-streamed /v1/completions request of fixed reply length."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": False,
        **sampling,
    }
    sent = time.perf_counter()
    async with session.post(
        f"{base}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        if resp.status != 200:
            raise await _error(resp, "POST /v1/completions")
        data = await resp.json(content_type=None)
    done = time.perf_counter()
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        raise BenchError(f"{base}/v1/completions gave no usage.completion_tokens: {str(data)[:300]}")
    return Completion(completion_tokens=usage["completion_tokens"], sent=sent, done=done)


async def _payloads(content: aiohttp.StreamReader):
    """Every ``data:`` payload of a server-sent-events body, as bytes, ``[DONE]`` included."""
    async for raw in content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def sse_data(content: aiohttp.StreamReader):
    """The ``data:`` payloads of a server-sent-events body, as bytes, up to ``[DONE]``."""
    async for payload in _payloads(content):
        if payload == b"[DONE]":
            return
        yield payload


STREAM_DONE = object()  # what sse_events yields for ``data: [DONE]``, as its last item


async def sse_events(content: aiohttp.StreamReader):
    """The JSON objects of a server-sent-events body's ``data:`` lines, then :data:`STREAM_DONE`
    if it ended with ``[DONE]`` (a stream cut short ends without it). Payloads that are not a JSON
    object are skipped: a client judging a stream by its events has nothing to take from them."""
    async for payload in _payloads(content):
        if payload == b"[DONE]":
            yield STREAM_DONE
            return
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _has_content(chunk: Any) -> bool:
    """A chunk carrying generated text: content, or reasoning_content for servers
    that split a thinking model's reasoning out of content."""
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


async def stream_ttft(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    user_text: str,
    max_tokens: int,
    sampling: dict[str, Any],
    timeout: float,
) -> Stream:
    """One /v1/chat/completions stream, read to its end: the instant of every content delta
    (the first gives the first-token time) and the usage's completion tokens. It asks for the
    usage chunk (``stream_options.include_usage``), which servers that do not know it ignore."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": user_text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    deltas: list[float] = []
    tokens = None
    sent = time.perf_counter()
    async with session.post(
        f"{base}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        if resp.status != 200:
            raise await _error(resp, "POST /v1/chat/completions")
        async for payload in sse_data(resp.content):
            arrived = time.perf_counter()  # before parsing, so the gaps do not include it
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise BenchError(f"bad SSE data from {base}: {payload[:200]!r}") from None
            if isinstance(chunk, dict) and chunk.get("error"):
                raise BenchError(f"stream error from {base}: {str(chunk['error'])[:300]}")
            if _has_content(chunk):
                deltas.append(arrived)
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tokens = usage["completion_tokens"]
    return Stream(ttft=deltas[0] - sent if deltas else None, sent=sent, done=time.perf_counter(),
                  deltas=tuple(deltas), completion_tokens=tokens)

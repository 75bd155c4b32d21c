"""A request's body read under the server's input limits (size, read time, list lengths:
:mod:`.input_limits`) and parsed into its route's typed request (:mod:`.typed`). Every route
that takes a body reads it here, so a bad one is the same 400, 408 or 413 wherever it is sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from superfluid.core.errors import InvalidRequest, RequestTimeout

from .input_limits import LIMITS, Limits
from .typed import Body, parse


def _limits(request) -> Limits | None:
    try:
        return request.config_dict.get(LIMITS)
    except AttributeError:  # not an aiohttp request (a test's stand-in): no limits
        return None


async def _read(request, limits: Limits | None) -> bytes:
    """The raw body: over --max-body-mb is a 413 (by Content-Length before reading it; aiohttp's
    client_max_size for a chunked body), slower than --body-timeout a 408."""
    if limits is None:
        return await request.read()
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise InvalidRequest(f"the request body is {length} bytes; at most {limits.max_body_bytes} "
                             f"({limits.max_body_bytes >> 20} MiB, --max-body-mb) are accepted",
                             code="request_too_large", status=413)
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request body was not received within {limits.body_timeout:g} s "
                             "(--body-timeout)") from None


def check_counts(body: Any, limits: Limits) -> None:
    """Lists longer than their limit (--max-messages, --max-stop, --max-tools): a 400 naming the field."""
    if not isinstance(body, dict):
        return
    for key, most, flag in (("messages", limits.max_messages, "--max-messages"),
                            ("stop", limits.max_stop, "--max-stop"), ("tools", limits.max_tools, "--max-tools")):
        value = body.get(key)
        if isinstance(value, list) and len(value) > most:
            raise InvalidRequest(f"{key} may hold at most {most} entries ({flag}), got {len(value)}",
                                 param=key, code="array_above_max_length")


async def read_body(request) -> dict:
    """The request's body as JSON: not UTF-8, empty, or not JSON is a 400 saying which; the
    server's input limits (input_limits.py) apply."""
    limits = _limits(request)
    raw = await _read(request, limits)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8", code="invalid_encoding") from None
    if not text.strip():
        raise InvalidRequest("request body is empty; send a JSON object", code="invalid_body")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # an integer over Python's 4300 digits
        raise InvalidRequest(f"request body holds a value we cannot parse: {exc}", code="invalid_json") from None
    if limits is not None:
        check_counts(body, limits)
    return body


async def read_as(request, cls: type[Body]) -> Body:
    """The request's body as the route's typed request ``cls`` (:mod:`.typed`): every route that
    takes a body reads it here, and nothing after the route sees the raw JSON."""
    return parse(cls, await read_body(request))


async def read_optional(request, cls: type[Body]) -> Body:
    """As :func:`read_as`, for a route whose body may be left out (no body: ``cls()``)."""
    if not request.can_read_body:
        return cls()
    raw = await request.read()
    if not raw.strip():
        return cls()
    return await read_as(request, cls)

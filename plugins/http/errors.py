"""Error responses, for our own errors and for aiohttp's: OpenAI's shape, or the shape of the
API a route belongs to (a front end registers its own with :func:`shape_errors_under`)."""

from __future__ import annotations

import json
import logging
from typing import Callable

from aiohttp import web

from superfluid.core.errors import SuperfluidError

log = logging.getLogger("superfluid.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   type_: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_ or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def from_exception(exc: SuperfluidError) -> web.Response:
    return error_response(exc.status, exc.message, code=exc.code, param=exc.param, type_=exc.type,
                          headers=exc.headers)


ErrorShape = Callable[[int, dict], dict]
"""Turns an OpenAI-style error body (``{"error": {message, type, param, code}}``) with its status
into the body another API answers errors with (Anthropic's ``{"type": "error", ...}``)."""

ERROR_SHAPES = web.AppKey("error_shapes", list)  # [(path prefix, ErrorShape)], longest prefix first


def shape_errors_under(app: web.Application, prefix: str, shape: ErrorShape) -> None:
    """Errors of requests whose path starts with ``prefix`` leave in ``shape``'s form: those the
    routes raise and those of the layers before them (authentication, limits, unknown routes),
    so a client of that API can parse every failure it gets."""
    shapes = app.setdefault(ERROR_SHAPES, [])
    shapes.append((prefix, shape))
    shapes.sort(key=lambda entry: -len(entry[0]))


def shape_for(request: web.Request) -> ErrorShape | None:
    for prefix, shape in request.app.get(ERROR_SHAPES, ()):
        if request.path.startswith(prefix):
            return shape
    return None


def reshaped(request: web.Request, resp: web.Response) -> web.Response:
    """``resp`` (an OpenAI-style error) in the form of the API ``request`` belongs to."""
    shape = shape_for(request)
    if shape is None or resp.status < 400 or resp.text is None:
        return resp
    body = shape(resp.status, json.loads(resp.text))
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.json_response(body, status=resp.status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every failure leaves as a JSON body with the right status: OpenAI's shape, or that of the
    API the path belongs to."""
    try:
        return await handler(request)
    except SuperfluidError as exc:
        return reshaped(request, from_exception(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        message = exc.text if exc.text and not exc.text.startswith(str(exc.status)) else exc.reason
        return reshaped(request, error_response(exc.status, message, code=code, headers={
            k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}))
    except json.JSONDecodeError as exc:
        return reshaped(request, error_response(400, f"request body is not valid JSON: {exc}", code="invalid_json"))

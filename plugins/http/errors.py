"""OpenAI-style error responses, for our own errors and for aiohttp's."""

from __future__ import annotations

import json
import logging

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


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every failure leaves as an OpenAI-style JSON body with the right status."""
    try:
        return await handler(request)
    except SuperfluidError as exc:
        return from_exception(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        message = exc.text if exc.text and not exc.text.startswith(str(exc.status)) else exc.reason
        return error_response(exc.status, message, code=code, headers={
            k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")})
    except json.JSONDecodeError as exc:
        return error_response(400, f"request body is not valid JSON: {exc}", code="invalid_json")

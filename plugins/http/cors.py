"""Browsers: CORS (``--cors-origins``), so a web page served from another origin may call the API.

Nothing is allowed by default: a page of another origin gets responses without CORS headers, and
the browser keeps them from it. Each ``--cors-origins`` names one origin (``scheme://host[:port]``,
as a browser sends it in ``Origin``) or ``*`` for any; ``*`` only with a key policy or on a
loopback ``--host``, since otherwise any page any user opens could drive the server
(:func:`wildcard_refusal`, checked before a model loads).

- A **preflight** (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here, on any path (an unknown one too), before authentication: a browser sends a preflight
  without the request's ``Authorization``, so a key policy must not refuse it. An allowed origin
  gets 204 with the methods, the headers (those it asked for, else what the APIs read) and a
  max age; any other a 403 ``cors_origin_not_allowed``. Preflights are counted by route like
  any request (``superfluid_http_requests_total``).
- Every **other response** to an allowed origin carries ``Access-Control-Allow-Origin`` (the
  origin itself, ``*`` under the wildcard) and ``Access-Control-Expose-Headers`` (the
  x-ratelimit-*, ``Retry-After``, ``x-superfluid-qos`` a client reads), set in
  ``on_response_prepare`` so streams (SSE) and error bodies carry them too. ``Vary: Origin`` goes
  on every response while CORS is on, so a cache never hands one origin's answer to another.

No ``Access-Control-Allow-Credentials``: keys travel in ``Authorization``, not in cookies."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from aiohttp import web

from superfluid.core.errors import ConfigError, SuperfluidError

from .loopback import is_loopback_host

WILDCARD = "*"
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS, HEAD"
# What the APIs and their SDKs send; a preflight that names its headers gets those back instead.
ALLOW_HEADERS = ", ".join([
    "authorization", "content-type", "accept", "x-api-key", "x-superfluid-qos", "x-superfluid-batch-invariant",
    "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
    "openai-organization", "openai-project", "openai-beta", "x-stainless-arch", "x-stainless-async",
    "x-stainless-lang", "x-stainless-os", "x-stainless-package-version", "x-stainless-retry-count",
    "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-timeout", "x-stainless-helper-method",
])
EXPOSE_HEADERS = ", ".join([
    "x-superfluid-qos", "retry-after", "x-request-id",
    *(f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")),
])
MAX_AGE = "600"  # seconds a browser may reuse a preflight's answer (Chromium caps it at 7200)
ROUTE = web.RequestKey("superfluid.preflight_route", str)  # request[ROUTE]: the preflight path's pattern, for /metrics

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_TOKEN_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


class OriginRefused(SuperfluidError):
    status = 403
    type = "permission_error"
    code = "cors_origin_not_allowed"


def parse_origin(text: str) -> str:
    """One ``--cors-origins`` value, normalised as browsers write ``Origin``: lowercase scheme
    and host, no default port, no trailing slash; or ``*``."""
    text = text.strip()
    if text == WILDCARD:
        return text
    problem = (f"expected an origin such as https://app.example.com or http://localhost:3000 "
               f"(scheme://host[:port], no path), or *, got {text!r}")
    if "://" not in text:
        raise ConfigError(problem)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if (not _SCHEME.fullmatch(scheme) or not parts.hostname or parts.path not in ("", "/") or parts.query
            or parts.fragment or "@" in parts.netloc or text.endswith("?") or text.endswith("#")):
        raise ConfigError(problem)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"bad port in origin {text!r}") from None
    host = parts.hostname.lower()
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc += f":{port}"
    return f"{scheme}://{netloc}"


def wildcard_refusal(origins, host: str | None, key_policy: str | None) -> str | None:
    """Why ``serve`` must not start with these origins (None: it may): ``*`` lets every page
    any user of the network opens call the server, so it needs a key policy, or a loopback
    ``--host`` (a page can then reach it only from the machine's own browser)."""
    if WILDCARD not in origins or key_policy or host is None or is_loopback_host(host):
        return None
    return (f"--cors-origins '*' with --host {host or '(all addresses)'} (not a loopback address) and no "
            f"--key-policy would let any web page, opened by anyone who can reach the port, use the server. "
            f"Name the origins of your web apps (--cors-origins https://app.example.com), or give "
            f"--key-policy FILE.toml.")


class Cors:
    """The origin rules of one front end."""

    def __init__(self, origins):
        self.origins = frozenset(origins)
        self.wildcard = WILDCARD in self.origins

    def __bool__(self) -> bool:
        return bool(self.origins)

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request's ``Origin`` (None: refused,
        or no Origin at all)."""
        if not origin:
            return None
        if self.wildcard:
            return WILDCARD
        return origin if origin.lower() in self.origins else None

    def preflight_headers(self, request: web.Request, allowed: str) -> dict[str, str]:
        asked = request.headers.get("Access-Control-Request-Headers", "").strip()
        return {"Access-Control-Allow-Origin": allowed,
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": asked if asked and _TOKEN_LIST.fullmatch(asked) else ALLOW_HEADERS,
                "Access-Control-Max-Age": MAX_AGE,
                "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"}

    def middleware(self):
        """Answers preflights before authentication (json_errors outside it shapes the 403)."""

        @web.middleware
        async def preflight(request: web.Request, handler):
            if not (request.method == "OPTIONS" and "Origin" in request.headers
                    and "Access-Control-Request-Method" in request.headers):
                return await handler(request)
            request[ROUTE] = await _pattern(request)
            allowed = self.allow_origin(request.headers["Origin"])
            if allowed is None:
                raise OriginRefused(f"origin {request.headers['Origin']!r} is not allowed to call this server "
                                    f"(--cors-origins)", headers={"Vary": "Origin"})
            return web.Response(status=204, headers=self.preflight_headers(request, allowed))

        return preflight

    def on_prepare(self):
        """An ``on_response_prepare`` callback: the CORS headers of every response that is not a
        preflight's (a stream's too)."""

        async def add(request: web.Request, response: web.StreamResponse) -> None:
            if "Access-Control-Allow-Origin" in response.headers:  # a preflight's 204
                return
            _vary_origin(response)
            allowed = self.allow_origin(request.headers.get("Origin"))
            if allowed is not None:
                response.headers["Access-Control-Allow-Origin"] = allowed
                response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS

        return add


def _vary_origin(response: web.StreamResponse) -> None:
    vary = response.headers.get("Vary")
    if vary is None:
        response.headers["Vary"] = "Origin"
    elif "origin" not in {v.strip().lower() for v in vary.split(",")}:
        response.headers["Vary"] = f"{vary}, Origin"


async def _pattern(request: web.Request) -> str | None:
    """The route pattern a preflight's path belongs to (the router matched none, the method being
    OPTIONS), so /metrics counts it under its route; None for a path no route serves."""
    for resource in request.app.router.resources():
        _match, methods = await resource.resolve(request)
        if methods:
            return resource.canonical
    return None


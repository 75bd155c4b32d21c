"""Per-route request counts and durations for /metrics, and a log line for paths no route serves.

Outermost middleware, so it sees the status that actually left: an error reshaped by
``json_errors``, a 401 from authentication, or 499 when the client went away. Routes are counted
by their pattern (``/v1/responses/{id}``), so ids never grow the series. A path that no route
serves is logged: it is how one finds what an unfamiliar client (an agent CLI) calls."""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter

from aiohttp import web

from ..cors import ROUTE as PREFLIGHT_ROUTE
from .metrics import METRICS

log = logging.getLogger("superfluid.http")
UNMATCHED = "(no route)"


def _route(request: web.Request) -> str | None:
    route = request.match_info.route
    resource = getattr(route, "resource", None)
    # a CORS preflight matched no route (no OPTIONS handler): its path's pattern, found by cors.py
    return resource.canonical if resource is not None else request.get(PREFLIGHT_ROUTE)


@web.middleware
async def count_by_route(request: web.Request, handler):
    start = perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499
        raise
    finally:
        route = _route(request)
        if route is None:
            log.info("%s %s %s: no route serves this path", request.remote, request.method, request.path)
        METRICS.http_answered(route or UNMATCHED, request.method, status, perf_counter() - start)

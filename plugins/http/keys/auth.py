"""Who is asking: the API key of a request, and what the door lets through.

With a key policy every route but /health needs a known key (``Authorization: Bearer …``, what
the ``openai`` client sends, or ``x-api-key``): a missing or unknown one is a 401
``invalid_api_key``, /admin/* without an admin key a 403. Without a policy /admin/* answers
loopback clients only, since it can unload models. The key rides on the request
(:func:`request_key`) for the routes to check models, grants and session owners; secrets are
never logged, only key names. Every response carries ``x-superfluid-qos`` with the class the
request got (set in ``on_response_prepare``, so streamed replies carry it too), and a generation
of a key with per-minute limits the x-ratelimit-* headers (see :mod:`.limits`).

**What the door costs** (``superfluid_http_auth_seconds``, one observation per request but
/health): the middleware's own work (the secret read and hashed against every key, the /admin
grant), the class ceiling (:func:`applied_class`), the key limiter's ``admit`` and the ticket's
``end`` (its release), and the ``on_response_prepare`` headers (x-superfluid-qos, x-ratelimit-*),
summed per request: one ``perf_counter`` pair per part, none around the handler's own work. The
routes time the limiter's calls with :func:`door_time`, which adds them to the request whose task
runs them, found through a context variable the middleware sets (the handler runs in the
middleware's task). The sum
is observed once its last part is done: after the handler for a stream (its headers went out while
it ran) or a client that left, else when the response (a reply, a 401, a 429) is prepared."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import logging
from time import perf_counter

from aiohttp import web

from superfluid.core import qos as qos_classes
from superfluid.core.errors import SuperfluidError

from ..info.metrics import METRICS
from ..loopback import is_loopback_host
from ..options import OPTIONS
from .limits import response_headers
from .policy import Key

log = logging.getLogger("superfluid.http")

QOS_HEADER = "x-superfluid-qos"
# Typed request keys (aiohttp's own kind: a plain string key warns, NotAppKeyWarning)
KEY = web.RequestKey("superfluid.key", Key)      # request[KEY]: the policy's Key, or absent without a policy
APPLIED = web.RequestKey("superfluid.qos", str)  # request[APPLIED]: the class a generation or session got
PUBLIC = ("/health", "/", "/api/version")  # liveness probes carry no key (Ollama's clients probe / and its version)
PROBES = ("/metrics", "/v1/models", "/api/tags", "/api/ps")  # scraped without a key, public under --http-open-probes
QUERY_KEY = ("/events", "/dashboard")  # a browser's EventSource sends no headers: ?key=SECRET there only


class Unauthorized(SuperfluidError):
    status = 401
    type = "invalid_request_error"  # what OpenAI answers for a bad key
    code = "invalid_api_key"


class Forbidden(SuperfluidError):
    status = 403
    type = "permission_error"


class _Cost:
    """What authentication and the key limits have cost one request so far, in seconds;
    ``open`` while its handler runs; observed once."""

    __slots__ = ("seconds", "open", "observed")

    def __init__(self) -> None:
        self.seconds, self.open, self.observed = 0.0, True, False

    def observe(self) -> None:
        if not self.observed:
            self.observed = True
            METRICS.auth_timed(self.seconds)


COST = web.RequestKey("superfluid.auth_cost", _Cost)  # request[COST]: its authentication and key limits' cost


_CURRENT: contextvars.ContextVar[_Cost | None] = contextvars.ContextVar("superfluid_auth_cost", default=None)


@contextlib.contextmanager
def door_time():
    """Count a block's time toward the cost of the request being handled (the routes wrap the
    key limiter's ``admit`` and the ticket's ``end`` in it); outside a request it counts nothing."""
    cost = _CURRENT.get()
    start = perf_counter()
    try:
        yield
    finally:
        if cost is not None:
            cost.seconds += perf_counter() - start


def request_key(request):
    """The request's key (None without a policy, or for a non-aiohttp request in unit tests)."""
    try:
        return request.get(KEY)
    except AttributeError:
        return None


def note_class(request, cls: str) -> str:
    """Record the class a request got, for its response's ``x-superfluid-qos``."""
    try:
        request[APPLIED] = cls
    except TypeError:
        pass
    return cls


def applied_class(request, config, asked: str | None = None, otherwise: str | None = None) -> str:
    """The class a request gets: what it asks for (``asked``, else the header if honoured, else
    ``otherwise``: the class of the model alias it named), capped at its key's class; with nothing
    asked, the key's class or --http-default-qos. ``config``: the Config, or this plugin's
    options (``OPTIONS.of(config)``)."""
    cost = _CURRENT.get()
    if cost is None:
        return _applied_class(request, config, asked, otherwise)
    start = perf_counter()
    try:
        return _applied_class(request, config, asked, otherwise)
    finally:
        cost.seconds += perf_counter() - start


def _applied_class(request, config, asked: str | None, otherwise: str | None = None) -> str:
    opts = OPTIONS.of(config)
    header = request.headers.get(QOS_HEADER)
    if header is not None and opts.http_qos_header:
        # resolved even when the body's extension names the class: an unknown class is the
        # client's mistake to hear about (a 400), not a header to drop without a word
        from_header = qos_classes.resolve(header)
        if asked is None:
            asked = from_header
    if asked is None:
        asked = otherwise
    key = request_key(request)
    if key is not None:
        return key.cap(asked)
    return asked or opts.http_default_qos


def check_model(request, model: str) -> None:
    key = request_key(request)
    if key is not None and not key.allows_model(model):
        raise Forbidden(f"key {key.name!r} may not use model {model!r}", param="model", code="model_not_allowed")


def may_see(request, owner: str | None) -> bool:
    """Whether the request's key may see a session opened by ``owner`` (a key name): its own
    sessions, or all of them with an admin key or without a policy."""
    key = request_key(request)
    return key is None or key.admin or owner == key.name


def open_door(host: str | None, key_policy: str | None, insecure: bool) -> str | None:
    """Why ``serve`` must not start (None: it may): a non-loopback address with no key policy
    lets anyone on the network use every model and claim any class."""
    if host is None or is_loopback_host(host) or key_policy or insecure:  # None: no --host option
        return None
    return (f"--host {host or '(all addresses)'} is not a loopback address and no --key-policy is set: "
            f"anyone who can reach the port could use every model, claim the interactive class and "
            f"unload models. Give --key-policy FILE.toml (see `superfluid keys new`), or --insecure "
            f"to serve without keys anyway.")


def _remote_is_loopback(request) -> bool:
    remote = request.remote or ""
    try:
        addr = ipaddress.ip_address(remote.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _is_admin(request) -> bool:
    route = request.match_info.route
    canonical = getattr(route.resource, "canonical", "") if route.resource is not None else ""
    paths = (request.path, canonical if isinstance(canonical, str) else "")
    return any(p == "/admin" or p.startswith("/admin/") for p in paths)


def _secret(request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    found = request.headers.get("x-api-key", "").strip() or None
    if found is None and request.path in QUERY_KEY:
        found = request.query.get("key", "").strip() or None  # never logged: log lines print the path only
    return found


def middleware(policy_file, config):
    """The authenticating middleware; ``policy_file`` a :class:`~.policy.PolicyFile` or None."""

    public = PUBLIC + (PROBES if OPTIONS.of(config).http_open_probes else ())

    @web.middleware
    async def authenticate(request: web.Request, handler):
        if request.path in public:
            return await handler(request)
        start = perf_counter()
        cost = request[COST] = _Cost()
        token = _CURRENT.set(cost)
        response = None
        try:
            try:
                check(request)
            finally:
                cost.seconds += perf_counter() - start
            response = await handler(request)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            cost.observe()  # the client left: no response will be prepared
            raise
        finally:
            _CURRENT.reset(token)
            cost.open = False
            if getattr(response, "prepared", False):
                cost.observe()  # a stream: its headers went out while the handler ran
            # else the response (the handler's, or json_errors' for a 401, 403 or 429) observes it

    def check(request: web.Request) -> None:
        policy = policy_file.current if policy_file is not None else None
        if policy is None:
            if _is_admin(request) and not _remote_is_loopback(request):
                raise Forbidden("without a key policy /admin routes answer loopback clients only "
                                "(start the server with --key-policy to manage it remotely)",
                                code="admin_loopback_only")
            return
        secret = _secret(request)
        if secret is None:
            where = " (or ?key=KEY here)." if request.path in QUERY_KEY else "."
            raise Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                               "or 'x-api-key: KEY'" + where, headers={"WWW-Authenticate": "Bearer"})
        key = policy.identify(secret)
        if key is None:
            log.warning("%s %s %s: unknown API key", request.remote, request.method, request.path)
            raise Unauthorized("Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"})
        request[KEY] = key
        if _is_admin(request) and not key.admin:
            log.warning("key %s: refused %s %s (not an admin key)", key.name, request.method, request.path)
            raise Forbidden(f"key {key.name!r} may not use /admin routes", code="admin_required")

    return authenticate


def qos_header(config):
    """An ``on_response_prepare`` callback: every response names the class applied; a generation
    of a key with per-minute limits carries its x-ratelimit-* headers as they stand when the
    response starts (a whole reply's after its completion was charged)."""

    opts = OPTIONS.of(config)

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        start = perf_counter()
        cls = request.get(APPLIED)
        if cls is None:
            try:
                cls = _applied_class(request, opts, None)
            except SuperfluidError:  # a bad header: the class it would have had without one
                key = request_key(request)
                cls = key.qos if key is not None else opts.http_default_qos
        response.headers[QOS_HEADER] = cls
        for name, value in response_headers(request).items():
            response.headers.setdefault(name, value)  # a 429's own headers stand
        cost = request.get(COST)
        if cost is not None:
            cost.seconds += perf_counter() - start
            if not cost.open:
                cost.observe()

    return add

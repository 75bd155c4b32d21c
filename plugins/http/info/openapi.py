"""The API's own description: an OpenAPI 3.0 document for every route, served at
``GET /openapi.json``. Here are the route table (each path's operations, their parameters and
the errors they may answer) and the document around it; the bodies' schemas are
:mod:`.openapi_requests` and :mod:`.openapi_responses`."""

from __future__ import annotations

import copy
import functools

from superfluid.core import qos as qos_classes

from .openapi_requests import request_schemas
from .openapi_responses import CONTENT_REPLY, MODEL_STATE, SSE_EVENT, response_schemas
from .openapi_schema import BOOL, json_body, obj, ref, string

OPENAPI_VERSION = "3.0.3"

_ERRORS = {400: "invalid request: the message and param name the field",
           401: "no or unknown API key", 403: "the key (or server) does not allow this",
           404: "unknown model, session or route", 405: "method not allowed on this route",
           409: "the session is closed or busy", 413: "body over 64 MiB",
           429: "rate limited; Retry-After says when to retry",
           500: "the engine failed while running the request",
           503: "model unloaded or loading, server shutting down, or start deadline exceeded; "
                "Retry-After says when to retry"}
_EVERY = (401, 403, 404, 405, 429, 503)  # any route: auth, limits, unknown paths, draining
_BODY = (400, 413)
_GENERATE = (*_BODY, 500)
_SESSION_ERRORS = (*_BODY, 409)

_QOS_HEADER = {"name": "x-superfluid-qos", "in": "header", "required": False,
               "description": "QoS class or alias (case-insensitive); ignored under --no-http-qos-header",
               "schema": string(enum=sorted(qos_classes.ALIASES))}
_INVARIANT_HEADER = {"name": "x-superfluid-batch-invariant", "in": "header", "required": False,
                     "description": "a lane that ticks alone; 403 unless --http-allow-batch-invariant",
                     "schema": string(enum=["true", "false", "1", "0", "yes", "no", "on", "off", ""],
                                      description="case-insensitive; empty: false")}
_SID = {"name": "sid", "in": "path", "required": True, "schema": string()}
_NAME = {"name": "name", "in": "path", "required": True, "schema": string()}


def _op(summary: str, ok: dict, *, errors: tuple = (), body: dict | None = None,
        body_required: bool = True, parameters: list | None = None, ok_status: int = 200,
        op_id: str) -> dict:
    responses = {str(ok_status): ok}
    for status in sorted(set(errors) | set(_EVERY)):
        headers = {"Retry-After": {"schema": string()}} if status in (429, 503) else {}
        responses[str(status)] = {"$ref": f"#/components/responses/E{status}"} if not headers else {
            "description": _ERRORS[status], "headers": headers,
            "content": {"application/json": {"schema": ref("Error")}}}
    out = {"operationId": op_id, "summary": summary, "responses": responses}
    if body is not None:
        out["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
    if parameters:
        out["parameters"] = parameters
    return out


def _generation(summary: str, request: str, response: str, op_id: str, params_: list | None = None) -> dict:
    ok = {"description": "the reply: whole, or with stream: true as server-sent events "
                         "(data: {chunk} lines ending with data: [DONE]; /infill streams end without it)",
          "content": {"application/json": {"schema": ref(response)},
                      "text/event-stream": {"schema": SSE_EVENT}}}
    return _op(summary, ok, errors=_GENERATE, body=ref(request), op_id=op_id,
               parameters=params_ if params_ is not None else [_QOS_HEADER, _INVARIANT_HEADER])


def _paths() -> dict:
    session = json_body(ref("Session"), "the session")
    return {
        "/v1/chat/completions": {"post": _generation(
            "chat completion", "ChatCompletionRequest", "ChatCompletion", "createChatCompletion")},
        "/v1/completions": {"post": _generation(
            "text completion (with suffix: fill-in-the-middle)", "CompletionRequest", "TextCompletion",
            "createCompletion")},
        "/infill": {"post": _generation(
            "llama.cpp-style fill-in-the-middle", "InfillRequest", "Infill", "infill", [_INVARIANT_HEADER])},
        "/v1/embeddings": {"post": _op(
            "embeddings: each input's mean-pooled, L2-normalised hidden state",
            json_body(ref("EmbeddingList"), "the embeddings, in input order"), errors=_GENERATE,
            body=ref("EmbeddingRequest"), parameters=[_QOS_HEADER], op_id="createEmbedding")},
        "/tokenize": {"post": _op("a text's tokens (llama-server's shape)",
                                  json_body(ref("TokenizeResponse"), "the tokens"),
                                  errors=_BODY, body=ref("TokenizeRequest"), op_id="tokenize")},
        "/detokenize": {"post": _op("the text of token ids", json_body(CONTENT_REPLY, "the text"), errors=_BODY,
                                    body=ref("DetokenizeRequest"), op_id="detokenize")},
        "/v1/models": {"get": _op("the served models", json_body(ref("ModelList"), "the models"),
                                  op_id="listModels")},
        "/v1/models/{id}": {"get": _op(
            "one served model (404 unknown, 503 unloaded or loading)", json_body(ref("Model"), "the model"),
            parameters=[{"name": "id", "in": "path", "required": True, "schema": string()}],
            op_id="retrieveModel")},
        "/health": {"get": _op("health: 503 with status degraded when a model's engine is not ready",
                               json_body(ref("Health"), "all models ready"), op_id="health")},
        "/slots": {"get": _op("per model: slots, queue, KV use, costs", json_body(ref("Slots"), "the slots"),
                              op_id="slots", parameters=[{"name": "model", "in": "query", "required": False,
                                                          "schema": string()}])},
        "/metrics": {"get": _op("Prometheus metrics", {"description": "Prometheus text exposition",
                                                       "content": {"text/plain": {"schema": string()}}},
                                op_id="metrics")},
        "/openapi.json": {"get": _op("this document", json_body({"type": "object"}, "OpenAPI 3.0"),
                                     op_id="openapi")},
        "/events": {"get": _op(  # docs/api.md, "Live events: GET /events"
            "live scheduler events (SSE: hello, snapshot every interval, ping); admin or dashboard grant",
            {"description": "event: hello|snapshot|ping, data: one line of JSON",
             "content": {"text/event-stream": {"schema": SSE_EVENT}}}, errors=(400,), op_id="events",
            parameters=[{"name": "model", "in": "query", "required": False, "schema": string()},
                        {"name": "interval_ms", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 100, "maximum": 5000, "default": 500}},
                        {"name": "key", "in": "query", "required": False, "schema": string(),
                         "description": "the API key, for a browser's EventSource (never logged)"}])},
        "/dashboard": {"get": _op("the live dashboard page (reads /events); admin or dashboard grant",
                                  {"description": "the page", "content": {"text/html": {"schema": string()}}},
                                  op_id="dashboard",
                                  parameters=[{"name": "key", "in": "query", "required": False,
                                               "schema": string(), "description": "the API key (never logged)"}])},
        "/v1/sessions": {
            "post": _op("open a session", json_body(ref("Session"), "the new session"), ok_status=201,
                        errors=_BODY, body=ref("SessionCreateRequest"), op_id="createSession",
                        parameters=[{**_QOS_HEADER, "schema": string(), "description":
                                     "the session's class when the body names none (then it must be a "
                                     "class or alias, else 400); not read when the body has qos"}]),
            "get": _op("all sessions", json_body(obj({"object": string(enum=["list"]),
                                                      "data": {"type": "array", "items": ref("Session")}},
                                                     required=("object", "data")), "the sessions"),
                       op_id="listSessions")},
        "/v1/sessions/{sid}": {
            "get": _op("a session and its messages", json_body(
                {"allOf": [ref("Session"), obj({"messages": {"type": "array", "items": {"type": "object"}}},
                                               required=("messages",))]}, "the session"),
                parameters=[_SID], op_id="getSession"),
            "delete": _op("close a session", json_body(obj(
                {"id": string(), "object": string(enum=["session.deleted"]), "deleted": BOOL},
                required=("id", "object", "deleted")), "closed"), errors=(409,), parameters=[_SID],
                op_id="closeSession")},
        "/v1/sessions/{sid}/turns": {"post": _op(
            "one turn: only its new messages; answered as a chat completion",
            {"description": "the reply, whole or as server-sent events",
             "content": {"application/json": {"schema": ref("ChatCompletion")},
                         "text/event-stream": {"schema": SSE_EVENT}}},
            errors=(*_SESSION_ERRORS, 500), body=ref("SessionTurnRequest"), parameters=[_SID],
            op_id="sessionTurn")},
        "/v1/sessions/{sid}/qos": {"post": _op(
            "change a session's QoS class", session, errors=_SESSION_ERRORS,
            body=ref("SessionQosRequest"),
            parameters=[_SID], op_id="setSessionQos")},
        "/v1/sessions/{sid}/park": {"post": _op(
            "park a session: its KV to disk (with --state-dir and --park)", session, errors=(409,),
            parameters=[_SID], op_id="parkSession")},
        "/admin/models": {"get": _op("every configured model's state", json_body(obj(
            {"models": {"type": "object", "additionalProperties": MODEL_STATE}}, required=("models",)),
            "the states"), op_id="adminModels")},
        "/admin/models/{name}/unload": {"post": _op(
            "unload a model: drain, then free its engine", json_body(ref("ModelState"), "unloaded"),
            errors=_BODY, body=ref("UnloadRequest"), body_required=False,
            parameters=[_NAME], op_id="unloadModel")},
        "/admin/models/{name}/load": {"post": _op(
            "load a model unloaded earlier", json_body(ref("ModelState"), "serving"),
            errors=_BODY, body=ref("LoadRequest"), body_required=False, parameters=[_NAME],
            op_id="loadModel")},
    }


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "superfluid", "version": "0.1.0",
                 "description": "The OpenAI HTTP API (chat, completions, embeddings), llama.cpp-style "
                                "/infill, /tokenize and /detokenize, "
                                "sessions, admin and info routes. See docs/api.md."},
        "paths": _paths(),
        # with --key-policy every route but /health needs a key; without one, none does
        "security": [{}, {"bearer": []}, {"apiKey": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "a key of the --key-policy file"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": _schemas(),
            "responses": {f"E{status}": json_body(ref("Error"), text) for status, text in _ERRORS.items()},
        },
    }


def _schemas() -> dict:
    requests, responses = request_schemas(), response_schemas()
    shared = sorted(name for name in set(requests) & set(responses) if requests[name] != responses[name])
    if shared:  # a request's object and a reply's may not share a name
        raise AssertionError(f"openapi: request and response schemas both named {shared}")
    return {**requests, **responses}


def document() -> dict:
    """The OpenAPI document (a fresh copy: callers may change it)."""
    return copy.deepcopy(_document())

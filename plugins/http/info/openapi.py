"""The API's own description: an OpenAPI 3.0 document for every route, served at
``GET /openapi.json``. Here are the route table (each path's operations, their parameters and
the errors they may answer) and the document around it; the bodies' schemas are
:mod:`.openapi_requests` and :mod:`.openapi_responses`."""

from __future__ import annotations

import copy
import functools


from .openapi_requests import request_schemas
from .openapi_responses import CONTENT_REPLY, MODEL_STATE, SSE_EVENT, response_schemas
from .openapi_ops import BODY, ERRORS, GENERATE, INVARIANT_HEADER, NAME, QOS_HEADER, SESSION_ERRORS, SID, op
from .openapi_schema import BOOL, json_body, obj, ref, string
from ..anthropic.openapi import paths as anthropic_paths
from ..responses.openapi import paths as responses_paths
from ..ollama.openapi import paths as ollama_paths
from ..manage.adapters_openapi import paths as adapter_paths
from ..rerank.openapi import paths as rerank_paths

OPENAPI_VERSION = "3.0.3"

def _generation(summary: str, request: str, response: str, op_id: str, params_: list | None = None) -> dict:
    ok = {"description": "the reply: whole, or with stream: true as server-sent events "
                         "(data: {chunk} lines ending with data: [DONE]; /infill streams end without it)",
          "content": {"application/json": {"schema": ref(response)},
                      "text/event-stream": {"schema": SSE_EVENT}}}
    return op(summary, ok, errors=GENERATE, body=ref(request), op_id=op_id,
               parameters=params_ if params_ is not None else [QOS_HEADER, INVARIANT_HEADER])


def _paths() -> dict:
    session = json_body(ref("Session"), "the session")
    return {
        "/v1/chat/completions": {"post": _generation(
            "chat completion", "ChatCompletionRequest", "ChatCompletion", "createChatCompletion")},
        "/v1/completions": {"post": _generation(
            "text completion (with suffix: fill-in-the-middle)", "CompletionRequest", "TextCompletion",
            "createCompletion")},
        "/infill": {"post": _generation(
            "llama.cpp-style fill-in-the-middle", "InfillRequest", "Infill", "infill", [INVARIANT_HEADER])},
        "/v1/embeddings": {"post": op(
            "embeddings: each input's mean-pooled, L2-normalised hidden state",
            json_body(ref("EmbeddingList"), "the embeddings, in input order"), errors=GENERATE,
            body=ref("EmbeddingRequest"), parameters=[QOS_HEADER], op_id="createEmbedding")},
        "/tokenize": {"post": op("a text's tokens (llama-server's shape)",
                                  json_body(ref("TokenizeResponse"), "the tokens"),
                                  errors=BODY, body=ref("TokenizeRequest"), op_id="tokenize")},
        "/detokenize": {"post": op("the text of token ids", json_body(CONTENT_REPLY, "the text"), errors=BODY,
                                    body=ref("DetokenizeRequest"), op_id="detokenize")},
        "/apply-template": {"post": op(
            "the prompt text a chat completion's body renders to (llama-server's shape), tools included",
            json_body(obj({"prompt": string()}, required=("prompt",)), "the prompt"), errors=BODY,
            body=ref("ChatCompletionRequest"), op_id="applyTemplate")},
        "/v1/models": {"get": op("the served models", json_body(ref("ModelList"), "the models"),
                                  op_id="listModels")},
        "/v1/models/{id}": {"get": op(
            "one served model (404 unknown, 503 unloaded or loading)", json_body(ref("Model"), "the model"),
            parameters=[{"name": "id", "in": "path", "required": True, "schema": string()}],
            op_id="retrieveModel")},
        "/health": {"get": op("health: 503 with status degraded when a model's engine is not ready",
                               json_body(ref("Health"), "all models ready"), op_id="health")},
        "/slots": {"get": op("per model: slots, queue, KV use, costs", json_body(ref("Slots"), "the slots"),
                              op_id="slots", parameters=[{"name": "model", "in": "query", "required": False,
                                                          "schema": string()}])},
        "/metrics": {"get": op("Prometheus metrics", {"description": "Prometheus text exposition",
                                                       "content": {"text/plain": {"schema": string()}}},
                                op_id="metrics")},
        "/openapi.json": {"get": op("this document", json_body({"type": "object"}, "OpenAPI 3.0"),
                                     op_id="openapi")},
        "/events": {"get": op(  # docs/api.md, "Live events: GET /events"
            "live scheduler events (SSE: hello, snapshot every interval, ping); admin or dashboard grant",
            {"description": "event: hello|snapshot|ping, data: one line of JSON",
             "content": {"text/event-stream": {"schema": SSE_EVENT}}}, errors=(400,), op_id="events",
            parameters=[{"name": "model", "in": "query", "required": False, "schema": string()},
                        {"name": "interval_ms", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 100, "maximum": 5000, "default": 500}},
                        {"name": "key", "in": "query", "required": False, "schema": string(),
                         "description": "the API key, for a browser's EventSource (never logged)"}])},
        "/dashboard": {"get": op("the live dashboard page (reads /events); admin or dashboard grant",
                                  {"description": "the page", "content": {"text/html": {"schema": string()}}},
                                  op_id="dashboard",
                                  parameters=[{"name": "key", "in": "query", "required": False,
                                               "schema": string(), "description": "the API key (never logged)"}])},
        "/v1/sessions": {
            "post": op("open a session", json_body(ref("Session"), "the new session"), ok_status=201,
                        errors=BODY, body=ref("SessionCreateRequest"), op_id="createSession",
                        parameters=[{**QOS_HEADER, "schema": string(), "description":
                                     "the session's class when the body names none (then it must be a "
                                     "class or alias, else 400); not read when the body has qos"}]),
            "get": op("all sessions", json_body(obj({"object": string(enum=["list"]),
                                                      "data": {"type": "array", "items": ref("Session")}},
                                                     required=("object", "data")), "the sessions"),
                       op_id="listSessions")},
        "/v1/sessions/{sid}": {
            "get": op("a session and its messages", json_body(
                {"allOf": [ref("Session"), obj({"messages": {"type": "array", "items": {"type": "object"}}},
                                               required=("messages",))]}, "the session"),
                parameters=[SID], op_id="getSession"),
            "delete": op("close a session", json_body(obj(
                {"id": string(), "object": string(enum=["session.deleted"]), "deleted": BOOL},
                required=("id", "object", "deleted")), "closed"), errors=(409,), parameters=[SID],
                op_id="closeSession")},
        "/v1/sessions/{sid}/turns": {"post": op(
            "one turn: only its new messages; answered as a chat completion",
            {"description": "the reply, whole or as server-sent events",
             "content": {"application/json": {"schema": ref("ChatCompletion")},
                         "text/event-stream": {"schema": SSE_EVENT}}},
            errors=(*SESSION_ERRORS, 500), body=ref("SessionTurnRequest"), parameters=[SID],
            op_id="sessionTurn")},
        "/v1/sessions/{sid}/qos": {"post": op(
            "change a session's QoS class", session, errors=SESSION_ERRORS,
            body=ref("SessionQosRequest"),
            parameters=[SID], op_id="setSessionQos")},
        "/v1/sessions/{sid}/park": {"post": op(
            "park a session: its KV to disk (with --state-dir and --park)", session, errors=(409,),
            parameters=[SID], op_id="parkSession")},
        "/admin/models": {"get": op("every configured model's state", json_body(obj(
            {"models": {"type": "object", "additionalProperties": MODEL_STATE}}, required=("models",)),
            "the states"), op_id="adminModels")},
        "/admin/models/{name}/unload": {"post": op(
            "unload a model: drain, then free its engine", json_body(ref("ModelState"), "unloaded"),
            errors=BODY, body=ref("UnloadRequest"), body_required=False,
            parameters=[NAME], op_id="unloadModel")},
        "/admin/models/{name}/load": {"post": op(
            "load a model unloaded earlier", json_body(ref("ModelState"), "serving"),
            errors=BODY, body=ref("LoadRequest"), body_required=False, parameters=[NAME],
            op_id="loadModel")},
        **responses_paths(),  # /v1/responses… (responses/openapi.py)
        **anthropic_paths(),  # /v1/messages… (anthropic/openapi.py)
        **ollama_paths(),  # /api/… (ollama/openapi.py)
        **rerank_paths(),  # /v1/rerank, /v1/score… (rerank/openapi.py)
        **adapter_paths(),  # LoRA adapters: /admin/models/{name}/adapters…, /lora-adapters
    }


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "superfluid", "version": "0.1.0",
                 "description": "The OpenAI HTTP API (chat, completions, embeddings), llama.cpp-style "
                                "/infill, /tokenize, /detokenize and /apply-template, "
                                "sessions, admin and info routes. See docs/api.md."},
        "paths": _paths(),
        # with --key-policy every route but /health needs a key; without one, none does
        "security": [{}, {"bearer": []}, {"apiKey": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "a key of the --key-policy file"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": _schemas(),
            "responses": {f"E{status}": json_body(ref("Error"), text) for status, text in ERRORS.items()},
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

"""The API's own description: an OpenAPI 3.0 document for every route, served at ``GET /openapi.json``.

Built in code from the same field sets the validators use (:mod:`.params`, the session and admin
routes), so a field the server accepts is a field the document lists, and every request body
refuses unknown fields (``additionalProperties: false``) as the server does. Ranges are the
validators' ranges; what depends on the served model (``max_tokens`` against its context, token
ids against its vocabulary) is described, not bounded, and answers 400 when out of range."""

from __future__ import annotations

import copy
import functools

from superfluid.core import qos as qos_classes

from . import params

OPENAPI_VERSION = "3.0.3"

# ---- small helpers ----------------------------------------------------------------------------


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _int(lo: int | None = None, hi: int | None = None, **extra) -> dict:
    out = {"type": "integer", **extra}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _num(lo: float, hi: float, **extra) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi, **extra}


def _str(**extra) -> dict:
    return {"type": "string", **extra}


_BOOL = {"type": "boolean"}


def _obj(props: dict, required: tuple = (), closed: bool = False, **extra) -> dict:
    out = {"type": "object", "properties": props, **extra}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# ---- request bodies ---------------------------------------------------------------------------

_SAMPLING = {
    "temperature": _nullable(_num(0.0, 2.0, description="0 is greedy; default 1")),
    "top_p": _nullable(_num(0.0, 1.0)),
    "top_k": _nullable(_int(0, 1 << 20, description="0: off")),
    "min_p": _nullable(_num(0.0, 1.0)),
    "seed": _nullable(_int(-(1 << 63), (1 << 64) - 1)),
    "presence_penalty": _nullable(_num(-2.0, 2.0)),
    "frequency_penalty": _nullable(_num(-2.0, 2.0)),
    "repeat_penalty": _nullable(_num(0.0, 10.0)),
    "repetition_penalty": _nullable(_num(0.0, 10.0, description="an alias of repeat_penalty")),
}
# logit_bias (chat, completions, infill): token ids (as JSON object keys are strings) to a bias
_LOGIT_BIAS = _nullable({"type": "object", "maxProperties": 300,
                         "additionalProperties": _nullable(_num(-100, 100, description="null: 0")),
                         "description": "token id (a decimal string, in the vocabulary) to a bias added to "
                                        "its logit, -100..100; at most 300 entries; 400 if the model's "
                                        "engine cannot bias logits"})
_STOP = _nullable({"anyOf": [_str(), {"type": "array", "items": _str(), "maxItems": 16}],
                   "description": "a string or at most 16 strings"})
_COMMON = {
    "model": _nullable(_str(description="a served model (GET /v1/models); null or empty: the first")),
    "max_tokens": _nullable(_int(1, description="the prompt plus max_tokens must fit the model's "
                                                "context (else 400 context_length_exceeded)")),
    "stream": _nullable(_BOOL),
    "stream_options": _nullable(_obj({"include_usage": _BOOL}, closed=True)),
    "stop": _STOP,
    "n": _nullable(_int(1, 1, description="/infill: only 1")),
    "user": _nullable(_str()),
    "logit_bias": _LOGIT_BIAS,
    "ignore_eos": _nullable(_BOOL),
    "logprobs": _nullable({"enum": [False, 0], "description": "/infill: none"}),
    "cache_prompt": _nullable({**_BOOL, "description": "false: prefill the whole prompt"}),
    "superfluid": _nullable(_obj({"qos": _nullable(_str(enum=sorted(qos_classes.ALIASES)))}, closed=True)),
    **_SAMPLING,
}

_TEXT_PART = _obj({"type": _str(enum=["text"]), "text": _str()}, required=("type", "text"))
_TOOL_CALL = _obj({"id": _str(), "type": _str(enum=["function"]),
                   "function": _obj({"name": _str(minLength=1),
                                     "arguments": {"anyOf": [_str(), {"type": "object"}]}},
                                    required=("name",))},
                  required=("id", "function"))
_CONTENT = {"anyOf": [_str(), {"type": "array", "items": _TEXT_PART}]}
_MESSAGE = {**_obj({
    "role": _str(enum=["system", "developer", "user", "assistant", "tool"]),
    "content": _nullable({**_CONTENT, "description": "required unless an assistant message carries tool_calls"}),
    "name": _str(description="the author's name, passed to the chat template"),
    "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL,
                             "description": "assistant messages only"}),
    "tool_call_id": _str(description="the call a tool message answers (required on tool messages)"),
}, required=("role",)), "anyOf": [
    _obj({"content": _CONTENT}, required=("content",)),
    _obj({"role": _str(enum=["assistant"]), "tool_calls": {"type": "array", "minItems": 1}},
         required=("role", "tool_calls"))]}
_TOOL = _obj({
    "type": _str(enum=["function"]),
    "function": _obj({"name": _str(pattern=r"^[A-Za-z0-9_.\-]{1,64}$"),
                      "description": _nullable(_str()),
                      "parameters": _nullable(_obj(
                          {"type": _str(enum=["object"]),
                           "properties": {"type": "object",
                                          "additionalProperties": {"anyOf": [{"type": "object"}, _BOOL]}},
                           "required": {"type": "array", "items": _str()}},
                          description="a JSON Schema for an object"))},
                     required=("name",)),
}, required=("type", "function"))
_TOOL_CHOICE = _nullable({"anyOf": [
    _str(enum=["none", "auto", "required"]),
    _obj({"type": _str(enum=["function"]), "function": _obj({"name": _str()}, required=("name",))},
         required=("type", "function"))]})

_N = _nullable(_int(1, 16, description="how many choices; each is a lane of its own"))
_JSON_SCHEMA_FORMAT = _obj({
    "name": _str(pattern=r"^[A-Za-z0-9_\-]{1,64}$"),
    "description": _nullable(_str()),
    "schema": _nullable({"type": "object", "description": "a JSON Schema the reply must match"}),
    "strict": _nullable(_BOOL),
}, required=("name",), closed=True)
_RESPONSE_FORMAT = _nullable({"anyOf": [
    _obj({"type": _str(enum=["text"])}, required=("type",), closed=True),
    _obj({"type": _str(enum=["json_object"])}, required=("type",), closed=True),
    _obj({"type": _str(enum=["json_schema"]), "json_schema": _JSON_SCHEMA_FORMAT},
         required=("type", "json_schema"), closed=True),
], "description": "text (default); json_object: the reply is a JSON object; json_schema: the reply "
                  "matches json_schema.schema"})

_CHAT_ONLY = {
    "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
    "max_completion_tokens": _nullable(_int(1, description="takes precedence over max_tokens")),
    "logprobs": _nullable({**_BOOL, "description": "each reply token's log-probability"}),
    "top_logprobs": _nullable(_int(0, 20, description="that many most likely candidates per token; "
                                                      "needs logprobs: true")),
    "response_format": _RESPONSE_FORMAT,
    "n": _N,
    "tools": _nullable({"type": "array", "maxItems": 128, "items": _ref("Tool"),
                        "description": "unique names"}),
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": _nullable(_BOOL),
    "service_tier": _nullable(_str()),
    "store": _nullable(_BOOL),
    "metadata": _nullable({"type": "object"}),
    "reasoning_effort": _nullable(_str()),
    "safety_identifier": _nullable(_str(description="accepted and ignored")),
    "prompt_cache_key": _nullable(_str(description="accepted and ignored: prompts are cached by their tokens")),
}
_PROMPT = {"anyOf": [
    _str(minLength=1),
    {"type": "array", "minItems": 1, "items": _int(0, description="a token id in the vocabulary")},
    {"type": "array", "minItems": 1, "maxItems": 1,
     "items": {"anyOf": [_str(minLength=1), {"type": "array", "minItems": 1, "items": _int(0)}]}},
], "description": "a string, a list of token ids, or a one-element list of either; with suffix, a string"}
_COMPLETION_ONLY = {
    "prompt": _PROMPT,
    "suffix": _nullable(_str(description="fill-in-the-middle: the text after the cursor")),
    "max_tokens": _nullable(_int(0, description="default 16; the prompt plus max_tokens must fit the "
                                                "model's context (else 400 context_length_exceeded); "
                                                "0 only with echo (the prompt scored, nothing generated)")),
    "logprobs": _nullable({"anyOf": [_int(0, 5), {"type": "boolean", "enum": [False]}],
                           "description": "the sampled token's log-probability and that many most likely "
                                          "candidates per token; false or null: none"}),
    "echo": _nullable({**_BOOL, "description": "the prompt is repeated before the completion (with "
                                               "logprobs: scored too)"}),
    "n": _N,
    "best_of": _nullable(_int(1, 16, description="must equal n (no server-side ranking)")),
}
_INFILL_ONLY = {
    "input_prefix": _nullable(_str()),
    "input_suffix": _nullable(_str()),
    "prompt": _nullable(_str(description="the start of the middle")),
    "input_extra": _nullable({"type": "array", "maxItems": 0, "description": "not supported yet"}),
    "n_predict": _nullable(_int(-1, description="-1: the rest of the context; 0 is refused; "
                                                "ignored when max_tokens is given")),
}


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _int(0, description="a token id in the vocabulary")}
_EMBEDDING_INPUT = {"anyOf": [
    _str(minLength=1),
    {"type": "array", "minItems": 1, "maxItems": 2048, "items": _str(minLength=1)},
    _TOKEN_IDS,
    {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_IDS},
], "description": "a string, a list of strings, a list of token ids, or a list of token-id lists; "
                  "at most 2048 inputs, none empty, each within the model's context"}
_EMBEDDING_KNOWN = {
    "input": _EMBEDDING_INPUT,
    "model": _nullable(_str(description="a served model with embeddings; null or empty: the first")),
    "encoding_format": _nullable(_str(enum=["float", "base64"], description="base64: little-endian "
                                                                            "float32 bytes")),
    "dimensions": _nullable(_int(1, description="must equal the model's width (it is not truncated)")),
    "user": _nullable(_str(description="accepted and ignored")),
    "superfluid": _COMMON["superfluid"],
}
_TOKENIZE_KNOWN = {
    "content": _str(),
    "add_special": _nullable({**_BOOL, "description": "add BOS (as the model does); default false"}),
    "parse_special": _nullable({**_BOOL, "description": "special-token text becomes those tokens; "
                                                        "default true"}),
    "with_pieces": _nullable({**_BOOL, "description": "each token with its text; default false"}),
    "model": _nullable(_str()),
}
_DETOKENIZE_KNOWN = {
    "tokens": {"type": "array", "items": _int(0, description="a token id in the vocabulary")},
    "model": _nullable(_str()),
}


def _closed(known: dict, fields: set[str], required: tuple = ()) -> dict:
    """A closed request body of another route: ``fields`` its validator's set."""
    if set(known) != fields:
        raise AssertionError(f"openapi: request fields {sorted(fields ^ set(known))} differ from the route's")
    return _obj(known, required=required, closed=True)


def _request(fields: set[str], extra: dict, required: tuple = ()) -> dict:
    """A closed request body holding exactly ``fields`` (the validator's set)."""
    known = {**_COMMON, **extra}
    missing = fields - set(known)
    if missing:  # a field the validator accepts that this module does not describe
        raise AssertionError(f"openapi: undescribed request fields {sorted(missing)}")
    return _obj({k: known[k] for k in sorted(fields)}, required=required, closed=True)


# ---- response bodies --------------------------------------------------------------------------

_USAGE = _obj({"prompt_tokens": _int(0), "completion_tokens": _int(0), "total_tokens": _int(0),
               "prompt_tokens_details": _obj({"cached_tokens": _int(0)})},
              required=("prompt_tokens", "completion_tokens", "total_tokens"))
_MS = _nullable({"type": "number"})
_TIMINGS = _obj({"queued_ms": _MS, "ttft_ms": _MS, "prompt_n": _int(0), "prompt_ms": _MS,
                 "predicted_n": _int(0), "predicted_ms": _MS})
_FINISH = _nullable(_str(description="stop, length, tool_calls, …"))


def _completion_envelope(obj: str, choice: dict) -> dict:
    return _obj({"id": _str(), "object": _str(enum=[obj]), "created": _int(), "model": _str(),
                 "choices": {"type": "array", "items": choice}, "usage": _ref("Usage"),
                 "timings": _ref("Timings")},
                required=("id", "object", "created", "model", "choices", "usage"))


_ASSISTANT = _obj({"role": _str(enum=["assistant"]), "content": _nullable(_str()),
                   "tool_calls": {"type": "array", "items": _TOOL_CALL}}, required=("role",))
_CHAT_COMPLETION = _completion_envelope("chat.completion", _obj(
    {"index": _int(0), "message": _ASSISTANT, "logprobs": _nullable({}), "finish_reason": _FINISH},
    required=("index", "message", "finish_reason")))
_TEXT_COMPLETION = _completion_envelope("text_completion", _obj(
    {"index": _int(0), "text": _str(), "logprobs": _nullable({}), "finish_reason": _FINISH},
    required=("index", "text", "finish_reason")))
_INFILL = _obj({"content": _str(), "model": _str(), "stop": _BOOL, "finish_reason": _FINISH,
                "tokens_predicted": _int(0), "tokens_evaluated": _int(0), "usage": _ref("Usage")},
               required=("content", "stop"))
# One server-sent event: its data a JSON chunk (the non-stream body's shape with ``delta`` or
# ``text``; /infill: {"content", "stop"}), an {"error": …} object, or the final [DONE].
_SSE_EVENT = _obj({"data": _str(description="a JSON chunk, an error object, or [DONE]")}, required=("data",))
_ERROR = _obj({"error": _obj({"message": _str(), "type": _str(), "param": _nullable(_str()),
                              "code": _nullable(_str())}, required=("message", "type"))},
              required=("error",))
_MODEL_STATE = _str(enum=["ready", "unloading", "unloaded", "loading"])
_MODEL = _obj({
    "id": _str(), "object": _str(enum=["model"]), "created": _int(), "owned_by": _str(),
    "meta": _obj({"engine": _str(), "path": _nullable(_str()), "context_length": _int(0),
                  "max_batch": _int(0)})}, required=("id", "object"))
_MODELS = _obj({"object": _str(enum=["list"]), "data": {"type": "array", "items": _ref("Model")}},
               required=("object", "data"))
_EMBEDDINGS = _obj({
    "object": _str(enum=["list"]),
    "data": {"type": "array", "items": _obj({
        "object": _str(enum=["embedding"]), "index": _int(0),
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, _str()],
                      "description": "L2-normalised; base64 of little-endian float32 with encoding_format base64"}},
        required=("object", "index", "embedding"))},
    "model": _str(),
    "usage": _obj({"prompt_tokens": _int(0), "total_tokens": _int(0)}, required=("prompt_tokens", "total_tokens")),
}, required=("object", "data", "model", "usage"))
_PIECE = _obj({"id": _int(0), "piece": {"anyOf": [_str(), {"type": "array", "items": _int(0, 255)}],
                                        "description": "the text, or its bytes when not valid UTF-8 alone"}},
              required=("id", "piece"))
_TOKENS = _obj({"tokens": {"type": "array", "items": {"anyOf": [_int(0), _PIECE]},
                           "description": "ids, or with with_pieces {id, piece} objects"}}, required=("tokens",))
_CONTENT_REPLY = _obj({"content": _str()}, required=("content",))
_HEALTH = _obj({"status": _str(enum=["ok", "degraded"]),
                "models": {"type": "object", "additionalProperties": {"type": "object"}}},
               required=("status", "models"))
_SLOTS = _obj({"models": {"type": "object", "additionalProperties": {"type": "object"}}},
              required=("models",))
_SESSION = _obj({"id": _str(), "object": _str(enum=["session"]), "model": _str(), "qos": _str(),
                 "system": _nullable(_str()), "pin_system": _BOOL,
                 "state": _str(enum=["open", "parked", "closed"]), "turns": _int(0), "created": _int(),
                 "busy": _BOOL, "parked_tokens": _int(0), "window_start": _int(0),
                 "dropped_messages": _int(0)}, required=("id", "object", "model", "qos", "state"))

# ---- routes -----------------------------------------------------------------------------------

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
               "schema": _str(enum=sorted(qos_classes.ALIASES))}
_INVARIANT_HEADER = {"name": "x-superfluid-batch-invariant", "in": "header", "required": False,
                     "description": "a lane that ticks alone; 403 unless --http-allow-batch-invariant",
                     "schema": _str(enum=["true", "false", "1", "0", "yes", "no", "on", "off", ""],
                                    description="case-insensitive; empty: false")}
_SID = {"name": "sid", "in": "path", "required": True, "schema": _str()}
_NAME = {"name": "name", "in": "path", "required": True, "schema": _str()}


def _op(summary: str, ok: dict, *, errors: tuple = (), body: dict | None = None,
        body_required: bool = True, parameters: list | None = None, ok_status: int = 200,
        op_id: str) -> dict:
    responses = {str(ok_status): ok}
    for status in sorted(set(errors) | set(_EVERY)):
        headers = {"Retry-After": {"schema": _str()}} if status in (429, 503) else {}
        responses[str(status)] = {"$ref": f"#/components/responses/E{status}"} if not headers else {
            "description": _ERRORS[status], "headers": headers,
            "content": {"application/json": {"schema": _ref("Error")}}}
    out = {"operationId": op_id, "summary": summary, "responses": responses}
    if body is not None:
        out["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
    if parameters:
        out["parameters"] = parameters
    return out


def _generation(summary: str, request: str, response: str, op_id: str, params_: list | None = None) -> dict:
    ok = {"description": "the reply: whole, or with stream: true as server-sent events "
                         "(data: {chunk} lines ending with data: [DONE]; /infill streams end without it)",
          "content": {"application/json": {"schema": _ref(response)},
                      "text/event-stream": {"schema": _SSE_EVENT}}}
    return _op(summary, ok, errors=_GENERATE, body=_ref(request), op_id=op_id,
               parameters=params_ if params_ is not None else [_QOS_HEADER, _INVARIANT_HEADER])


def _paths() -> dict:
    session = _json(_ref("Session"), "the session")
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
            _json(_ref("EmbeddingList"), "the embeddings, in input order"), errors=_GENERATE,
            body=_ref("EmbeddingRequest"), parameters=[_QOS_HEADER], op_id="createEmbedding")},
        "/tokenize": {"post": _op("a text's tokens (llama-server's shape)", _json(_ref("TokenizeResponse"), "the tokens"),
                                  errors=_BODY, body=_ref("TokenizeRequest"), op_id="tokenize")},
        "/detokenize": {"post": _op("the text of token ids", _json(_CONTENT_REPLY, "the text"), errors=_BODY,
                                    body=_ref("DetokenizeRequest"), op_id="detokenize")},
        "/v1/models": {"get": _op("the served models", _json(_ref("ModelList"), "the models"),
                                  op_id="listModels")},
        "/v1/models/{id}": {"get": _op(
            "one served model (404 unknown, 503 unloaded or loading)", _json(_ref("Model"), "the model"),
            parameters=[{"name": "id", "in": "path", "required": True, "schema": _str()}],
            op_id="retrieveModel")},
        "/health": {"get": _op("health: 503 with status degraded when a model's engine is not ready",
                               _json(_ref("Health"), "all models ready"), op_id="health")},
        "/slots": {"get": _op("per model: slots, queue, KV use, costs", _json(_ref("Slots"), "the slots"),
                              op_id="slots", parameters=[{"name": "model", "in": "query", "required": False,
                                                          "schema": _str()}])},
        "/metrics": {"get": _op("Prometheus metrics", {"description": "Prometheus text exposition",
                                                       "content": {"text/plain": {"schema": _str()}}},
                                op_id="metrics")},
        "/openapi.json": {"get": _op("this document", _json({"type": "object"}, "OpenAPI 3.0"),
                                     op_id="openapi")},
        "/events": {"get": _op(  # docs/api.md, "Live events: GET /events"
            "live scheduler events (SSE: hello, snapshot every interval, ping); admin or dashboard grant",
            {"description": "event: hello|snapshot|ping, data: one line of JSON",
             "content": {"text/event-stream": {"schema": _SSE_EVENT}}}, errors=(400,), op_id="events",
            parameters=[{"name": "model", "in": "query", "required": False, "schema": _str()},
                        {"name": "interval_ms", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 100, "maximum": 5000, "default": 500}},
                        {"name": "key", "in": "query", "required": False, "schema": _str(),
                         "description": "the API key, for a browser's EventSource (never logged)"}])},
        "/dashboard": {"get": _op("the live dashboard page (reads /events); admin or dashboard grant",
                                  {"description": "the page", "content": {"text/html": {"schema": _str()}}},
                                  op_id="dashboard",
                                  parameters=[{"name": "key", "in": "query", "required": False,
                                               "schema": _str(), "description": "the API key (never logged)"}])},
        "/v1/sessions": {
            "post": _op("open a session", _json(_ref("Session"), "the new session"), ok_status=201,
                        errors=_BODY, body=_ref("SessionCreateRequest"), op_id="createSession",
                        parameters=[{**_QOS_HEADER, "schema": _str(), "description":
                                     "the session's class when the body names none (then it must be a "
                                     "class or alias, else 400); not read when the body has qos"}]),
            "get": _op("all sessions", _json(_obj({"object": _str(enum=["list"]),
                                                   "data": {"type": "array", "items": _ref("Session")}},
                                                  required=("object", "data")), "the sessions"),
                       op_id="listSessions")},
        "/v1/sessions/{sid}": {
            "get": _op("a session and its messages", _json(
                {"allOf": [_ref("Session"), _obj({"messages": {"type": "array", "items": {"type": "object"}}},
                                                 required=("messages",))]}, "the session"),
                parameters=[_SID], op_id="getSession"),
            "delete": _op("close a session", _json(_obj(
                {"id": _str(), "object": _str(enum=["session.deleted"]), "deleted": _BOOL},
                required=("id", "object", "deleted")), "closed"), errors=(409,), parameters=[_SID],
                op_id="closeSession")},
        "/v1/sessions/{sid}/turns": {"post": _op(
            "one turn: only its new messages; answered as a chat completion",
            {"description": "the reply, whole or as server-sent events",
             "content": {"application/json": {"schema": _ref("ChatCompletion")},
                         "text/event-stream": {"schema": _SSE_EVENT}}},
            errors=(*_SESSION_ERRORS, 500), body=_ref("SessionTurnRequest"), parameters=[_SID],
            op_id="sessionTurn")},
        "/v1/sessions/{sid}/qos": {"post": _op(
            "change a session's QoS class", session, errors=_SESSION_ERRORS,
            body=_obj({"qos": _str(enum=sorted(qos_classes.ALIASES))}, required=("qos",), closed=True),
            parameters=[_SID], op_id="setSessionQos")},
        "/v1/sessions/{sid}/park": {"post": _op(
            "park a session: its KV to disk (with --state-dir and --park)", session, errors=(409,),
            parameters=[_SID], op_id="parkSession")},
        "/admin/models": {"get": _op("every configured model's state", _json(_obj(
            {"models": {"type": "object", "additionalProperties": _MODEL_STATE}}, required=("models",)),
            "the states"), op_id="adminModels")},
        "/admin/models/{name}/unload": {"post": _op(
            "unload a model: drain, then free its engine", _json(_ref("ModelState"), "unloaded"),
            errors=_BODY, body=_obj({"drain_timeout_s": _num(0, 3600)}, closed=True), body_required=False,
            parameters=[_NAME], op_id="unloadModel")},
        "/admin/models/{name}/load": {"post": _op(
            "load a model unloaded earlier", _json(_ref("ModelState"), "serving"),
            errors=_BODY, body=_obj({}, closed=True), body_required=False, parameters=[_NAME],
            op_id="loadModel")},
    }


def _schemas() -> dict:
    from . import embedding_routes, tokenize_routes
    from .session_routes import CREATE_FIELDS, TURN_FIELDS
    create_known = {"model": _nullable(_str()), "qos": _str(enum=sorted(qos_classes.ALIASES)),
                    "system": _nullable(_str()), "pin_system": _nullable({**_BOOL, "description": "needs system"})}
    assert set(create_known) == CREATE_FIELDS, "openapi: session create fields changed"
    return {
        "ChatCompletionRequest": _request(params.CHAT_FIELDS, _CHAT_ONLY, required=("messages",)),
        "CompletionRequest": _request(params.COMPLETION_FIELDS, _COMPLETION_ONLY, required=("prompt",)),
        "InfillRequest": _request(params.INFILL_FIELDS, _INFILL_ONLY),
        "SessionCreateRequest": _obj(create_known, closed=True),
        "EmbeddingRequest": _closed(_EMBEDDING_KNOWN, embedding_routes.FIELDS, required=("input",)),
        "TokenizeRequest": _closed(_TOKENIZE_KNOWN, tokenize_routes.TOKENIZE_FIELDS, required=("content",)),
        "DetokenizeRequest": _closed(_DETOKENIZE_KNOWN, tokenize_routes.DETOKENIZE_FIELDS, required=("tokens",)),
        "SessionTurnRequest": _request(TURN_FIELDS, _CHAT_ONLY, required=("messages",)),
        "ChatMessage": _MESSAGE,
        "Tool": _TOOL,
        "ChatCompletion": _CHAT_COMPLETION,
        "TextCompletion": _TEXT_COMPLETION,
        "Infill": _INFILL,
        "Usage": _USAGE,
        "Timings": _TIMINGS,
        "Error": _ERROR,
        "Model": _MODEL,
        "ModelList": _MODELS,
        "EmbeddingList": _EMBEDDINGS,
        "TokenizeResponse": _TOKENS,
        "Health": _HEALTH,
        "Slots": _SLOTS,
        "Session": _SESSION,
        "ModelState": _obj({"model": _str(), "state": _nullable(_MODEL_STATE)}, required=("model",)),
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
            "responses": {f"E{status}": _json(_ref("Error"), text) for status, text in _ERRORS.items()},
        },
    }


def document() -> dict:
    """The OpenAPI document (a fresh copy: callers may change it)."""
    return copy.deepcopy(_document())

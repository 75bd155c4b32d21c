"""The Responses API's routes in ``/openapi.json``: their path table, merged into the document's by
:func:`..info.openapi._paths`. The request bodies come from the typed requests
(:mod:`.protocol`, listed in :data:`..info.openapi_requests.REQUESTS`); the answers are
described here."""

from __future__ import annotations

from ..info.openapi_ops import BODY, GENERATE, INVARIANT_HEADER, QOS_HEADER, op
from ..info.openapi_responses import SSE_EVENT
from ..info.openapi_schema import BOOL, integer, json_body, nullable, obj, ref, string

_ID = {"name": "response_id", "in": "path", "required": True, "schema": string()}
_ITEM = obj({"id": string(), "type": string(enum=["message", "function_call"]),
             "status": string(enum=["in_progress", "completed", "incomplete"]),
             "role": string(enum=["assistant"]),
             "content": {"type": "array", "items": obj({"type": string(enum=["output_text"]), "text": string(),
                                                         "annotations": {"type": "array", "items": {}}},
                                                        required=("type", "text"))},
             "call_id": string(), "name": string(), "arguments": string(description="a JSON string")},
            required=("id", "type", "status"))
_USAGE = obj({"input_tokens": integer(0), "output_tokens": integer(0), "total_tokens": integer(0),
              "input_tokens_details": obj({"cached_tokens": integer(0), "cache_write_tokens": integer(0)}),
              "output_tokens_details": obj({"reasoning_tokens": integer(0)})},
             required=("input_tokens", "output_tokens", "total_tokens"))
RESPONSE = obj({
    "id": string(description="resp_…"), "object": string(enum=["response"]), "created_at": integer(),
    "status": string(enum=["in_progress", "completed", "incomplete", "cancelled", "failed"]),
    "completed_at": nullable(integer()), "model": string(),
    "error": nullable(obj({"code": string(), "message": string()})),
    "incomplete_details": nullable(obj({"reason": string(enum=["max_output_tokens"])})),
    "output": {"type": "array", "items": _ITEM}, "usage": nullable(_USAGE),
    "instructions": nullable(string()), "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"description": "as sent; default auto"}, "parallel_tool_calls": BOOL,
    "previous_response_id": nullable(string()), "store": BOOL,
    "metadata": {"type": "object", "additionalProperties": string()}},
    required=("id", "object", "created_at", "status", "model", "output"))
_INPUT_ITEMS = obj({"object": string(enum=["list"]),
                    "data": {"type": "array", "items": obj({"id": string(), "type": string(
                        enum=["message", "function_call", "function_call_output"])}, required=("id", "type"))},
                    "first_id": nullable(string()), "last_id": nullable(string()), "has_more": BOOL},
                   required=("object", "data", "has_more"))
_PAGE = [{"name": "limit", "in": "query", "required": False, "schema": integer(1, 100)},
         {"name": "order", "in": "query", "required": False, "schema": string(enum=["asc", "desc"])},
         {"name": "after", "in": "query", "required": False, "schema": string()},
         {"name": "before", "in": "query", "required": False, "schema": string()}]
_DELETED = obj({"id": string(), "object": string(enum=["response"]), "deleted": BOOL},
               required=("id", "object", "deleted"))
_INPUT_TOKENS = obj({"object": string(enum=["response.input_tokens"]), "input_tokens": integer(0)},
                    required=("object", "input_tokens"))


def paths() -> dict:
    """The Responses routes' entries of the document's ``paths``."""
    created = {"description": "the response: whole, or with stream: true as server-sent events (event: TYPE, "
                              "data: {type, sequence_number, ...}; response.created first, response.completed, "
                              "response.incomplete or response.failed last)",
               "content": {"application/json": {"schema": RESPONSE}, "text/event-stream": {"schema": SSE_EVENT}}}
    response = json_body(RESPONSE, "the response")
    return {
        "/v1/responses": {"post": op(
            "OpenAI Responses API: a response to input items (stored as a session turn unless store is false)",
            created, errors=(*GENERATE, 409), body=ref("ResponsesRequest"), parameters=[QOS_HEADER, INVARIANT_HEADER],
            op_id="createResponse")},
        "/v1/responses/input_tokens": {"post": op(
            "how many tokens a response's prompt would be", json_body(_INPUT_TOKENS, "the count"),
            errors=(*BODY, 409), body=ref("ResponsesInputTokensRequest"), op_id="countResponseInputTokens")},
        "/v1/responses/{response_id}": {
            "get": op("a stored response (another key's: 404)", response, parameters=[_ID], op_id="getResponse"),
            "delete": op("delete a stored response (the latest of its conversation closes its session)",
                         json_body(_DELETED, "deleted"), errors=(409,), parameters=[_ID], op_id="deleteResponse")},
        "/v1/responses/{response_id}/input_items": {"get": op(
            "the input items a stored response was asked with, paged (limit 1-100, default 20; order desc by "
            "default; after/before: an item id)", json_body(_INPUT_ITEMS, "a list of items"), errors=(400,),
            parameters=[_ID, *_PAGE], op_id="listResponseInputItems")},
        "/v1/responses/{response_id}/cancel": {"post": op(
            "cancel a response in flight (status cancelled); a finished stored one comes back unchanged",
            response, parameters=[_ID], op_id="cancelResponse")},
    }

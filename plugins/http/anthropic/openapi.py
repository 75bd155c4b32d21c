"""The Messages routes in ``/openapi.json``: their path table, merged into the document's by
:func:`..info.openapi._paths`. The request bodies come from the typed requests (:mod:`.protocol`,
listed in :data:`..info.openapi_requests.REQUESTS`); the answers are described here. Errors
under these paths are Anthropic's shape (``{"type": "error", "error": {type, message}}``)."""

from __future__ import annotations

from ..info.openapi_ops import GENERATE, INVARIANT_HEADER, QOS_HEADER, errors_shaped, op
from ..info.openapi_responses import SSE_EVENT
from ..info.openapi_schema import integer, json_body, nullable, obj, string
from .wire import STOP_REASONS

_USAGE = obj({"input_tokens": integer(0), "output_tokens": integer(0), "cache_read_input_tokens": integer(0),
              "cache_creation_input_tokens": integer(0)}, required=("input_tokens", "output_tokens"))
_BLOCK = obj({"type": string(enum=["text", "tool_use", "thinking"]), "text": string(), "id": string(),
              "name": string(), "input": {"type": "object"}}, required=("type",))
MESSAGE = obj({
    "id": string(description="msg_…"), "type": string(enum=["message"]), "role": string(enum=["assistant"]),
    "model": string(), "content": {"type": "array", "items": _BLOCK},
    "stop_reason": nullable(string(enum=list(STOP_REASONS))),
    "stop_sequence": nullable(string()), "usage": _USAGE},
    required=("id", "type", "role", "model", "content", "stop_reason", "usage"))
_COUNT = obj({"input_tokens": integer(0)}, required=("input_tokens",))
_BETA = {"name": "beta", "in": "query", "required": False, "schema": string(),
         "description": "accepted (Claude Code sends beta=true)"}


_ERROR = obj({"type": string(enum=["error"]),
               "error": obj({"type": string(description="invalid_request_error, authentication_error, "
                                                        "permission_error, not_found_error, request_too_large, "
                                                        "rate_limit_error, overloaded_error, api_error"),
                             "message": string()}, required=("type", "message"))},
              required=("type", "error"))


def _anthropic_errors(operation: dict) -> dict:
    """``operation`` with its error answers in Anthropic's shape (``op`` writes OpenAI's)."""
    return errors_shaped(operation, _ERROR)


def paths() -> dict:
    """The Messages routes' entries of the document's ``paths``."""
    created = {"description": "the message: whole, or with stream: true as server-sent events (event: NAME, "
                              "data: {type, ...}: message_start, content_block_start/delta/stop, message_delta, "
                              "message_stop; ping while a long prefill runs; error on a failure midway)",
               "content": {"application/json": {"schema": MESSAGE}, "text/event-stream": {"schema": SSE_EVENT}}}
    return {
        "/v1/messages": {"post": _anthropic_errors(op(
            "Anthropic Messages API: a message in reply to a conversation (Claude Code's route)", created,
            errors=GENERATE, body={"$ref": "#/components/schemas/MessagesRequest"},
            parameters=[QOS_HEADER, INVARIANT_HEADER, _BETA], op_id="createMessage"))},
        "/v1/messages/count_tokens": {"post": _anthropic_errors(op(
            "how many tokens a message's prompt is", json_body(_COUNT, "the count"), errors=GENERATE,
            body={"$ref": "#/components/schemas/CountTokensRequest"}, parameters=[_BETA],
            op_id="countMessageTokens"))},
    }

"""The response bodies of the OpenAPI document: what each route answers (a streamed reply as its
server-sent events), and the error object every route may answer."""

from __future__ import annotations


from .openapi_schema import BOOL, integer, nullable, obj, ref, string

_USAGE = obj({"prompt_tokens": integer(0), "completion_tokens": integer(0), "total_tokens": integer(0),
              "prompt_tokens_details": obj({"cached_tokens": integer(0)})},
             required=("prompt_tokens", "completion_tokens", "total_tokens"))
_MS = nullable({"type": "number"})
_TIMINGS = obj({"queued_ms": _MS, "ttft_ms": _MS, "prompt_n": integer(0), "prompt_ms": _MS,
                "predicted_n": integer(0), "predicted_ms": _MS})
_FINISH = nullable(string(description="stop, length, tool_calls, …"))
_STOP_REASON = nullable(string(description="the stop string that ended the reply (null: end of generation or another reason)"))


def _completion_envelope(name: str, choice: dict) -> dict:
    return obj({"id": string(), "object": string(enum=[name]), "created": integer(), "model": string(),
                "choices": {"type": "array", "items": choice}, "usage": ref("Usage"),
                "timings": ref("Timings")},
               required=("id", "object", "created", "model", "choices", "usage"))


_ASSISTANT = obj({"role": string(enum=["assistant"]), "content": nullable(string()),
                  "tool_calls": {"type": "array", "items": ref("ToolCall")}}, required=("role",))
_CHAT_COMPLETION = _completion_envelope("chat.completion", obj(
    {"index": integer(0), "message": _ASSISTANT, "logprobs": nullable({}), "finish_reason": _FINISH,
     "stop_reason": _STOP_REASON},
    required=("index", "message", "finish_reason")))
_TEXT_COMPLETION = _completion_envelope("text_completion", obj(
    {"index": integer(0), "text": string(), "logprobs": nullable({}), "finish_reason": _FINISH,
     "stop_reason": _STOP_REASON},
    required=("index", "text", "finish_reason")))
_INFILL = obj({"content": string(), "model": string(), "stop": BOOL, "finish_reason": _FINISH,
               "tokens_predicted": integer(0), "tokens_evaluated": integer(0), "usage": ref("Usage")},
              required=("content", "stop"))
# One server-sent event: its data a JSON chunk (the non-stream body's shape with ``delta`` or
# ``text``; /infill: {"content", "stop"}), an {"error": …} object, or the final [DONE].
SSE_EVENT = obj({"data": string(description="a JSON chunk, an error object, or [DONE]")}, required=("data",))
_ERROR = obj({"error": obj({"message": string(), "type": string(), "param": nullable(string()),
                            "code": nullable(string())}, required=("message", "type"))},
             required=("error",))
# a model's chat setup (core.formats.setup.ChatSetup.describe): /v1/models' meta, /api/show's superfluid
CHAT_SETUP = {"chat_template_source": string(description='"model", "file:PATH", "name:NAME" or "none"'),
              "tool_call_parser": nullable(string()), "tool_call_parser_source": string(enum=["auto", "option"]),
              "reasoning_parser": nullable(string()), "reasoning_parser_source": string(enum=["auto", "option"])}
MODEL_STATE = string(enum=["ready", "unloading", "unloaded", "loading"])
_CONTEXT = integer(0)
_MODEL = obj({
    "id": string(), "object": string(enum=["model"]), "created": integer(), "owned_by": string(),
    "context_length": _CONTEXT, "context_window": _CONTEXT, "max_model_len": _CONTEXT,
    "type": string(enum=["model"], description="Anthropic's model object"), "display_name": string(),
    "created_at": string(description="RFC 3339"), "max_input_tokens": _CONTEXT, "max_tokens": _CONTEXT,
    "meta": obj({"engine": string(), "path": nullable(string()), "context_length": integer(0),
                 "max_batch": integer(0), "alias_of": string(description="an alias: the model serving it"),
                 "qos": nullable(string(description="an alias: the class its requests ask for")),
                 **CHAT_SETUP})},
    required=("id", "object"))
_MODELS = obj({"object": string(enum=["list"]), "data": {"type": "array", "items": ref("Model")},
               "has_more": BOOL, "first_id": nullable(string()), "last_id": nullable(string())},
              required=("object", "data"))
_EMBEDDINGS = obj({
    "object": string(enum=["list"]),
    "data": {"type": "array", "items": obj({
        "object": string(enum=["embedding"]), "index": integer(0),
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, string()],
                      "description": "L2-normalised; base64 of little-endian float32 with encoding_format base64"}},
        required=("object", "index", "embedding"))},
    "model": string(),
    "usage": obj({"prompt_tokens": integer(0), "total_tokens": integer(0)}, required=("prompt_tokens", "total_tokens")),
}, required=("object", "data", "model", "usage"))
_PIECE = obj({"id": integer(0), "piece": {"anyOf": [string(), {"type": "array", "items": integer(0, 255)}],
                                          "description": "the text, or its bytes when not valid UTF-8 alone"}},
             required=("id", "piece"))
_TOKENS = obj({"tokens": {"type": "array", "items": {"anyOf": [integer(0), _PIECE]},
                          "description": "ids, or with with_pieces {id, piece} objects"}}, required=("tokens",))
CONTENT_REPLY = obj({"content": string()}, required=("content",))
_HEALTH = obj({"status": string(enum=["ok", "degraded"]),
               "models": {"type": "object", "additionalProperties": {"type": "object"}}},
              required=("status", "models"))
_SLOTS = obj({"models": {"type": "object", "additionalProperties": {"type": "object"}}},
             required=("models",))
_SESSION = obj({"id": string(), "object": string(enum=["session"]), "model": string(), "qos": string(),
                "system": nullable(string()), "pin_system": BOOL,
                "state": string(enum=["open", "parked", "closed"]), "turns": integer(0), "created": integer(),
                "busy": BOOL, "parked_tokens": integer(0), "window_start": integer(0),
                "dropped_messages": integer(0)}, required=("id", "object", "model", "qos", "state"))


def response_schemas() -> dict:
    """The response bodies, by component name."""
    return {
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
        "ModelState": obj({"model": string(), "state": nullable(MODEL_STATE)}, required=("model",)),
    }

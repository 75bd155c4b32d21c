"""The request bodies of the OpenAPI document, built from the same field sets the validators use
(:mod:`..prepare.params`, the embedding, tokenize and session routes), so a field the server
accepts is a field the document lists, and every request body refuses unknown fields
(``additionalProperties: false``) as the server does. Ranges are the validators' ranges; what
depends on the served model (``max_tokens`` against its context, token ids against its
vocabulary) is described, not bounded, and answers 400 when out of range."""

from __future__ import annotations

from superfluid.core import qos as qos_classes

from ..prepare import params
from .openapi_schema import BOOL, integer, nullable, number, obj, ref, string

_SAMPLING = {
    "temperature": nullable(number(0.0, 2.0, description="0 is greedy; default 1")),
    "top_p": nullable(number(0.0, 1.0)),
    "top_k": nullable(integer(0, 1 << 20, description="0: off")),
    "min_p": nullable(number(0.0, 1.0)),
    "seed": nullable(integer(-(1 << 63), (1 << 64) - 1)),
    "presence_penalty": nullable(number(-2.0, 2.0)),
    "frequency_penalty": nullable(number(-2.0, 2.0)),
    "repeat_penalty": nullable(number(0.0, 10.0)),
    "repetition_penalty": nullable(number(0.0, 10.0, description="an alias of repeat_penalty")),
}
# logit_bias (chat, completions, infill): token ids (as JSON object keys are strings) to a bias
_LOGIT_BIAS = nullable({"type": "object", "maxProperties": 300,
                        "additionalProperties": nullable(number(-100, 100, description="null: 0")),
                        "description": "token id (a decimal string, in the vocabulary) to a bias added to "
                                       "its logit, -100..100; at most 300 entries; 400 if the model's "
                                       "engine cannot bias logits"})
_STOP = nullable({"anyOf": [string(), {"type": "array", "items": string(), "maxItems": 16}],
                  "description": "a string or at most 16 strings"})
_COMMON = {
    "model": nullable(string(description="a served model (GET /v1/models); null or empty: the first")),
    "max_tokens": nullable(integer(1, description="the prompt plus max_tokens must fit the model's "
                                                  "context (else 400 context_length_exceeded)")),
    "stream": nullable(BOOL),
    "stream_options": nullable(obj({"include_usage": BOOL}, closed=True)),
    "stop": _STOP,
    "n": nullable(integer(1, 1, description="/infill: only 1")),
    "user": nullable(string()),
    "logit_bias": _LOGIT_BIAS,
    "ignore_eos": nullable(BOOL),
    "logprobs": nullable({"enum": [False, 0], "description": "/infill: none"}),
    "cache_prompt": nullable({**BOOL, "description": "false: prefill the whole prompt"}),
    "superfluid": nullable(obj({"qos": nullable(string(enum=sorted(qos_classes.ALIASES)))}, closed=True)),
    **_SAMPLING,
}

_TEXT_PART = obj({"type": string(enum=["text"]), "text": string()}, required=("type", "text"))
TOOL_CALL = obj({"id": string(), "type": string(enum=["function"]),
                 "function": obj({"name": string(minLength=1),
                                  "arguments": {"anyOf": [string(), {"type": "object"}]}},
                                 required=("name",))},
                required=("id", "function"))
_CONTENT = {"anyOf": [string(), {"type": "array", "items": _TEXT_PART}]}
_MESSAGE = {**obj({
    "role": string(enum=["system", "developer", "user", "assistant", "tool"]),
    "content": nullable({**_CONTENT, "description": "required unless an assistant message carries tool_calls"}),
    "name": string(description="the author's name, passed to the chat template"),
    "tool_calls": nullable({"type": "array", "items": TOOL_CALL,
                            "description": "assistant messages only"}),
    "tool_call_id": string(description="the call a tool message answers (required on tool messages)"),
}, required=("role",)), "anyOf": [
    obj({"content": _CONTENT}, required=("content",)),
    obj({"role": string(enum=["assistant"]), "tool_calls": {"type": "array", "minItems": 1}},
        required=("role", "tool_calls"))]}
_TOOL = obj({
    "type": string(enum=["function"]),
    "function": obj({"name": string(pattern=r"^[A-Za-z0-9_.\-]{1,64}$"),
                     "description": nullable(string()),
                     "parameters": nullable(obj(
                          {"type": string(enum=["object"]),
                           "properties": {"type": "object",
                                          "additionalProperties": {"anyOf": [{"type": "object"}, BOOL]}},
                           "required": {"type": "array", "items": string()}},
                          description="a JSON Schema for an object"))},
                    required=("name",)),
}, required=("type", "function"))
_TOOL_CHOICE = nullable({"anyOf": [
    string(enum=["none", "auto", "required"]),
    obj({"type": string(enum=["function"]), "function": obj({"name": string()}, required=("name",))},
        required=("type", "function"))]})

_N = nullable(integer(1, 16, description="how many choices; each is a lane of its own"))
_JSON_SCHEMA_FORMAT = obj({
    "name": string(pattern=r"^[A-Za-z0-9_\-]{1,64}$"),
    "description": nullable(string()),
    "schema": nullable({"type": "object", "description": "a JSON Schema the reply must match"}),
    "strict": nullable(BOOL),
}, required=("name",), closed=True)
_RESPONSE_FORMAT = nullable({"anyOf": [
    obj({"type": string(enum=["text"])}, required=("type",), closed=True),
    obj({"type": string(enum=["json_object"])}, required=("type",), closed=True),
    obj({"type": string(enum=["json_schema"]), "json_schema": _JSON_SCHEMA_FORMAT},
        required=("type", "json_schema"), closed=True),
], "description": "text (default); json_object: the reply is a JSON object; json_schema: the reply "
                  "matches json_schema.schema"})

_CHAT_ONLY = {
    "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
    "max_completion_tokens": nullable(integer(1, description="takes precedence over max_tokens")),
    "logprobs": nullable({**BOOL, "description": "each reply token's log-probability"}),
    "top_logprobs": nullable(integer(0, 20, description="that many most likely candidates per token; "
                                                        "needs logprobs: true")),
    "response_format": _RESPONSE_FORMAT,
    "n": _N,
    "tools": nullable({"type": "array", "maxItems": 128, "items": ref("Tool"),
                       "description": "unique names"}),
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": nullable(BOOL),
    "service_tier": nullable(string()),
    "store": nullable(BOOL),
    "metadata": nullable({"type": "object"}),
    "reasoning_effort": nullable(string()),
    "safety_identifier": nullable(string(description="accepted and ignored")),
    "prompt_cache_key": nullable(string(description="accepted and ignored: prompts are cached by their tokens")),
}
_PROMPT = {"anyOf": [
    string(minLength=1),
    {"type": "array", "minItems": 1, "items": integer(0, description="a token id in the vocabulary")},
    {"type": "array", "minItems": 1, "maxItems": 1,
     "items": {"anyOf": [string(minLength=1), {"type": "array", "minItems": 1, "items": integer(0)}]}},
], "description": "a string, a list of token ids, or a one-element list of either; with suffix, a string"}
_COMPLETION_ONLY = {
    "prompt": _PROMPT,
    "suffix": nullable(string(description="fill-in-the-middle: the text after the cursor")),
    "max_tokens": nullable(integer(0, description="default 16; the prompt plus max_tokens must fit the "
                                                  "model's context (else 400 context_length_exceeded); "
                                                  "0 only with echo (the prompt scored, nothing generated)")),
    "logprobs": nullable({"anyOf": [integer(0, 5), {"type": "boolean", "enum": [False]}],
                          "description": "the sampled token's log-probability and that many most likely "
                                         "candidates per token; false or null: none"}),
    "echo": nullable({**BOOL, "description": "the prompt is repeated before the completion (with "
                                             "logprobs: scored too)"}),
    "n": _N,
    "best_of": nullable(integer(1, 16, description="must equal n (no server-side ranking)")),
}
_INFILL_ONLY = {
    "input_prefix": nullable(string()),
    "input_suffix": nullable(string()),
    "prompt": nullable(string(description="the start of the middle")),
    "input_extra": nullable({"type": "array", "maxItems": 0, "description": "not supported yet"}),
    "n_predict": nullable(integer(-1, description="-1: the rest of the context; 0 is refused; "
                                                  "ignored when max_tokens is given")),
}


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": integer(0, description="a token id in the vocabulary")}
_EMBEDDING_INPUT = {"anyOf": [
    string(minLength=1),
    {"type": "array", "minItems": 1, "maxItems": 2048, "items": string(minLength=1)},
    _TOKEN_IDS,
    {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_IDS},
], "description": "a string, a list of strings, a list of token ids, or a list of token-id lists; "
                  "at most 2048 inputs, none empty, each within the model's context"}
_EMBEDDING_KNOWN = {
    "input": _EMBEDDING_INPUT,
    "model": nullable(string(description="a served model with embeddings; null or empty: the first")),
    "encoding_format": nullable(string(enum=["float", "base64"], description="base64: little-endian "
                                                                             "float32 bytes")),
    "dimensions": nullable(integer(1, description="must equal the model's width (it is not truncated)")),
    "user": nullable(string(description="accepted and ignored")),
    "superfluid": _COMMON["superfluid"],
}
_TOKENIZE_KNOWN = {
    "content": string(),
    "add_special": nullable({**BOOL, "description": "add BOS (as the model does); default false"}),
    "parse_special": nullable({**BOOL, "description": "special-token text becomes those tokens; "
                                                      "default true"}),
    "with_pieces": nullable({**BOOL, "description": "each token with its text; default false"}),
    "model": nullable(string()),
}
_DETOKENIZE_KNOWN = {
    "tokens": {"type": "array", "items": integer(0, description="a token id in the vocabulary")},
    "model": nullable(string()),
}


def _closed(known: dict, fields: set[str], required: tuple = ()) -> dict:
    """A closed request body of another route: ``fields`` its validator's set."""
    if set(known) != fields:
        raise AssertionError(f"openapi: request fields {sorted(fields ^ set(known))} differ from the route's")
    return obj(known, required=required, closed=True)


def _request(fields: set[str], extra: dict, required: tuple = ()) -> dict:
    """A closed request body holding exactly ``fields`` (the validator's set)."""
    known = {**_COMMON, **extra}
    missing = fields - set(known)
    if missing:  # a field the validator accepts that this module does not describe
        raise AssertionError(f"openapi: undescribed request fields {sorted(missing)}")
    return obj({k: known[k] for k in sorted(fields)}, required=required, closed=True)


def request_schemas() -> dict:
    """The request bodies, and the message and tool objects they hold, by component name."""
    from ..manage.sessions import CREATE_FIELDS, TURN_FIELDS
    from ..openai import embeddings, tokenize
    create_known = {"model": nullable(string()), "qos": string(enum=sorted(qos_classes.ALIASES)),
                    "system": nullable(string()), "pin_system": nullable({**BOOL, "description": "needs system"})}
    assert set(create_known) == CREATE_FIELDS, "openapi: session create fields changed"
    return {
        "ChatCompletionRequest": _request(params.CHAT_FIELDS, _CHAT_ONLY, required=("messages",)),
        "CompletionRequest": _request(params.COMPLETION_FIELDS, _COMPLETION_ONLY, required=("prompt",)),
        "InfillRequest": _request(params.INFILL_FIELDS, _INFILL_ONLY),
        "SessionCreateRequest": obj(create_known, closed=True),
        "EmbeddingRequest": _closed(_EMBEDDING_KNOWN, embeddings.FIELDS, required=("input",)),
        "TokenizeRequest": _closed(_TOKENIZE_KNOWN, tokenize.TOKENIZE_FIELDS, required=("content",)),
        "DetokenizeRequest": _closed(_DETOKENIZE_KNOWN, tokenize.DETOKENIZE_FIELDS, required=("tokens",)),
        "SessionTurnRequest": _request(TURN_FIELDS, _CHAT_ONLY, required=("messages",)),
        "ChatMessage": _MESSAGE,
        "Tool": _TOOL,
    }

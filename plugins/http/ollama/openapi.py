"""The Ollama routes in ``/openapi.json``: their path table, merged into the document's by
:func:`..info.openapi._paths`. Request bodies come from the typed requests (:mod:`.protocol`,
listed in :data:`..info.openapi_requests.REQUESTS`); the answers are described here. Errors
under ``/api`` are Ollama's shape (``{"error": "…"}``)."""

from __future__ import annotations

from ..info.openapi_ops import BODY, GENERATE, QOS_HEADER, errors_shaped, op
from ..info.openapi_responses import CHAT_SETUP
from ..info.openapi_schema import integer, json_body, obj, string

_ERROR = obj({"error": string()}, required=("error",))
_COUNTERS = {"total_duration": integer(0), "load_duration": integer(0), "prompt_eval_count": integer(0),
             "prompt_eval_duration": integer(0), "eval_count": integer(0), "eval_duration": integer(0)}
_MESSAGE = obj({"role": string(), "content": string(), "thinking": string(),
                "tool_calls": {"type": "array", "items": {"type": "object"}}}, required=("role",))
CHAT = obj({"model": string(), "created_at": string(), "message": _MESSAGE, "done": {"type": "boolean"},
            "done_reason": string(), **_COUNTERS}, required=("model", "created_at", "done"))
GENERATED = obj({"model": string(), "created_at": string(), "response": string(), "done": {"type": "boolean"},
                 "done_reason": string(), **_COUNTERS}, required=("model", "created_at", "done"))
_DETAILS = {"type": "object"}
_MODEL = obj({"name": string(), "model": string(), "modified_at": string(), "size": integer(0),
              "digest": string(), "details": _DETAILS}, required=("name", "model"))
_NDJSON = "application/x-ndjson"


def _ollama_errors(operation: dict) -> dict:
    """``operation`` with its error answers in Ollama's shape (``op`` writes OpenAI's)."""
    return errors_shaped(operation, _ERROR)


def _generation(schema: dict, what: str) -> dict:
    return {"description": f"{what}: NDJSON lines (one object a line, the last with done: true and the counters), "
                           "or with stream: false one object",
            "content": {"application/json": {"schema": schema}, _NDJSON: {"schema": schema}}}


def paths() -> dict:
    """The Ollama routes' entries of the document's ``paths``."""
    def post(summary, ok, body, op_id, errors=GENERATE, parameters=None):
        return {"post": _ollama_errors(op(summary, ok, errors=errors, body={"$ref": f"#/components/schemas/{body}"},
                                          parameters=parameters, op_id=op_id))}

    def get(summary, ok, op_id):
        return {"get": _ollama_errors(op(summary, ok, op_id=op_id))}

    return {
        "/api/chat": post("Ollama: a chat reply", _generation(CHAT, "the reply"), "OllamaChatRequest",
                          "ollamaChat", parameters=[QOS_HEADER]),
        "/api/generate": post("Ollama: a completion of a prompt", _generation(GENERATED, "the completion"),
                              "OllamaGenerateRequest", "ollamaGenerate", parameters=[QOS_HEADER]),
        "/api/embed": post("Ollama: embeddings of one input or several", json_body(obj({
            "model": string(), "embeddings": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "total_duration": integer(0), "load_duration": integer(0), "prompt_eval_count": integer(0)},
            required=("model", "embeddings")), "the embeddings"), "OllamaEmbedRequest", "ollamaEmbed"),
        "/api/embeddings": post("Ollama (older route): one input's embedding", json_body(obj({
            "embedding": {"type": "array", "items": {"type": "number"}}}, required=("embedding",)), "the embedding"),
            "OllamaEmbeddingsRequest", "ollamaEmbeddings"),
        "/api/show": post("Ollama: one model's details", json_body(obj({
            "modelfile": string(), "parameters": string(), "template": string(), "details": _DETAILS,
            "model_info": {"type": "object"}, "capabilities": {"type": "array", "items": string()},
            "modified_at": string(), "superfluid": obj(CHAT_SETUP)}), "the model"), "OllamaShowRequest", "ollamaShow",
            errors=BODY),
        "/api/tags": get("Ollama: the served models", json_body(obj({"models": {"type": "array", "items": _MODEL}},
                                                                     required=("models",)), "the models"),
                         "ollamaTags"),
        "/api/ps": get("Ollama: the loaded models", json_body(obj({"models": {"type": "array", "items": _MODEL}},
                                                                   required=("models",)), "the models"), "ollamaPs"),
        "/": get("Ollama's probe: a server that answers it is taken for an Ollama server (HEAD too)",
                 {"description": "Ollama is running", "content": {"text/plain": {"schema": string()}}},
                 "ollamaRoot"),
        "/api/version": get("Ollama: the API version followed", json_body(obj({"version": string()},
                                                                                required=("version",)), "the version"),
                            "ollamaVersion"),
    }

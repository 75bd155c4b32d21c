"""The request bodies of the OpenAPI document, generated from the routes' typed requests
(:mod:`..typed`): a field the server accepts is a field the document lists, with the same type,
range and default, and every body refuses unknown fields (``additionalProperties: false``) as
the server does. What depends on the served model (``max_tokens`` against its context, token ids
against its vocabulary) is described, not bounded, and answers 400 when out of range.

pydantic writes JSON Schema 2020-12; the document is OpenAPI 3.0, so :func:`openapi30` turns a
null member of ``anyOf`` into ``nullable`` and ``const`` into a one-value ``enum``."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from ..manage.adapters import AdapterLoadRequest, AdapterUnloadRequest
from ..manage.protocol import (LoadRequest, SessionCreateRequest, SessionQosRequest, SessionTurnRequest,
                               UnloadRequest)
from ..openai.chat_protocol import ChatCompletionRequest
from ..rerank.protocol import RerankRequest, ScoreRequest
from ..openai.protocol import (CompletionRequest, DetokenizeRequest, EmbeddingRequest, InfillRequest,
                               TokenizeRequest)
from ..anthropic.protocol import CountTokensRequest, MessagesRequest
from ..responses.protocol import ResponsesInputTokensRequest, ResponsesRequest
from ..ollama.protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                               OllamaShowRequest)

REF = "#/components/schemas/{model}"
# each route's body, by the component name the route table refers to (the class's own name)
REQUESTS = (ChatCompletionRequest, CompletionRequest, InfillRequest, EmbeddingRequest, TokenizeRequest,
            DetokenizeRequest, SessionCreateRequest, SessionTurnRequest, SessionQosRequest, UnloadRequest,
            LoadRequest, ResponsesRequest, ResponsesInputTokensRequest, MessagesRequest, CountTokensRequest,
            OllamaChatRequest, OllamaGenerateRequest, OllamaEmbedRequest, OllamaEmbeddingsRequest, OllamaShowRequest,
            AdapterLoadRequest, AdapterUnloadRequest, RerankRequest, ScoreRequest)


def openapi30(node):
    """A JSON Schema 2020-12 node (pydantic's) in OpenAPI 3.0's dialect."""
    if isinstance(node, list):
        return [openapi30(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key == "properties":
            out[key] = {name: openapi30(schema) for name, schema in value.items()}
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = openapi30(value)
    members = out.get("anyOf")
    if members is not None and {"type": "null"} in members:
        rest = [m for m in members if m != {"type": "null"}]
        del out["anyOf"]
        if len(rest) == 1 and "$ref" in rest[0]:
            out["allOf"] = rest
        elif len(rest) == 1:
            out = {**rest[0], **out}
        else:
            out["anyOf"] = rest
        out["nullable"] = True
    return out


def request_schemas() -> dict:
    """The request bodies, and the objects they hold (messages, tools, ...), by component name."""
    _, top = models_json_schema([(cls, "validation") for cls in REQUESTS], ref_template=REF)
    return {name: openapi30(schema) for name, schema in top["$defs"].items()}

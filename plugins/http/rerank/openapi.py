"""The rerank and score routes in ``/openapi.json`` (:mod:`.routes`): their path table, merged
into the document's by :func:`..info.openapi._paths`. The bodies are the typed requests of
:mod:`.protocol` (``RerankRequest``, ``ScoreRequest``)."""

from __future__ import annotations

from ..info.openapi_ops import GENERATE, QOS_HEADER, op
from ..info.openapi_schema import integer, json_body, obj, ref, string

_USAGE = obj({"prompt_tokens": integer(0), "total_tokens": integer(0), "completion_tokens": integer(0)},
             required=("prompt_tokens", "total_tokens"))
_RESULT = obj({"index": integer(0, description="the document's place in the request"),
               "relevance_score": {"type": "number", "description": "the reranker's score (its head's first "
                                                                     "output: Qwen3-Reranker's p(yes))"},
               "document": obj({"text": string()}, required=("text",),
                               description="with return_documents (the default)")},
              required=("index", "relevance_score"))
_RERANKED = obj({"id": string(), "object": string(enum=["list"]), "model": string(),
                 "results": {"type": "array", "items": _RESULT, "description": "best first, top_n of them"},
                 "usage": _USAGE}, required=("id", "model", "results", "usage"))
_SCORES = obj({"id": string(), "object": string(enum=["list"]), "created": integer(0), "model": string(),
               "data": {"type": "array", "items": obj({"index": integer(0), "object": string(enum=["score"]),
                                                       "score": {"type": "number"}},
                                                      required=("index", "object", "score"))},
               "usage": _USAGE}, required=("id", "model", "data", "usage"))


def paths() -> dict:
    def rerank(op_id: str, who: str) -> dict:
        return {"post": op(f"rank documents against a query with a reranker model ({who}'s shape)",
                           json_body(_RERANKED, "the documents' scores, best first"), errors=GENERATE,
                           body=ref("RerankRequest"), parameters=[QOS_HEADER], op_id=op_id)}

    def score(op_id: str) -> dict:
        return {"post": op("score text pairs with a reranker model (vLLM's shape)",
                           json_body(_SCORES, "each pair's score, in order"), errors=GENERATE,
                           body=ref("ScoreRequest"), parameters=[QOS_HEADER], op_id=op_id)}

    return {"/v1/rerank": rerank("rerank", "llama-server, vLLM, Jina, Cohere v1"),
            "/rerank": rerank("rerankUnversioned", "llama-server, vLLM"),
            "/v2/rerank": rerank("rerankV2", "Cohere v2"),
            "/v1/score": score("score"), "/score": score("scoreUnversioned")}

"""POST /v1/rerank and /v1/score: a reranker scores (query, document) pairs.

Each pair is one prompt (:mod:`.pairs`) run as an embedding lane with ``Request.rank``: the
engine applies the model's classification head to the pooled state and the lane ends with the
head's outputs, the first being the pair's score. The lanes go through the same path as
``/v1/embeddings`` (:meth:`..openai.embeddings.EmbeddingRoutes.pooled`): the request's QoS
class, the key policy, the key's rate limits and lanes, ``--max-queue`` and cancellation when the
client leaves all apply as they do to embeddings.

Paths: ``/v1/rerank`` (llama-server, vLLM, Jina, Cohere's v1 client), ``/rerank`` (llama-server,
vLLM) and ``/v2/rerank`` (Cohere's v2 client); ``/v1/score`` and ``/score`` (vLLM)."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..aliases import served_name
from ..body import read_as
from ..keys.auth import check_model
from .pairs import check_fits, pair_tokens
from .protocol import RerankRequest, ScoreRequest


def reranker(request: web.Request, daemon, model: str | None):
    """The served model a rerank or score request names, if it is a reranker; a 400 if not."""
    runtime = daemon.get(served_name(request, model))
    check_model(request, runtime.name)
    if runtime.engine.info.rerank is None:
        engine = getattr(runtime.engine, "engine_name", type(runtime.engine).__name__)
        raise InvalidRequest(f"model {runtime.name!r} is not a reranker (engine {engine}): /v1/rerank and /v1/score "
                             "need a cross-encoder GGUF with rank pooling and its classification head (pooling_type "
                             "4, e.g. Qwen3-Reranker converted by llama.cpp's convert_hf_to_gguf.py), served on "
                             "llamacpp or basert", param="model", code="model_not_reranker")
    runtime.loop.check_serves(embed=True)
    return runtime


class RerankRoutes:
    """``embeddings``: the front end's :class:`~..openai.embeddings.EmbeddingRoutes`, whose lane
    path (classes, keys, limits) the pairs take."""

    def __init__(self, daemon, embeddings):
        self.daemon = daemon
        self.embeddings = embeddings

    def add_to(self, app: web.Application) -> None:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        for path in ("/v1/score", "/score"):
            app.router.add_post(path, self.score)

    async def _scores(self, request, runtime, pairs: list[tuple[str, str]], extension, arrived: float,
                      what: str, max_doc_tokens: int | None = None) -> tuple[list[float], int]:
        """Each pair's score, in order, and the prompt tokens counted."""
        fmt = runtime.engine.info.rerank
        prompts = [pair_tokens(runtime.engine, fmt, q, d, max_doc_tokens) for q, d in pairs]
        check_fits(prompts, runtime.loop.settings.context_length, what)
        vectors, counted = await self.embeddings.pooled(request, runtime, prompts, extension, arrived,
                                                        rank=True, what=what)
        return [float(v[0]) for v in vectors], counted

    async def rerank(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        req = await read_as(request, RerankRequest)
        runtime = reranker(request, self.daemon, req.model)
        texts = req.texts
        scores, counted = await self._scores(request, runtime, [(req.query, t) for t in texts], req.superfluid,
                                             arrived, "documents", req.max_tokens_per_doc)
        order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))[:req.top_n or len(texts)]
        results = []
        for i in order:
            item = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": runtime.name,
                                  "results": results,
                                  "usage": {"prompt_tokens": counted, "total_tokens": counted}})

    async def score(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        req = await read_as(request, ScoreRequest)
        runtime = reranker(request, self.daemon, req.model)
        scores, counted = await self._scores(request, runtime, req.pairs(), req.superfluid, arrived, "text_2")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                  "model": runtime.name, "data": data,
                                  "usage": {"prompt_tokens": counted, "total_tokens": counted,
                                            "completion_tokens": 0}})

"""POST /tokenize and /detokenize, in llama-server's shapes: a model's tokenizer for clients
that count or build prompts themselves (token-id prompts, logit_bias keys).

They run no lane (the tokenizer lives in the daemon, not the engine's thread), so no scheduler
or key limiter is involved; a key's model allow-list applies as on every other route."""

from __future__ import annotations

from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..aliases import served_name
from ..body import read_as
from ..keys.auth import check_model
from .protocol import DetokenizeRequest, TokenizeRequest


def piece(data: bytes) -> str | list[int]:
    """A token's text as llama-server shows it: a string when its bytes are valid UTF-8 alone,
    else the byte values (part of a multi-byte character split across tokens)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def token_ids(req, n_vocab: int) -> list[int]:
    """``tokens``: ids in the vocabulary (an empty list is allowed: "")."""
    bad = [t for t in req.tokens if t >= n_vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})",
                             param="tokens", code="invalid_value")
    return req.tokens


class TokenizeRoutes:
    def __init__(self, daemon):
        self.daemon = daemon

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def _read(self, request: web.Request, cls):
        req = await read_as(request, cls)
        runtime = self.daemon.get(served_name(request, req.model))
        check_model(request, runtime.name)
        return req, runtime

    async def tokenize(self, request: web.Request) -> web.Response:
        req, runtime = await self._read(request, TokenizeRequest)
        engine = runtime.engine
        tokens = engine.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if req.with_pieces:
            return web.json_response({"tokens": [{"id": t, "piece": piece(engine.token_bytes(t))} for t in tokens]})
        return web.json_response({"tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        req, runtime = await self._read(request, DetokenizeRequest)
        engine = runtime.engine
        ids = token_ids(req, engine.info.n_vocab)
        text = b"".join(engine.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        return web.json_response({"content": text})

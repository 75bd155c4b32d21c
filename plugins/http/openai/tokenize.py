"""POST /tokenize and /detokenize, in llama-server's shapes: a model's tokenizer for clients
that count or build prompts themselves (token-id prompts, logit_bias keys).

They run no lane (the tokenizer lives in the daemon, not the engine's thread), so no scheduler
or key limiter is involved; a key's model allow-list applies as on every other route."""

from __future__ import annotations

from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..body import check_fields, read_body
from ..keys.auth import check_model
from ..prepare import params

TOKENIZE_FIELDS = {"content", "add_special", "parse_special", "with_pieces", "model"}
DETOKENIZE_FIELDS = {"tokens", "model"}


def piece(data: bytes) -> str | list[int]:
    """A token's text as llama-server shows it: a string when its bytes are valid UTF-8 alone,
    else the byte values (part of a multi-byte character split across tokens)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def token_ids(body: dict, n_vocab: int) -> list[int]:
    """``tokens``: a list of ids in the vocabulary (an empty list is allowed: "")."""
    value = body.get("tokens")
    if value is None:
        raise InvalidRequest("tokens is required", param="tokens", code="missing_required_parameter")
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest("tokens must be a list of token ids", param="tokens", code="invalid_type")
    bad = [t for t in value if not 0 <= t < n_vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})",
                             param="tokens", code="invalid_value")
    return value


class TokenizeRoutes:
    def __init__(self, daemon):
        self.daemon = daemon

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def _runtime(self, request: web.Request, fields: set[str]):
        body = check_fields(await read_body(request), fields)
        runtime = self.daemon.get(params.model_name(body))
        check_model(request, runtime.name)
        return body, runtime

    async def tokenize(self, request: web.Request) -> web.Response:
        body, runtime = await self._runtime(request, TOKENIZE_FIELDS)
        if body.get("content") is None:
            raise InvalidRequest("content is required", param="content", code="missing_required_parameter")
        content = params.text(body, "content")
        add_special = params.boolean(body, "add_special", False)
        parse_special = params.boolean(body, "parse_special", True)
        with_pieces = params.boolean(body, "with_pieces", False)
        engine = runtime.engine
        tokens = engine.tokenize(content, add_special=add_special, parse_special=parse_special)
        if with_pieces:
            return web.json_response({"tokens": [{"id": t, "piece": piece(engine.token_bytes(t))} for t in tokens]})
        return web.json_response({"tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        body, runtime = await self._runtime(request, DETOKENIZE_FIELDS)
        engine = runtime.engine
        ids = token_ids(body, engine.info.n_vocab)
        text = b"".join(engine.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        return web.json_response({"content": text})

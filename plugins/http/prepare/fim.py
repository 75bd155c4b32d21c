"""Fill-in-the-middle: prompts from the model's FIM tokens, the completion class, rate limits
and start deadlines. Serves ``suffix`` on /v1/completions and llama.cpp-style ``POST /infill``."""

from __future__ import annotations

import math

from superfluid.core.errors import InvalidRequest

from ..keys.auth import request_key
from ..keys.rate_limit import ClientBuckets, RateLimited, parse_rate
from ..options import OPTIONS

FIM_CLASS = "completion"


def fim_prompt(runtime, prefix: str, suffix: str, middle: str = "") -> list[int]:
    """[BOS] <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle (PSM order, as llama.cpp)."""
    info = runtime.engine.info
    if None in (info.fim_prefix, info.fim_suffix, info.fim_middle):
        raise InvalidRequest(f"model {runtime.name!r} has no fill-in-the-middle tokens; "
                             "serve a FIM-capable model (see --fim-model)", param="suffix",
                             code="fim_unsupported")
    tok = runtime.engine.tokenize
    tokens = [info.bos_id] if info.add_bos and info.bos_id is not None else []
    tokens += [info.fim_prefix, *tok(prefix, add_special=False, parse_special=False),
               info.fim_suffix, *tok(suffix, add_special=False, parse_special=False), info.fim_middle]
    if middle:
        tokens += tok(middle, add_special=False, parse_special=False)
    return tokens


class FimPolicy:
    """Where FIM requests run and whether a client may send one now."""

    def __init__(self, config):
        self.options = opts = OPTIONS.of(config)
        self.buckets = ClientBuckets(parse_rate(opts.completion_rate), opts.completion_burst)
        self.deadline_s = opts.completion_deadline_ms / 1000.0

    def runtime(self, daemon, model: str | None):
        if self.options.fim_model:
            return daemon.get(FIM_MODEL_NAME)
        return daemon.get(model)

    def admit(self, request) -> None:
        """Raise 429 with Retry-After when this client's bucket is empty. A client is its API key
        under a key policy (by name: no secret is kept in the table); without one, what it sends
        as Authorization, else its address."""
        key = request_key(request)
        client = (f"key:{key.name}" if key is not None
                  else request.headers.get("Authorization") or request.remote or "unknown")
        wait = self.buckets.take(client)
        if wait > 0:
            raise RateLimited(f"too many completion requests from this client (--completion-rate "
                              f"{self.options.completion_rate}, --completion-burst "
                              f"{self.options.completion_burst}); retry in {wait:.2f} s",
                              headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def deadline(self, arrived: float) -> float | None:
        return arrived + self.deadline_s if self.deadline_s > 0 else None


FIM_MODEL_NAME = "fim"

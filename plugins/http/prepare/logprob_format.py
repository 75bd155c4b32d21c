"""Log-probabilities as OpenAI's two APIs ask for and answer them.

Chat: ``logprobs: true`` and ``top_logprobs`` 0..20; each choice's ``logprobs`` is
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}``. Completions: ``logprobs`` 0..5; ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``, the prompt's positions first with ``echo``.
Streamed, each chunk carries its own tokens' entries.

A ``token`` string is the token's bytes decoded as UTF-8 with the bytes of a split character
dropped (never U+FFFD): a token holding half a character is "" and the exact bytes are in
``bytes``. Only tokens counted in usage get entries (the engine's numbers come with the deltas,
:attr:`superfluid.core.lane.LaneEvent.logprobs`)."""

from __future__ import annotations

import codecs
import math

FLOOR = -9999.0         # what OpenAI answers for a probability too small for a float (JSON has no -inf)


def chat_request(req) -> int | None:
    """The top count a chat asks for (0: the chosen token's only), None without ``logprobs``
    (``top_logprobs`` without it was refused when the request was parsed)."""
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_request(req) -> int | None:
    """A completion's ``logprobs`` (0..5 top candidates), None when absent or false."""
    return None if req.logprobs is None or req.logprobs is False else req.logprobs


def _value(logprob: float) -> float:
    return float(logprob) if math.isfinite(logprob) else FLOOR


class TokenText:
    """A token's (text, bytes), through the engine's ``token_bytes``, cached per request."""

    def __init__(self, token_bytes):
        self._token_bytes = token_bytes
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        found = self._cache.get(token)
        if found is None:
            raw = bytes(self._token_bytes(token))
            found = self._cache[token] = (raw.decode("utf-8", errors="ignore"), raw)
        return found


def chat_entries(logprobs, text: TokenText, top: int) -> list[dict]:
    """The ``content`` entries of a chat choice's ``logprobs`` for these TokenLogprobs."""
    out = []
    for lp in logprobs:
        token, raw = text(lp.token)
        alts = []
        for other, value in lp.top[:top]:
            alt, alt_raw = text(other)
            alts.append({"token": alt, "logprob": _value(value), "bytes": list(alt_raw)})
        out.append({"token": token, "logprob": _value(lp.logprob), "bytes": list(raw), "top_logprobs": alts})
    return out


def chat_object(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


class CompletionLogprobs:
    """A completion choice's ``logprobs``, built in order (the echoed prompt, then each delta's
    tokens): ``text_offset`` counts characters from 0 over the choice's text as the client
    reads it (the echoed prompt included), decoding the tokens' bytes as the text stream does."""

    def __init__(self, text: TokenText, top: int):
        self.text = text
        self.top = top
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.whole = _empty()

    def prompt(self, tokens: list[int], scores) -> dict:
        """The prompt's entries: the first token has no logprob (nothing precedes it), the others
        the scores of positions 1.. (``LaneEvent.prompt_logprobs``; a missing one is null)."""
        part = _empty()
        for i, token in enumerate(tokens):
            score = scores[i - 1] if 0 < i <= len(scores) else None
            self._entry(part, token, score)
        return self._keep(part)

    def add(self, logprobs) -> dict:
        """The entries of generated tokens (one delta's, for a streamed chunk)."""
        part = _empty()
        for lp in logprobs:
            self._entry(part, lp.token, lp)
        return self._keep(part)

    def _entry(self, part: dict, token: int, lp) -> None:
        token_str, raw = self.text(token)
        part["tokens"].append(token_str)
        part["text_offset"].append(self.offset)
        self.offset += len(self._decoder.decode(raw))
        if lp is None:
            part["token_logprobs"].append(None)
            part["top_logprobs"].append(None)
            return
        part["token_logprobs"].append(_value(lp.logprob))
        tops: dict[str, float] = {}
        for other, value in lp.top[:self.top]:
            tops.setdefault(self.text(other)[0], _value(value))  # best first: a repeated string keeps its best
        part["top_logprobs"].append(tops)

    def _keep(self, part: dict) -> dict:
        for key, values in part.items():
            self.whole[key].extend(values)
        return part


def _empty() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

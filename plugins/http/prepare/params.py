"""Validation of OpenAI request bodies: unknown fields, wrong types and out-of-range values are
400s that name the field, before anything reaches a scheduler."""

from __future__ import annotations

import math

from superfluid.core.errors import InvalidRequest
from superfluid.core.request import SamplingParams

from ..input_limits import STOP_CAP

_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repeat_penalty", "repetition_penalty"}
_COMMON = {"model", "max_tokens", "stream", "stream_options", "stop", "n", "user", "logit_bias",
           "ignore_eos", "logprobs", "cache_prompt", "superfluid"} | _SAMPLING
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "service_tier", "store",
                         "metadata", "stream_options", "reasoning_effort", "safety_identifier",
                         "prompt_cache_key"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo", "best_of"}
INFILL_FIELDS = _COMMON | {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict"}
FIELDS = {"chat": CHAT_FIELDS, "completion": COMPLETION_FIELDS, "infill": INFILL_FIELDS}


def model_name(body: dict) -> str | None:
    """The body's ``model`` (None: the server's default model); not a string is a 400."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model", code="invalid_type")
    return model


def text(body: dict, key: str) -> str:
    """An optional string field ("" when absent)."""
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string", param=key, code="invalid_type")
    return value


def fim_parts(body: dict) -> str:
    """The prefix of a /v1/completions FIM request: its prompt, as a string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if prompt is None:
        raise InvalidRequest("prompt is required", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise InvalidRequest("with suffix, prompt must be a string", param="prompt", code="invalid_type")
    return prompt


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{key} must be a number", param=key, code="invalid_type")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise InvalidRequest(f"{key} must be a number", param=key, code="invalid_type")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{key} must be between {lo} and {hi}, got {value}", param=key,
                             code="invalid_value")
    return float(value)


def integer(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer", param=key, code="invalid_type")
    if value < lo or (hi is not None and value > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequest(f"{key} must be {span}, got {value}", param=key, code="invalid_value")
    return value


def boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false", param=key, code="invalid_type")
    return value


def sampling(body: dict) -> SamplingParams:
    repeat_key = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    seed = integer(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=integer(body, "top_k", 0, 0, 1 << 20),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        repeat_penalty=_number(body, repeat_key, 1.0, 0.0, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0))


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > STOP_CAP:  # the server's --max-stop (at most this) is checked in body.read_body
        raise InvalidRequest(f"stop may hold at most {STOP_CAP} strings", param="stop", code="invalid_value")
    return tuple(s for s in stop if s)


# OpenAI fields accepted and ignored (they mean nothing to one server), still held to their type
_IGNORED_TYPES = {"service_tier": (str, "a string"), "store": (bool, "a boolean"), "metadata": (dict, "an object"),
                  "reasoning_effort": (str, "a string"), "safety_identifier": (str, "a string"),
                  "prompt_cache_key": (str, "a string")}


def unsupported(body: dict) -> None:
    """Known OpenAI fields whose non-default values we do not serve: say so instead of ignoring;
    fields we ignore must still have their type."""
    for key, (kind, name) in _IGNORED_TYPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequest(f"{key} must be {name}", param=key, code="invalid_type")
    if body.get("input_extra") not in (None, []):
        raise InvalidRequest("input_extra is not supported yet", param="input_extra", code="unsupported_value")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise InvalidRequest("stream_options may only hold include_usage", param="stream_options",
                             code="invalid_value")


MAX_CHOICES = 16  # n: each choice is a lane of its own, so a request may not take a whole server
MAX_BIAS = 300    # logit_bias entries: OpenAI's limit


def choice_count(body: dict) -> int:
    """``n`` (1..16); ``best_of`` (completions) is only accepted equal to it: we return every
    choice we generate, so there is nothing to pick the best of."""
    n = integer(body, "n", 1, 1, MAX_CHOICES)
    best_of = integer(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise InvalidRequest(f"best_of must equal n ({n}): every generated choice is returned, none is "
                             f"picked, got best_of {best_of}", param="best_of", code="unsupported_value")
    return n


def logit_bias(body: dict, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: {token id as a string: bias -100..100}, at most 300 entries, every id in
    the vocabulary; as (id, bias) pairs sorted by id, so equal maps make equal sampling params."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids (as strings) to numbers "
                             "from -100 to 100", param="logit_bias", code="invalid_type")
    if len(raw) > MAX_BIAS:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_BIAS} entries, got {len(raw)}",
                             param="logit_bias", code="invalid_value")
    out = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.strip().isdigit() and key.strip().isascii()):
            raise InvalidRequest(f"logit_bias keys must be token ids written as integer strings, got {key!r}",
                                 param="logit_bias", code="invalid_value")
        token = int(key) if len(key) <= 18 else 1 << 62  # (int() refuses over 4,300 digits)
        if n_vocab and token >= n_vocab:
            raise InvalidRequest(f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                                 param="logit_bias", code="invalid_value")
        try:
            bias = _number(raw, key, 0.0, -100.0, 100.0)
        except InvalidRequest as exc:  # named after the field, not the token id
            raise InvalidRequest(f"logit_bias[{key!r}]: {exc.message.split(' ', 1)[1]}", param="logit_bias",
                                 code=exc.code) from None
        out[token] = bias
    return tuple(sorted(out.items()))


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{where} must be an object", param=where, code="invalid_type")
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidRequest(f"{where}.role must be system, developer, user, assistant or tool",
                                 param=f"{where}.role", code="invalid_value")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"{where}.content: only text parts are supported",
                                         param=f"{where}.content", code="unsupported_value")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and not (role == "assistant" and msg.get("tool_calls")):
            raise InvalidRequest(f"{where}.content is required", param=f"{where}.content",
                                 code="missing_required_parameter")
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string or a list of text parts",
                                 param=f"{where}.content", code="invalid_type")
        clean = {"role": "system" if role == "developer" else role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}", code="invalid_type")
        for key in ("name", "tool_calls", "tool_call_id"):
            if key in msg:
                clean[key] = msg[key]
        out.append(clean)
    return out


def completion_prompt(body: dict, tokenize) -> list[int]:
    """Prompt tokens from a string, a list of token ids, or a one-element list of either."""
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("prompt is required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt", code="invalid_value")
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise InvalidRequest("batched prompts are not supported; send one prompt per request",
                             param="prompt", code="unsupported_value")
    raise InvalidRequest("prompt must be a non-empty string or a list of token ids", param="prompt",
                         code="invalid_type")

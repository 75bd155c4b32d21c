"""What a typed generation request asks of the engine, in core's terms: its sampling parameters,
stop strings, logit biases and prompt tokens. The request's types and ranges were checked when
it was parsed (:mod:`..openai.protocol`); what is checked here needs the served model (token
ids against its vocabulary) or turns the API's shapes into core's."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest
from superfluid.core.request import SamplingParams


def sampling(req) -> SamplingParams:
    """A generation request's (:class:`~..openai.protocol.GenerationFields`) sampling;
    ``repeat_penalty`` wins over its alias ``repetition_penalty`` when both are sent."""
    repeat = req.repeat_penalty if req.given("repeat_penalty") else req.repetition_penalty
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        repeat_penalty=repeat, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)


def stop_strings(req) -> tuple[str, ...]:
    stop = req.stop
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)


def logit_bias(req, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (id, bias) pairs sorted by id, so equal maps make equal sampling params;
    every id must be in the vocabulary (a null bias is 0)."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        token = int(key) if len(key.strip()) <= 18 else 1 << 62  # (int() refuses over 4,300 digits)
        if n_vocab and token >= n_vocab:
            raise InvalidRequest(f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                                 param="logit_bias", code="invalid_value")
        out[token] = 0.0 if bias is None else float(bias)
    return tuple(sorted(out.items()))


def _single(prompt):
    """A one-element list of a prompt is that prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def fim_prefix(prompt) -> str:
    """The prefix of a /v1/completions FIM request: its prompt, which must be a string."""
    prompt = _single(prompt)
    if not isinstance(prompt, str):
        raise InvalidRequest("with suffix, prompt must be a string", param="prompt", code="invalid_type")
    return prompt


def completion_prompt(prompt, tokenize) -> list[int]:
    """Prompt tokens from a string, a list of token ids, or a one-element list of either; several
    prompts in one request are refused (one prompt per request)."""
    prompt = _single(prompt)
    if isinstance(prompt, str):
        return tokenize(prompt)
    if all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise InvalidRequest("batched prompts are not supported; send one prompt per request",
                         param="prompt", code="unsupported_value")

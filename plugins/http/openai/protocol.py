"""The request bodies of OpenAI's and llama-server's routes but chat (:mod:`.chat_protocol`):
``/v1/completions``, ``/infill``, ``/v1/embeddings``, ``/tokenize`` and ``/detokenize``, and the
fields every generation shares. Each field's type, range and default is declared here once; the
validator and ``/openapi.json`` both come from it (:mod:`..typed`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from ..extension import Extension
from ..input_limits import STOP_CAP
from ..lora import LoraField
from ..typed import NamedByField, RequestBody, fail

MAX_CHOICES = 16  # n: each choice is a lane of its own, so a request may not take a whole server
MAX_BIAS = 300    # logit_bias entries: OpenAI's limit
MAX_INPUTS = 2048  # embedding inputs per request: OpenAI's limit

Model = str | None  # a served model (GET /v1/models); null or empty: the first
TokenId = Annotated[int, Field(ge=0, description="a token id in the vocabulary")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)] | None


class StreamOptions(RequestBody):
    include_usage: bool = False


class GenerationFields(RequestBody):
    """The fields of every generation (chat, completion, infill): sampling, stops, streaming,
    choices and the QoS extension. Sampling fields left out (or null) take these defaults."""

    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="with stream: include_usage adds a usage chunk")
    stop: Annotated[str | Annotated[list[str], Field(max_length=STOP_CAP)], NamedByField] | None = Field(
        None, description=f"a string or at most {STOP_CAP} strings (fewer with --max-stop)")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(1, description="how many choices; each is a lane of its own")
    user: str | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_BIAS), NamedByField] | None = Field(
        None, description="token id (a decimal string, in the vocabulary) to a bias added to its logit, "
                          "-100..100; 400 if the model's engine cannot bias logits")
    ignore_eos: bool | None = False
    cache_prompt: bool | None = Field(True, description="false: prefill the whole prompt")
    lora: LoraField = Field(None, description="llama-server's per-request LoRA adapters, [{id, scale}]: id as GET "
                                               "/lora-adapters lists it (or the adapter's name); unlisted adapters get "
                                               "scale 0. A model name MODEL:ADAPTER selects one too")
    superfluid: Extension | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = Field(1.0, description="0 is greedy")
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = 1.0
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = Field(0, description="0: off")
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = 0.0
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    repeat_penalty: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] | None = 1.0
    repetition_penalty: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] | None = Field(
        1.0, description="an alias of repeat_penalty (which wins when both are sent)")

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, bias):
        for key in bias:
            if not (key.strip().isdigit() and key.strip().isascii()):
                raise fail("invalid_value", f"keys must be token ids written as integer strings, got {key!r}")
        return bias


Prompt = (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]],
                      Field(min_length=1)])


Prompt = Annotated[Prompt, NamedByField]


class CompletionRequest(GenerationFields):
    """The body of ``POST /v1/completions``; with ``suffix``, fill-in-the-middle."""

    model: Model = None
    prompt: Prompt = Field(description="a string, a list of token ids, or a one-element list of either; "
                                       "with suffix, a string")
    suffix: str | None = Field(None, description="fill-in-the-middle: the text after the cursor")
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="default 16; the prompt plus max_tokens must fit the model's context (else 400 "
                          "context_length_exceeded); 0 only with echo (the prompt scored, nothing generated)")
    logprobs: Annotated[int, Field(ge=0, le=5)] | Literal[False] | None = Field(
        None, description="the sampled token's log-probability and that many most likely candidates per "
                          "token; false or null: none")
    echo: bool | None = Field(False, description="the prompt is repeated before the completion (with logprobs: "
                                                 "scored too)")
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description="must equal n (no server-side ranking)")
    grammar: str | None = Field(None, description="llama-server's: a GBNF grammar (root rule root) the "
                                                  "completion follows")

    @field_validator("echo")
    @classmethod
    def _not_with_suffix(cls, echo, info: ValidationInfo):
        if echo and info.data.get("suffix") is not None:
            raise fail("invalid_value", "cannot be used with suffix")
        return echo

    @field_validator("best_of")
    @classmethod
    def _equal_to_n(cls, best_of, info: ValidationInfo):
        """Every generated choice is returned, none is picked: best_of may only restate n."""
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            raise fail("unsupported_value", f"must equal n ({n}): every generated choice is returned, "
                                            f"none is picked, got best_of {best_of}")
        return best_of


class InfillRequest(GenerationFields):
    """The body of llama-server's ``POST /infill``."""

    model: Model = None
    input_prefix: str | None = ""
    input_suffix: str | None = ""
    prompt: str | None = Field("", description="the start of the middle")
    input_extra: list | None = Field(None, json_schema_extra={"maxItems": 0}, description="not supported yet")
    n_predict: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="-1: the rest of the context; 0 is refused; ignored when max_tokens is given")
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False, 0] | None = Field(None, description="/infill answers none")

    @field_validator("input_extra")
    @classmethod
    def _no_extra(cls, extra):
        if extra:
            raise fail("unsupported_value", "is not supported yet")
        return extra

    @field_validator("n")
    @classmethod
    def _one(cls, n):
        if n != 1:
            raise fail("unsupported_value", "must be 1: /infill answers one completion")
        return n

    @property
    def limit(self) -> int | None:
        """max_tokens, else n_predict (llama.cpp's name; -1: the default)."""
        if self.max_tokens is not None or self.n_predict in (None, -1):
            return self.max_tokens
        return self.n_predict


Input = (Annotated[str, Field(min_length=1)]
         | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)]
         | Annotated[list[TokenId], Field(min_length=1)]
         | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)])


Input = Annotated[Input, NamedByField]


class EmbeddingRequest(RequestBody):
    """The body of ``POST /v1/embeddings``."""

    input: Input = Field(description="a string, a list of strings, a list of token ids, or a list of token-id "
                                     f"lists; at most {MAX_INPUTS} inputs, none empty, each within the "
                                     "model's context")
    model: str | None = Field(None, description="a served model with embeddings; null or empty: the first")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="base64: little-endian float32 bytes")
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="must equal the model's width (it is not truncated)")
    user: str | None = Field(None, description="accepted and ignored")
    superfluid: Extension | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or a token-id list (one list of ids is one input)."""
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


class TokenizeRequest(RequestBody):
    """The body of ``POST /tokenize`` (llama-server's)."""

    content: str
    add_special: bool | None = Field(False, description="add BOS (as the model does)")
    parse_special: bool | None = Field(True, description="special-token text becomes those tokens")
    with_pieces: bool | None = Field(False, description="each token with its text")
    model: Model = None


class DetokenizeRequest(RequestBody):
    """The body of ``POST /detokenize`` (llama-server's)."""

    tokens: Annotated[list[TokenId], NamedByField]
    model: Model = None

"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``,
``/api/show``), its request bodies typed.

Ollama's own server ignores fields it does not know, and its clients (the ``ollama`` library,
Open WebUI, LangChain's ``ChatOllama``) send fields of newer and older versions alike, so bodies
are :class:`~..typed.Lenient` at every level: an unknown field is ignored, a known one is checked
(strict types, ranges), and each of ``options`` is honored, ignored for a stated reason, or
refused (:data:`OPTION_RULES`, the table docs/api.md shows)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ..typed import Lenient, fail

# ---- options ------------------------------------------------------------------------------------

#: what each ``options`` key does here, in the words docs/api.md uses
OPTION_RULES: dict[str, str] = {
    "temperature": "honored", "top_p": "honored", "top_k": "honored", "min_p": "honored", "seed": "honored",
    "stop": "honored", "num_predict": "honored: the reply's limit (-1 or -2: the rest of the context)",
    "num_ctx": "checked: at most the lane's context (a 400 above it, never a silent cut); the prompt and reply "
               "must fit within it",
    "repeat_penalty": "honored", "repeat_last_n": "ignored: the penalties' window is 64 tokens",
    "presence_penalty": "honored", "frequency_penalty": "honored",
    "num_keep": "ignored: nothing is cut from the prompt (a prompt that does not fit is a 400)",
    "typical_p": "refused unless 1 (not implemented)", "tfs_z": "refused unless 1 (not implemented)",
    "mirostat": "refused unless 0 (not implemented)", "mirostat_tau": "ignored (mirostat is off)",
    "mirostat_eta": "ignored (mirostat is off)", "penalize_newline": "ignored (newlines are penalized like any token)",
    "numa": "ignored: a load setting, the server's", "num_batch": "ignored: a load setting, the server's",
    "num_gpu": "ignored: a load setting, the server's", "main_gpu": "ignored: a load setting, the server's",
    "low_vram": "ignored: a load setting, the server's", "vocab_only": "ignored: a load setting, the server's",
    "use_mmap": "ignored: a load setting, the server's", "use_mlock": "ignored: a load setting, the server's",
    "num_thread": "ignored: a load setting, the server's (--threads)",
    "logits_all": "ignored", "embedding_only": "ignored: a load setting, the server's (embedding-only)",
}


class OllamaOptions(Lenient):
    """``options``: sampling and limits (see :data:`OPTION_RULES`)."""

    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    num_predict: Annotated[int, Field(ge=-2)] | None = None
    num_ctx: Annotated[int, Field(ge=1)] | None = None
    repeat_penalty: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None

    @field_validator("typical_p", "tfs_z")
    @classmethod
    def _off(cls, value):
        if value is not None and value != 1:
            raise fail("unsupported_value", "is not implemented: only 1 (off) is served")
        return value

    @field_validator("mirostat")
    @classmethod
    def _no_mirostat(cls, value):
        if value:
            raise fail("unsupported_value", "is not implemented: only 0 (off) is served")
        return value


# ---- chat ---------------------------------------------------------------------------------------

class OllamaFunctionCall(Lenient):
    name: Annotated[str, Field(min_length=1)]
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(Lenient):
    function: OllamaFunctionCall


class OllamaMessage(Lenient):
    """``{"role", "content", "images"?, "tool_calls"?, "tool_name"?, "thinking"?}``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="base64 images (without a data: prefix)")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = Field(None, description="an assistant's reasoning: given to the chat template as "
                                                   "reasoning_content (most leave it out)")


Format = Literal["", "json"] | dict[str, Any]
Think = bool | Literal["low", "medium", "high"]
KeepAlive = float | int | str


class _Generating(Lenient):
    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = Field(None, description="default true: NDJSON lines")
    options: OllamaOptions | None = None
    format: Format | None = None
    keep_alive: KeepAlive | None = Field(None, description="accepted: models stay loaded (see docs/api.md)")
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class OllamaChatRequest(_Generating):
    """``POST /api/chat``."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Generating):
    """``POST /api/generate``."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Annotated[str, Field(min_length=1)]] | None = None

    @field_validator("template")
    @classmethod
    def _no_template(cls, value):
        if value:
            raise fail("unsupported_value", "is not supported: the model's own chat template renders prompts "
                                            "(send raw: true with the prompt already rendered)")
        return value

    @field_validator("context")
    @classmethod
    def _no_context(cls, value):
        if value:
            raise fail("unsupported_value", "is not supported (Ollama deprecated it): send the conversation to "
                                            "/api/chat, whose prefix cache serves the history")
        return value


class OllamaEmbedRequest(Lenient):
    """``POST /api/embed``."""

    model: Annotated[str, Field(min_length=1)]
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool | None = Field(None, description="accepted: an input longer than the context is a 400, never cut")
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None


class OllamaEmbeddingsRequest(Lenient):
    """``POST /api/embeddings`` (Ollama's older route)."""

    model: Annotated[str, Field(min_length=1)]
    prompt: str
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaShowRequest(Lenient):
    """``POST /api/show``."""

    model: Annotated[str, Field(min_length=1)] | None = None
    name: Annotated[str, Field(min_length=1)] | None = Field(None, description="the older name of model")
    verbose: bool | None = None

    @property
    def which(self) -> str:
        return self.model or self.name or ""

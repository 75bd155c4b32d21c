"""``POST /v1/responses`` and ``POST /v1/responses/input_tokens``: the request, declared once
(:mod:`..typed`: strict types, unknown fields refused, null the same as absent).

Every field of OpenAI's request is decided here: honored, accepted and ignored (its description
says why), or refused with a 400 naming it; docs/api.md has the table. What depends on the
served model (the prompt against its context, whether its engine has grammars) is checked by the
chat preparation path the request is mapped onto (:mod:`.mapping`).

Objects a client copies from earlier replies (input items, content parts, tools) are
:class:`~..typed.Lenient`: fields the server does not read (``id``, ``status``, ``phase``,
``annotations``…) are ignored, as OpenAI ignores them. Objects told apart by ``type`` are unions
whose member is picked by :func:`.items.by_type`; a ``type`` no member takes lands on a member
kept out of the published schema that refuses it with a 400 naming ``….type``. The input (parts
and items) is :mod:`.items`; its names are importable from here too."""


from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, Tag, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from superfluid.core.errors import InvalidRequest

from ..extension import Extension
from ..openai.chat_protocol import FORMAT_NAME, MAX_TOOLS, FunctionDef
from ..openai.protocol import Model
from ..typed import Lenient, RequestBody, fail
from .items import (CHOICE_MODES, ITEM_TYPES, ONLY_FUNCTIONS, TEXT_PARTS, Content, Item, Part,  # noqa: F401
                    ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem, ResponsesImagePart,
                    ResponsesMessageItem, ResponsesReasoningItem, ResponsesRefusalPart, ResponsesTextPart,
                    ResponsesUnknownItem, ResponsesUnservedPart, by_type, content_text, refusing)


# ---- tools -------------------------------------------------------------------------------------

class ResponsesFunctionTool(FunctionDef):
    """``{"type": "function", "name", "description"?, "parameters"?, "strict"?}``: offered to the
    model. ``parameters`` is checked as chat's are; ``strict`` is accepted and ignored (a forced
    call is always held to the schema, an unforced one never is)."""

    type: Literal["function"]
    strict: bool | None = None


class ResponsesLeftOutTool(Lenient):
    """A tool of any other type (``namespace``, ``web_search``, ``file_search``, ``mcp``,
    ``custom``, ``code_interpreter``…): left out of the prompt, never refused (Codex always sends
    some), and echoed in the response as sent."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True, populate_by_name=True)

    type: Annotated[str, Field(min_length=1, json_schema_extra={"not": {"enum": ["function"]}})]


Tool = Annotated[Union[Annotated[ResponsesFunctionTool, Tag("ResponsesFunctionTool")],
                       Annotated[ResponsesLeftOutTool, Tag("ResponsesLeftOutTool")]],
                 by_type({"function": "ResponsesFunctionTool"}, other="ResponsesLeftOutTool")]


class ResponsesFunctionChoice(Lenient):
    """``{"type": "function", "name"}``: that function must be called."""

    type: Literal["function"]
    name: str


class ResponsesAllowedTool(Lenient):
    type: str
    name: str | None = None


class ResponsesAllowedTools(Lenient):
    """``{"type": "allowed_tools", "mode", "tools"}``: only the listed functions are offered
    (entries of other types are left out, as in ``tools``); ``mode`` is then the choice."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ResponsesAllowedTool]


class ResponsesOtherChoice(Lenient):
    """A choice of a tool type the server does not run (``web_search_preview``, ``mcp``, ...)."""

    type: Any = Field(None, validate_default=True)

    _refuse = refusing({}, ("function", "allowed_tools"), otherwise=ONLY_FUNCTIONS + "; choose a function, allowed_tools, auto, none or required")


ToolChoice = (Literal["none", "auto", "required"]
              | Annotated[Union[Annotated[ResponsesFunctionChoice, Tag("ResponsesFunctionChoice")],
                                Annotated[ResponsesAllowedTools, Tag("ResponsesAllowedTools")],
                                Annotated[SkipJsonSchema[ResponsesOtherChoice], Tag("ResponsesOtherChoice")]],
                          by_type({"function": "ResponsesFunctionChoice", "allowed_tools": "ResponsesAllowedTools"},
                                   other="ResponsesOtherChoice")])


# ---- text format, reasoning, streaming -----------------------------------------------------------

class ResponsesTextFormat(RequestBody):
    """``{"type": "text"}`` (the default) or ``{"type": "json_object"}``: the reply is a JSON
    object, held to that token by token."""

    type: Literal["text", "json_object"]


class ResponsesJsonSchemaFormat(RequestBody):
    """``{"type": "json_schema", "name", "schema", "strict"?, "description"?}``: the reply
    matches ``schema``, enforced token by token (as chat's ``response_format``)."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=FORMAT_NAME)]
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the reply must match")
    description: str | None = None
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponsesOtherFormat(RequestBody):
    type: Any = Field(None, validate_default=True)

    _refuse = refusing({}, ("text", "json_object", "json_schema"))


TextFormat = Annotated[Union[Annotated[ResponsesTextFormat, Tag("ResponsesTextFormat")],
                             Annotated[ResponsesJsonSchemaFormat, Tag("ResponsesJsonSchemaFormat")],
                             Annotated[SkipJsonSchema[ResponsesOtherFormat], Tag("ResponsesOtherFormat")]],
                       by_type({"text": "ResponsesTextFormat", "json_object": "ResponsesTextFormat",
                                 "json_schema": "ResponsesJsonSchemaFormat"}, other="ResponsesOtherFormat")]


class ResponsesTextConfig(RequestBody):
    format: TextFormat | None = Field(None, description="default: text")
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="accepted and ignored: the model is not asked for a length")


class ResponsesReasoning(Lenient):
    """``effort``: a reasoning model's switch, as chat's ``reasoning_effort`` ("none" and
    "minimal" render the chat template with ``enable_thinking`` false, others true); ``summary``
    is accepted and ignored (a reply's reasoning item carries the text, no summary)."""

    effort: str | None = None
    summary: str | None = None


class ResponsesStreamOptions(Lenient):
    include_obfuscation: bool | None = Field(
        None, description="accepted and ignored: events carry no obfuscation padding")


# ---- the requests ------------------------------------------------------------------------------

def _function_names(info: ValidationInfo) -> set[str]:
    return {t.name for t in info.data.get("tools") or () if isinstance(t, ResponsesFunctionTool)}


class ResponsesInput(RequestBody):
    """What a response's prompt is made of: the fields ``/v1/responses/input_tokens`` takes too."""

    model: Model = None
    input: str | list[Item] | None = Field(
        None, description="a user message's text, or items: messages, function_call, function_call_output "
                          "and reasoning (dropped)")
    instructions: str | None = Field(
        None, description="a system message before the input; not carried over by previous_response_id")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools are offered; every other type is left out (never refused)")
    tool_choice: ToolChoice | None = Field(None, description="default auto")
    parallel_tool_calls: bool | None = Field(True, description="false: at most one call")
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    grammar: str | None = Field(None, description="llama-server's (an extension): a GBNF grammar (root rule "
                                                  "root) the reply follows; not with a JSON text.format")
    previous_response_id: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="continue that stored response (the latest of its conversation): only the new items "
                          "are sent")
    conversation: str | dict[str, Any] | None = Field(
        None, description="refused: there is no conversations API; use previous_response_id")
    truncation: Literal["auto", "disabled"] | None = Field(
        "disabled", description="auto: a conversation that outgrows the context drops its oldest items")

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools):
        seen = set()
        for i, tool in enumerate(tools or ()):
            if isinstance(tool, ResponsesFunctionTool):
                if tool.name in seen:
                    raise InvalidRequest(f"tools[{i}].name: duplicate tool name {tool.name!r}",
                                         param=f"tools[{i}].name", code="invalid_value")
                seen.add(tool.name)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, choice, info: ValidationInfo):
        names = _function_names(info)
        if choice == "required" and not names:
            raise fail("invalid_value", '"required" needs a function tool (tools of other types are left out)')
        if isinstance(choice, ResponsesFunctionChoice) and choice.name not in names:
            raise fail("invalid_value", f"names {choice.name!r}, which is not a function in tools")
        if isinstance(choice, ResponsesAllowedTools):
            listed = [t.name for t in choice.tools if t.type == "function"]
            missing = [n for n in listed if n not in names]
            if missing:
                raise fail("invalid_value", f"allows {missing[0]!r}, which is not a function in tools")
            if choice.mode == "required" and not listed:
                raise fail("invalid_value", 'mode "required" needs a function tool among the allowed tools')
        return choice

    @field_validator("conversation")
    @classmethod
    def _no_conversations(cls, value):
        raise fail("unsupported_value", "is not supported: there is no conversations API here; continue a "
                                        "stored response with previous_response_id")


class ResponsesInputTokensRequest(ResponsesInput):
    """The body of ``POST /v1/responses/input_tokens``: how many tokens the prompt would be."""

    personality: str | None = Field(None, description="accepted and ignored")


class ResponsesRequest(ResponsesInput):
    """The body of ``POST /v1/responses``."""

    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="a ceiling: cut to what the context leaves; default: the rest of the context")
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = Field(1.0, description="0 is greedy")
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = 1.0
    store: bool | None = Field(True, description="keep the response (a session turn) for GET and previous_response_id")
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="kept with the response and echoed")
    include: list[str] | None = Field(None, description="accepted and ignored: there is nothing extra to include")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        None, description="accepted and ignored: this route returns no logprobs (chat completions does)")
    max_tool_calls: Annotated[int, Field(ge=0)] | None = Field(
        None, description="accepted and ignored: it limits built-in tools, and none runs here")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored: prompts are cached by their tokens")
    prompt_cache_retention: str | None = Field(None, description="accepted and ignored: the prefix cache keeps what "
                                                                 "memory allows")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="accepted and ignored")
    context_management: list[dict[str, Any]] | None = Field(
        None, description="accepted and ignored: nothing is compacted on the server")
    client_metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    user: str | None = Field(None, description="accepted and ignored: clients are told apart by API key")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    service_tier: str | None = Field(None, description="accepted and ignored: the QoS class comes from the key, "
                                                       "x-superfluid-qos or superfluid.qos")
    background: bool | None = Field(False, json_schema_extra={"enum": [False]},
                                    description="true is refused: a response runs while its request is open")
    prompt: dict[str, Any] | None = Field(None, description="refused: there are no stored prompt templates")
    superfluid: Extension | None = None

    @field_validator("background")
    @classmethod
    def _foreground(cls, background):
        if background:
            raise fail("unsupported_value", "true is not supported: a response runs while its request is open "
                                            "(stream it, and cancel it with POST /v1/responses/ID/cancel)")
        return background

    @field_validator("prompt")
    @classmethod
    def _no_templates(cls, value):
        raise fail("unsupported_value", "is not supported: there are no stored prompt templates; send "
                                        "instructions and input")

"""The typed ``POST /v1/messages`` and ``/v1/messages/count_tokens`` requests.

Every top-level field of Anthropic's Messages request is decided here (docs/api.md has the
table): honored (``model``, ``messages``, ``system``, ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata.user_id``, ``tools``,
``tool_choice``), accepted and ignored with the reason on the field (``thinking``,
``context_management``, ``output_config``, ``service_tier``, ``container``, ``mcp_servers``,
``inference_geo``, ``speed``, ``cache_control``, ``diagnostics``, ``user_profile_id``,
``workspace_id``), or refused as any unknown field is (a 400 naming it). Claude Code sends
``thinking``, ``context_management``, ``output_config`` and ``metadata`` on every turn, so they
must parse.

Tools are :class:`~..typed.Lenient`: a client echoes tool definitions with fields this server
does not read (``cache_control``, ``strict``, ``defer_loading``, ``input_examples``). A tool
with a ``type`` other than ``custom`` is one of Anthropic's own (web search, code execution,
computer use, text editor, bash): the server cannot run it, so it is left out of the prompt, as
the Responses front end leaves out ``web_search``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from ..extension import Extension
from ..typed import Lenient, RequestBody, fail
from .blocks import AnthropicMessage, AnthropicTextBlock

IGNORED = "accepted and ignored"


class AnthropicTool(Lenient):
    """A tool the model may call. ``type`` absent or ``custom``: a function with ``input_schema``;
    any other ``type`` names one of Anthropic's server or client tools, left out of the prompt."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @property
    def runnable(self) -> bool:
        """A function tool the model can be offered (the others are left out)."""
        return self.type in (None, "custom")

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema):
        if schema is not None and schema.get("type", "object") != "object":
            raise fail("invalid_value", "must be a JSON schema of type object")
        return schema


class ToolChoiceAuto(Lenient):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Lenient):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Lenient):
    type: Literal["none"]


class ToolChoiceTool(Lenient):
    type: Literal["tool"]
    name: Annotated[str, Field(min_length=1)]
    disable_parallel_tool_use: bool | None = None


_CHOICES = {"auto": "auto", "any": "any", "none": "none", "tool": "tool"}


def _choice_kind(value) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _CHOICES.get(kind) if isinstance(kind, str) else None


ToolChoice = Annotated[
    Union[Annotated[ToolChoiceAuto, Tag("auto")], Annotated[ToolChoiceAny, Tag("any")],
          Annotated[ToolChoiceNone, Tag("none")], Annotated[ToolChoiceTool, Tag("tool")]],
    Discriminator(_choice_kind, custom_error_type="invalid_value",
                  custom_error_message="tool_choice must have type auto, any, tool or none")]


class Thinking(Lenient):
    """Extended thinking: ``enabled`` / ``disabled`` render the chat template with
    ``enable_thinking`` true / false (a reasoning model's switch, e.g. Qwen3's; a template without
    it ignores it); ``adaptive`` leaves the template's default. ``budget_tokens`` (with
    ``enabled``) holds a reasoning model's thinking to that many tokens: the scheduler then lets it
    only close its think span and answer. A reasoning model's reasoning comes back as
    ``thinking`` blocks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class Metadata(Lenient):
    user_id: str | None = Field(None, description="the end user, logged as the request's user")


class MessagesInput(RequestBody):
    """What a prompt is made of: the fields ``count_tokens`` takes, and the Messages request's."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="enabled/disabled: the chat template's enable_thinking; "
                                                         "budget_tokens: the thinking's token budget, enforced")
    context_management: dict[str, Any] | None = Field(
        None, description=f"{IGNORED}: the server never edits the conversation it is sent")
    output_config: dict[str, Any] | None = Field(
        None, description=f"{IGNORED}: effort and output format hints for Anthropic's models")
    mcp_servers: list[dict[str, Any]] | None = Field(
        None, description=f"{IGNORED}: the server connects to no MCP server; their tools are not offered")
    superfluid: Extension | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, choice, info):
        tools = [t for t in info.data.get("tools") or () if t.runnable]
        if isinstance(choice, ToolChoiceTool) and choice.name not in {t.name for t in tools}:
            raise fail("invalid_value", f"names tool {choice.name!r}, which is not among the function tools offered")
        if isinstance(choice, ToolChoiceAny) and not tools:
            raise fail("invalid_value", "is any, but no function tools are offered")
        return choice

    @field_validator("tools")
    @classmethod
    def _functions_have_schemas(cls, tools):
        for i, tool in enumerate(tools or ()):
            if tool.runnable and tool.input_schema is None:
                raise fail("missing_required_parameter", f"[{i}].input_schema is required")
        names = [t.name for t in tools or () if t.runnable]
        if len(names) != len(set(names)):
            raise fail("invalid_value", "must not hold two tools with the same name")
        return tools


class MessagesRequest(MessagesInput):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1)] = Field(
        description="a ceiling: cut to what the context leaves after the prompt")
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=64)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: str | None = Field(None, description=f"{IGNORED}: QoS classes (x-superfluid-qos) play this part")
    container: dict[str, Any] | str | None = Field(None, description=f"{IGNORED}: no code-execution container")
    inference_geo: str | None = Field(None, description=f"{IGNORED}: one server, one place")
    speed: str | None = Field(None, description=f"{IGNORED}: QoS classes decide what runs first")
    cache_control: dict[str, Any] | None = Field(
        None, description=f"{IGNORED}: every prompt's prefix is cached by its tokens, automatically")
    diagnostics: dict[str, Any] | None = Field(None, description=f"{IGNORED}: the server's own timings are in /metrics and its log")
    user_profile_id: str | None = Field(None, description=f"{IGNORED}: keys, not profiles, identify clients")
    workspace_id: str | None = Field(None, description=f"{IGNORED}: keys, not workspaces, identify clients")


class CountTokensRequest(MessagesInput):
    """``POST /v1/messages/count_tokens``: the prompt's fields only."""

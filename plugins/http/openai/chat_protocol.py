"""``POST /v1/chat/completions``: the request, declared once. Its messages, tools, tool choice and
response format are typed here; what depends on the served model (the prompt against its
context, token ids against its vocabulary, whether its engine has grammars) is checked by the
preparation path (:mod:`..prepare`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator

from superfluid.core.errors import InvalidRequest

from superfluid.core.formats.conversation import Conversation, ImageRef, Message, TextPart, parts_of
from superfluid.core.formats.conversation import ToolCall as Call

from ..content import Content, ImagePart, content_text
from ..typed import Lenient, RequestBody, fail, parse
from .protocol import GenerationFields, Model

MAX_TOOLS = 128
TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
FORMAT_NAME = r"^[A-Za-z0-9_\-]{1,64}$"


# ---- messages ----------------------------------------------------------------------------------

class FunctionCall(Lenient):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = Field("{}", description="the arguments as a JSON string (or object)")


class ToolCall(Lenient):
    """A call in an assistant message of the history, as the reply gave it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    """One message of the conversation. Fields the server does not read (``refusal``,
    ``annotations``, ... as the SDKs echo them) are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages only")
    tool_call_id: str | None = Field(None, validate_default=True, description="the call a tool message answers (required on tool messages)")
    name: str | None = Field(None, description="the author's name, passed to the chat template")
    content: Content | None = Field(None, validate_default=True,
                                    description="required unless an assistant message carries tool_calls")
    reasoning_content: str | None = Field(None, description="assistant messages: a reasoning model's reasoning "
                                                            "(given to the chat template, which may render it)")
    reasoning: str | None = Field(None, description="another name of reasoning_content")

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_assistant(cls, calls, info: ValidationInfo):
        if calls is not None and info.data.get("role") not in (None, "assistant"):
            raise fail("invalid_value", "is only allowed on assistant messages")
        return calls

    @field_validator("tool_call_id", mode="after")
    @classmethod
    def _tool_answers_a_call(cls, value, info: ValidationInfo):
        if value is None and info.data.get("role") == "tool":
            raise fail("missing_required_parameter", "is required for a tool message")
        return value

    @field_validator("content", mode="after")
    @classmethod
    def _content_unless_calls(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise fail("missing_required_parameter", "is required")
        return content

    @property
    def text(self) -> str:
        return content_text(self.content)

    def as_message(self, index: int = 0) -> Message:
        """The message in the conversation every front end maps onto (``index``: its place in
        ``messages``, which names its images' fields in errors)."""
        if isinstance(self.content, list):
            parts = tuple(ImageRef(p, _image_field(index, j, p)) if isinstance(p, ImagePart) else TextPart(p.text)
                          for j, p in enumerate(self.content))
        else:
            parts = parts_of(self.content)
        calls = tuple(Call.of(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        return Message(self.role, parts, calls, reasoning=thought, tool_call_id=self.tool_call_id, name=self.name)


def _image_field(message: int, part: int, image: ImagePart) -> str:
    return f"messages[{message}].content[{part}].image_url" + ("" if isinstance(image.image_url, str) else ".url")


def kept_messages(history: list[dict]) -> list[Message]:
    """Messages a session keeps (chat's shape, each checked when its turn was sent) as the
    conversation's."""
    return [ChatMessage.model_validate(m).as_message(i) for i, m in enumerate(history)]


# ---- tools -------------------------------------------------------------------------------------

class FunctionDef(Lenient):
    name: Annotated[str, Field(pattern=TOOL_NAME, description="1-64 letters, digits, '_', '.' or '-'; unique")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema for an object")

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema):
        """What would make it no schema at all is a 400; what an engine cannot express as a
        constraint is not (it falls back to any JSON object)."""
        if schema is None:
            return None
        kind = schema.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise fail("invalid_value", 'must have type "object": a function takes an object of arguments')
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
            raise fail("invalid_type", "properties must map names to JSON Schemas")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise fail("invalid_type", "required must be a list of property names")
        return schema

    def offered(self) -> dict:
        """The tool as the prompt shows it: the fields a model reads."""
        return {"type": "function", "function": self.model_dump(exclude_none=True)}


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- response_format ---------------------------------------------------------------------------

class JsonSchemaFormat(RequestBody):
    name: Annotated[str, Field(pattern=FORMAT_NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema the reply must match")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """text (default); json_object: the reply is a JSON object; json_schema: the reply matches
    ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema", mode="after")
    @classmethod
    def _with_its_type(cls, value, info: ValidationInfo):
        kind = info.data.get("type")
        if value is None and kind == "json_schema":
            raise fail("missing_required_parameter", 'is required with type "json_schema"')
        if value is not None and kind != "json_schema":
            raise fail("unknown_parameter", f"is not allowed with type {kind!r}")
        return value


# ---- the request -------------------------------------------------------------------------------

class ChatFields(GenerationFields):
    """A chat's fields but the model: a session's turn is these (its model is the session's)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="default: the rest of the context; the prompt plus max_tokens must fit it "
                          "(else 400 context_length_exceeded)")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="takes precedence over max_tokens")
    logprobs: bool | None = Field(False, description="each reply token's log-probability")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        None, description="that many most likely candidates per token; needs logprobs: true")
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(None, description="unique names")
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, else none")
    parallel_tool_calls: bool | None = True
    service_tier: str | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    reasoning_effort: str | None = Field(None, description="a reasoning model's switch: none or minimal renders "
                                         "the chat template with enable_thinking false, any other value with "
                                         "true; a template without the switch ignores it")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. {\"enable_thinking\": false}); "
                          "they win over reasoning_effort")
    add_generation_prompt: bool | None = Field(
        None, description="end the prompt with the template's generation prompt (default true; false with "
                          "continue_final_message)")
    continue_final_message: bool | None = Field(
        None, description="end the prompt where the last message's content ends, so the model goes on writing it "
                          "(an assistant message to continue); cannot be combined with add_generation_prompt true")
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="documents for a template that renders them (its documents variable: retrieval-augmented "
                          "templates such as Command R's and Granite's)")
    thinking_budget: Annotated[int, Field(ge=1)] | None = Field(
        None, description="a reasoning model's thinking held to this many tokens: after them the model may only "
                          "close its think span, then answer (enforced by the scheduler's sampling); ignored for "
                          "a model that does not reason")
    grammar: str | None = Field(None, description="llama-server's: a GBNF grammar (root rule root) the reply "
                                                  "follows; not with a JSON response_format or a forced tool call")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored: prompts are cached by their tokens")

    @property
    def conversation(self) -> Conversation:
        """The messages as the prompt is rendered from them."""
        return Conversation(m.as_message(i) for i, m in enumerate(self.messages))

    @field_validator("continue_final_message", mode="after")
    @classmethod
    def _continue_without_generation_prompt(cls, value, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message continues the last message; it cannot also add a generation "
                             "prompt (leave add_generation_prompt unset or false)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top, info: ValidationInfo):
        if top is not None and not info.data.get("logprobs"):
            raise fail("invalid_value", "requires logprobs to be true")
        return top

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools):
        seen = set()
        for i, tool in enumerate(tools or ()):
            if tool.function.name in seen:
                raise InvalidRequest(f"tools[{i}].function.name: duplicate tool name {tool.function.name!r}",
                                     param=f"tools[{i}].function.name", code="invalid_value")
            seen.add(tool.function.name)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, choice, info: ValidationInfo):
        names = {t.function.name for t in info.data.get("tools") or ()}
        if choice == "required" and not names:
            raise fail("invalid_value", '"required" needs tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise fail("invalid_value", f"names {choice.function.name!r}, which is not in tools")
        return choice


class ChatCompletionRequest(ChatFields):
    """The body of ``POST /v1/chat/completions``."""

    model: Model = None


class MappedChat(ChatCompletionRequest):
    """A chat another front end (Messages, Responses, Ollama) runs: chat's generation fields,
    validated by chat's rules, and the conversation that front end mapped from its own typed
    request (no ``messages``: no front end writes chat's messages for them to be parsed again)."""

    messages: list[ChatMessage] = Field(default_factory=list, description="unused: see conversation")
    _conversation: Conversation = PrivateAttr(default_factory=Conversation)

    @classmethod
    def of(cls, conversation: Conversation, fields: dict) -> "MappedChat":
        """The chat of ``conversation`` with ``fields`` (chat's generation fields, typed or as
        chat's JSON takes them: a 400 names the first one wrong)."""
        if not conversation.messages:
            raise InvalidRequest("messages must not be empty", param="messages", code="invalid_value")
        chat = parse(cls, fields)
        chat._conversation = conversation
        return chat

    @property
    def conversation(self) -> Conversation:
        return self._conversation

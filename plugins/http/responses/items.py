"""The Responses API's input: content parts and input items, and the tagged-union helpers every
part of the request (:mod:`.protocol`) builds its ``type``-discriminated unions with.

Objects a client copies from earlier replies (input items, content parts) are
:class:`~..typed.Lenient`: fields the server does not read (``id``, ``status``, ``phase``,
``annotations``…) are ignored, as OpenAI ignores them. A union's member is picked by
:func:`by_type`; a ``type`` no member takes lands on a member kept out of the published schema
that refuses it with a 400 naming ``….type`` (:func:`refusing`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from ..typed import Lenient, fail

TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
CHOICE_MODES = ("none", "auto", "required")
# what a refused type is, in the 400's words: content the server cannot read yet, and items of
# tools it never offers (so a model here cannot have made them)
_UNSERVED_PARTS = {"input_file": "files are not supported", "input_audio": "audio is not supported"}
ONLY_FUNCTIONS = "the server offers only function tools (other types are left out)"
_NOT_OFFERED = ONLY_FUNCTIONS + ", so the history cannot hold them"


def by_type(tags: dict[str, str], other: str, absent: str | None = None) -> Discriminator:
    """Picks a union's member by the object's ``type`` (``tags``: type → member tag; a missing
    ``type`` → ``absent``; anything else, or a value that is no object → ``other``). Tags are
    class-like names, which :func:`..typed.param_of` leaves out of the field a 400 names."""
    def tag(value) -> str:
        if isinstance(value, dict):
            kind = value.get("type")
            if kind is None and absent is not None:
                return absent
            return tags.get(kind, other) if isinstance(kind, str) else other
        return tags.get(getattr(value, "type", None), other)
    return Discriminator(tag)


def refusing(unsupported: dict[str, str], allowed: tuple[str, ...], otherwise: str | None = None):
    """A ``type`` validator for a union's catch-all member: always a 400, which says why
    (``unsupported``: why a known type is not served; ``otherwise``: why no other string is)."""
    def check(cls, kind):
        if kind is None:
            raise fail("missing_required_parameter", "is required")
        if isinstance(kind, str) and (kind in unsupported or otherwise is not None):
            raise fail("unsupported_value", f"{kind!r} is not supported: {unsupported.get(kind, otherwise)}")
        raise fail("invalid_value", f"must be one of {', '.join(allowed)}, got {kind!r}")
    return field_validator("type", mode="before")(classmethod(check))


# ---- content parts -----------------------------------------------------------------------------

class ResponsesTextPart(Lenient):
    """``input_text`` (what a client writes) or ``output_text`` (a reply it sends back)."""

    type: Literal["input_text", "output_text"]
    text: str


class ResponsesRefusalPart(Lenient):
    """A refusal a reply held, sent back: its text is the assistant's words."""

    type: Literal["refusal"]
    refusal: str


class ResponsesImagePart(Lenient):
    """``{"type": "input_image", "image_url": …, "detail"?}``: an image, as chat's ``image_url``
    part (a data: URL, or an http(s) URL the server may fetch); ``file_id`` (the Files API) is
    not served."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)] | None = Field(None, validate_default=True)
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None

    @field_validator("image_url", mode="after")
    @classmethod
    def _url_given(cls, url, info: ValidationInfo):
        if url is None:
            raise fail("missing_required_parameter", "is required (file_id images are not served: send a data: URL)")
        return url


class ResponsesUnservedPart(Lenient):
    """Any other part (images, files, audio, unknown types): refused, naming ``….type``."""

    type: Any = Field(None, validate_default=True)

    _refuse = refusing(_UNSERVED_PARTS, (*TEXT_PARTS, "refusal", "input_image"))


Part = Annotated[Union[Annotated[ResponsesTextPart, Tag("ResponsesTextPart")],
                       Annotated[ResponsesRefusalPart, Tag("ResponsesRefusalPart")],
                       Annotated[ResponsesImagePart, Tag("ResponsesImagePart")],
                       Annotated[SkipJsonSchema[ResponsesUnservedPart], Tag("ResponsesUnservedPart")]],
                 by_type({"input_text": "ResponsesTextPart", "output_text": "ResponsesTextPart",
                           "refusal": "ResponsesRefusalPart", "input_image": "ResponsesImagePart"},
                          other="ResponsesUnservedPart")]
Content = str | list[Part]


def content_text(content: Content) -> str:
    """A content's text: a string as it is, parts joined with nothing between them (as chat's),
    images left out."""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, ResponsesTextPart) else p.refusal for p in content
                   if not isinstance(p, ResponsesImagePart))


# ---- input items -------------------------------------------------------------------------------

class ResponsesMessageItem(Lenient):
    """A message: ``{"type": "message", "role", "content"}``, or the same without ``type``."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class ResponsesFunctionCallItem(Lenient):
    """A call a reply made (becomes an assistant message's ``tool_calls`` entry)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str = Field(description="the arguments as a JSON string")


class ResponsesFunctionCallOutputItem(Lenient):
    """A call's result (becomes a ``tool`` message answering ``call_id``)."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: Content


class ResponsesReasoningItem(Lenient):
    """A reasoning item of an earlier reply (this server's, or another's, whose text is often
    encrypted for the server that made it): dropped from the prompt."""

    type: Literal["reasoning"]


class ResponsesUnknownItem(Lenient):
    """Any other item (another tool's calls, item references): refused, naming ``….type``."""

    type: Any = Field(None, validate_default=True)

    _refuse = refusing({"item_reference": "send the item itself (items are not looked up by id)",
                         **{kind: _NOT_OFFERED for kind in (
                             "custom_tool_call", "custom_tool_call_output", "web_search_call", "file_search_call",
                             "computer_call", "computer_call_output", "image_generation_call",
                             "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call",
                             "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_call",
                             "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                             "tool_search_call", "tool_search_output")}}, ITEM_TYPES)


Item = Annotated[Union[Annotated[ResponsesMessageItem, Tag("ResponsesMessageItem")],
                       Annotated[ResponsesFunctionCallItem, Tag("ResponsesFunctionCallItem")],
                       Annotated[ResponsesFunctionCallOutputItem, Tag("ResponsesFunctionCallOutputItem")],
                       Annotated[ResponsesReasoningItem, Tag("ResponsesReasoningItem")],
                       Annotated[SkipJsonSchema[ResponsesUnknownItem], Tag("ResponsesUnknownItem")]],
                 by_type({"message": "ResponsesMessageItem", "function_call": "ResponsesFunctionCallItem",
                           "function_call_output": "ResponsesFunctionCallOutputItem",
                           "reasoning": "ResponsesReasoningItem"},
                          other="ResponsesUnknownItem", absent="ResponsesMessageItem")]

"""Typed request bodies: the base every endpoint's request class extends, and the one place
pydantic's validation errors become the API's 400s.

Why pydantic: each field's type, range and default is declared once, on the request class, and
pydantic derives from that one declaration both the validator (strict: ``"1"`` is no integer,
``1`` no boolean; unknown fields refused) and the JSON Schema that ``/openapi.json`` publishes,
so the document cannot drift from what the server accepts. Its errors are structured (a
location, a type, the bound that failed), which lets this module name the field the way
OpenAI's errors do (``messages[0].content``) with a stable ``code``. attrs has no schema and no
validation of nested JSON; msgspec's errors are strings.

Rules a request class follows:
- a field's range is its ``Field(ge=..., le=...)``; its default is the API's default, or None
  where the default depends on the served model (resolved by the preparation path);
- a cross-field rule that names a field is a field validator on the later field raising
  :func:`fail`; one that needs the served model stays in the preparation path;
- objects a client echoes back from a reply (messages, tool calls, content parts) use
  :class:`Lenient`: fields we do not read are ignored, as OpenAI ignores them."""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from superfluid.core.errors import InvalidRequest


def _null_is_absent(cls, data):
    """OpenAI's rule: a field sent as null means its default (an unknown field stays, to be
    refused even when null)."""
    if not isinstance(data, dict):
        return data
    fields = _field_names(cls)
    return {k: v for k, v in data.items() if v is not None or k not in fields}


def _field_names(cls) -> frozenset:
    names = cls.__dict__.get("_json_names")
    if names is None:
        names = frozenset(f.alias or n for n, f in cls.model_fields.items())
        setattr(cls, "_json_names", names)
    return names


class RequestBody(BaseModel):
    """A request body: strict types, unknown fields refused (a 400 naming them), null the same
    as absent (so a field's default is written once, on its declaration)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_absent(cls, data)

    def given(self, name: str) -> bool:
        """Whether the client sent ``name`` (a field left at its default was not sent)."""
        return name in self.model_fields_set


class Lenient(BaseModel):
    """An object inside a body that clients fill from replies: strict types, extra fields
    ignored (OpenAI ignores them too; the SDKs echo ``refusal``, ``annotations``, ...)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_absent(cls, data)


def fail(code: str, text: str) -> PydanticCustomError:
    """An error for a field validator to raise: ``code`` is the API error's code, ``text`` what
    follows the field's name in the message (``"needs tools"`` → ``"tool_choice needs tools"``)."""
    return PydanticCustomError(code, "{text}", {"text": text})


def _named_by_field(value, handler):
    try:
        return handler(value)
    except ValidationError as exc:
        inner = translate(exc.errors(include_url=False), root="")
        rest = inner.message[len(inner.param):].lstrip(" :")
        where = inner.param if not inner.param or inner.param.startswith("[") else f"[{inner.param!r}]"
        raise fail(inner.code, f"{where} {rest}" if where else rest) from None


# On a field whose entries are the client's data (token ids, inputs, a map keyed by token id),
# not objects with fields: its errors name the field, as OpenAI's do, and the entry in the
# message ("input[1] must not be empty", param "input").
NamedByField = WrapValidator(_named_by_field)

Body = TypeVar("Body", bound=BaseModel)


def parse(cls: type[Body], body: Any) -> Body:
    """``body`` (a decoded JSON value) as a ``cls``; a 400 naming the first thing wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_body")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise translate(exc.errors(include_url=False)) from None


# ---- pydantic's errors as the API's ------------------------------------------------------------

_TYPE_WORDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "true or false", "list_type": "a list", "dict_type": "an object",
               "model_type": "an object", "model_attributes_type": "an object", "none_required": "null",
               "finite_number": "a finite number", "int_from_float": "an integer", "tuple_type": "a list"}
_RANGE = {"greater_than_equal": ("at least", "ge"), "greater_than": ("greater than", "gt"),
          "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt")}
_LENGTH = {"too_short": "at least", "string_too_short": "at least", "too_long": "at most",
           "string_too_long": "at most"}
_VALUE_ERRORS = set(_RANGE) | set(_LENGTH) | {"string_pattern_mismatch"}
# how pydantic names a union's member in an error's location: a type ("str", "list[int]",
# "constrained-int", "literal['a']", "function-after[...]") or a model's class name
_MEMBER = re.compile(r"^(str|int|float|bool|none|dict|list|constrained-.*|.*\[.*|[A-Z][A-Za-z0-9]*)$")


def _is_member_tag(part) -> bool:
    return isinstance(part, str) and bool(_MEMBER.match(part))


def param_of(loc: tuple) -> str:
    """A location as OpenAI names fields: ``messages[0].content``; union members left out."""
    out = ""
    for part in loc:
        if _is_member_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _depth(error: dict) -> int:
    return sum(1 for part in error["loc"] if not _is_member_tag(part))


def _union_error(errors: list[dict], base: int) -> dict:
    """One error for a value no member of a union took (``base``: the union's own depth): the
    member that got furthest into the value speaks (``content[1].type``); if none got past the
    value itself, a range it broke, else one type error listing what the value may be."""
    deepest = max(_depth(e) for e in errors)
    top = [e for e in errors if _depth(e) == deepest]
    ranged = [e for e in top if e["type"] in _VALUE_ERRORS]
    if deepest > base or ranged:
        return (ranged or top)[0]
    words = []
    for e in top:
        word = (str(e.get("ctx", {}).get("expected", "")) if e["type"] == "literal_error"
                else _TYPE_WORDS.get(e["type"], ""))
        if word and word not in words:
            words.append(word)
    return {**top[0], "type": "string_type", "_words": " or ".join(words) or "of another type"}


def _first(errors: list[dict]) -> dict:
    """The error to report: an unknown top-level field first (as OpenAI does); else the first
    error, with a union's alternatives reduced to one."""
    first = errors[0]
    tag_at = next((i for i, part in enumerate(first["loc"]) if _is_member_tag(part)), None)
    if tag_at is None:
        return first
    prefix = first["loc"][:tag_at]
    group = [e for e in errors if e["loc"][:tag_at] == prefix and len(e["loc"]) > tag_at
             and _is_member_tag(e["loc"][tag_at])]
    return _union_error(group, sum(1 for part in prefix if not _is_member_tag(part)))


def translate(errors: list[dict], root: str = "the request body") -> InvalidRequest:
    """pydantic's errors (``ValidationError.errors()``) as one 400: its ``param`` the field,
    its ``code`` what kind of mistake, its message both in words (``root``: what to call the
    value itself)."""
    unknown = [e["loc"][0] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if unknown:
        return InvalidRequest(f"Unrecognized request argument supplied: {', '.join(sorted(map(str, unknown)))}",
                              param=str(sorted(map(str, unknown))[0]), code="unknown_parameter")
    error = _first(errors)
    kind, ctx, param = error["type"], error.get("ctx") or {}, param_of(error["loc"])
    name = param or root
    got = error.get("input")
    if kind == "extra_forbidden":
        return InvalidRequest(f"{name} is not a known field here", param=param, code="unknown_parameter")
    if kind == "missing":
        return InvalidRequest(f"{name} is required", param=param, code="missing_required_parameter")
    if "_words" in error:
        return InvalidRequest(f"{name} must be {error['_words']}", param=param, code="invalid_type")
    if kind in _TYPE_WORDS:
        return InvalidRequest(f"{name} must be {_TYPE_WORDS[kind]}", param=param, code="invalid_type")
    if kind in _RANGE:
        words, bound = _RANGE[kind]
        return InvalidRequest(f"{name} must be {words} {ctx.get(bound)}, got {_short(got)}", param=param,
                              code="invalid_value")
    if kind == "literal_error":
        return InvalidRequest(f"{name} must be {ctx.get('expected')}, got {_short(got)}", param=param,
                              code="invalid_value")
    if kind in _LENGTH:
        most = _LENGTH[kind]
        bound = ctx.get("min_length" if most == "at least" else "max_length")
        unit = "characters" if isinstance(got, str) else "entries"
        if most == "at least" and bound == 1:
            return InvalidRequest(f"{name} must not be empty".lstrip(), param=param, code="invalid_value")
        length = ctx.get("actual_length", len(got) if hasattr(got, "__len__") else "?")
        return InvalidRequest(f"{name} must hold {most} {bound} {unit}, got {length}".lstrip(),
                              param=param, code="invalid_value")
    if kind == "string_pattern_mismatch":
        return InvalidRequest(f"{name} must match {ctx.get('pattern')}, got {_short(got)}", param=param,
                              code="invalid_value")
    if "text" in ctx and kind not in ("value_error", "assertion_error"):  # raised through fail()
        text = ctx["text"]
        return InvalidRequest(f"{name}{'' if text.startswith('[') else ' '}{text}", param=param, code=kind)
    return InvalidRequest(f"{name}: {error.get('msg')}", param=param, code="invalid_value")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""A chat's ``response_format``: plain text, any JSON object, or JSON following a schema.

A JSON format becomes a :class:`~superfluid.core.request.JsonConstraint` with one choice and no
lead, which the engine enforces token by token (llguidance, :mod:`superfluid.core.constrain`).
A schema llguidance cannot enforce is refused by the model's loop on submit, for every front end
(a 400 ``unsupported_schema`` naming ``response_format``, llguidance's reason in the message):
a client that asked for a schema must never get a free-form answer it would take for a valid
one."""

from __future__ import annotations

import re

from superfluid.core.errors import InvalidRequest
from superfluid.core.request import JsonChoice, JsonConstraint

ANY_OBJECT = {"type": "object"}
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}
FIELD = "response_format"


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def constraint(body: dict) -> JsonConstraint | None:
    """The constraint ``response_format`` asks for (None: free text); a malformed one is a 400
    naming the part that is wrong, e.g. ``response_format.json_schema.name``."""
    fmt = body.get(FIELD)
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad('response_format must be an object such as {"type": "json_object"}', FIELD, "invalid_type")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
                   f"{FIELD}.type", "missing_required_parameter" if kind is None else "invalid_value")
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in fmt):
        name = extra[0] if extra else "json_schema"
        raise _bad(f"response_format.{name} is not allowed with type {kind!r}", f"{FIELD}.{name}",
                   "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonConstraint(choices=(JsonChoice("", ANY_OBJECT),))
    return JsonConstraint(choices=(JsonChoice("", _schema(fmt.get("json_schema"))),))


def _schema(spec) -> dict:
    where = f"{FIELD}.json_schema"
    if spec is None:
        raise _bad(f'{where} is required with type "json_schema"', where, "missing_required_parameter")
    if not isinstance(spec, dict):
        raise _bad(f"{where} must be an object: {{name, schema, strict, description}}", where, "invalid_type")
    extra = sorted(set(spec) - _SCHEMA_FIELDS)
    if extra:
        raise _bad(f"{where}.{extra[0]} is not a field of json_schema (name, schema, strict, description)",
                   f"{where}.{extra[0]}", "unknown_parameter")
    name = spec.get("name")
    if name is None:
        raise _bad(f"{where}.name is required", f"{where}.name", "missing_required_parameter")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{where}.name must be 1-64 of a-z, A-Z, 0-9, '_' and '-', got {name!r}", f"{where}.name")
    for key, kind, label in (("strict", bool, "true or false"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise _bad(f"{where}.{key} must be {label}", f"{where}.{key}", "invalid_type")
    schema = spec.get("schema")
    if schema is None:
        return {}  # no schema: any JSON value, as OpenAI's
    if not isinstance(schema, dict):
        raise _bad(f"{where}.schema must be a JSON Schema object", f"{where}.schema", "invalid_type")
    return schema


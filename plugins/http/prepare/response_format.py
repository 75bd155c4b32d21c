"""A chat's ``response_format``: plain text, any JSON object, or JSON following a schema.

A JSON format becomes a :class:`~superfluid.core.request.JsonConstraint` with one choice and no
lead, which the engine enforces token by token (llguidance, :mod:`superfluid.core.constrain`).
A schema llguidance cannot enforce is refused by the model's loop on submit, for every front end
(a 400 ``unsupported_schema`` naming ``response_format``, llguidance's reason in the message):
a client that asked for a schema must never get a free-form answer it would take for a valid
one."""

from __future__ import annotations

from superfluid.core.request import JsonChoice, JsonConstraint

ANY_OBJECT = {"type": "object"}


def constraint(fmt) -> JsonConstraint | None:
    """The constraint a chat's ``response_format`` (:class:`~..openai.chat_protocol.ResponseFormat`)
    asks for; None: free text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonConstraint(choices=(JsonChoice("", ANY_OBJECT),))
    schema = fmt.json_schema.schema_
    return JsonConstraint(choices=(JsonChoice("", {} if schema is None else schema),))  # none: any JSON value

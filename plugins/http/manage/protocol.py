"""The request bodies of the session and admin routes, declared once (:mod:`..typed`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from superfluid.core import qos as qos_classes

from ..openai.chat_protocol import ChatFields
from ..typed import RequestBody, fail

_CLASS = Field(json_schema_extra={"enum": sorted(qos_classes.ALIASES)}, description="a QoS class or alias")


def _class(name: str) -> str:
    return qos_classes.resolve(name, param="qos")


class SessionCreateRequest(RequestBody):
    """``POST /v1/sessions``."""

    model: str | None = None
    qos: Annotated[str, _CLASS] | None = None
    system: str | None = None
    pin_system: bool | None = Field(False, description="keep the system prompt's KV pinned; needs system")

    _known = field_validator("qos")(classmethod(lambda cls, name: _class(name)))

    @field_validator("pin_system")
    @classmethod
    def _needs_system(cls, pin, info: ValidationInfo):
        if pin and not info.data.get("system"):
            raise fail("invalid_value", "needs a system prompt")
        return pin


class SessionQosRequest(RequestBody):
    """``POST /v1/sessions/{sid}/qos``."""

    qos: Annotated[str, _CLASS]

    _known = field_validator("qos")(classmethod(lambda cls, name: _class(name)))


class SessionTurnRequest(ChatFields):
    """``POST /v1/sessions/{sid}/turns``: a chat's fields but the model (the session's)."""


class UnloadRequest(RequestBody):
    """``POST /admin/models/{name}/unload`` (the body is optional)."""

    drain_timeout_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] | None = Field(
        30.0, description="seconds running requests may take to finish")


class LoadRequest(RequestBody):
    """``POST /admin/models/{name}/load`` (the body is optional and holds nothing)."""

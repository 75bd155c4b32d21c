"""The body's ``superfluid`` extension object, ``{"qos": CLASS}``, which any front end's request
may carry: it says what the ``x-superfluid-qos`` header says, in the body, where a gateway that
drops unknown headers (SMG, so ``superfluid fleet``) still carries it."""

from __future__ import annotations

from pydantic import Field, field_validator

from superfluid.core import qos as qos_classes

from .typed import RequestBody

FIELD = "superfluid"


class Extension(RequestBody):
    qos: str | None = Field(None, json_schema_extra={"enum": sorted(qos_classes.ALIASES)},
                            description="a QoS class or alias, as x-superfluid-qos")

    @field_validator("qos")
    @classmethod
    def _known_class(cls, name: str) -> str:
        """The canonical class (validated even where the server does not honour it)."""
        return qos_classes.resolve(name, param=f"{FIELD}.qos")

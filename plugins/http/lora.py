"""Which LoRA adapters a request runs under, from what it names.

Two ways, as the servers people come from do it:

* vLLM's: the model name ``MODEL:ADAPTER`` (listed by ``/v1/models`` with ``parent`` = MODEL)
  selects that adapter at the scale it was loaded with (``--lora NAME=PATH:SCALE``).
* llama-server's per-request ``lora: [{"id": 0, "scale": 0.5}, ...]``: ``id`` is the adapter's
  id as ``GET /lora-adapters`` lists it (or its name); adapters not listed get scale 0, as in
  llama-server; a scale of 0 drops the adapter.

Both together: the named adapter, with the ``lora`` field's scales over it. Neither: the global
scales ``POST /lora-adapters`` set (none by default: the base model, as vLLM serves it).

The set is checked again under the model's lock when the request is queued, so an adapter
unloaded in between is a 404, never a request served without it."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from superfluid.core.adapters import AdapterNotFound
from superfluid.core.errors import InvalidRequest
from superfluid.core.request import AdapterSet

from .typed import RequestBody

MAX_ADAPTERS = 16  # entries of one request's ``lora`` field


class LoraRef(RequestBody):
    """One entry of llama-server's per-request ``lora`` field."""

    id: int | str = Field(description="the adapter's id (GET /lora-adapters) or its name")
    scale: Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)] | None = Field(
        None, description="its scale (default: the scale it was loaded with); 0 leaves it out")


LoraField = Annotated[list[LoraRef], Field(max_length=MAX_ADAPTERS)] | None


def named_adapter(runtime, named: str | None) -> str | None:
    """The adapter a model name selects (``MODEL:ADAPTER``), or None for the model itself."""
    if not named or named == runtime.name or not named.startswith(runtime.name + ":"):
        return None
    return named[len(runtime.name) + 1:]


def request_adapters(runtime, named: str | None, lora: list | None) -> AdapterSet:
    """The adapter set of a request to ``runtime`` naming the served model ``named`` (an alias
    already resolved) with llama-server's ``lora`` field (None: not sent)."""
    table = runtime.loop.adapters
    scales: dict[str, float] = {}
    adapter = named_adapter(runtime, named)
    if adapter is not None:
        found = table.get(adapter)
        if found is None:
            raise AdapterNotFound(f"The model {named!r} does not exist: model {runtime.name!r} has no LoRA adapter "
                                  f"{adapter!r}", param="model", code="model_not_found")
        scales[found.name] = found.scale
    if lora is None:
        return tuple(sorted(scales.items())) if adapter is not None else table.default_set()
    for i, ref in enumerate(lora):
        ident = ref.id if isinstance(ref, LoraRef) else ref.get("id")
        found = table.by_id(ident) if isinstance(ident, int) else table.get(str(ident))
        if found is None:
            served = ", ".join(f"{a.id} ({a.name})" for a in table.served()) or "none"
            raise InvalidRequest(f"lora[{i}]: model {runtime.name!r} has no LoRA adapter {ident!r} (served: {served})",
                                 param="lora", code="adapter_not_found")
        scale = ref.scale if isinstance(ref, LoraRef) else ref.get("scale")
        scales[found.name] = found.scale if scale is None else float(scale)
    return tuple(sorted((name, scale) for name, scale in scales.items() if scale != 0))

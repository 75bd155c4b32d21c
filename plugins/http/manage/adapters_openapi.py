"""The LoRA adapter routes in ``/openapi.json`` (:mod:`.adapters`): their path table, merged into
the document's by :func:`..info.openapi._paths`. The admin bodies are typed requests
(:class:`.adapters.AdapterLoadRequest`, :class:`.adapters.AdapterUnloadRequest`); llama-server's
``POST /lora-adapters`` takes a JSON list, described in its summary."""

from __future__ import annotations

from ..info.openapi_ops import BODY, NAME, op
from ..info.openapi_schema import integer, json_body, obj, ref, string

_ADAPTER = obj({"id": integer(0), "name": string(), "model": string(description="MODEL:NAME, the model name "
                                                                               "that selects it"),
                "path": string(), "scale": {"type": "number", "description": "the global scale"},
                "model_scale": {"type": "number", "description": "the scale a request selecting it gets"},
                "state": string(enum=["loading", "ready", "unloading", "unloaded", "failed"])},
               required=("id", "name", "path", "scale"))
_LISTED = {"type": "array", "items": obj({"id": integer(0), "path": string(), "scale": {"type": "number"},
                                          "name": string(), "model": string()},
                                         required=("id", "path", "scale"))}
_MODEL = {"name": "model", "in": "query", "required": False, "schema": string(),
          "description": "the model (default: the first served)"}
_ADAPTER_NAME = {"name": "adapter", "in": "path", "required": True, "schema": string()}
_UNLOADED = obj({"model": string(), "adapter": string(), "state": string(enum=["unloaded", "unloading"])},
                required=("model", "adapter", "state"))


def paths() -> dict:
    return {
        "/admin/models/{name}/adapters": {
            "get": op("a model's LoRA adapters (loading and unloading ones too)", json_body(
                obj({"model": string(), "adapters": {"type": "array", "items": _ADAPTER}},
                    required=("model", "adapters")), "the adapters"), parameters=[NAME], op_id="listAdapters"),
            "post": op("load a LoRA adapter at the next tick; answers once the engine loaded it (422: the "
                       "engine could not, with its reason)", json_body(_ADAPTER, "loaded"),
                       errors=(*BODY, 409, 422), body=ref("AdapterLoadRequest"), parameters=[NAME],
                       op_id="loadAdapter")},
        "/admin/models/{name}/adapters/{adapter}": {"delete": op(
            "unload a LoRA adapter: new requests for it get 404 at once; its lanes finish, then it is "
            "unloaded (200; 202 while its lanes still run after drain_timeout_s)", json_body(_UNLOADED, "unloaded"),
            errors=BODY, body=ref("AdapterUnloadRequest"), body_required=False,
            parameters=[NAME, _ADAPTER_NAME], op_id="unloadAdapter")},
        "/lora-adapters": {
            "get": op("llama-server's list of a model's LoRA adapters: id, path, global scale",
                      json_body(_LISTED, "the adapters"), parameters=[_MODEL], op_id="loraAdapters"),
            "post": op("llama-server's global LoRA scales: the body is a JSON list [{id, scale}] (id: an "
                       "adapter's id or name); unlisted adapters get 0; applied to requests naming the base "
                       "model without a lora field", json_body(_LISTED, "the adapters"), errors=BODY,
                       parameters=[_MODEL], op_id="setLoraScales")},
    }

"""GET /openapi.json: every route the app registers is described, and the document is valid.

The app is build_app's own, with a stand-in daemon (no model): routes are registered without one."""

from __future__ import annotations

import asyncio
import json
import re
import types

import pytest
from aiohttp.test_utils import TestClient, TestServer

from superfluid.core.cli import load
from superfluid.plugins.http.info.openapi_requests import REQUESTS
from superfluid.plugins.http.frontend import build_app
from superfluid.plugins.http.info.openapi import document

METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}


class _Daemon:
    def __init__(self):
        self.models = {}
        self.sessions = types.SimpleNamespace(sessions={})
        self.draining = False

    def model_states(self):
        return {}


def _app():
    config, _pm = load(["serve"])  # the defaults, with every plugin's options
    return build_app(_Daemon(), config)


def _registered(app) -> set[tuple[str, str]]:
    """(method, path template) of every route; aiohttp's automatic HEAD for GET left out."""
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info()
        path = info.get("path") or info.get("formatter")
        assert path, f"route without a path: {route!r}"
        out.add((route.method.lower(), path))
    return out


def _documented(doc: dict) -> set[tuple[str, str]]:
    return {(m, path) for path, item in doc["paths"].items() for m in item if m in METHODS}


def test_every_registered_route_is_documented():
    registered = _registered(_app())
    documented = _documented(document())
    assert ("get", "/openapi.json") in registered
    assert not registered - documented, f"routes missing from /openapi.json: {sorted(registered - documented)}"
    assert not documented - registered, f"documented routes the app lacks: {sorted(documented - registered)}"


def test_served_document_is_the_document():
    async def fetch():
        async with TestClient(TestServer(_app())) as client:
            resp = await client.get("/openapi.json")
            assert resp.status == 200
            assert resp.content_type == "application/json"
            return await resp.json()
    assert asyncio.run(fetch()) == json.loads(json.dumps(document()))


def _refs(node, found: set):
    if isinstance(node, dict):
        if "$ref" in node:
            found.add(node["$ref"])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)
    return found


def test_document_is_valid():
    doc = document()
    json.dumps(doc)  # plain JSON
    try:
        from openapi_spec_validator import validate
    except ImportError:
        validate = None
    if validate is not None:
        validate(doc)
    # structural checks either way
    assert doc["openapi"].startswith("3.")
    components = doc["components"]
    for ref in _refs(doc, set()):
        kind, name = re.fullmatch(r"#/components/(schemas|responses)/(.+)", ref).groups()
        assert name in components[kind], f"dangling $ref {ref}"
    op_ids = []
    for path, item in doc["paths"].items():
        names = set(re.findall(r"{(\w+)}", path))
        for method, op in item.items():
            op_ids.append(op["operationId"])
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == names, f"{method} {path}: path parameters {declared} != {names}"
            assert any(s.startswith("2") for s in op["responses"]), f"{method} {path}: no 2xx"
            for status in ("401", "403", "404", "429", "503"):
                assert status in op["responses"], f"{method} {path}: no {status}"
            if "requestBody" in op:
                for status in ("400", "413"):
                    assert status in op["responses"], f"{method} {path}: no {status}"
    assert len(op_ids) == len(set(op_ids)), "operationIds must be unique"


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda cls: cls.__name__)
def test_request_bodies_are_the_typed_requests(cls):
    """Each route's body in the document is its typed request's own schema: the fields it
    accepts (by their JSON names), the ones it requires, and unknown ones refused; or, for
    Ollama's bodies (Lenient, as Ollama ignores what it does not know), not described as refused."""
    schema = document()["components"]["schemas"][cls.__name__]
    fields = {field.alias or name: field for name, field in cls.model_fields.items()}
    assert set(schema.get("properties", {})) == set(fields)
    assert set(schema.get("required", [])) == {name for name, field in fields.items() if field.is_required()}
    if cls.model_config.get("extra") == "forbid":
        assert schema["additionalProperties"] is False  # unknown fields are refused
    else:
        assert cls.__name__.startswith("Ollama") and schema.get("additionalProperties", True) is not False


def test_every_route_body_is_a_typed_request():
    """Every requestBody of the document refers to one of the typed requests."""
    names = {cls.__name__ for cls in REQUESTS}
    for path, item in document()["paths"].items():
        for method, op in item.items():
            if "requestBody" in op:
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in names, f"{method} {path}: {ref}"


def test_error_shape():
    doc = document()
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    assert set(error["properties"]["error"]["properties"]) == {"message", "type", "param", "code"}
    for status in ("400", "401", "403", "404", "413", "429", "503"):
        content = doc["components"]["responses"][f"E{status}"]["content"]["application/json"]
        assert content["schema"] == {"$ref": "#/components/schemas/Error"}


def test_new_generation_fields_are_described():
    schemas = document()["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    formats = schemas["ResponseFormat"]["properties"]
    assert formats["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert set(schemas["JsonSchemaFormat"]["properties"]) == {"name", "schema", "strict", "description"}
    assert chat["logprobs"]["type"] == "boolean"
    assert (chat["top_logprobs"]["minimum"], chat["top_logprobs"]["maximum"]) == (0, 20)
    count = completion["logprobs"]["anyOf"][0]
    assert (count["minimum"], count["maximum"]) == (0, 5)
    assert completion["echo"]["type"] == "boolean"
    for body in (chat, completion):
        assert (body["n"]["minimum"], body["n"]["maximum"]) == (1, 16)
        bias = body["logit_bias"]
        assert bias["maxProperties"] == 300
        assert (bias["additionalProperties"]["minimum"], bias["additionalProperties"]["maximum"]) == (-100, 100)
    assert completion["best_of"]["maximum"] == 16 and "n" in completion["best_of"]["description"]
    assert completion["max_tokens"]["minimum"] == 0 and "echo" in completion["max_tokens"]["description"]
    assert chat["max_tokens"]["minimum"] == 1

"""Builders for the JSON Schema pieces of the OpenAPI document (OpenAPI 3.0's dialect: ``nullable``
rather than a list of types), so each body's schema reads as one expression."""

from __future__ import annotations


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def integer(lo: int | None = None, hi: int | None = None, **extra) -> dict:
    out = {"type": "integer", **extra}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def number(lo: float, hi: float, **extra) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi, **extra}


def string(**extra) -> dict:
    return {"type": "string", **extra}


BOOL = {"type": "boolean"}


def obj(props: dict, required: tuple = (), closed: bool = False, **extra) -> dict:
    out = {"type": "object", "properties": props, **extra}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def json_body(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}

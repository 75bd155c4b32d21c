"""This front end's routes in the OpenAPI document (merged into :mod:`..info.openapi`'s table)."""

from __future__ import annotations


def paths() -> dict:
    """Path -> operations, built with :func:`..info.openapi_ops.op`."""
    return {}

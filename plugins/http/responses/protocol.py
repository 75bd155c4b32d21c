"""This front end's typed requests (:mod:`..typed`)."""

from __future__ import annotations

REQUESTS: tuple = ()  # the classes of this front end's request bodies, for /openapi.json

"""What the head reads from and writes into a request body, without judging it: a body the head
cannot read is passed on as sent, so the node (or SMG) answers it with the error it would give a
direct request."""

from __future__ import annotations

import json

QOS_HEADER = "x-superfluid-qos"
EXTENSION = "superfluid"  # the node's body extension object: {"qos": CLASS}


def carry_class(raw: bytes, header: str | None) -> bytes:
    """The body with the header's class moved into ``superfluid.qos``, unless the body names one
    (or is not a JSON object: then the node's or SMG's 400 says what is wrong with it)."""
    if header is None:
        return raw
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw
    if not isinstance(body, dict):
        return raw
    ext = body.get(EXTENSION)
    if ext is None:
        body[EXTENSION] = {"qos": header}
    elif isinstance(ext, dict) and "qos" not in ext:
        ext["qos"] = header
    else:
        return raw
    return json.dumps(body).encode()


def parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def body_class(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    ext = body.get(EXTENSION) if isinstance(body, dict) else None
    return ext.get("qos") if isinstance(ext, dict) else None


def body_model(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def wants_stream(raw: bytes | None) -> bool:
    """The body asks for a streamed reply (``"stream": true``)."""
    if not raw or b'"stream"' not in raw:
        return False
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(body, dict) and body.get("stream") is True

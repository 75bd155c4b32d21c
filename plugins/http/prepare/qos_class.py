"""What a request asks of the scheduler besides its prompt: its QoS class (the
``x-superfluid-qos`` header or the body's ``superfluid`` extension, capped at its key's class)
and whether its lane ticks alone (``x-superfluid-batch-invariant``). Generations, embeddings
and sessions choose their class here, so every route honours the same header, extension and
ceiling."""

from __future__ import annotations

from superfluid.core import qos as qos_classes
from superfluid.core.errors import InvalidRequest

from ..keys.auth import Forbidden, applied_class, request_key

BATCH_INVARIANT_HEADER = "x-superfluid-batch-invariant"
EXTENSION_FIELD = "superfluid"  # the body's extension object: {"qos": CLASS}
EXTENSION_KEYS = {"qos"}


def body_class(body: dict, config) -> str | None:
    """The class the body's ``superfluid`` extension object asks for (``{"qos": "batch"}``), or
    None. It says what the ``x-superfluid-qos`` header says, in the body, where a gateway that
    drops unknown headers (SMG, so ``superfluid fleet``) still carries it; honoured under the
    same switch as the header (``--no-http-qos-header`` ignores both), and it wins over the
    header when both are sent."""
    ext = body.get(EXTENSION_FIELD)
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise InvalidRequest(f"{EXTENSION_FIELD} must be an object", param=EXTENSION_FIELD, code="invalid_type")
    unknown = sorted(set(ext) - EXTENSION_KEYS)
    if unknown:
        raise InvalidRequest(f"Unrecognized {EXTENSION_FIELD} field: {', '.join(unknown)}",
                             param=f"{EXTENSION_FIELD}.{unknown[0]}", code="unknown_parameter")
    qos = ext.get("qos")
    if qos is None:
        return None
    if not isinstance(qos, str):
        raise InvalidRequest(f"{EXTENSION_FIELD}.qos must be a string", param=f"{EXTENSION_FIELD}.qos",
                             code="invalid_type")
    cls = qos_classes.resolve(qos, param=f"{EXTENSION_FIELD}.qos")  # validated even when not honoured
    return cls if config["http-qos-header"] else None


def request_class(request, config, body: dict | None = None) -> str:
    """The QoS class a request gets: the body's ``superfluid.qos`` or the header's, if honoured,
    else the default; with a key policy the key's class is both the default and the ceiling (see
    :func:`..keys.auth.applied_class`)."""
    asked = body_class(body, config) if body is not None else None
    return applied_class(request, config, asked=asked)


def batch_invariant(request, config) -> bool:
    """The x-superfluid-batch-invariant header; a 403 unless --http-allow-batch-invariant (with a
    key policy: unless the key's ``batch-invariant`` grant)."""
    raw = request.headers.get(BATCH_INVARIANT_HEADER)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("0", "false", "no", "off", ""):
        return False
    if value not in ("1", "true", "yes", "on"):
        raise InvalidRequest(f"{BATCH_INVARIANT_HEADER} must be true or false, got {raw!r}",
                             param=BATCH_INVARIANT_HEADER, code="invalid_value")
    key = request_key(request)
    if key is not None:
        if not key.batch_invariant:
            raise Forbidden(f"batch-invariant lanes tick alone and can serialize the server; key {key.name!r} "
                            f"is not granted them (batch-invariant = true in the key policy)",
                            param=BATCH_INVARIANT_HEADER, code="batch_invariant_not_allowed")
    elif not config["http-allow-batch-invariant"]:
        raise Forbidden("batch-invariant lanes tick alone and can serialize the server; this server "
                        "does not allow them (start it with --http-allow-batch-invariant)",
                        param=BATCH_INVARIANT_HEADER, code="batch_invariant_not_allowed")
    return True

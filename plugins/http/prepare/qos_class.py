"""What a request asks of the scheduler besides its prompt: its QoS class (the
``x-superfluid-qos`` header or the body's ``superfluid`` extension, capped at its key's class)
and whether its lane ticks alone (``x-superfluid-batch-invariant``). Generations, embeddings
and sessions choose their class here, so every route honours the same header, extension and
ceiling."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest

from ..keys.auth import Forbidden, applied_class, request_key
from ..options import OPTIONS

BATCH_INVARIANT_HEADER = "x-superfluid-batch-invariant"


def body_class(ext, config) -> str | None:
    """The class the body's ``superfluid`` extension (:class:`~..extension.Extension`, already
    resolved to a canonical class) asks for, or None. Honoured under the same switch as the
    header (``--no-http-qos-header`` ignores both); it wins over the header when both are sent."""
    if ext is None or ext.qos is None:
        return None
    return ext.qos if OPTIONS.of(config).http_qos_header else None


def request_class(request, config, ext=None, otherwise: str | None = None) -> str:
    """The QoS class a request gets: its body's ``superfluid.qos`` (``ext``) or the header's, if
    honoured, else ``otherwise`` (the class of the model alias it named), else the default; with
    a key policy the key's class is both the default and the ceiling (see
    :func:`..keys.auth.applied_class`)."""
    return applied_class(request, config, asked=body_class(ext, config), otherwise=otherwise)


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
    elif not OPTIONS.of(config).http_allow_batch_invariant:
        raise Forbidden("batch-invariant lanes tick alone and can serialize the server; this server "
                        "does not allow them (start it with --http-allow-batch-invariant)",
                        param=BATCH_INVARIANT_HEADER, code="batch_invariant_not_allowed")
    return True

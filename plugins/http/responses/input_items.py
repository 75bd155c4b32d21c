"""``GET /v1/responses/{response_id}/input_items``: the items a stored response was asked with, in
OpenAI's list shape (``object: "list"``, ``data``, ``first_id``, ``last_id``, ``has_more``), paged
by ``limit`` (1..100, default 20), ``order`` (``desc``, the default, or ``asc``) and the cursors
``after`` / ``before`` (an item id of the list).

The items are the request's ``input`` as sent (a string is one user message), each given an id
when the response is stored and kept with it (:mod:`.chains`); ``instructions`` are no item, as at
OpenAI. A response stored before this existed lists no items."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest

from .items import (ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem, ResponsesImagePart,
                    ResponsesMessageItem, ResponsesReasoningItem, ResponsesRefusalPart, ResponsesTextPart)
from .objects import new_id
from .protocol import ResponsesInput

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def _content(content, role: str) -> list[dict]:
    """A message's content as OpenAI lists it: ``input_text`` parts (``output_text`` for an
    assistant's), images as ``input_image``."""
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        content = [ResponsesTextPart(type=text_type, text=content)]
    out = []
    for part in content:
        if isinstance(part, ResponsesTextPart):
            out.append({"type": text_type, "text": part.text, **({"annotations": []} if role == "assistant" else {})})
        elif isinstance(part, ResponsesRefusalPart):
            out.append({"type": "refusal", "refusal": part.refusal})
        elif isinstance(part, ResponsesImagePart):
            out.append({"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"})
    return out


def input_item_objects(req: ResponsesInput) -> list[dict]:
    """The request's input items as a stored response lists them, each with a fresh id."""
    if req.input is None:
        return []
    items = [ResponsesMessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out = []
    for item in items:
        if isinstance(item, ResponsesMessageItem):
            out.append({"id": new_id("msg"), "type": "message", "role": item.role, "status": "completed",
                        "content": _content(item.content, item.role)})
        elif isinstance(item, ResponsesFunctionCallItem):
            out.append({"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments})
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _content(item.output, "user")
            out.append({"id": new_id("fco"), "type": "function_call_output", "status": "completed",
                        "call_id": item.call_id, "output": output})
        elif isinstance(item, ResponsesReasoningItem):
            continue  # dropped from the prompt; not kept either
    return out


def _query_limit(query) -> int:
    raw = query.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}", param="limit",
                             code="invalid_value")
    return limit


def page(items: list[dict], query) -> dict:
    """One page of ``items`` (oldest first, as stored) for the request's query; a bad ``limit``,
    ``order`` or a cursor that is no item of the list is a 400 naming it."""
    limit = _query_limit(query)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {order!r}", param="order", code="invalid_value")
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for param in ("after", "before"):
        cursor = query.get(param)
        if cursor is None:
            continue
        if cursor not in ids:
            raise InvalidRequest(f"{param}: no input item {cursor!r} in this response", param=param,
                                 code="invalid_value")
        if param == "after":
            start = max(start, ids.index(cursor) + 1)
        else:
            end = min(end, ids.index(cursor))
    window = ordered[start:end]
    if query.get("before") is not None and query.get("after") is None:
        data = window[-limit:]  # the page just before the cursor
        has_more = len(window) > limit
    else:
        data = window[:limit]
        has_more = len(window) > limit
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}

"""The ``response`` object and its output items, built the same way for a reply sent whole, a
stream's events and a stored response, so the three cannot disagree.

The object carries what the ``openai`` SDK's ``Response`` model requires, echoing the request's
settings (instructions, tools as sent, tool_choice, text, sampling, store, metadata…), as
OpenAI's does."""

from __future__ import annotations

import secrets
import time

from .protocol import ResponsesRequest

# finish_reason → (the response's status, its incomplete_details)
_STATUS = {"length": ("incomplete", {"reason": "max_output_tokens"}), "cancelled": ("cancelled", None)}


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_…``, ``msg_…``, ``fc_…``."""
    return f"{prefix}_{secrets.token_hex(24)}"


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """A reply's finish reason as the response's ``status`` and ``incomplete_details``."""
    return _STATUS.get(finish_reason, ("completed", None))


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """The assistant's text (``text`` None: no content part yet, as a stream opens it)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning model's reasoning, before its message: the text as ``content`` (one
    ``reasoning_text`` part; None: none yet, as a stream opens it), no ``summary`` (none is made)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: dict, status: str, arguments: str | None = None) -> dict:
    """A function call of the reply (``call``: chat's ``{"id", "function": {"name", "arguments"}}``)."""
    fn = call["function"]
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments}


def usage(chat_usage: dict | None) -> dict | None:
    """Chat's ``usage`` in the Responses API's names (reasoning tokens: a reasoning model's; no
    explicit cache writes: the prefix cache keeps prompts by itself)."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage["total_tokens"]}


def _echo(req: ResponsesRequest) -> dict:
    """The request's settings as the response echoes them (their defaults where not sent)."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", "medium")
    choice = req.tool_choice
    reasoning = req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None}
    return {
        "instructions": req.instructions,
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()],
        "tool_choice": choice.model_dump(exclude_none=True) if hasattr(choice, "model_dump") else (choice or "auto"),
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id, "store": req.store, "metadata": dict(req.metadata or {}),
        "text": text, "reasoning": reasoning, "truncation": req.truncation, "background": False,
        "service_tier": "default", "top_logprobs": req.top_logprobs or 0, "user": req.user,
        "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
    }


class ResponseShape:
    """One response's identity (id, creation time, model) and echoed settings; builds its
    ``response`` object at any point of its life."""

    def __init__(self, req: ResponsesRequest, model: str | None = None, response_id: str | None = None):
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.model = model if model is not None else (req.model or "")
        self.echo = _echo(req)

    def body(self, status: str, output: list[dict], usage_: dict | None = None, *,
             incomplete: dict | None = None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "incomplete_details": incomplete, "model": self.model,
                "output": list(output), "usage": usage_, **self.echo}

"""A generation answered in the Responses API's format: the :class:`~..wire.Wire` the OpenAI
routes' generation run writes through.

That run builds OpenAI chat objects (the whole ``chat.completion``, or ``chat.completion.chunk``
objects as they come: the role, text deltas, tool calls as they are read, the finish, then the
usage chunk, which :attr:`ResponsesWire.always_usage` asks for). This wire translates them:

- whole: one ``response`` object (:mod:`.objects`);
- streamed: ``event: TYPE`` / ``data: {"type", "sequence_number", …}`` events, numbered from 0:
  ``response.created``, ``response.in_progress``; for a reasoning model's reasoning (a
  ``reasoning`` item before the message, its text one ``reasoning_text`` content part, no
  summary) ``response.output_item.added``, ``response.reasoning_text.delta``…,
  ``response.reasoning_text.done``, ``response.output_item.done``; for the text ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``; for each function call
  ``response.output_item.added``, ``response.function_call_arguments.delta`` (the arguments
  whole: calls are parsed when the reply ends), ``.done``, ``response.output_item.done``; then
  ``response.completed`` (with usage) or ``response.incomplete`` (cut by ``max_output_tokens``,
  or cancelled: status ``cancelled``). A failure midway ends with ``response.failed``.

A reply with neither text nor calls is one message with empty text, so every response has an
output item. ``on_response`` hears the finished response object (not a failed one): the routes
keep it when the response is stored."""

from __future__ import annotations

import json
from typing import Callable

from aiohttp import web

from ..openai.replies import error_body, status_of as http_status
from ..wire import Wire
from .objects import ResponseShape, call_item, message_item, new_id, reasoning_item, status_of, text_part, usage

_FAILED_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}  # else server_error
_CLOSING_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                  "cancelled": "response.incomplete"}


class ResponsesWire(Wire):
    """One response's answer. ``shape``: its identity and echoed settings; ``on_response``:
    called with the finished response object (completed, incomplete or cancelled)."""

    always_usage = True  # response.completed carries usage
    ping_every = 15.0    # a long prefill (an agent's first turn) does not look like a dead stream

    def __init__(self, shape: ResponseShape, on_response: Callable[[dict], None] | None = None):
        super().__init__()
        self.shape = shape
        self.on_response = on_response
        self.seq = 0
        self.output: list[dict] = []  # the output items so far, in order
        self._text: dict | None = None  # the message item being streamed
        self._thought: dict | None = None  # the reasoning item being streamed
        self._calls: dict[int, int] = {}  # a streamed call's index -> its item's output index, until done
        self.finish: str | None = None
        self.final: dict | None = None  # the finished response object

    def prepared(self, prep) -> None:
        super().prepared(prep)
        self.shape.model = prep.runtime.name

    def snapshot(self, status: str = "in_progress") -> dict:
        """The response as it stands (the finished one, once there is one)."""
        return self.final if self.final is not None else self.shape.body(status, self.output)

    def _finished(self, items: list[dict], chat_usage: dict | None) -> dict:
        status, incomplete = status_of(self.finish)
        self.final = self.shape.body(status, items, usage(chat_usage), incomplete=incomplete)
        if self.on_response is not None:
            self.on_response(self.final)
        return self.final

    # ---- a reply sent whole -----------------------------------------------------------------

    def whole(self, body: dict) -> web.StreamResponse:
        choice = body["choices"][0]
        message, self.finish = choice["message"], choice["finish_reason"]
        status = "completed" if status_of(self.finish)[0] == "completed" else "incomplete"
        calls = message.get("tool_calls") or []
        items = []
        if message.get("reasoning_content"):
            items.append(reasoning_item(new_id("rs"), message["reasoning_content"], status))
        if message.get("content") or not calls:
            items.append(message_item(new_id("msg"), message.get("content") or "", status))
        items += [call_item(new_id("fc"), call, "completed") for call in calls]
        return web.json_response(self._finished(items, body.get("usage")))

    # ---- a stream ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def opening(self) -> list[bytes]:
        snapshot = self.shape.body("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: dict) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():  # one: the Responses API has no n
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason") is not None:
                out += self._close_reasoning()
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            if delta.get("tool_calls"):
                out += self._close_text()
                for call in delta["tool_calls"]:
                    out += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                out += self._close_calls()
                if not any(item["type"] != "reasoning" for item in self.output):
                    out += self._text_delta("")
                out += self._close_text()
        return out

    def _reasoning_delta(self, text: str) -> list[bytes]:
        out = []
        if self._thought is None:
            item = reasoning_item(new_id("rs"), None, "in_progress")
            self.output.append(item)
            self._thought = item
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            item["content"].append({"type": "reasoning_text", "text": ""})
        self._thought["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self._thought["id"],
                               output_index=self.output.index(self._thought), content_index=0, delta=text))
        return out

    def _close_reasoning(self) -> list[bytes]:
        item, self._thought = self._thought, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _text_delta(self, text: str) -> list[bytes]:
        out = []
        if self._text is None:
            item = message_item(new_id("msg"), None, "in_progress")
            self.output.append(item)
            self._text = item
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            item["content"].append(text_part(""))
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=text_part("")))
        if text:
            self._text["content"][0]["text"] += text
            out.append(self._event("response.output_text.delta", item_id=self._text["id"],
                                   output_index=self.output.index(self._text), content_index=0, delta=text,
                                   logprobs=[]))
        return out

    def _close_text(self) -> list[bytes]:
        item, self._text = self._text, None
        if item is None:
            return []
        index, part = self.output.index(item), item["content"][0]
        item["status"] = "completed" if status_of(self.finish)[0] == "completed" else "incomplete"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict) -> list[bytes]:
        """A piece of a streamed call: its first (with the name) adds its item, each piece's
        arguments are a delta; the item is done when the reply finishes (:meth:`_close_calls`)."""
        fn = call.get("function") or {}
        out = []
        if fn.get("name") is not None:
            item = call_item(new_id("fc"), {"id": call["id"], "function": {"name": fn["name"], "arguments": ""}},
                             "in_progress", arguments="")
            self.output.append(item)
            self._calls[call["index"]] = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        index = self._calls.get(call["index"])
        if index is None or not fn.get("arguments"):
            return out
        item = self.output[index]
        item["arguments"] += fn["arguments"]
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=fn["arguments"]))
        return out

    def _close_calls(self) -> list[bytes]:
        out = []
        for index in self._calls.values():
            item = self.output[index]
            item["status"] = "completed"
            out += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        self._calls = {}
        return out

    def closing(self, usage_chunk: dict | None) -> list[bytes]:
        final = self._finished(list(self.output), (usage_chunk or {}).get("usage"))
        return [self._event(_CLOSING_EVENT[final["status"]], response=final)]

    def stream_error(self, exc: BaseException | None) -> list[bytes]:
        message = error_body(exc)["error"]["message"]
        failed = self.shape.body("failed", self.output, error={
            "code": _FAILED_CODES.get(http_status(exc), "server_error"), "message": message})
        return [self._event("response.failed", response=failed)]

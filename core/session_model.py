"""A session's state in memory: its messages and turns, its park artifact's tokens and who holds
them, and what front ends keep with its turns. :mod:`.sessions` changes it (and logs each change);
:mod:`.session_log` rebuilds it from a log."""

from __future__ import annotations

import time

import attrs


@attrs.define(eq=False)
class Session:
    id: str
    model: str
    qos: str
    system: str | None = None
    pin_system: bool = False  # the system prompt's cached KV is evicted last while the session is open
    created: float = attrs.field(factory=time.time)
    messages: list[dict] = attrs.field(factory=list)   # every turn's messages and replies, in order
    turns: int = 0
    state: str = "open"                                 # open | parked | closed
    prompt_tokens: list[int] = attrs.field(factory=list)  # the last turn's prompt (its KV is cached)
    artifact_tokens: list[int] | None = None           # what the park artifact on disk holds
    # The model loop that took the park artifact into its host tier, and the one holding the
    # system prompt's pin: a model unloaded and loaded again has a new loop holding neither.
    artifact_adopted_by: object | None = attrs.field(default=None, repr=False)
    busy: bool = False                                  # a turn is running
    pinned_tokens: list[int] | None = None              # the system prompt's tokens, once pinned
    pinned_by: object | None = attrs.field(default=None, repr=False)
    window_start: int = 0  # messages before this index (bar the anchor) no longer reach the prompt
    owner: str | None = None  # the name of the API key that opened it (an opaque string; None: no policy)
    origin: str | None = None  # the front end that opened it, when not POST /v1/sessions (e.g. "responses")
    # turn number (1-based) → what the front end that ran the turn keeps with it (the Responses
    # API's stored response object), logged with the turn so it survives a restart
    extras: dict[int, dict] = attrs.field(factory=dict)

    @property
    def anchor(self) -> int:
        """Leading messages a prompt always keeps: the first user message (the task), if the
        conversation starts with one; chat templates may insist on a user query."""
        return 1 if self.messages and self.messages[0].get("role") == "user" else 0

    def history(self, window_start: int | None = None) -> list[dict]:
        """The messages a new turn's prompt starts with: the system prompt, the anchor, and the
        messages from ``window_start`` (default: the session's) on."""
        start = self.window_start if window_start is None else window_start
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[:self.anchor] + self.messages[max(start, self.anchor):]

    def window_cuts(self) -> list[int]:
        """Where the kept history may start, oldest first: after the anchor and the current
        window, at an assistant or user message (a tool result stays with the call it answers)."""
        first = max(self.window_start, self.anchor) + 1
        return [i for i in range(first, len(self.messages))
                if self.messages[i].get("role") in ("assistant", "user")]

    @property
    def dropped_messages(self) -> int:
        return max(self.window_start - self.anchor, 0)

    def view(self) -> dict:
        return {"id": self.id, "object": "session", "model": self.model, "qos": self.qos,
                "system": self.system, "pin_system": self.pin_system, "state": self.state, "turns": self.turns,
                "created": int(self.created), "busy": self.busy,
                "parked_tokens": len(self.artifact_tokens or []),
                "window_start": self.window_start, "dropped_messages": self.dropped_messages,
                "owner": self.owner}

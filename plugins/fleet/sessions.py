"""Session affinity: which node holds each ``/v1/sessions`` conversation.

A session lives in one node's memory (its history, its KV in that node's prefix cache), so
every call for it must reach that node; SMG does not proxy ``/v1/sessions`` at all, and a
policy's hash would not pin a session anyway. The head places a new session on the least busy
healthy node that serves its model, remembers ``id -> node``, and sends the session's calls
straight there. A session whose node is down answers 503 ``node_unavailable`` naming the node;
sessions on other nodes are untouched."""

from __future__ import annotations

from .nodes import Node, NodeMonitor


class SessionMap:
    def __init__(self, monitor: NodeMonitor):
        self.monitor = monitor
        self.owner: dict[str, str] = {}  # session id -> node URL

    def place(self, model: str | None) -> Node | None:
        """The node a new session goes to: healthy, serving ``model`` (any model if None), least
        busy by its last /health (lanes busy + queued), then fewest sessions placed by the head."""
        candidates = self.monitor.healthy(model)
        if not candidates:
            return None
        held: dict[str, int] = {}
        for url in self.owner.values():
            held[url] = held.get(url, 0) + 1
        return min(candidates, key=lambda n: (n.busy, held.get(n.url, 0), n.url))

    def remember(self, sid: str, url: str) -> None:
        self.owner[sid] = url

    def forget(self, sid: str) -> None:
        self.owner.pop(sid, None)

    def node_of(self, sid: str) -> str | None:
        return self.owner.get(sid)

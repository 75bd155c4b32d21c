"""What the prefix cache holds, reported as it changes: :class:`CacheEvent` records, which the
KV manager hands to observers with each tick's stats (``TickStats.cache_events``), so a plugin
can tell a router which prefixes this node has (``plugins/kvevents``: KV events for llm-d).

Reporting costs one small object per change and never copies tokens; turning them into blocks
and hashes is the observer's work, off the model's thread."""

from __future__ import annotations

import attrs

from .prefix import HostTier


@attrs.define(frozen=True)
class CacheEvent:
    """One change in what the prefix cache holds, engine-agnostic.

    ``kind`` is "stored" (``holder`` now holds ``tokens[:length]``, replacing what it held),
    "removed" (``holder`` holds nothing) or "cleared" (every holder of ``medium`` holds nothing;
    ``medium`` None: of both media: the engine lost its KV). ``medium`` is "gpu" for the KV pool
    (a free slot's cached prefix, or what a running lane's slot holds of its prompt: its seed,
    then each prefilled chunk) and "cpu" for the host tier. ``holder`` is the slot number or the host tier's key. ``tokens`` is a
    reference, never a copy: the core only appends to a lane's tokens and never changes a cached
    token list, so ``tokens[:length]`` stays what was held."""

    kind: str
    medium: str | None
    holder: int | str | None = None
    tokens: list[int] = attrs.field(factory=list)
    length: int = 0
    adapters: tuple = ()  # the LoRA adapter set the KV was computed under (Request.adapters)


class ReportingHostTier(HostTier):
    """The host tier, reporting each entry it gains or loses as a :class:`CacheEvent`: entries
    come from evictions and from park artifacts loaded back (``core/artifacts.py``), and go by
    LRU, by failed parks, by failed seeds and by OS pressure."""

    def __init__(self, limit_bytes: int, events: list[CacheEvent]):
        super().__init__(limit_bytes)
        self.events = events

    def add(self, tokens: list[int], force: bool = False, adapters: tuple = ()) -> str | None:
        key = super().add(tokens, force, adapters)
        if key is not None:
            self.events.append(CacheEvent("stored", "cpu", key, tokens, len(tokens), adapters))
        return key

    def parked(self, key: str, size: int) -> None:
        n = len(self)
        super().parked(key, size)
        if len(self) < n:  # the engine could not park it
            self.events.append(CacheEvent("removed", "cpu", key))

    def remove(self, key: str) -> None:
        n = len(self)
        super().remove(key)
        if len(self) < n:
            self.events.append(CacheEvent("removed", "cpu", key))

    def trim(self) -> list[str]:
        dropped = super().trim()
        self.events.extend(CacheEvent("removed", "cpu", key) for key in dropped)
        return dropped

    def clear(self) -> list[str]:
        keys = super().clear()
        if keys:
            self.events.append(CacheEvent("cleared", "cpu"))
        return keys

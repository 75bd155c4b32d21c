"""The prefix cache: which free slot's KV already holds the start of a new prompt.

A finished lane leaves its KV in its slot. When a new lane is admitted, the slot (or running
lane) whose tokens share the longest prefix with its prompt seeds it, and only the rest is
prefilled. A prompt that shares a long prefix with one still being prefilled waits for it
instead of prefilling the same tokens again.

KV computed under one LoRA adapter set is not the KV of another (nor of the base model): every
cached prefix carries the adapter set it was computed under (``Request.adapters``), and a lookup
matches only prefixes of the asker's set. A slot's cache of another set shares nothing with the
prompt, whatever its tokens."""

from __future__ import annotations

import time

from .request import AdapterSet

MIN_REUSE = 16  # shorter shared prefixes are not worth a copy
# A cache whose head is at least this share of a new prompt is cut and kept in place for it rather
# than left for an empty slot (llama-server's --slot-prompt-similarity default, 0.1)
SIMILAR_HEAD = 0.1


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slice comparisons run in C: O(n log n))."""
    lo, hi = 0, min(len(a), len(b))
    if hi and a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SlotCache:
    """The tokens each free slot's KV still holds, with last-use times for LRU choice.

    A cache that starts with a pinned prefix (a shared system prompt named in the config) is
    pinned: it yields, oldest first, only when no unpinned cache is left to evict."""

    def __init__(self, pinned: list[list[int]] | None = None) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._sets: dict[int, AdapterSet] = {}  # the adapter set each cache was computed under
        self._used: dict[int, float] = {}
        self._pins = [p for p in (pinned or []) if p]

    def pin(self, tokens: list[int]) -> None:
        """Pin a prefix at runtime (a session's system prompt); pins are counted, not deduplicated."""
        if tokens:
            self._pins.append(list(tokens))

    def unpin(self, tokens: list[int]) -> None:
        if tokens in self._pins:
            self._pins.remove(tokens)

    def store(self, slot: int, tokens: list[int], adapters: AdapterSet = ()) -> None:
        if tokens:
            self._tokens[slot] = tokens
            self._sets[slot] = adapters
            self._used[slot] = time.monotonic()
        else:
            self.forget(slot)

    def forget(self, slot: int) -> None:
        self._tokens.pop(slot, None)
        self._sets.pop(slot, None)
        self._used.pop(slot, None)

    def tokens(self, slot: int) -> list[int]:
        return self._tokens.get(slot, [])

    def adapters(self, slot: int) -> AdapterSet:
        """The adapter set the slot's cache was computed under."""
        return self._sets.get(slot, ())

    def tokens_for(self, slot: int, adapters: AdapterSet) -> list[int]:
        """The slot's cached tokens if computed under ``adapters``, else none (not a prefix to share)."""
        return self._tokens.get(slot, []) if self._sets.get(slot, ()) == adapters else []

    def pinned(self, slot: int) -> bool:
        tokens = self._tokens.get(slot, [])
        return any(len(tokens) >= len(p) and tokens[:len(p)] == p for p in self._pins)

    def cached_tokens(self) -> int:
        return sum(len(t) for t in self._tokens.values())

    def lru_slots(self) -> list[int]:
        """Slots holding a cached prefix in eviction order: unpinned least recently used first,
        then pinned, oldest first."""
        return sorted(self._tokens, key=lambda s: (self.pinned(s), self._used.get(s, 0.0)))

    def best_slot(self, prompt: list[int], free_slots: list[int],
                  busy: list[int] | None = None, adapters: AdapterSet = ()) -> tuple[int, int]:
        """(slot, reusable tokens): the free slot sharing the longest prefix with ``prompt``; with
        none worth a copy (``MIN_REUSE``), the unpinned cache with the longest head shared with the
        prompt if that head is at least ``SIMILAR_HEAD`` of it (cutting it in place is free, and
        short prompts such as raw ChatML share a tenth or more), else an empty slot, else the first
        cache in eviction order. Only caches of the prompt's ``adapters`` share anything with it.
        Given the ``busy`` slots (an engine whose steps cost more the wider
        the range of slots they touch), the slot that keeps that range narrowest comes first."""
        best, best_n = None, 0
        limit = len(prompt) - 1  # at least one token is fed, so there are logits to sample
        heads = {}
        for slot in free_slots:
            n = heads[slot] = min(common_prefix(self.tokens_for(slot, adapters), prompt), limit)
            # of caches sharing as much (a common system prompt), the least valuable: the slot
            # cut for this lane, or copied from, keeps the most recent conversations whole
            if n > best_n or (n and n == best_n and self._value(slot, busy) < self._value(best, busy)):
                best, best_n = slot, n
        if best is not None and best_n >= MIN_REUSE:
            return best, best_n
        similar = {s: n for s, n in heads.items() if n and n >= SIMILAR_HEAD * len(prompt)}
        return min(free_slots, key=lambda s: (span(busy, s), self.pinned(s), -similar.get(s, 0),
                                              s in self._tokens, self._used.get(s, 0.0), -s)), 0

    def least_valuable(self, free_slots: list[int], busy: list[int] | None = None) -> int | None:
        """The free slot whose cache is worth least: an empty slot (the narrowest span first),
        else the cache :meth:`best_slot` would overwrite (narrowest span, unpinned, least recently
        used)."""
        return min(free_slots, key=lambda s: (s in self._tokens, self._value(s, busy)), default=None)

    def worth_less(self, slot: int, than: int) -> bool:
        """Whether ``slot``'s cache is worth less than ``than``'s: empty, or unpinned and older (or
        ``than`` pinned)."""
        if slot not in self._tokens:
            return True
        if self.pinned(slot):
            return False
        return self.pinned(than) or self._used.get(slot, 0.0) < self._used.get(than, 0.0)

    def _value(self, slot: int, busy: list[int] | None) -> tuple:
        return (span(busy, slot), self.pinned(slot), slot in self._tokens, self._used.get(slot, 0.0), -slot)


def span(busy: list[int] | None, slot: int) -> int:
    """How wide the range of slot ids gets with ``slot`` added to ``busy`` (0 without ``busy``)."""
    if not busy:
        return 0
    return max(max(busy), slot) - min(min(busy), slot)


MIN_HOST_TOKENS = 64  # shorter prefixes are cheaper to prefill again than to keep


class HostTier:
    """Prefixes evicted from the KV pool, kept in host memory (as the engine's parked KV) so the
    next request that shares one imports it instead of prefilling. Bounded in bytes, LRU."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self._entries: dict[str, list] = {}  # key -> [tokens, bytes, last use, adapter set]
        self._bytes = 0  # the entries' bytes, kept as they change: read every tick
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, tokens: list[int], force: bool = False, adapters: AdapterSet = ()) -> str | None:
        """A key to park a prefix (computed under ``adapters``) under, or None if it is not worth
        keeping (``force``: a park artifact being loaded, kept whatever the limit until it is
        used once)."""
        if not force and (self.limit <= 0 or len(tokens) < MIN_HOST_TOKENS):
            return None
        self._next += 1
        key = f"prefix-{self._next}"
        self._entries[key] = [list(tokens), 0, time.monotonic(), adapters]
        return key

    def parked(self, key: str, size: int) -> None:
        """The engine reported the bytes it holds for ``key`` (0: it could not park it)."""
        if key not in self._entries:
            return
        self._bytes -= self._entries[key][1]
        if size <= 0:
            del self._entries[key]
        else:
            self._entries[key][1] = size
            self._bytes += size

    def best(self, prompt: list[int], adapters: AdapterSet = ()) -> tuple[str | None, int]:
        """The entry of the prompt's ``adapters`` holding the longest prefix of it."""
        best, best_n = None, 0
        limit = len(prompt) - 1
        head = prompt[:MIN_REUSE]
        for key, (tokens, size, _, held_under) in self._entries.items():
            if tokens[:MIN_REUSE] != head or held_under != adapters:  # cheap reject: nothing worth reusing
                continue
            n = min(common_prefix(tokens, prompt), limit)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def tokens(self, key: str) -> list[int]:
        entry = self._entries.get(key)
        return list(entry[0]) if entry else []

    def adapters(self, key: str) -> AdapterSet:
        entry = self._entries.get(key)
        return entry[3] if entry else ()

    def keys_under(self, name: str) -> list[str]:
        """The entries computed under a set holding adapter ``name``."""
        return [key for key, entry in self._entries.items() if name in dict(entry[3])]

    def remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]

    def touch(self, key: str) -> None:
        """The entry was imported: it becomes the most recently used."""
        if key in self._entries:
            self._entries[key][2] = time.monotonic()

    def trim(self) -> list[str]:
        """Keys to drop (least recently used first) until the tier fits its limit."""
        if self.bytes <= self.limit:  # the usual case, asked every tick: no sort
            return []
        dropped = []
        total = self.bytes
        for key, (_, size, _, _) in sorted(self._entries.items(), key=lambda kv: kv[1][2]):
            if total <= self.limit:
                break
            dropped.append(key)
            total -= size
        for key in dropped:
            self._bytes -= self._entries.pop(key)[1]
        return dropped

    def clear(self) -> list[str]:
        keys = list(self._entries)
        self._entries.clear()
        self._bytes = 0
        return keys

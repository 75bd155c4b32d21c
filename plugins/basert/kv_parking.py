"""How basert's paged pool (:class:`~.kv_pool.PagedKV`) parks a slot and brings it back.

Two forms, both :class:`~.kv_blocks.ParkedKV`: a host copy of the slot's blocks (``export``,
and what park files hold), or the blocks themselves, kept in the pool by reference (``keep``).
A kept entry costs no copy to park or to restore while the pool has room; when a step or a
restore needs the room, the oldest kept entry whose blocks would free any is copied to host
memory and lets them go (``spill``). Either form reports the bytes a host copy takes, so the
scheduler's host budget holds whichever form an entry is in.

This is a part of ``PagedKV`` (a base class it inherits), kept in its own file because it is
its own job: it works on the pool's block bookkeeping (``_slots``, ``_ref``, ``_free``, the
store) and adds only the kept entries (``_kept``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from .kv_blocks import ParkedKV, ceil_div, tensors_match

if TYPE_CHECKING:
    from .kv_pool import _Slot


class Parking:
    """``PagedKV``'s parking (the module docstring says how)."""

    def _init_parking(self, block_bytes: int) -> None:
        # parked entries whose blocks stay in the pool, oldest first: id(entry) -> (entry, holder)
        self._kept: OrderedDict[int, tuple[ParkedKV, _Slot]] = OrderedDict()
        self._block_bytes = block_bytes

    def export(self, slot: int) -> ParkedKV:
        """A host copy of the slot's blocks."""
        s = self._view(slot)
        blocks = s.table[:ceil_div(s.length, self.block_size)]
        return ParkedKV(length=s.length, tokens=list(s.tokens), meta=self.meta,
                        tensors=self.store.export(blocks))

    def keep(self, slot: int) -> ParkedKV:
        """Park the slot by keeping its blocks (a reference each, no copy): the entry holds them
        until it comes back (``import_``), is forgotten (``forget``), or a step needs the room,
        when the oldest kept entry is copied to host memory and its blocks let go (``spill``).
        Why: parking and restoring then cost nothing while the pool has room, and host memory
        is spent only when it must be (on a CPU, host and device memory are the same)."""
        s = self._view(slot)
        held = self._held_copy(s, s.length)
        entry = ParkedKV(length=s.length, tokens=list(s.tokens), meta=self.meta,
                         size=len(held.table) * self._block_bytes)
        self._kept[id(entry)] = (entry, held)
        return entry

    def kept(self, entry: ParkedKV) -> bool:
        """Whether the pool still keeps the entry's blocks."""
        return id(entry) in self._kept

    def spill(self, entry: ParkedKV) -> None:
        """Copy a kept entry's blocks to host memory (``entry.tensors``) and let them go."""
        item = self._kept.pop(id(entry), None)
        if item is None:
            return
        held = item[1]
        entry.tensors = self.store.export(held.table)
        for b in held.table:
            self._release(b)

    def forget(self, entry: ParkedKV) -> None:
        """The entry is dropped: let go of the blocks the pool kept for it (if any)."""
        item = self._kept.pop(id(entry), None)
        if item is not None:
            for b in item[1].table:
                self._release(b)

    def host_copy(self, entry: ParkedKV) -> ParkedKV:
        """The entry with its blocks in host memory (a park file's content); a kept entry stays
        kept."""
        item = self._kept.get(id(entry))
        if item is None:
            return entry
        return ParkedKV(length=entry.length, tokens=list(entry.tokens), meta=entry.meta,
                        tensors=self.store.export(item[1].table))

    def _spill_one(self) -> bool:
        """Spill the oldest kept entry whose spilling frees a block; False if none would."""
        for entry, held in self._kept.values():
            if any(self._ref[b] == 1 for b in held.table):
                self.spill(entry)
                return True
        return False

    def import_(self, slot: int, parked: ParkedKV) -> bool:
        """Bring a parked slot back into ``slot``: a kept entry's blocks by reference, a host
        copy into fresh blocks (spilling kept entries for the room if need be). The slot is
        meant to be cleared; if it is not, what it holds is replaced (its blocks count towards
        the room). False, changing nothing, if the geometry differs or the blocks cannot hold
        it."""
        item = self._kept.get(id(parked))
        if item is not None:
            self.clear(slot)
            self._slots[slot] = self._held_copy(item[1], parked.length)
            return True
        n_blk = ceil_div(parked.length, self.block_size)
        if parked.meta != self.meta or not tensors_match(parked, n_blk):
            return False
        while n_blk > len(self._free) + self._freed_by_clearing(slot):
            if not self._spill_one():
                return False
        self.clear(slot)
        s = self._slot(slot)
        s.table = [self._alloc() for _ in range(n_blk)]
        if n_blk:
            self.store.load(s.table, parked.tensors)
        s.length = s.computed = parked.length
        s.tokens = list(parked.tokens)
        s.hashes = []
        self._hash_blocks(s)
        return True

    def _freed_by_clearing(self, slot: int) -> int:
        held = self._slots.get(slot)
        return sum(1 for b in set(held.table) if self._ref[b] == 1) if held else 0

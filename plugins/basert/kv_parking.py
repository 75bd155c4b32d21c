"""How basert's paged pool (:class:`~.kv_pool.PagedKV`) parks a slot and brings it back.

Two forms, both :class:`~.kv_blocks.ParkedKV`: a host copy of the slot's blocks (``export``,
and what park files hold), or the blocks themselves, kept in the pool by reference (``keep``).
A kept entry costs no copy to park or to restore while the pool has room; when a step or a
restore needs the room, the pool asks for the oldest kept entry whose blocks would free any to
be copied to host memory and let go (``spill_oldest``). Either form reports the bytes a host
copy takes, so the scheduler's host budget holds whichever form an entry is in.

``Parking`` is an object the pool holds (``pool.parking``): it owns the kept entries and
reaches the pool's blocks only through :class:`ParkingPool`, the pool's holder methods."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from .kv_blocks import DenseBlocks, ParkedKV, SlotBlocks
from .kv_quant import QuantBlocks


class ParkingPool(Protocol):
    """What parking reads and asks of the pool (``PagedKV`` is one)."""

    store: DenseBlocks | QuantBlocks   # the blocks' storage (parking makes host copies of them)
    block_bytes: int                   # one block's device bytes (its host copy takes as many)

    @property
    def meta(self) -> dict: ...
    def length(self, slot: int) -> int: ...
    def tokens(self, slot: int) -> list[int]: ...
    def block_table(self, slot: int) -> list[int]: ...
    def hold(self, slot: int) -> SlotBlocks: ...
    def let_go(self, held: SlotBlocks) -> None: ...
    def would_free(self, held: SlotBlocks) -> bool: ...
    def adopt(self, slot: int, held: SlotBlocks, length: int) -> None: ...
    def fill(self, slot: int, parked: ParkedKV) -> bool: ...


class Parking:
    """A pool's parked entries (the module docstring says how)."""

    def __init__(self, pool: ParkingPool) -> None:
        self._pool = pool
        # parked entries whose blocks stay in the pool, oldest first: id(entry) -> (entry, holder)
        self._kept: OrderedDict[int, tuple[ParkedKV, SlotBlocks]] = OrderedDict()

    def export(self, slot: int) -> ParkedKV:
        """A host copy of the slot's blocks."""
        pool = self._pool
        return ParkedKV(length=pool.length(slot), tokens=pool.tokens(slot), meta=pool.meta,
                        tensors=pool.store.export(pool.block_table(slot)))

    def keep(self, slot: int) -> ParkedKV:
        """Park the slot by keeping its blocks (a reference each, no copy): the entry holds them
        until it comes back (``import_``), is forgotten (``forget``), or a step needs the room,
        when the oldest kept entry is copied to host memory and its blocks let go (``spill``).
        Why: parking and restoring then cost nothing while the pool has room, and host memory
        is spent only when it must be (on a CPU, host and device memory are the same)."""
        held = self._pool.hold(slot)
        entry = ParkedKV(length=held.length, tokens=list(held.tokens), meta=self._pool.meta,
                         size=len(held.table) * self._pool.block_bytes)
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
        entry.tensors = self._pool.store.export(held.table)
        self._pool.let_go(held)

    def spill_oldest(self) -> bool:
        """Spill the oldest kept entry whose spilling frees a block; False if none would."""
        for entry, held in self._kept.values():
            if self._pool.would_free(held):
                self.spill(entry)
                return True
        return False

    def forget(self, entry: ParkedKV) -> None:
        """The entry is dropped: let go of the blocks the pool kept for it (if any)."""
        item = self._kept.pop(id(entry), None)
        if item is not None:
            self._pool.let_go(item[1])

    def host_copy(self, entry: ParkedKV) -> ParkedKV:
        """The entry with its blocks in host memory (a park file's content); a kept entry stays
        kept."""
        item = self._kept.get(id(entry))
        if item is None:
            return entry
        return ParkedKV(length=entry.length, tokens=list(entry.tokens), meta=entry.meta,
                        tensors=self._pool.store.export(item[1].table))

    def import_(self, slot: int, parked: ParkedKV) -> bool:
        """Bring a parked slot back into ``slot``: a kept entry's blocks by reference, a host
        copy into fresh blocks (``PagedKV.fill``: spilling kept entries for the room if need
        be). The slot is meant to be cleared; if it is not, what it holds is replaced. False,
        changing nothing, if the geometry differs or the blocks cannot hold it."""
        item = self._kept.get(id(parked))
        if item is not None:
            self._pool.adopt(slot, item[1], parked.length)
            return True
        return self._pool.fill(slot, parked)

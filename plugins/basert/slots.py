"""basert's slots and parked KV on the paged pool (:mod:`.kv_pool`): the scheduler's slot
operations (clear, copy a prefix, cut, park, restore, load and save a parked lane) as page-table
operations, for :class:`~.runner.BasertRunner`, which mixes this in ahead of core's tick.

A copy from another slot shares its full pages (the prefix cache costs its blocks once), and a
parked slot keeps its pages in the pool, copied to host memory only when a step needs the room or
a park artifact is written."""

from __future__ import annotations

from .kv_pool import PagedKV
from .speculate import Gate


class PagedSlots:
    """The slot and parking primitives of :class:`~superfluid.core.tick_runner.TickRunner` over a
    :class:`PagedKV` (set by the runner: ``pool``, ``gate``, ``parked``)."""

    pool: PagedKV
    gate: Gate | None
    parked: dict[str, object]

    # ---- slots ------------------------------------------------------------------------------

    def clear_kv(self, slot: int) -> None:
        self.pool.clear(slot)
        if self.gate:
            self.gate.forget(slot)

    def copy(self, src: int, dst: int, pos: int) -> None:
        """``dst`` shares ``src``'s pages up to ``pos`` (copy-on-write for a partial last page)."""
        self.pool.share(src, dst, pos)

    def keep_prefix(self, slot: int, pos: int) -> bool:
        if pos == 0:
            self.pool.clear(slot)
            return True
        self.pool.truncate(slot, pos)
        return self.pool.length(slot) == pos

    def cut(self, slot: int, pos: int) -> None:
        self.pool.truncate(slot, pos)

    def kv_used(self, touched: set[int] = frozenset()) -> int:
        """Positions the slots hold, a shared page's once (the pool's capacity is its pages'
        cells, so a partly filled page shows as partly used)."""
        return self.pool.used_cells()

    # ---- parked KV --------------------------------------------------------------------------

    def park(self, slot: int, key: str) -> int:
        """Park by keeping the slot's pages in the pool (``Parking.keep``): no copy until the
        pool needs the room. The size reported is what a host copy takes, so the scheduler's
        host budget holds whether or not the pages were copied yet."""
        self.drop(key)
        entry = self.parked[key] = self.pool.parking.keep(slot)
        return max(entry.nbytes, 1)

    def drop(self, key: str) -> None:
        entry = self.parked.pop(key, None)
        if entry is not None:
            self.pool.parking.forget(entry)

    def parked_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.parked.values())

    def restore(self, slot: int, entry) -> bool:
        ok = self.pool.parking.import_(slot, entry)
        if not any(held is entry for held in self.parked.values()):
            self.pool.parking.forget(entry)  # the tick took it out of self.parked: the slot holds its pages now
        return ok

    def load(self, path: str, key: str) -> int:
        try:
            with open(path, "rb") as f:
                entry = PagedKV.load(f)
        except (OSError, ValueError, EOFError, RuntimeError, KeyError):
            return 0
        self.drop(key)
        self.parked[key] = entry
        return max(entry.nbytes, 1)

    def save_writer(self, key: str):
        """The host copy is taken on the tick thread; the writer thread serializes it."""
        entry = self.parked.get(key)
        if entry is None:
            return None
        copy = self.pool.parking.host_copy(entry)
        return lambda f: PagedKV.save(copy, f)

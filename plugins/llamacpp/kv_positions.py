"""A slot's KV on llama.cpp in model positions: cut, copy, keep a prefix, count cells.

Core counts a lane's tokens (prompt tokens with one placeholder per image row) and asks for cuts
and copies in those counts. For most models a token's index is its llama.cpp position. Under
M-RoPE (Qwen-VL) it is not: an image of ``nx × ny`` rows takes ``max(nx, ny)`` positions and its
cells all sit at the position it starts at (:mod:`.mrope`). Each tick's plan carries every such
image of a lane (``LanePlan.grids``), so the runner keeps a :class:`~.mrope.Positions` per slot
and translates here; a slot without grids keeps the identity at no cost.

A cut falls on a whole image or none of it (core snaps its prefixes to image boundaries,
:func:`superfluid.core.media.snap`); a tick that stopped inside an image (its rows fed over two
steps) leaves ``pos`` inside it, and a cut there keeps the rows fed so far."""

from __future__ import annotations

import llama_cpp

from superfluid.core.tick import TickPlan, TickResult

from .mrope import Grid, Positions


class KvPositions:
    """Mixin for :class:`~.runner.LlamaCppRunner` (it has ``mem``, ``unified``, ``n_swa``, ``used``)."""

    _positions: dict  # slot -> (the plan's grids, their Positions)

    def run(self, plan: TickPlan) -> TickResult:
        """Each planned lane's positions set from its grids before the tick uses them."""
        if not hasattr(self, "_positions"):
            self._positions = {}
        for lp in plan.lanes:
            if not lp.grids:
                self._positions.pop(lp.slot, None)
            elif self._positions.get(lp.slot, (None,))[0] != lp.grids:
                self._positions[lp.slot] = (lp.grids, Positions([Grid(*g) for g in lp.grids]))
        for slot in plan.release:
            self._positions.pop(slot, None)
        return super().run(plan)

    def positions(self, slot: int) -> Positions | None:
        got = getattr(self, "_positions", {}).get(slot)
        return got[1] if got is not None else None

    def at(self, slot: int, pos: int) -> int:
        """The llama.cpp position of the slot's token ``pos`` (text, or an image's start)."""
        p = self.positions(slot)
        return pos if p is None else p.of(pos)

    def _from(self, slot: int, pos: int) -> int:
        """The first llama.cpp position a cut back to ``pos`` tokens removes."""
        p = self.positions(slot)
        if p is None:
            return pos
        return p.of(pos) if p.snap(pos) == pos else p.of(pos) + 1  # inside an image: keep its rows

    def _last(self, slot: int, pos: int) -> int:
        """``seq_pos_max`` of a slot holding exactly its first ``pos`` tokens."""
        p = self.positions(slot)
        return pos - 1 if p is None else p.last(pos)

    def cut(self, slot: int, pos: int) -> None:
        at = self._from(slot, pos)
        if llama_cpp.llama_memory_seq_pos_max(self.mem, slot) >= at:
            llama_cpp.llama_memory_seq_rm(self.mem, slot, at, -1)

    def copy(self, src: int, dst: int, pos: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, dst, -1, -1)
        if self.unified:  # one pool: the slot shares the source's cells for positions [0, pos)
            llama_cpp.llama_memory_seq_cp(self.mem, src, dst, 0, self._from(dst, pos))
        else:  # across per-sequence buffers llama.cpp copies whole buffers only: copy, then cut
            llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def keep_prefix(self, slot: int, pos: int) -> bool:
        at = self._from(slot, pos)
        if not llama_cpp.llama_memory_seq_rm(self.mem, slot, at, -1):
            return False  # a recurrent state cannot be cut back to ``pos``
        if pos == 0:
            return True
        if llama_cpp.llama_memory_seq_pos_max(self.mem, slot) != self._last(slot, pos):
            return False
        if self.n_swa > 0:
            # A sliding-window cache drops cells that fell out of the window of its sequence's
            # end, so a prefix cut short of that end may lack the cells the next token attends
            # to (those after pos - n_swa). llama-server's test: seq_pos_min <= max(0, pos - n_swa).
            low = llama_cpp.llama_memory_seq_pos_min(self.mem, slot)
            if low > max(0, at - self.n_swa):
                return False
        return True

    def kv_used(self, touched) -> int:
        """Cells held, per sequence. In a shared pool a cell two sequences share counts twice (an
        upper bound: llama.cpp exposes no count of used cells). Only a sequence a tick fed, cut,
        seeded or cleared can have changed, so only the ``touched`` slots are asked again. Under
        M-RoPE positions count fewer than cells: they are counted back to tokens."""
        for seq in touched:
            top = llama_cpp.llama_memory_seq_pos_max(self.mem, seq)
            if top < 0:
                self.used[seq] = 0
                continue
            low = llama_cpp.llama_memory_seq_pos_min(self.mem, seq)
            p = self.positions(seq)
            self.used[seq] = top - low + 1 if p is None else _tokens_through(p, top) - _tokens_through(p, low - 1)
        return sum(self.used.values())


def _tokens_through(p: Positions, position: int) -> int:
    """How many of a lane's tokens sit at llama.cpp positions up to ``position`` (an image counts
    whole once its position is reached)."""
    lag = 0
    for g in p.grids:
        p0 = g.start - lag
        if position < p0:
            break
        if position < p0 + g.n_pos:
            return g.end
        lag += g.rows - g.n_pos
    return max(position + 1 + lag, 0)

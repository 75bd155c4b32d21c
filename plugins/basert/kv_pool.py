"""basert's paged KV cache: one pool of fixed-size blocks shared by every lane (slot).

Why paged: lanes grow and shrink by whole blocks instead of each reserving a maximum context, so
the pool holds as many tokens as the memory allows, whatever their mix of lengths. Blocks are
reference counted, which buys three things: ``share`` gives a new lane a prefix without copying
it (a partial last block is copied only when someone writes into it), identical prefixes computed
twice are deduplicated by a chained hash of their full blocks (as vLLM's prefix caching does; the
hash is the core's, :mod:`superfluid.core.block_hash`, the one KV events publish), and a lane can
be parked by keeping its blocks where they are (``parking.keep``: no copy; they are copied to host
memory only when the pool needs the room, oldest first) or in host memory (``parking.export``,
``save``), and brought back (``load``, ``parking.import_``).

Bookkeeping (tables, refcounts, the free list, hashes) is plain Python on the host; only the
block contents live on the device. The step's attention is ``paged_attention.StepView``; the
quantized storage is ``kv_quant.QuantBlocks``, the full-width one and parked copies ``kv_blocks``;
parking is the pool's ``parking`` (``kv_parking.Parking``), which holds blocks through the pool's
holder methods (``hold``, ``let_go``, ``adopt``, ``fill``).

Call order per step: ``reserve(rows)`` (room, copy-on-write), ``begin_step(rows)``, the model's
forward (``attend`` per layer), then ``note_tokens`` for the rows' token ids (before or after the
forward, once reserved). A block is hashed, and deduplicated, only once it is full, its tokens
are noted and the forward has written its KV in every layer, so a dedupe never redirects a block
the step is still writing.
"""

from __future__ import annotations

import torch

from superfluid.core.block_hash import chain_hash, root_hash

from .kv_blocks import (DenseBlocks, ParkedKV, SlotBlocks, ceil_div, load_parked, save_parked,
                        tensors_match)
from .kv_parking import Parking
from .kv_quant import QuantBlocks
from .paged_attention import StepView


class PagedKV:
    """The paged KV pool (see the module docstring). ``bits`` 0 stores ``dtype``; 8 or 4 store
    quantized codes (``kv_quant``). ``max_gather_tokens`` caps the key rows one decode
    attention call gathers (``StepView``). ``scratch``: the store holds one block more, which no
    slot is ever given (``scratch_block``): the padding rows of a fixed-size decode step
    (``paged_decode``) write there."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int = 16, dtype: torch.dtype, device: torch.device,
                 bits: int = 0, max_gather_tokens: int = 1 << 16, scratch: bool = False) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError("n_blocks and block_size must be positive")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.n_blocks, self.block_size, self.bits = n_blocks, block_size, bits
        self.dtype, self.device = dtype, torch.device(device)
        self.max_gather_tokens = max_gather_tokens
        self.scratch_block = n_blocks if scratch else None
        dims = dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                    n_blocks=n_blocks + bool(scratch), block_size=block_size, dtype=dtype, device=self.device)
        if bits == 0:
            self.store: DenseBlocks | QuantBlocks = DenseBlocks(**dims)
        else:
            self.store = QuantBlocks(**dims, bits=bits)
        self._ref = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))   # pop() hands out low ids first
        self._slots: dict[int, SlotBlocks] = {}
        self._by_hash: dict[int, int] = {}               # hash -> live full block holding it
        self._hash_of: dict[int, int] = {}               # block -> its registered hash
        self._root = root_hash("basert", block_size)     # the names never leave the pool: one root
        self.roots: dict[int, int | None] = {}           # slot -> its lane's LoRA set's root (lora.set_root)
        self.block_bytes = self.store.nbytes // (n_blocks + bool(scratch))   # one block, on the device
        self.parking = Parking(self)

    # ---- sizing and queries -------------------------------------------------------------

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        bits: int, block_size: int = 16) -> float:
        """Device bytes one token's K and V take in every layer, scales included: what the
        engine divides free memory by to size the pool."""
        if bits == 0:
            return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize
        return QuantBlocks.bytes_per_token(n_layers, n_kv_heads, head_dim, bits, block_size)

    @property
    def meta(self) -> dict:
        """The geometry a parked copy must match to come back into this pool."""
        return {"n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size, "bits": self.bits,
                "dtype": str(self.dtype).removeprefix("torch."), "basis": self.store.basis}

    def length(self, slot: int) -> int:
        s = self._slots.get(slot)
        return s.length if s else 0

    def tokens(self, slot: int) -> list[int]:
        s = self._slots.get(slot)
        return list(s.tokens) if s else []

    def block_table(self, slot: int) -> list[int]:
        """The slot's physical block ids, one per ``block_size`` positions (what a host copy of
        the slot copies)."""
        s = self._slots.get(slot)
        return list(s.table) if s else []

    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    def used_cells(self) -> int:
        """Positions held, a shared page's counted once (a page holds as many as the slot that
        fills it furthest): what the scheduler compares with the tokens it knows are cached."""
        bs = self.block_size
        fill: dict[int, int] = {}
        for s in self._slots.values():
            for i, block in enumerate(s.table):
                n = min(bs, s.length - i * bs)
                if n > fill.get(block, 0):
                    fill[block] = n
        return sum(fill.values())

    def free_blocks(self) -> int:
        return len(self._free)

    # ---- block lifetime ------------------------------------------------------------------

    def _alloc(self) -> int:
        b = self._free.pop()
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            h = self._hash_of.pop(b, None)
            if h is not None and self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._free.append(b)

    def _unhash(self, b: int) -> None:
        """``b`` is about to be written: its content will no longer match its hash."""
        h = self._hash_of.pop(b, None)
        if h is not None and self._by_hash.get(h) == b:
            del self._by_hash[h]

    def _view(self, slot: int) -> SlotBlocks:
        """The slot's state, an empty one (not stored) for a slot never used."""
        return self._slots.get(slot) or SlotBlocks()

    def _slot(self, slot: int) -> SlotBlocks:
        s = self._slots.get(slot)
        if s is None:
            s = self._slots[slot] = SlotBlocks(root=self.roots.get(slot))
        return s

    # ---- slot edits --------------------------------------------------------------------------

    def clear(self, slot: int) -> None:
        self.truncate(slot, 0)
        self._slots.pop(slot, None)

    def truncate(self, slot: int, pos: int) -> None:
        if pos < 0:
            raise ValueError(f"negative position {pos}")
        s = self._slots.get(slot)
        if s is None or pos >= s.length:
            return
        keep = ceil_div(pos, self.block_size)
        for b in s.table[keep:]:
            self._release(b)
        del s.table[keep:]
        s.length = pos
        s.computed = min(s.computed, pos)
        del s.tokens[pos:]
        del s.hashes[pos // self.block_size:]

    def share(self, src: int, dst: int, pos: int) -> None:
        """``dst`` := ``src``'s first ``min(pos, length)`` positions, blocks by reference; the
        last one, if partial, is copied by whichever slot writes into it first (``reserve``)."""
        if src == dst:
            self.truncate(src, pos)
            return
        self.clear(dst)
        s = self._slots.get(src)
        if s is None:
            return
        self._slots[dst] = self._held_copy(s, pos)

    def _held_copy(self, s: SlotBlocks, pos: int) -> SlotBlocks:
        """A new holder of ``s``'s first ``min(pos, length)`` positions: its blocks by reference."""
        n = min(max(pos, 0), s.length)
        d = SlotBlocks(table=s.table[:ceil_div(n, self.block_size)], length=n, computed=min(s.computed, n),
                       tokens=s.tokens[:n], hashes=s.hashes[:n // self.block_size], root=s.root)
        for b in d.table:
            self._ref[b] += 1
        return d

    def reserve(self, rows: list[tuple[int, int, int]]) -> bool:
        """Cut each row's slot to ``start`` and make room for ``count`` more positions, copying
        any shared block in the write range. All or nothing: the blocks the cuts free count
        towards the room, and kept parked entries are spilled for it, oldest first; if it is
        still short, no slot changes and the answer is False."""
        bs = self.block_size
        seen: set[int] = set()
        for slot, start, count in rows:
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one step")
            seen.add(slot)
            if start < 0 or count < 0 or start > self.length(slot):
                raise ValueError(f"row ({slot}, {start}, {count}) does not fit a slot of "
                                 f"length {self.length(slot)}")
        need, freed = self._room(rows)
        while need > len(self._free) + freed:
            if not self.parking.spill_oldest():
                return False
            need, freed = self._room(rows)
        for slot, start, _ in rows:
            self.truncate(slot, start)
        for slot, start, count in rows:
            s = self._slot(slot)
            end = start + count
            if count:
                for bi in range(start // bs, min(len(s.table), ceil_div(end, bs))):
                    b = s.table[bi]
                    if self._ref[b] > 1:
                        nb = self._alloc()
                        self.store.copy_block(b, nb)
                        self._release(b)
                        s.table[bi] = nb
                    else:
                        self._unhash(b)
            while len(s.table) < ceil_div(end, bs):
                s.table.append(self._alloc())
            s.length = end
        return True

    def _room(self, rows: list[tuple[int, int, int]]) -> tuple[int, int]:
        """``reserve``'s dry run on a refcount overlay: the blocks the rows need (growth and
        copies of shared blocks they write) and the blocks their cuts free."""
        bs = self.block_size
        delta: dict[int, int] = {}
        freed = 0
        for slot, start, _ in rows:
            s = self._slots.get(slot)
            for b in (s.table[ceil_div(start, bs):] if s else []):
                delta[b] = delta.get(b, 0) - 1
                if self._ref[b] + delta[b] == 0:
                    freed += 1
        need = 0
        for slot, start, count in rows:
            s = self._slots.get(slot)
            keep = ceil_div(start, bs)
            end = start + count
            need += max(0, ceil_div(end, bs) - keep)
            if count and s:
                for bi in range(start // bs, min(keep, ceil_div(end, bs))):
                    b = s.table[bi]
                    if self._ref[b] + delta.get(b, 0) > 1:
                        need += 1
                        delta[b] = delta.get(b, 0) - 1
        return need, freed

    def begin_step(self, rows: list[tuple[int, int, int]]) -> StepView:
        """The step's attention view; ``rows`` as passed to ``reserve`` (their order is the
        order of the flat T the model's tensors use)."""
        return StepView(store=self.store, rows=rows, tables=self.step_tables(rows), n_layers=self.n_layers,
                        device=self.device, on_done=lambda: self.step_done(rows),
                        max_gather_tokens=self.max_gather_tokens)

    def step_tables(self, rows: list[tuple[int, int, int]]) -> list[list[int]]:
        """Each reserved row's block table, checked: the blocks it writes are its own. For an
        attention that is not a ``StepView`` (``paged_decode``), which then calls ``step_done``."""
        bs = self.block_size
        tables = []
        for slot, start, count in rows:
            s = self._slots.get(slot)
            if s is None and count == 0:
                tables.append([])
                continue
            if s is None or s.length != start + count:
                raise ValueError(f"row ({slot}, {start}, {count}) was not reserved")
            for bi in range(start // bs, ceil_div(start + count, bs)):
                if self._ref[s.table[bi]] != 1:
                    raise ValueError(f"slot {slot} would write shared block {s.table[bi]}; "
                                     "reserve the row after sharing")
            tables.append(list(s.table))
        return tables

    def step_done(self, rows: list[tuple[int, int, int]]) -> None:
        """The forward wrote the rows' KV in every layer: their full blocks may now be hashed."""
        for slot, start, count in rows:
            s = self._slots.get(slot)
            if s is None or s.computed < start:
                continue
            s.computed = max(s.computed, min(start + count, s.length))
            self._hash_blocks(s)

    def note_tokens(self, slot: int, start: int, tokens: list[int]) -> None:
        """The token ids at positions ``start..`` of the slot (reserved positions only, with
        no gap after the ones already noted)."""
        s = self._slots.get(slot)
        n_noted = len(s.tokens) if s else 0
        if start < 0 or start > n_noted or start + len(tokens) > self.length(slot):
            raise ValueError(f"tokens for [{start}, {start + len(tokens)}) of slot {slot}: "
                             f"{n_noted} noted, length {self.length(slot)}")
        if not tokens:
            return
        old = s.tokens[start:start + len(tokens)]
        if old != list(tokens[:len(old)]):
            del s.hashes[start // self.block_size:]   # changed ids: their hashes are void
        s.tokens[start:start + len(tokens)] = list(tokens)
        self._hash_blocks(s)

    def _hash_blocks(self, s: SlotBlocks) -> None:
        """Hash each newly full, noted and computed block; a hash a live block already holds
        makes this slot point to that block and frees its own."""
        bs = self.block_size
        ready = min(len(s.tokens), s.computed) // bs
        while len(s.hashes) < ready:
            i = len(s.hashes)
            h = chain_hash(s.hashes[-1] if s.hashes else s.root or self._root, s.tokens[i * bs:(i + 1) * bs])
            b = s.table[i]
            live = self._by_hash.get(h)
            if live is None:
                if b not in self._hash_of:
                    self._by_hash[h] = b
                    self._hash_of[b] = h
            elif live != b:
                self._ref[live] += 1
                s.table[i] = live
                self._release(b)
            s.hashes.append(h)

    # ---- holders other than slots (what ``parking`` holds) -----------------------------------

    def hold(self, slot: int) -> SlotBlocks:
        """A new holder of the slot's blocks, by reference, listed nowhere in the pool: its
        blocks stay out of the free list until the holder is let go (``let_go``)."""
        s = self._view(slot)
        return self._held_copy(s, s.length)

    def let_go(self, held: SlotBlocks) -> None:
        for b in held.table:
            self._release(b)

    def would_free(self, held: SlotBlocks) -> bool:
        """Whether letting ``held`` go would free a block (it is some block's only holder)."""
        return any(self._ref[b] == 1 for b in held.table)

    def adopt(self, slot: int, held: SlotBlocks, length: int) -> None:
        """``slot`` := ``held``'s first ``length`` positions, its blocks by reference."""
        self.clear(slot)
        self._slots[slot] = self._held_copy(held, length)

    def fill(self, slot: int, parked: ParkedKV) -> bool:
        """``slot`` := a host copy, in fresh blocks (parking spills its oldest kept entries for
        the room if need be). The slot is meant to be cleared; if it is not, what it holds is
        replaced (its blocks count towards the room). False, changing nothing, if the geometry
        differs or the blocks cannot hold it."""
        n_blk = ceil_div(parked.length, self.block_size)
        if parked.meta != self.meta or not tensors_match(parked, n_blk):
            return False
        while n_blk > len(self._free) + self._freed_by_clearing(slot):
            if not self.parking.spill_oldest():
                return False
        self.clear(slot)
        s = self._slot(slot)
        s.table = [self._alloc() for _ in range(n_blk)]
        if n_blk:
            self.store.load(s.table, parked.tensors)
        s.length = s.computed = parked.length
        s.tokens = list(parked.tokens)
        self._hash_blocks(s)
        return True

    def _freed_by_clearing(self, slot: int) -> int:
        held = self._slots.get(slot)
        return sum(1 for b in set(held.table) if self._ref[b] == 1) if held else 0

    # the park file format lives beside ParkedKV (kv_blocks): a pool reads and writes it
    save = staticmethod(save_parked)
    load = staticmethod(load_parked)

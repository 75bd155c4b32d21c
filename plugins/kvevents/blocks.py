"""From cache changes to KV blocks: what the prefix cache reports (``core.cache_events.CacheEvent``: a
holder, a slot or a host-tier entry, now holds these tokens, or nothing) becomes vLLM-style block
events (:mod:`.wire`).

A holder's tokens are cut into full blocks of ``block_size`` tokens (a partial last block is not
published, as in vLLM) and each block is named by the core's chained block hash
(:mod:`superfluid.core.block_hash`, chained from a root of the model's name and the block size).
Equal hashes therefore mean equal token sequences from the start, and a block's
``parent_block_hash`` is the hash of the block before it.

Blocks are counted per medium: a block two slots hold is published once, and removed when its
last holder lets it go. The blocks a medium holds are prefix-closed (a holder holds whole chains
from the start), so the blocks one change adds form a run at the end of its chain, published as
one ``BlockStored`` whose parent is a block already published."""

from __future__ import annotations

from superfluid.core.block_hash import block_hashes, root_hash

from .wire import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent

MEDIA = {"gpu": "GPU", "cpu": "CPU"}  # the core's media, as vLLM names them on the wire


class BlockLedger:
    """The blocks one model's cache holds, per medium, and the block events each change makes."""

    def __init__(self, model: str, block_size: int):
        self.block_size = block_size
        self.model = model
        self.root = root_hash(model, block_size)
        self._roots: dict[tuple, int] = {(): self.root}  # per LoRA adapter set: its blocks are other blocks
        self._held: dict[tuple[str, object], list[int]] = {}   # (medium, holder) -> its chain
        self._refs: dict[str, dict[int, int]] = {m: {} for m in MEDIA}  # medium -> hash -> holders

    def blocks(self, medium: str) -> set[int]:
        """The hashes ``medium`` holds now."""
        return set(self._refs[medium])

    def apply(self, events) -> list[WireEvent]:
        """The block events for a tick's cache events, in order."""
        out: list[WireEvent] = []
        for ev in events:
            if ev.kind == "stored":
                self._store(ev.medium, ev.holder, ev.tokens[:ev.length], out, getattr(ev, "adapters", ()))
            elif ev.kind == "removed":
                self._remove(ev.medium, ev.holder, out)
            elif ev.kind == "cleared":
                if ev.medium is None:
                    self._held.clear()
                    for refs in self._refs.values():
                        refs.clear()
                    out[:] = [AllBlocksCleared()]  # what came before in this batch is wiped too
                else:
                    self._clear(ev.medium, out)
        return out

    def _root(self, adapters: tuple) -> int:
        """The chain's root for KV computed under a LoRA adapter set: the same tokens under
        another adapter are other blocks (a router must not send them where they are not)."""
        root = self._roots.get(adapters)
        if root is None:
            key = ",".join(f"{name}@{scale:g}" for name, scale in adapters)
            root = self._roots[adapters] = root_hash(f"{self.model}\x00lora:{key}", self.block_size)
        return root

    def _store(self, medium: str, holder, tokens: list[int], out: list[WireEvent], adapters: tuple = ()) -> None:
        hashes = block_hashes(self._root(adapters), tokens, self.block_size)
        refs = self._refs[medium]
        new = []
        for i, h in enumerate(hashes):  # take the new chain before letting the old one go
            count = refs.get(h, 0)
            refs[h] = count + 1
            if count == 0:
                new.append(i)
        start = 0
        while start < len(new):  # one BlockStored per run of new blocks (one run, in practice)
            end = start
            while end + 1 < len(new) and new[end + 1] == new[end] + 1:
                end += 1
            first, last = new[start], new[end]
            bs = self.block_size
            out.append(BlockStored(block_hashes=hashes[first:last + 1],
                                   parent_block_hash=hashes[first - 1] if first else None,
                                   token_ids=list(tokens[first * bs:(last + 1) * bs]),
                                   block_size=bs, medium=MEDIA[medium],
                                   lora_name=",".join(name for name, _ in adapters) or None))
            start = end + 1
        self._release(medium, self._held.pop((medium, holder), None), out)
        if hashes:
            self._held[(medium, holder)] = hashes

    def _remove(self, medium: str, holder, out: list[WireEvent]) -> None:
        self._release(medium, self._held.pop((medium, holder), None), out)

    def _release(self, medium: str, hashes: list[int] | None, out: list[WireEvent]) -> None:
        if not hashes:
            return
        refs = self._refs[medium]
        gone = []
        for h in reversed(hashes):  # the chain's end first, as an LRU evicts
            count = refs[h] - 1
            if count:
                refs[h] = count
            else:
                del refs[h]
                gone.append(h)
        if gone:
            out.append(BlockRemoved(block_hashes=gone, medium=MEDIA[medium]))

    def _clear(self, medium: str, out: list[WireEvent]) -> None:
        refs = self._refs[medium]
        if refs:
            out.append(BlockRemoved(block_hashes=list(refs), medium=MEDIA[medium]))
        refs.clear()
        for key in [k for k in self._held if k[0] == medium]:
            del self._held[key]

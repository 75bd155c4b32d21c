"""Names for prefix blocks: the one chained block hash of the tree.

A token sequence is cut into full blocks of ``block_size`` tokens and each block is named by
BLAKE2b-64 (digest read big-endian) of its parent's name (8 bytes big-endian) and its token ids
(little-endian signed 64-bit integers). The first block's parent is a root: a hash of the model's
name and the block size. Equal names therefore mean equal token sequences from the start, so
equal KV. A name is never 0, which means "no parent" to llm-d.

Two users, one hash: the KV events plugin publishes these names to llm-d's precise prefix
scorer (vLLM's KV-event format, where a block's ``parent_block_hash`` is the name before it), and
basert's paged pool names its full pages with them to share equal prefixes. Plugins may not
import each other, so the hash lives here."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def root_hash(model: str, block_size: int) -> int:
    """What a sequence's first block chains on: the model and the block size, so two models (or
    block sizes) never share a block name in an indexer that maps block names across nodes."""
    digest = hashlib.blake2b(f"superfluid-kv:{model}:{block_size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _ids_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian signed 64-bit integers, whatever the machine's byte order."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def _chain(parent: int, block: bytes | memoryview) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(block)
    return int.from_bytes(h.digest(), "big") or 1


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """One full block's name: ``block``'s token ids chained on ``parent`` (the previous block's
    name, or the root for the first block)."""
    return _chain(parent, _ids_bytes(block))


def block_hashes(root: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """The names of the full blocks of ``tokens``, chained from ``root`` (a partial last block
    has none)."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    raw = memoryview(_ids_bytes(tokens[:n * block_size]))
    step = block_size * 8
    out, parent = [], root
    for i in range(n):
        parent = _chain(parent, raw[i * step:(i + 1) * step])
        out.append(parent)
    return out

"""vLLM's KV-event messages (``vllm/distributed/kv_events.py``), encoded with msgpack.

A message is a ``KVEventBatch``: ``[ts, events, data_parallel_rank]``, always a positional array.
Each event is one of

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

in the "array" encoding (msgspec ``array_like=True, tag=True``, as vLLM published them until its
PR #42892, June 2026, and as every llm-d-kv-cache release decodes them), or a map with the tag
under ``"type"`` and the same field names in the "map" encoding (vLLM since that PR; llm-d-kv-cache
since its PR #661). Fields vLLM leaves at their defaults (``extra_keys``, ``group_idx``, the cache
spec) are omitted, as msgspec's ``omit_defaults`` does. Block hashes are unsigned 64-bit integers."""

from __future__ import annotations

from typing import Union

import attrs
import msgpack

ENCODINGS = ("array", "map")


@attrs.define(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None
    lora_name: str | None = None

    def fields(self) -> list[tuple[str, object]]:
        return [("block_hashes", self.block_hashes), ("parent_block_hash", self.parent_block_hash),
                ("token_ids", self.token_ids), ("block_size", self.block_size), ("lora_id", self.lora_id),
                ("medium", self.medium), ("lora_name", self.lora_name)]


@attrs.define(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def fields(self) -> list[tuple[str, object]]:
        return [("block_hashes", self.block_hashes), ("medium", self.medium)]


@attrs.define(frozen=True)
class AllBlocksCleared:
    def fields(self) -> list[tuple[str, object]]:
        return []


WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def as_array(event: WireEvent) -> list:
    return [type(event).__name__, *(value for _, value in event.fields())]


def as_map(event: WireEvent) -> dict:
    return {"type": type(event).__name__, **dict(event.fields())}


def encode_batch(ts: float, events: list[WireEvent], encoding: str = "array", dp_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload."""
    shape = as_array if encoding == "array" else as_map
    return msgpack.packb([float(ts), [shape(e) for e in events], dp_rank], use_bin_type=True)

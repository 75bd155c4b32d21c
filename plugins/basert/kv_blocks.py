"""How a paged pool's blocks are stored, held and carried: full-width blocks (``DenseBlocks``; the
quantized ones are ``kv_quant.QuantBlocks``), the shapes a pool's geometry implies, what one
holder holds (``SlotBlocks``), and a slot's parked copy (``ParkedKV``) and its file
(``save_parked``/``load_parked``), checked against those shapes when it comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO

import torch
from torch import Tensor

from .kv_quant import QuantBlocks
from .paged_attention import WritePlan

PARK_FORMAT = "basert-parked-kv/1"


def ceil_div(a: int, b: int) -> int:
    """Blocks of ``b`` positions that ``a`` positions take."""
    return -(-a // b)


class DenseBlocks:
    """The pool's storage in the compute dtype: ``data [n_layers, 2 (K, V), n_blocks,
    block_size, n_kv_heads, head_dim]``. Rows are written in place, in their own basis; reads
    index the blocks."""

    basis = "identity"
    rotation = None

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape, _ = self.shapes(n_layers, n_kv_heads, head_dim, block_size, n_blocks, dtype)["data"]
        self.data = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def shapes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, n_blocks: int,
               dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((n_layers, 2, n_blocks, block_size, n_kv_heads, head_dim), dtype)}

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write(self, layer: int, kv: int, plan: WritePlan, x: Tensor) -> None:
        dst = self.data[layer, kv]
        dst.view(-1, *dst.shape[-2:]).index_copy_(0, plan.flat, x.to(self.dtype))

    def read(self, layer: int, kv: int, block_ids: Tensor) -> Tensor:
        return self.data[layer, kv][block_ids]

    def copy_block(self, src: int, dst: int) -> None:
        self.data[:, :, dst] = self.data[:, :, src]

    def export(self, blocks: list[int]) -> dict[str, Tensor]:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return {"data": self.data[:, :, idx].cpu()}

    def load(self, blocks: list[int], tensors: dict[str, Tensor]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.data[:, :, idx] = tensors["data"].to(self.device)


def stored_shapes(meta: dict, n_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What ``n_blocks`` blocks of a pool described by ``meta`` hold, per stored tensor."""
    dtype = getattr(torch, meta["dtype"])
    dims = (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"], meta["block_size"], n_blocks,
            dtype)
    if meta["bits"] == 0:
        return DenseBlocks.shapes(*dims)
    return QuantBlocks.shapes(*dims, meta["bits"])


@dataclass
class SlotBlocks:
    """What one holder of a pool's blocks holds: a slot, or a parked entry the pool keeps
    (``kv_parking``). Each block in ``table`` counts this holder once in the pool's refcounts."""

    table: list[int] = field(default_factory=list)   # block ids, position p in table[p // bs]
    length: int = 0                                  # reserved positions
    computed: int = 0                                # positions whose KV all layers wrote
    tokens: list[int] = field(default_factory=list)  # noted token ids, <= length of them
    hashes: list[int] = field(default_factory=list)  # chained hashes of the leading full blocks
    root: int | None = None                          # what they chain from (a LoRA set's; None: the pool's)


@dataclass
class ParkedKV:
    """A parked slot's KV: the blocks covering ``length`` positions, the noted tokens and the
    pool's geometry (``meta``). ``tensors`` holds the blocks in host memory, in the pool's stored
    form (quantized stays quantized); it is None while the pool still keeps the blocks themselves
    (``Parking.keep``), which then reports ``size``, the bytes a host copy takes."""

    length: int
    tokens: list[int]
    meta: dict
    tensors: dict[str, Tensor] | None = field(default=None, repr=False)
    size: int = 0

    @property
    def nbytes(self) -> int:
        """Host bytes the blocks take, or would take once copied there."""
        if self.tensors is None:
            return self.size
        return sum(t.nbytes for t in self.tensors.values())



def tensors_match(parked: ParkedKV, n_blocks: int) -> bool:
    try:
        want = stored_shapes(parked.meta, n_blocks)
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    got = parked.tensors
    if got is None:
        return False
    return set(got) == set(want) and all(
        isinstance(got[k], Tensor) and tuple(got[k].shape) == shape and got[k].dtype == dt
        for k, (shape, dt) in want.items())


def save_parked(parked: ParkedKV, f: BinaryIO) -> None:
    """Write a park artifact: plain tensors, ints and strings (``torch.load`` with
    ``weights_only`` can read it back without running code)."""
    if parked.tensors is None:
        raise ValueError("a kept entry has no host copy to save (Parking.host_copy makes one)")
    torch.save({"format": PARK_FORMAT, "length": parked.length,
                "tokens": torch.tensor(parked.tokens, dtype=torch.long),
                "meta": dict(parked.meta), "tensors": dict(parked.tensors)}, f)


def load_parked(f: BinaryIO) -> ParkedKV:
    """Read a park artifact; anything that is not one, or is inconsistent, is a
    ValueError."""
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # a torn or foreign file fails in many ways inside unpickling
        raise ValueError(f"not a parked KV file: {e}") from e
    try:
        if not isinstance(obj, dict) or obj.get("format") != PARK_FORMAT:
            raise ValueError("missing format tag")
        length, tokens, meta, tensors = (obj["length"], obj["tokens"], obj["meta"],
                                         obj["tensors"])
        if not isinstance(length, int) or length < 0 or not isinstance(tokens, Tensor):
            raise ValueError("bad length or tokens")
        if tokens.dim() != 1 or tokens.numel() > length:
            raise ValueError("more tokens than positions")
        keys = {"n_layers", "n_kv_heads", "head_dim", "block_size", "bits", "dtype", "basis"}
        if not isinstance(meta, dict) or set(meta) != keys:
            raise ValueError("bad meta")
        parked = ParkedKV(length=length, tokens=tokens.tolist(), meta=meta,
                          tensors=dict(tensors))
        if not tensors_match(parked, ceil_div(length, meta["block_size"])):
            raise ValueError("tensor shapes do not match the meta")
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed parked KV file: {e}") from e
    return parked

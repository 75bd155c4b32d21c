"""How a paged pool's blocks are stored and carried: full-width blocks (``DenseBlocks``; the
quantized ones are ``kv_quant.QuantBlocks``), the shapes a pool's geometry implies, and a slot's
parked copy (``ParkedKV``), checked against those shapes when it comes back from a file."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .kv_quant import QuantBlocks
from .paged_attention import WritePlan


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
class ParkedKV:
    """A slot's KV in host memory, in the pool's stored form (quantized stays quantized): the
    blocks covering ``length`` positions, the noted tokens and the pool's geometry (``meta``)."""

    length: int
    tokens: list[int]
    meta: dict
    tensors: dict[str, Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())



def tensors_match(parked: ParkedKV, n_blocks: int) -> bool:
    try:
        want = stored_shapes(parked.meta, n_blocks)
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    got = parked.tensors
    return set(got) == set(want) and all(
        isinstance(got[k], Tensor) and tuple(got[k].shape) == shape and got[k].dtype == dt
        for k, (shape, dt) in want.items())

"""Quantized KV blocks (8-bit and 4-bit) for ``PagedKV(bits=8 | 4)``.

Why: the KV cache, not the weights, is what limits how many lanes and how long a context fit.
Each block stores its rows as integer codes with one symmetric absmax scale per block per kv
head (fp32): 8-bit codes in ``int8`` (-127..127), 4-bit codes (-7..7) packed two per ``uint8``
along head_dim (even index in the low nibble). Per token and layer, K and V together take
``2 * n_kv_heads * (head_dim * bits / 8 + 4 / block_size)`` bytes against
``2 * n_kv_heads * head_dim * 2`` for bf16: with head_dim 128 and 16-token blocks that is 50.1 %
(8-bit) and 25.1 % (4-bit) of the bf16 bytes, so the same memory holds about 2x or 4x the tokens.

Blocks written over several steps (decode adds one row at a time): a write dequantizes the
blocks it touches (fp32), puts the new rows in, zeroes the rows past the block's valid end
(stale rows of a truncated block must not inflate the scale), and requantizes them with scale
``max(old scale, absmax / qmax)`` when the block already held rows, ``absmax / qmax`` when it did
not. While the scale holds, the old rows' codes come back unchanged (``round(c * s / s) == c``),
so a row picks up error again only when a larger value arrives and the scale grows (a new
running maximum: about ln(block_size) times per block on random data), each time at most half a
step of the new scale. Measured on random rows written one per step: within 1.25 steps of the
block's final scale, against 0.5 for a block quantized in one go. Keeping an exact copy of each
partial block instead would remove that, at the price of a full-precision block per lane.

Reads dequantize only the blocks a step reads, into a transient tensor per layer and per K/V
(freed once that layer's attention is done); there is never a full-precision copy of the cache.

Rows are stored in a rotated basis: K and V are multiplied by a fixed orthogonal matrix R
(``rotation``: a Hadamard matrix with random signs, ``head_dim`` a power of two; otherwise a
seeded random orthogonal one) before they are quantized. Why: a few K channels of a model carry
values many times larger than the rest, and one absmax scale per block and head then leaves the
other channels a handful of levels (4-bit SmolLM2 lost 50 % perplexity that way). The rotation
spreads every channel over all of them, so a row's absmax is close to its norm's share. Attention
does not need the rows back in their own basis: ``(q R)(k R)^T = q k^T``, and the output of the
rotated values, ``P (V R)``, times ``R^T`` is ``P V``. So the step rotates its queries and its
output (``StepView``), two small products per token, not the keys it reads. ``read`` returns
rows in the rotated basis; ``basis`` names it, and parked copies carry it in their meta.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged_attention import WritePlan

SCALE_DTYPE = torch.float32

BASIS = "rotated-1"
"""The stored rows' basis (``rotation`` below, seed included): a parked copy made in another
basis is refused, not misread."""


def rotation(head_dim: int, device: torch.device | str = "cpu") -> Tensor:
    """The fixed orthogonal ``[head_dim, head_dim]`` fp32 matrix quantized rows are stored in,
    the same on every run (a parked file written by one run is read by the next)."""
    gen = torch.Generator().manual_seed(0x5EED)
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:  # Sylvester's construction
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
        mat = signs[:, None] * h / head_dim ** 0.5
    else:
        mat, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
        mat = (mat * torch.sign(torch.diagonal(r))[None, :]).float()
    return mat.to(device)


def qmax(bits: int) -> int:
    """The largest code magnitude: symmetric, so zero is exact and -x quantizes to -q(x)."""
    if bits == 8:
        return 127
    if bits == 4:
        return 7
    raise ValueError(f"quantized KV supports 8 or 4 bits, not {bits}")


def quantize(x: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Codes of ``x [..., bs, H, D]`` (fp32) with ``scale [..., H]``: int8 for 8 bits, uint8
    ``[..., bs, H, D // 2]`` for 4 bits."""
    m = qmax(bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None, :, None]).clamp_(-m, m)
    if bits == 8:
        return codes.to(torch.int8)
    biased = (codes + 8).to(torch.uint8)           # 1..15, 8 is zero
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


def dequantize(codes: Tensor, scale: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """Inverse of ``quantize``: ``[..., bs, H, D]`` in ``dtype``."""
    if bits == 8:
        vals = codes.to(dtype)
    else:
        lo = (codes & 15).to(dtype) - 8
        hi = (codes >> 4).to(dtype) - 8
        vals = torch.stack((lo, hi), dim=-1).flatten(-2)
    return vals * scale.to(dtype)[..., None, :, None]


class QuantBlocks:
    """The pool's storage as integer codes plus per-block per-head scales.

    ``codes [n_layers, 2 (K, V), n_blocks, block_size, n_kv_heads, head_dim * bits / 8]`` and
    ``scales [n_layers, 2, n_blocks, n_kv_heads]``; reads come back in ``dtype``, in the basis
    of ``rotation`` (the module docstring says why)."""

    basis = BASIS

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, bits: int) -> None:
        self.bits = bits
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._shapes = self.shapes(n_layers, n_kv_heads, head_dim, block_size, n_blocks, dtype,
                                   bits)
        self.codes = torch.zeros(self._shapes["codes"][0], dtype=self._shapes["codes"][1],
                                 device=self.device)
        self.scales = torch.zeros(self._shapes["scales"][0], dtype=SCALE_DTYPE,
                                  device=self.device)
        self.rotation = rotation(head_dim, self.device)

    @staticmethod
    def shapes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, n_blocks: int,
               dtype: torch.dtype, bits: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The stored tensors' shapes and dtypes for ``n_blocks`` blocks (also what a parked
        copy of that many blocks holds)."""
        qmax(bits)
        if bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit KV packs pairs along head_dim; {head_dim} is odd")
        width = head_dim if bits == 8 else head_dim // 2
        code_dtype = torch.int8 if bits == 8 else torch.uint8
        return {"codes": ((n_layers, 2, n_blocks, block_size, n_kv_heads, width), code_dtype),
                "scales": ((n_layers, 2, n_blocks, n_kv_heads), SCALE_DTYPE)}

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, bits: int,
                        block_size: int) -> float:
        """K and V bytes per token, the scales' share included."""
        scale_bytes = SCALE_DTYPE.itemsize / block_size
        return 2 * n_layers * n_kv_heads * (head_dim * bits / 8 + scale_bytes)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def write(self, layer: int, kv: int, plan: WritePlan, x: Tensor) -> None:
        """Requantize the blocks ``plan`` touches with the new rows ``x [T, H, D]`` in them
        (the scheme is in the module docstring)."""
        codes, scales = self.codes[layer, kv], self.scales[layer, kv]
        bs = self.block_size
        n_w = plan.blocks.numel()
        old_scale = scales[plan.blocks]                                     # [W, H]
        buf = dequantize(codes[plan.blocks], old_scale, self.bits, torch.float32)
        h, d = buf.shape[-2:]
        buf = buf.reshape(n_w * bs, h, d)
        buf.index_copy_(0, plan.local, x.to(torch.float32) @ self.rotation)
        buf = buf.view(n_w, bs, h, d)
        valid = torch.arange(bs, device=buf.device)[None, :] < plan.fill[:, None]
        buf = buf * valid[:, :, None, None]
        fresh = buf.abs().amax(dim=(1, 3)) / qmax(self.bits)                # [W, H]
        scale = torch.where(plan.prior[:, None], torch.maximum(old_scale, fresh), fresh)
        codes.index_copy_(0, plan.blocks, quantize(buf, scale, self.bits))
        scales.index_copy_(0, plan.blocks, scale)

    def read(self, layer: int, kv: int, block_ids: Tensor) -> Tensor:
        """Dequantized ``[*block_ids.shape, bs, H, D]`` of just those blocks, rotated."""
        return dequantize(self.codes[layer, kv][block_ids], self.scales[layer, kv][block_ids],
                          self.bits, self.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: ``dst`` gets ``src``'s codes and scales in every layer."""
        self.codes[:, :, dst] = self.codes[:, :, src]
        self.scales[:, :, dst] = self.scales[:, :, src]

    def export(self, blocks: list[int]) -> dict[str, Tensor]:
        """Host copies of those blocks in stored form (codes stay codes)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return {"codes": self.codes[:, :, idx].cpu(), "scales": self.scales[:, :, idx].cpu()}

    def load(self, blocks: list[int], tensors: dict[str, Tensor]) -> None:
        """Write exported tensors back into ``blocks`` (shapes checked by the caller)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.codes[:, :, idx] = tensors["codes"].to(self.device)
        self.scales[:, :, idx] = tensors["scales"].to(self.device)

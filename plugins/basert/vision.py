"""The vision half of a SmolVLM / Idefics3 in PyTorch: an image tile to its embedding rows; and
the entry points for either vision family basert serves (LLaVA-NeXT's tower is
:mod:`.llava_next`'s: :func:`read_shape`, :func:`load` and :func:`encoder` hand its directory
there).

The tower is SigLIP's ViT as transformers' ``Idefics3VisionTransformer`` runs it: a strided
convolution cuts the tile into ``patch_size`` patches (one hidden vector each), a learned position
embedding is added per patch (a whole tile's patches take positions 0 … n-1, row-major: the
fractional bucketing transformers does for padded tiles reduces to that), then ``n_layers``
pre-LayerNorm encoder blocks (bidirectional multi-head attention with biases, and an MLP with
GELU's tanh approximation, ``gelu_pytorch_tanh``), then a final LayerNorm. The connector
(``Idefics3Connector``) pixel-shuffles the patch grid by ``scale_factor`` (each ``s × s`` block of
neighbouring patches becomes one row ``s²`` times as wide, so the language model sees ``s²``
times fewer rows) and projects each row to the language model's width with one Linear without
bias. Those rows stand in the prompt where the image's placeholders are (core/media.py).

Weights come from either file a SmolVLM ships as (an mmproj GGUF or the Hugging Face directory,
read and checked by :mod:`.vision_files`, which also holds the processor's settings).

An image reaches the engine resized as the processor's first step resizes it (the front end's);
:func:`encoder` cuts it into the processor's tiles and global image
(:meth:`superfluid.core.image_tiles.Tiling.tiles`), runs the tower over all of them in one batch,
and gives their rows in that order: every tile's, then the global image's, which is the order
``core.media.VisionInfo.place`` lays the spans out in, and transformers' order."""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from superfluid.core.errors import ConfigError
from superfluid.core.image_tiles import normalise
from superfluid.core.media import Image

from . import llava_next, unfilled
from . import vision_files as files
from .vision_files import (HF_TYPES, PROJECTORS, VisionShape, expected_shapes, hf_config, not_served,  # noqa: F401
                           source)

# ---- the module -----------------------------------------------------------------------------------

class VisionLayer(nn.Module):
    """One SigLIP encoder block: x + attn(ln1(x)), then x + fc2(gelu_tanh(fc1(ln2(x))))."""

    def __init__(self, vs: VisionShape) -> None:
        super().__init__()
        h = vs.hidden_size
        self.ln1 = nn.LayerNorm(h, eps=vs.layer_norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln2 = nn.LayerNorm(h, eps=vs.layer_norm_eps)
        self.fc1 = nn.Linear(h, vs.intermediate_size)
        self.fc2 = nn.Linear(vs.intermediate_size, h)
        self.n_heads = vs.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.ln1(x)
        q, k, v = (proj(y).view(b, t, self.n_heads, h // self.n_heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        # every patch sees every patch (no mask: a whole tile, no padding); scale head_dim ** -0.5
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[B, side², D] patch rows -> [B, (side/s)², D·s²], exactly as transformers'
    ``Idefics3Connector.pixel_shuffle`` orders it: output rows run over the ``s × s`` blocks of
    the patch grid row-major, and a block's row is its patches' vectors concatenated row-major
    within the block (top-left, top-right, …, bottom-right for s = 2). The projection's input
    columns were trained in that order, so any other order is a different model."""
    b, seq, d = x.shape
    side = math.isqrt(seq)
    x = x.reshape(b, side, side // s, d * s)                 # s horizontal neighbours side by side
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(b, side // s, side // s, d * s * s)        # then s vertical neighbours of those
    x = x.permute(0, 2, 1, 3)
    return x.reshape(b, seq // (s * s), d * s * s)


class VisionTower(nn.Module):
    """The tower and the connector: ``forward`` takes normalised tiles [B, 3, H, W] and gives
    their embedding rows [B, rows, out_size] in the language model's input space."""

    def __init__(self, vs: VisionShape) -> None:
        super().__init__()
        self.shape = vs
        h = vs.hidden_size
        self.patch = nn.Conv2d(3, h, kernel_size=vs.patch_size, stride=vs.patch_size)
        self.pos = unfilled.embedding(vs.n_patches, h)
        self.layers = nn.ModuleList(VisionLayer(vs) for _ in range(vs.n_layers))
        self.post_ln = nn.LayerNorm(h, eps=vs.layer_norm_eps)
        self.proj = nn.Linear(h * vs.scale_factor ** 2, vs.out_size, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The encoder's output before the connector: [B, n_patches, hidden]."""
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # [B, n_patches, hidden], patches row-major
        x = x + self.pos.weight[None, :x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.post_ln(x)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_shuffle(self.features(pixels), self.shape.scale_factor))


def build(vs, tensors: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype,
          tower_class: type[nn.Module] = VisionTower) -> nn.Module:
    """A ``tower_class(vs)`` (SmolVLM's, or LLaVA-NeXT's) holding ``tensors`` (checked, internal
    names, on the CPU) on ``device`` in ``dtype``, built on the meta device so no random init is
    allocated."""
    with torch.device("meta"):
        tower = tower_class(vs)
    tower.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, strict=True, assign=True)
    for p in tower.parameters():
        p.requires_grad_(False)
    return tower.eval()


def tile_encoder(tower: VisionTower) -> Callable[[Image], np.ndarray]:
    """An image (resized as the front end resizes it) -> its ``tiles × rows`` by ``out_size``
    float32 embedding rows, tiles then global image: what ``core.media.EncoderCache`` calls,
    once per distinct image."""
    vs = tower.shape
    device = tower.proj.weight.device

    def encode(image: Image) -> np.ndarray:
        tiles = vs.tiles(image)
        pixels = torch.from_numpy(normalise(tiles, vs.mean, vs.std)).to(device=device, dtype=tower.dtype)
        with torch.inference_mode():
            rows = tower(pixels)
        return rows.reshape(-1, rows.shape[-1]).float().cpu().numpy()

    return encode


# ---- either family ----------------------------------------------------------------------------------

def _llava_next(src: str) -> dict | None:
    """A LLaVA-NeXT directory's config (its vision half is :mod:`.llava_next`'s); else None."""
    if os.path.isdir(src):
        config = hf_config(src)
        if config.get("model_type") == llava_next.HF_TYPE:
            return config
    return None


def read_shape(src: str, *, name: str) -> VisionShape | llava_next.LlavaNextShape:
    """The vision half's shape (no tensor read): SmolVLM's from either file, LLaVA-NeXT's."""
    config = _llava_next(src)
    return llava_next.read_shape(src, config, name) if config is not None else files.read_shape(src, name=name)


def read(src: str, *, name: str):
    """(shape, checked float32 CPU tensors by internal name) of the vision half in ``src``."""
    config = _llava_next(src)
    return llava_next.read(src, config, name) if config is not None else files.read(src, name=name)


def load(src: str, *, name: str, device: torch.device | str, dtype: torch.dtype,
         out_size: int | None = None) -> VisionTower | llava_next.LlavaNextTower:
    """The tower from ``src`` on ``device``; ``out_size``: the language model's width, which the
    connector must give (a mismatched mmproj is a ConfigError, not a crash at the first image)."""
    vs, tensors = read(src, name=name)
    if out_size is not None and vs.out_size != out_size:
        raise ConfigError(f"model {name!r}: the vision half in {src} gives {vs.out_size}-wide rows, the language "
                          f"model takes {out_size}-wide ones (mmproj of another model?)")
    if isinstance(vs, llava_next.LlavaNextShape):
        return build(vs, tensors, device, dtype, llava_next.LlavaNextTower)
    return build(vs, tensors, device, dtype)


def encoder(tower) -> Callable[[Image], np.ndarray]:
    """The image encoder of either tower: what ``core.media.EncoderCache`` calls."""
    if isinstance(tower, llava_next.LlavaNextTower):
        return llava_next.encoder(tower)
    return tile_encoder(tower)



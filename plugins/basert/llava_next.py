"""The vision half of a LLaVA-NeXT (llava-v1.6) in PyTorch, from its Hugging Face directory: an
image to the packed embedding rows transformers' ``LlavaNextModel.get_image_features`` gives.

The tower is CLIP's ViT as transformers' ``CLIPVisionTransformer`` runs it: a strided
convolution without bias cuts each crop into patches, a learned CLS embedding goes first, a
learned position embedding is added (CLS at 0, patches row-major), a LayerNorm *before* the
encoder (``pre_layrnorm``), then pre-LayerNorm blocks (attention with biases, an MLP with the
config's activation, ``quick_gelu`` for the released models). LLaVA-NeXT takes the hidden state
after ``vision_feature_layer`` (-2: the second-last block's output; the final LayerNorm is never
applied), drops CLS (the ``"default"`` strategy) and projects each patch with a 2-layer MLP.

The crops are the processor's (:func:`superfluid.core.anyres_pixels.crops`: the base image, then
the best pinpoint's tiles). Packing (transformers' ``pack_image_features``): the base image's
rows, then the tiles' patch grids stitched into one feature map, cut to the image's own aspect
(the rows or columns over padding dropped, :meth:`AnyRes.layout`), with the learned
``image_newline`` after each of its rows. The rows fill one span
(``VisionInfo.anyres``): the processor writes nothing between them."""

from __future__ import annotations

import os
from typing import Callable

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from superfluid.core.anyres import AnyRes
from superfluid.core.anyres_pixels import crops
from superfluid.core.errors import ConfigError
from superfluid.core.image_tiles import normalise, read_preprocessor
from superfluid.core.media import Image, VisionInfo

from . import unfilled

HF_TYPE = "llava_next"
_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


@attrs.define(frozen=True)
class LlavaNextShape:
    """Every number the tower, projector and packing need, from ``config.json`` and the
    processor's settings."""

    rule: AnyRes             # the processor's tiles and the packing's layout
    hidden_size: int
    intermediate_size: int
    n_layers: int            # blocks run: up to the hidden state vision_feature_layer names
    n_heads: int
    layer_norm_eps: float
    act: str                 # the tower's MLP activation
    projector_act: str
    projector_bias: bool
    out_size: int            # the language model's width
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def image_size(self) -> int:
        return self.rule.tile

    @property
    def rows(self) -> int:
        """The base image's rows (an image gives more: :meth:`AnyRes.image_rows`)."""
        return self.rule.layout(self.rule.tile, self.rule.tile).base

    def layout(self, token_id: Callable[[str], int | None]) -> VisionInfo:
        """One span of placeholders an image, as many as the processor writes ``<image>``."""
        return VisionInfo(tile=self.rule.tile, rows=self.rows, family="llava_next", anyres=self.rule)


def read_shape(path: str, config: dict, name: str) -> LlavaNextShape:
    """The shape from a LLaVA-NeXT directory's config and processor settings (no tensor read)."""
    vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
    if str(vision.get("model_type", "clip_vision_model")) != "clip_vision_model":
        raise ConfigError(f"model {name!r}: LLaVA-NeXT with a {vision.get('model_type')} tower; basert implements "
                          "the CLIP one")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ConfigError(f"model {name!r}: vision_feature_layer {layer!r} (several layers) is not implemented")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ConfigError(f"model {name!r}: vision_feature_select_strategy {strategy!r} is not implemented (default)")
    for key, act in (("vision_config.hidden_act", vision.get("hidden_act", "quick_gelu")),
                     ("projector_hidden_act", config.get("projector_hidden_act", "gelu"))):
        if act not in _ACTS:
            raise ConfigError(f"model {name!r}: {key} {act!r} is not one basert implements ({', '.join(_ACTS)})")
    pre = read_preprocessor(path) or {}
    try:
        total = int(vision["num_hidden_layers"])
        used = layer if layer >= 0 else total + 1 + layer  # hidden_states[0] is the embeddings
        if not 0 <= used <= total:
            raise ValueError(f"vision_feature_layer {layer} of a {total}-layer tower")
        pinpoints = pre.get("image_grid_pinpoints") or config["image_grid_pinpoints"]
        rule = AnyRes.from_config(pinpoints, tile=int(vision["image_size"]), patch=int(vision["patch_size"]))
        crop = (pre.get("crop_size") or {}).get("height", rule.tile)
        if int(crop) != rule.tile:
            raise ValueError(f"the processor's {crop}-pixel crops are not the tower's {rule.tile}-pixel tiles")
        return LlavaNextShape(
            rule=rule, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            n_layers=used, n_heads=int(vision["num_attention_heads"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)), act=vision.get("hidden_act", "quick_gelu"),
            projector_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=bool(config.get("multimodal_projector_bias", True)), out_size=int(text["hidden_size"]),
            mean=tuple(map(float, pre.get("image_mean") or (0.48145466, 0.4578275, 0.40821073))),
            std=tuple(map(float, pre.get("image_std") or (0.26862954, 0.26130258, 0.27577711))))
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"model {name!r}: {path}: unusable LLaVA-NeXT vision or processor config ({exc})") from None


class ClipLayer(nn.Module):
    """One CLIP encoder block: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, vs: LlavaNextShape) -> None:
        super().__init__()
        h = vs.hidden_size
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=vs.layer_norm_eps), nn.LayerNorm(h, eps=vs.layer_norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, vs.intermediate_size), nn.Linear(vs.intermediate_size, h)
        self.n_heads, self.act = vs.n_heads, _ACTS[vs.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.ln1(x)
        q, k, v = (proj(y).view(b, t, self.n_heads, h // self.n_heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class LlavaNextTower(nn.Module):
    """CLIP up to the feature layer, the projector and the learned newline: ``forward`` takes
    normalised crops [B, 3, tile, tile] and gives their projected patch rows [B, side², out]."""

    def __init__(self, vs: LlavaNextShape) -> None:
        super().__init__()
        self.shape = vs
        h, p, side = vs.hidden_size, vs.rule.patch, vs.rule.side
        self.patch = nn.Conv2d(3, h, kernel_size=p, stride=p, bias=False)
        self.cls = nn.Parameter(torch.empty(h))
        self.pos = unfilled.embedding(side * side + 1, h)
        self.pre_ln = nn.LayerNorm(h, eps=vs.layer_norm_eps)
        self.layers = nn.ModuleList(ClipLayer(vs) for _ in range(vs.n_layers))
        self.proj1 = nn.Linear(h, vs.out_size, bias=vs.projector_bias)
        self.proj2 = nn.Linear(vs.out_size, vs.out_size, bias=vs.projector_bias)
        self.newline = nn.Parameter(torch.empty(vs.out_size))

    @property
    def dtype(self) -> torch.dtype:
        return self.proj2.weight.dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], dim=1) + self.pos.weight[None]
        x = self.pre_ln(x)
        for layer in self.layers:
            x = layer(x)
        x = x[:, 1:]  # the "default" strategy: CLS dropped
        return self.proj2(_ACTS[self.shape.projector_act](self.proj1(x)))


def pack(feats: torch.Tensor, rule: AnyRes, width: int, height: int, newline: torch.Tensor) -> torch.Tensor:
    """[1 + tiles, side², D] projected rows of the base image and the tiles -> the image's
    packed rows: the base image's, then the stitched grid cut to the image's aspect with a
    newline after each row (``rule.image_rows(width, height)`` rows)."""
    grid = rule.layout(width, height)
    across, down = grid.tiles
    side, d = rule.side, feats.shape[-1]
    tiles = feats[1:].reshape(down, across, side, side, d)
    full = tiles.permute(0, 2, 1, 3, 4).reshape(down * side, across * side, d)  # [rows, cols, D]
    cols, rows = grid.grid
    top, left = (full.shape[0] - rows) // 2, (full.shape[1] - cols) // 2
    kept = full[top:top + rows, left:left + cols]
    kept = torch.cat([kept, newline.expand(rows, 1, d)], dim=1).reshape(-1, d)
    return torch.cat([feats[0], kept], dim=0)


def expected(vs: LlavaNextShape) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Internal name -> (the HF checkpoint's name, shape) of every tensor the tower holds."""
    h, ff, p, o, n = vs.hidden_size, vs.intermediate_size, vs.rule.patch, vs.out_size, vs.rule.side ** 2 + 1
    enc = "vision_tower."
    out = {"patch.weight": (enc + "embeddings.patch_embedding.weight", (h, 3, p, p)),
           "cls": (enc + "embeddings.class_embedding", (h,)),
           "pos.weight": (enc + "embeddings.position_embedding.weight", (n, h)),
           "pre_ln.weight": (enc + "pre_layrnorm.weight", (h,)), "pre_ln.bias": (enc + "pre_layrnorm.bias", (h,)),
           "proj1.weight": ("multi_modal_projector.linear_1.weight", (o, h)),
           "proj2.weight": ("multi_modal_projector.linear_2.weight", (o, o)),
           "newline": ("image_newline", (o,))}
    if vs.projector_bias:
        out["proj1.bias"] = ("multi_modal_projector.linear_1.bias", (o,))
        out["proj2.bias"] = ("multi_modal_projector.linear_2.bias", (o,))
    parts = {"ln1": ("layer_norm1", (h,), (h,)), "ln2": ("layer_norm2", (h,), (h,)),
             "q": ("self_attn.q_proj", (h, h), (h,)), "k": ("self_attn.k_proj", (h, h), (h,)),
             "v": ("self_attn.v_proj", (h, h), (h,)), "o": ("self_attn.out_proj", (h, h), (h,)),
             "fc1": ("mlp.fc1", (ff, h), (ff,)), "fc2": ("mlp.fc2", (h, ff), (h,))}
    for i in range(vs.n_layers):
        for ours, (theirs, w, b) in parts.items():
            out[f"layers.{i}.{ours}.weight"] = (f"{enc}encoder.layers.{i}.{theirs}.weight", w)
            out[f"layers.{i}.{ours}.bias"] = (f"{enc}encoder.layers.{i}.{theirs}.bias", b)
    return out


def _aliases(key: str) -> tuple[str, ...]:
    """A checkpoint name as transformers 5 saves it, as llava-hf's checkpoints (saved by
    transformers 4, whose CLIP tower sat in a ``vision_model`` wrapper) write it, and under
    ``model.``."""
    names = [key]
    if key.startswith("vision_tower."):
        names.append("vision_tower.vision_model." + key[len("vision_tower."):])
    return (*names, *("model." + n for n in names))


def read(path: str, config: dict, name: str) -> tuple[LlavaNextShape, dict[str, torch.Tensor]]:
    """(shape, checked float32 CPU tensors by internal name), every name and shape checked
    before a tensor is read."""
    from safetensors import safe_open

    vs = read_shape(path, config, name)
    where: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        full = os.path.join(path, file)
        with safe_open(full, framework="pt") as st:
            for key in st.keys():
                where[key] = (full, tuple(st.get_slice(key).get_shape()))
    chosen: dict[str, tuple[str, str]] = {}
    for ours, (theirs, want) in expected(vs).items():
        hit = next((k for k in _aliases(theirs) if k in where), None)
        if hit is None:
            raise ConfigError(f"model {name!r}: vision tensor {theirs} is missing from {path}")
        if where[hit][1] != want:
            raise ConfigError(f"model {name!r}: vision tensor {hit} in {path} has shape {where[hit][1]}, "
                              f"this tower needs {want}")
        chosen[ours] = (where[hit][0], hit)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({f for f, _ in chosen.values()}):
        with safe_open(file, framework="pt") as st:
            for ours, (f, key) in chosen.items():
                if f == file:
                    tensors[ours] = st.get_tensor(key).float().contiguous()
    return vs, tensors


def encoder(tower: LlavaNextTower) -> Callable[[Image], np.ndarray]:
    """An image as sent -> its packed ``rule.image_rows(w, h)`` by ``out_size`` float32 rows."""
    vs = tower.shape
    device = tower.proj2.weight.device

    def encode(image: Image) -> np.ndarray:
        pixels = torch.from_numpy(normalise(crops(image, vs.rule), vs.mean, vs.std)).to(device=device,
                                                                                         dtype=tower.dtype)
        with torch.inference_mode():
            rows = pack(tower(pixels), vs.rule, image.width, image.height, tower.newline)
        return rows.float().cpu().numpy()

    return encode

"""Where basert's vision half (SmolVLM / Idefics3) comes from, and its shape: a llama.cpp mmproj
GGUF (``v.*`` and ``mm.model.fc.weight``, keys ``clip.vision.*``) beside a text GGUF, or the
Hugging Face directory (``model.vision_model.*`` and
``model.connector.modality_projection.proj.weight``). Both are read into one set of internal
names (:mod:`.vision`'s tower's) and checked (names and shapes) before any tensor is read, as
:mod:`.weights` does for the language half, so a wrong file fails naming the tensor.

The shape includes the image processor's settings (:class:`superfluid.core.image_tiles.Tiling`):
how an image is resized and split into tiles. An HF directory's come from its
``preprocessor_config.json`` (or the ``image_processor`` of transformers 5's
``processor_config.json``), an mmproj's from its metadata (``clip.vision.preproc_image_size``),
as llama.cpp's mtmd reads them."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import attrs
import numpy as np
import torch

from superfluid.core.errors import ConfigError
from superfluid.core.image_tiles import Tiling, from_mmproj, from_preprocessor, read_preprocessor
from superfluid.core.media import Image, VisionInfo, idefics3_layout
from superfluid.plugins import vision_families as families
from superfluid.plugins.gguf_file import GgufFile

#: mmproj projector types this tower implements (llama.cpp's ``clip.projector_type``)
PROJECTORS = ("idefics3",)
#: HF ``model_type`` of the multimodal models whose vision half basert implements (LLaVA-NeXT's
#: is :mod:`.llava_next`'s, which :mod:`.vision` hands its directories to)
HF_TYPES = ("idefics3", "llava_next")


@attrs.define(frozen=True)
class VisionShape:
    """Every number the tower needs, from an mmproj's metadata or an HF config."""

    image_size: int          # the tile's side in pixels
    patch_size: int
    hidden_size: int         # the tower's width
    intermediate_size: int   # its MLP's
    n_layers: int
    n_heads: int
    layer_norm_eps: float
    scale_factor: int        # the connector's pixel shuffle
    out_size: int            # an embedding row's width: the language model's hidden size
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    tiling: Tiling | None = None  # the processor's resize and split (None: an image is squeezed to a tile)

    def __attrs_post_init__(self) -> None:
        # a tile that is not a whole number of patches keeps the whole ones, as the patch
        # convolution does (SmolVLM-Instruct's SigLIP: 384 px in 14-px patches, 27 a side)
        side = self.image_size // self.patch_size
        if side == 0:
            raise ValueError(f"image size {self.image_size} is smaller than one {self.patch_size}-pixel patch")
        if side % self.scale_factor:
            raise ValueError(f"{side} patches a side do not pixel-shuffle by {self.scale_factor}")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"vision width {self.hidden_size} is not a multiple of {self.n_heads} heads")

    @property
    def side(self) -> int:
        """Patches along a side of the tile."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.side * self.side

    @property
    def rows(self) -> int:
        """Embedding rows an image gives (the prompt positions it fills)."""
        return self.n_patches // (self.scale_factor * self.scale_factor)

    def layout(self, token_id: Callable[[str], int | None]) -> VisionInfo:
        """How a prompt holds an image of this tower (SmolVLM's tokens around its tiles' rows)."""
        return idefics3_layout(self.image_size, self.patch_size, self.scale_factor, token_id, self.tiling)

    def tiles(self, image: Image) -> np.ndarray:
        """The image's tiles and global image (``n × tile × tile × 3`` uint8) as the processor
        cuts them; without processor settings, the image itself, which the front end squeezed to
        the tile."""
        if self.tiling is not None:
            return self.tiling.tiles(image)
        if (image.width, image.height) != (self.image_size, self.image_size):
            raise ValueError(f"a {image.width}x{image.height} image reached a vision tower of "
                             f"{self.image_size}-pixel tiles without processor settings")
        return image.array()[None]


def expected_shapes(vs: VisionShape) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower holds, by internal name (:class:`VisionTower`'s parameter names)."""
    h, ff, p = vs.hidden_size, vs.intermediate_size, vs.patch_size
    out: dict[str, tuple[int, ...]] = {
        "patch.weight": (h, 3, p, p), "patch.bias": (h,), "pos.weight": (vs.n_patches, h),
        "post_ln.weight": (h,), "post_ln.bias": (h,),
        "proj.weight": (vs.out_size, h * vs.scale_factor ** 2)}
    for i in range(vs.n_layers):
        b = f"layers.{i}."
        for norm in ("ln1", "ln2"):
            out[b + norm + ".weight"] = out[b + norm + ".bias"] = (h,)
        for lin in ("q", "k", "v", "o"):
            out[b + lin + ".weight"], out[b + lin + ".bias"] = (h, h), (h,)
        out.update({b + "fc1.weight": (ff, h), b + "fc1.bias": (ff,), b + "fc2.weight": (h, ff), b + "fc2.bias": (h,)})
    return out


# ---- where the vision half is -----------------------------------------------------------------------

def source(model_path: str, mmproj: str | None) -> str | None:
    """The file the vision half loads from: ``mmproj`` (an mmproj GGUF) when there is one, else a
    Hugging Face directory whose config has a vision half; None for a text-only model."""
    if mmproj:
        return mmproj
    if os.path.isdir(model_path) and hf_config(model_path).get("vision_config") is not None:
        return model_path
    return None


def not_served(src: str, *, name: str) -> tuple[str, str] | None:
    """(family, the file's evidence) of a vision half this tower does not implement (a Gemma 3
    or Qwen-VL directory or mmproj); None for one it does, or may (:func:`read_shape` checks it).
    The engine then serves the language half alone and refuses images naming the family."""
    if os.path.isdir(src):
        kind = str(hf_config(src).get("model_type") or "")
        return None if kind in HF_TYPES else (families.family(kind), f"model_type {kind}")
    meta = _open_mmproj(src, name).fields
    projector = meta.get("clip.projector_type")
    if projector is None or projector in PROJECTORS:
        return None
    if projector == "mlp" and meta.get("clip.vision.image_grid_pinpoints") is not None:  # a LLaVA-NeXT's
        return families.family("llava_next"), "projector mlp with image_grid_pinpoints"
    return families.family(str(projector), families.PROJECTOR_FAMILIES), f"projector {projector}"


def read_shape(src: str, *, name: str) -> VisionShape:
    """The tower's shape from an mmproj's metadata or an HF directory's config (no tensor read)."""
    if os.path.isdir(src):
        return _hf_shape(src, name)
    return _mmproj_shape(_open_mmproj(src, name).fields, src, name)


def read(src: str, *, name: str) -> tuple[VisionShape, dict[str, torch.Tensor]]:
    """(shape, checked float32 CPU tensors by internal name) of the vision half in ``src``."""
    if os.path.isdir(src):
        return _read_hf(src, name)
    return _read_mmproj(src, name)


def _check(name: str, src: str, vs: VisionShape, found: dict[str, tuple[int, ...]],
           names: dict[str, str]) -> None:
    for key, want in expected_shapes(vs).items():
        got = found.get(names[key])
        if got is None:
            raise ConfigError(f"model {name!r}: vision tensor {names[key]} is missing from {src}")
        if tuple(got) != want:
            raise ConfigError(f"model {name!r}: vision tensor {names[key]} in {src} has shape {tuple(got)}, "
                              f"this tower needs {want}")


# ---- HF directory ---------------------------------------------------------------------------------

def hf_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _hf_names(vs: VisionShape) -> dict[str, str]:
    enc = "model.vision_model."
    names = {"patch.weight": enc + "embeddings.patch_embedding.weight",
             "patch.bias": enc + "embeddings.patch_embedding.bias",
             "pos.weight": enc + "embeddings.position_embedding.weight",
             "post_ln.weight": enc + "post_layernorm.weight", "post_ln.bias": enc + "post_layernorm.bias",
             "proj.weight": "model.connector.modality_projection.proj.weight"}
    parts = {"ln1": "layer_norm1", "ln2": "layer_norm2", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    for i in range(vs.n_layers):
        for ours, theirs in parts.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"{enc}encoder.layers.{i}.{theirs}.{kind}"
    return names


def _hf_shape(path: str, name: str) -> VisionShape:
    config = hf_config(path)
    model_type = config.get("model_type")
    vision = config.get("vision_config")
    if vision is None:
        raise ConfigError(f"model {name!r}: {path} has no vision half (no vision_config)")
    if model_type not in HF_TYPES:
        raise ConfigError(f"model {name!r}: vision model {model_type!r} is not one basert implements "
                          f"({', '.join(HF_TYPES)}: SmolVLM / Idefics3)")
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"model {name!r}: vision activation {act!r} is not supported (gelu_pytorch_tanh)")
    if int(vision.get("num_channels", 3)) != 3:
        raise ConfigError(f"model {name!r}: the vision half takes {vision['num_channels']} channels, not RGB")
    text = config.get("text_config") or {}
    mean = std = (0.5, 0.5, 0.5)  # SigLIP's, also transformers' default for Idefics3
    pre = read_preprocessor(path)
    tiling = None
    try:
        if pre is not None:
            mean, std = tuple(pre.get("image_mean") or mean), tuple(pre.get("image_std") or std)
            tiling = from_preprocessor(pre, int(vision["image_size"]))
        return VisionShape(
            image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
            hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            n_layers=int(vision["num_hidden_layers"]), n_heads=int(vision["num_attention_heads"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)), scale_factor=int(config.get("scale_factor", 2)),
            out_size=int(text["hidden_size"]), mean=tuple(map(float, mean)), std=tuple(map(float, std)),
            tiling=tiling)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"model {name!r}: {path}: unusable vision or image processor config ({exc})") from None


def _read_hf(path: str, name: str) -> tuple[VisionShape, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    vs = _hf_shape(path, name)
    names = _hf_names(vs)
    wanted = set(names.values())
    where: dict[str, str] = {}
    found: dict[str, tuple[int, ...]] = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        full = os.path.join(path, file)
        with safe_open(full, framework="pt") as st:
            for key in st.keys():
                if key in wanted:
                    where[key] = full
                    found[key] = tuple(st.get_slice(key).get_shape())
    _check(name, path, vs, found, names)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(where.values())):
        with safe_open(file, framework="pt") as st:
            for key, src in names.items():
                if where[src] == file:
                    tensors[key] = st.get_tensor(src).float().contiguous()
    return vs, tensors


# ---- mmproj GGUF ----------------------------------------------------------------------------------

def _gguf_names(vs: VisionShape) -> dict[str, str]:
    names = {"patch.weight": "v.patch_embd.weight", "patch.bias": "v.patch_embd.bias",
             "pos.weight": "v.position_embd.weight", "post_ln.weight": "v.post_ln.weight",
             "post_ln.bias": "v.post_ln.bias", "proj.weight": "mm.model.fc.weight"}
    parts = {"ln1": "ln1", "ln2": "ln2", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_out",
             "fc1": "ffn_up", "fc2": "ffn_down"}
    for i in range(vs.n_layers):
        for ours, theirs in parts.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"v.blk.{i}.{theirs}.{kind}"
    return names


def _open_mmproj(path: str, name: str) -> GgufFile:
    try:
        return GgufFile(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model {name!r}: cannot read mmproj {path}: {exc}") from None


def _mmproj_shape(meta: dict[str, Any], path: str, name: str) -> VisionShape:
    projector = meta.get("clip.projector_type")
    if not meta.get("clip.has_vision_encoder") or projector is None:
        raise ConfigError(f"model {name!r}: {path} is not a vision mmproj (no clip vision encoder)")
    if projector not in PROJECTORS:
        raise ConfigError(f"model {name!r}: mmproj projector {projector!r} is not one basert implements "
                          f"({', '.join(PROJECTORS)}: SmolVLM / Idefics3)")
    if meta.get("clip.use_silu"):
        raise ConfigError(f"model {name!r}: mmproj {path} uses SiLU; the Idefics3 tower is GELU (tanh)")

    def get(key: str):
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise ConfigError(f"model {name!r}: mmproj {path} lacks clip.vision.{key}")
        return value

    mean = meta.get("clip.vision.image_mean") or (0.5, 0.5, 0.5)
    std = meta.get("clip.vision.image_std") or (0.5, 0.5, 0.5)
    try:
        return VisionShape(
            image_size=int(get("image_size")), patch_size=int(get("patch_size")),
            hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
            n_layers=int(get("block_count")), n_heads=int(get("attention.head_count")),
            layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon") or 1e-6),
            scale_factor=int(meta.get("clip.vision.projector.scale_factor") or 2),
            out_size=int(get("projection_dim")), mean=tuple(map(float, mean)), std=tuple(map(float, std)),
            tiling=from_mmproj(meta, int(get("image_size"))))
    except ValueError as exc:
        raise ConfigError(f"model {name!r}: mmproj {path}: {exc}") from None


def _read_mmproj(path: str, name: str) -> tuple[VisionShape, dict[str, torch.Tensor]]:
    from .weights import GGUF_TYPES

    mmproj = _open_mmproj(path, name)
    vs = _mmproj_shape(mmproj.fields, path, name)
    try:
        tensors = mmproj.tensors
    except ValueError as exc:
        raise ConfigError(f"model {name!r}: cannot read mmproj {path}: {exc}") from None
    # numpy's order is ggml's reversed: a Linear is [out, in], the patch conv [out, 3, p, p]
    found = {n: t.array_shape for n, t in tensors.items()}
    names = _gguf_names(vs)
    _check(name, path, vs, found, names)
    out: dict[str, torch.Tensor] = {}
    for key, src in names.items():
        qtype = tensors[src].tensor_type
        if qtype.name not in GGUF_TYPES:
            raise ConfigError(f"model {name!r}: mmproj tensor {src} has quantization type {qtype.name}, which "
                              f"basert does not read (it reads {', '.join(GGUF_TYPES)})")
        w = np.array(tensors[src].dequantize(), dtype=np.float32)  # a copy: the map is read-only
        out[key] = torch.from_numpy(w)
    return vs, out

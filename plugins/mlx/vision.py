"""Images on MLX: a SmolVLM / Idefics3 Hugging Face directory, its vision half through mlx-vlm.

mlx-vlm (the optional extra ``superfluid[mlx-vlm]``) reads the directory: its weight names, its
quantization and SigLIP's patch-embedding layout are its own business. Of the model it builds
only the vision tower and the connector are used, to encode an image (resized by the front end
as the processor's first step resizes it) into its embedding rows (:class:`Encoder`): the image
is cut into the processor's tiles and global image (``preprocessor_config.json``'s settings,
:mod:`superfluid.core.image_tiles`), all encoded in one batch, their rows in that order. The language half is moved
into mlx-lm's own ``llama.Model`` (the same arrays, no copy), so it runs in the runner's tick
machinery exactly as a text model does (per-slot caches, batched decode, parking); the runner
feeds the image rows through mlx-lm's ``input_embeddings`` where the prompt holds placeholders.

The daemon side (:func:`layout`) reads only ``config.json`` and ``preprocessor_config.json``
and imports no MLX: it decides whether the directory has a vision half, whether it is served,
and how an image is laid out in a prompt. A Gemma 3 or Qwen-VL directory serves its language
half through mlx-lm's own classes, as text, and refuses images naming the family
(:func:`images_not_served`)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Callable

import numpy as np

from superfluid.core.errors import ConfigError
from superfluid.core.image_tiles import Tiling, from_preprocessor, normalise, read_preprocessor
from superfluid.core.media import Image, VisionInfo, idefics3_layout
from superfluid.plugins import vision_families as families

#: HF ``model_type`` of the vision-language directories served (SmolVLM is an Idefics3)
SERVED_TYPES = ("idefics3", "smolvlm")
#: vision-language types whose language half mlx-lm runs as a text model of its own (its
#: ``gemma3``, ``qwen2_vl``, ``qwen3_vl`` classes drop the vision weights): served for text only
TEXT_HALF_TYPES = ("gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: how to get mlx-vlm, for messages
INSTALL = "pip install 'superfluid[mlx-vlm]'"
DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)  # SmolVLM's, when the directory does not say


def _json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def hf_config(path: str) -> dict:
    """A model directory's ``config.json`` ({} for a file or an unreadable config)."""
    return _json(os.path.join(path, "config.json")) if os.path.isdir(path) else {}


def has_vision(path: str) -> bool:
    """Whether ``path`` is a Hugging Face directory whose model has a vision half."""
    return bool(hf_config(path).get("vision_config"))


def images_not_served(path: str) -> str | None:
    """Why the directory's model is served for text only (a family whose images MLX does not
    serve but whose language half mlx-lm runs), in the words the 400 for an image request
    gives; None for a text model, a vision model served, or one not served at all."""
    kind = str(hf_config(path).get("model_type") or "")
    if not has_vision(path) or kind not in TEXT_HALF_TYPES:
        return None
    return families.images_not_served("mlx", families.family(kind), f"model_type {kind}")


def check_text_half(model_name: str, path: str) -> None:
    """ConfigError for a language half mlx-lm's class cannot run: its Gemma 3 takes the global
    layer's mask from layer ``sliding_window_pattern - 1`` (a Gemma 3 with fewer layers fails at
    its first token, so it is refused at serve time instead)."""
    config = hf_config(path)
    if config.get("model_type") != "gemma3":
        return
    text = config.get("text_config") or {}
    layers = int(text.get("num_hidden_layers") or 0)
    pattern = int(text.get("sliding_window_pattern") or 6)  # mlx-lm's reading (and default)
    if layers < pattern:
        raise ConfigError(f"model {model_name!r}: {path}: " + families.not_loadable(
            "mlx", "Gemma 3", f"{layers} layers",
            f"mlx-lm's Gemma 3 needs a global layer every {pattern} layers and so at least {pattern}; "
            "serve it with --engine basert (text) or --engine llamacpp"))


def mlx_vlm_installed() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def layout(model_name: str, path: str, token_id: Callable[[str], int | None]) -> VisionInfo:
    """How the directory's model lays out an image (daemon side, no MLX import); ConfigError for
    a model type not served, a missing mlx-vlm, or a vocabulary without the image tokens."""
    config = hf_config(path)
    kind = str(config.get("model_type") or "")
    if kind not in SERVED_TYPES:
        raise ConfigError(f"model {model_name!r}: {path}: " + families.not_loadable(
            "mlx", families.family(kind), f"model_type {kind}",
            f"its images are served for {', '.join(SERVED_TYPES)} (SmolVLM / Idefics3) and its text for "
            f"{', '.join(TEXT_HALF_TYPES)}; llama.cpp serves the families it reads from a GGUF and mmproj"))
    if not mlx_vlm_installed():
        raise ConfigError(f"model {model_name!r}: {path} has a vision half, which the MLX engine runs through "
                          f"mlx-vlm, and mlx-vlm is not installed ({INSTALL})")
    vision = config["vision_config"]
    try:
        return idefics3_layout(int(vision.get("image_size", 224)), int(vision["patch_size"]),
                               int(config.get("scale_factor", 2)), token_id, tiling(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model {model_name!r}: {path}: {exc}") from None


def tiling(path: str) -> Tiling | None:
    """The directory's image processor settings (None: it has none, and an image is squeezed to
    one tile); ValueError for settings not served."""
    pre = read_preprocessor(path)
    if pre is None:
        return None
    return from_preprocessor(pre, int(hf_config(path)["vision_config"].get("image_size", 224)))


def text_facts(path: str) -> dict:
    """The language half's training context and width (a VLM's config nests them under
    ``text_config``, where a text model's tokenizer facts do not look)."""
    text = hf_config(path).get("text_config") or {}
    facts = {"n_ctx_train": int(text.get("max_position_embeddings") or 0), "n_embd": int(text.get("hidden_size") or 0)}
    return {k: v for k, v in facts.items() if v}


# ---- the worker side ------------------------------------------------------------------------------

class Encoder:
    """The vision tower and the connector of an mlx-vlm Idefics3 model: :meth:`__call__` turns an
    image (as the front end fitted it) into its ``tiles × rows`` by ``hidden`` float32 embedding
    rows, every tile's then the global image's."""

    def __init__(self, vlm, mean, std, tiling: Tiling | None = None):
        cfg = vlm.config.vision_config
        self.vision = vlm.vision_model
        self.connector = vlm.connector
        self.tile = int(cfg.image_size)
        self.patch = int(cfg.patch_size)
        self.mean, self.std = tuple(mean), tuple(std)
        self.tiling = tiling

    def __call__(self, image: Image) -> np.ndarray:
        import mlx.core as mx

        if self.tiling is not None:
            tiles = self.tiling.tiles(image)
        elif (image.width, image.height) == (self.tile, self.tile):
            tiles = image.array()[None]
        else:
            raise ValueError(f"a {image.width}x{image.height} image reached a vision tower of "
                             f"{self.tile}x{self.tile} tiles without processor settings")
        # mlx-vlm's convolution is channels-last: n × H × W × 3
        pixels = mx.array(normalise(tiles, self.mean, self.std).transpose(0, 2, 3, 1))
        side = self.tile // self.patch
        patches = mx.ones((len(tiles), side, side), dtype=mx.bool_)
        pooled, *_ = self.vision(pixels, patch_attention_mask=patches, output_hidden_states=True)
        rows = self.connector(pooled.astype(pixels.dtype))
        return np.array(rows.reshape(-1, rows.shape[-1]).astype(mx.float32))


def _language_half(vlm, rope: dict | None = None):
    """mlx-lm's ``llama.Model`` holding the VLM's language half (its arrays, quantized as mlx-vlm
    loaded them); ``rope``: the rope options' fields (rope_config.overrides)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from .loader import ModelLoadError

    tc = vlm.config.text_config
    if tc.model_type != "llama":
        raise ModelLoadError(f"the MLX engine runs a llama language half behind a vision tower, not {tc.model_type!r}")
    args = llama.ModelArgs(
        model_type="llama", hidden_size=tc.hidden_size, num_hidden_layers=tc.num_hidden_layers,
        intermediate_size=tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps, vocab_size=tc.vocab_size, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads,  # as mlx-vlm's attention computes it
        max_position_embeddings=tc.max_position_embeddings, rope_theta=tc.rope_theta,
        rope_traditional=tc.rope_traditional,
        tie_word_embeddings=False)  # mlx-vlm's language half always holds its own lm_head
    if rope:
        args = llama.ModelArgs(**{**vars(args), **rope})
    model = llama.Model(args)
    source = vlm.language_model

    def ours(name: str) -> str:  # mlx-vlm's name -> mlx-lm's
        return name if name.startswith("lm_head") else f"model.{name}"

    quantized = {ours(name): m for name, m in source.named_modules() if hasattr(m, "bits")}

    def quant_params(path: str, module) -> dict | bool:
        m = quantized.get(path)
        if m is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}

    if quantized:
        nn.quantize(model, class_predicate=quant_params)
    model.load_weights([(ours(name), value) for name, value in tree_flatten(source.parameters())], strict=True)
    model.eval()
    return model


def load(path: str, rope: dict | None = None):
    """(language model, :class:`Encoder`) for a SmolVLM / Idefics3 directory."""
    import mlx.core as mx
    from pathlib import Path

    from mlx_vlm.utils import load_model

    vlm = load_model(Path(path))
    if not hasattr(vlm, "connector") or not hasattr(vlm, "vision_model"):
        from .loader import ModelLoadError

        raise ModelLoadError(f"{path}: mlx-vlm built a {type(vlm).__module__} model, not an Idefics3 / SmolVLM")
    pre = read_preprocessor(path) or {}
    encoder = Encoder(vlm, pre.get("image_mean") or DEFAULT_MEAN, pre.get("image_std") or DEFAULT_STD, tiling(path))
    model = _language_half(vlm, rope)
    mx.eval(model.parameters())
    return model, encoder

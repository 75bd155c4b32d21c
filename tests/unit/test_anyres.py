"""LLaVA-NeXT's anyres layout (core/anyres.py) against transformers' own processor: for images
square, wide, tall, tiny and huge, the number of ``<image>`` tokens ``LlavaNextProcessor`` writes
equals ours, with a tiny CLIP tower, a tiny SigLIP one (no CLS, ``"full"`` strategy) and
LLaVA-NeXT-7B's real settings (336-pixel tiles, 14-pixel patches, its five pinpoints)."""

from __future__ import annotations

import functools

import pytest

from superfluid.core.anyres import AnyRes

pytest.importorskip("transformers")

# (width, height): square, wide, tall, tiny, huge, and the ratios between
SIZES = [(336, 336), (1000, 300), (300, 1000), (10, 7), (4000, 3000), (640, 480), (480, 640),
         (1920, 1080), (123, 457), (3, 200), (700, 699), (2000, 50)]


@functools.cache
def _tokenizer():
    from tools.fixtures.vlm_build import smollm2_tokenizer

    return smollm2_tokenizer({"image_token": "<image>"})


def _processor(tile: int, patch: int, pinpoints, strategy: str, extra: int):
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                        image_grid_pinpoints=pinpoints)
    return LlavaNextProcessor(image_processor=images, tokenizer=_tokenizer(), patch_size=patch,
                              vision_feature_select_strategy=strategy, num_additional_image_tokens=extra)


def _hf_config(vision: str, tile: int, patch: int, pinpoints, strategy: str) -> dict:
    """A tiny ``LlavaNextConfig`` from transformers' classes, as its config.json reads."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, SiglipVisionConfig

    tower = (CLIPVisionConfig if vision == "clip" else SiglipVisionConfig)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=tile, patch_size=patch)
    cfg = LlavaNextConfig(vision_config=tower.to_dict(), image_grid_pinpoints=pinpoints,
                          vision_feature_select_strategy=strategy)
    return cfg.to_dict()


CASES = {
    "llava-next-7b": ("clip", 336, 14, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], "default"),
    "tiny-clip": ("clip", 32, 8, [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]], "default"),
    "tiny-siglip-full": ("siglip", 28, 7, [[28, 56], [56, 28], [56, 56], [84, 84]], "full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_image_token_counts_are_the_processors(case):
    from PIL import Image as PILImage

    vision, tile, patch, pinpoints, strategy = CASES[case]
    rule = AnyRes.from_hf_config(_hf_config(vision, tile, patch, pinpoints, strategy))
    assert (rule.tile, rule.patch, rule.strategy, rule.extra) == (tile, patch, strategy, 1 if vision == "clip" else 0)
    proc = _processor(tile, patch, pinpoints, strategy, rule.extra)
    image_id = proc.image_token_id
    for w, h in SIZES:
        inputs = proc(text="<image>\nwhat is it?", images=[PILImage.new("RGB", (w, h))], return_tensors="np")
        want = inputs["input_ids"][0].tolist().count(image_id)
        layout = rule.layout(w, h)
        assert layout.rows == want, (case, (w, h), layout)
        # the processor's crops: the base image plus one per tile of the chosen pinpoint
        assert inputs["pixel_values"][0].shape[0] == 1 + layout.tiles[0] * layout.tiles[1], (case, (w, h))


def test_the_7b_layout_of_a_few_images():
    """Worked examples (LLaVA-NeXT-7B): a square picks 672x672 (2x2 tiles, 48x48 features, no
    padding); a 2:1 image 672x336; a very wide one 1008x336 whose padding rows are cut."""
    rule = AnyRes()
    square = rule.layout(800, 800)
    assert (square.resolution, square.tiles, square.grid, square.base) == ((672, 672), (2, 2), (48, 48), 576)
    assert square.rows == 576 + 48 * 49 == 2928
    wide = rule.layout(1000, 500)
    assert (wide.resolution, wide.grid) == ((672, 336), (48, 24))
    very_wide = rule.layout(2000, 300)
    assert very_wide.resolution == (1008, 336) and very_wide.grid == (72, 10)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="strategy 'cls'"):
        AnyRes(strategy="cls")
    with pytest.raises(ValueError, match="pinpoint 500x336 is not whole 336-pixel tiles"):
        AnyRes(pinpoints=((500, 336),))
    with pytest.raises(ValueError, match="no area"):
        AnyRes().layout(0, 5)

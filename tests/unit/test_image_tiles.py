"""Images split as the model's processor splits them (core/image_tiles.py, core/media.py's layout,
plugins/http/images.py's resize), against transformers' own ``Idefics3Processor`` read from the tiny
SmolVLM's files (tools/fixtures/tiny_vlm.py: longest edge 256, tiles of 64): for images of
several aspect ratios, the tile grid, the prompt's tokens (every tile's ``<row_r_col_c>``, the
newlines, the global image's tokens, one placeholder per row) and the pixels of every tile and of
the global image are the processor's, exactly."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from superfluid.core.image_tiles import Tiling, keep_aspect, normalise, whole_tiles  # noqa: E402
from superfluid.core.media import placeholder  # noqa: E402
from tests import vision_reference as ref  # noqa: E402
from tools.fixtures.tiny_vlm import build  # noqa: E402

# square small, wide, wide, tall, larger than the longest edge, tiny, one tile plus a pixel, very wide
SIZES = [(64, 64), (200, 64), (256, 100), (64, 200), (600, 300), (30, 20), (65, 64), (1000, 70)]


@pytest.fixture(scope="module")
def hf():
    return str(build(gguf=False)["hf"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiles_tokens_and_pixels_equal_the_processors(hf, size):
    image = ref.noise(size, seed=size[0] * 7 + size[1])
    info = ref.layout(hf)
    fitted = ref.fit(hf, image)  # what the front end hands the engine
    theirs = ref.processed(hf, "<image>", [image])
    rows, cols = info.grid(fitted.width, fitted.height)
    assert (rows, cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    image_id = ref.processor(hf).image_token_id
    ours = info.prompt_tokens(fitted)
    assert [image_id if t == placeholder(fitted.digest) else t for t in ours] == theirs["input_ids"][0].tolist()
    assert ours.count(placeholder(fitted.digest)) == info.image_rows(fitted.width, fitted.height) \
        == (rows * cols + 1) * 4
    tiles = info.tiling.tiles(fitted)
    assert tiles.shape == (rows * cols + 1, 64, 64, 3)
    np.testing.assert_allclose(normalise(tiles, ref.MEAN, ref.STD), theirs["pixel_values"][0], rtol=0, atol=1e-6)


def test_the_fixture_splits_wide_and_tall_images_into_two_by_four(hf):
    info = ref.layout(hf)
    assert info.grid(*info.fit(*ref.WIDE)) == (2, 4) and info.grid(*info.fit(*ref.TALL)) == (4, 2)


def test_a_fitted_size_fits_again_as_it_is():
    tiling = Tiling(tile=64, longest_edge=256)
    for w in range(1, 400, 7):
        for h in range(1, 400, 11):
            fitted = tiling.resized(w, h)
            if min(fitted) > 2:  # (an image thinner than 2 pixels is made even once more)
                assert tiling.resized(*fitted) == fitted, (w, h)
            assert whole_tiles(*fitted, 64)[0] % 64 == 0


def test_splitting_off_is_the_global_image_alone_and_4096_bounds_the_longest_edge():
    tiling = Tiling(tile=64, longest_edge=256, split=False)
    assert tiling.grid(256, 82) == (0, 0) and tiling.count(256, 82) == 1 and tiling.max_side == 0
    assert keep_aspect(100, 50, 10000) == (4096, 2048)


@pytest.mark.parametrize("split", [True, False], ids=["split", "not-split"])
@pytest.mark.parametrize("size", [(4000, 3000), (384, 384), (385, 10), (700, 2500), (5000, 100)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_at_smolvlms_scale_the_tiles_and_tokens_are_the_processors(hf, size, split):
    """SmolVLM-Instruct's settings (tiles of 384, the longest edge to 4 of them, 81 rows a
    tile), on the fixture's tokenizer: no weights are needed to cut an image or count it."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from superfluid.core.media import idefics3_layout
    from superfluid.plugins.http.images import decode

    images = Idefics3ImageProcessorPil(size={"longest_edge": 1536}, max_image_size={"longest_edge": 384},
                                       do_image_splitting=split, resample=1)
    proc = Idefics3Processor(images, ref.processor(hf).tokenizer, image_seq_len=81)
    tok = proc.tokenizer

    def token_id(text):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    tiling = Tiling(tile=384, longest_edge=1536, split=split)
    info = idefics3_layout(384, 14, 3, token_id, tiling)
    assert info.rows == 81
    image = ref.noise(size, seed=3)
    fitted = decode(ref.png(image), "image", info, 1 << 30)
    theirs = proc(text=["<image>"], images=[[ref.pil(image)]], return_tensors="np", add_special_tokens=False)
    ours = info.prompt_tokens(fitted)
    assert [proc.image_token_id if t < 0 else t for t in ours] == theirs["input_ids"][0].tolist()
    tiles = tiling.tiles(fitted)
    assert len(tiles) == info.image_rows(fitted.width, fitted.height) // 81 == len(theirs["pixel_values"][0])
    np.testing.assert_allclose(normalise(tiles, ref.MEAN, ref.STD), theirs["pixel_values"][0], rtol=0, atol=1e-6)

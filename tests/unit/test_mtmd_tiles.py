"""llama.cpp's mtmd splits an image as our layout and transformers' processor do (plugins/llamacpp/
vision.py's ``MtmdEncoder``, on the tiny SmolVLM's GGUF and mmproj, tools/fixtures/tiny_vlm.py):
for several aspect ratios its text chunks are our layout's tokens, token for token, it gives one
image chunk per tile and one for the global image, and their rows are transformers'
``get_image_features`` on what its processor cut. mtmd computes in ggml and resizes with its own
copy of Pillow's Lanczos filter, so its rows agree to a tolerance, not bit for bit: within 0.1% of
their scale for one-colour images, 2% for noise (measured: 0.03% and up to 1.3%)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from superfluid.core.media import idefics3_layout  # noqa: E402
from tests import vision_reference as ref  # noqa: E402
from tools.fixtures.tiny_vlm import build  # noqa: E402


@pytest.fixture(scope="module")
def vlm():
    return build()


@pytest.fixture(scope="module")
def encoder(vlm):
    import llama_cpp

    from superfluid.plugins.llamacpp.vision import MtmdEncoder

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(vlm["gguf"]).encode(), params)
    enc = MtmdEncoder(str(vlm["mmproj"]), model, 2, 4)
    yield enc
    enc.close()
    llama_cpp.llama_model_free(model)


def test_the_workers_layout_is_the_daemons_and_the_processors(encoder, vlm):
    assert encoder.layout == ref.layout(vlm["hf"])
    assert encoder.layout.tiling.longest_edge == 256  # clip.vision.preproc_image_size


@pytest.mark.parametrize("image, tolerance", [
    (ref.solid((255, 0, 0), ref.WIDE), 1e-3), (ref.solid((0, 0, 255), ref.TALL), 1e-3),
    (ref.noise((200, 64)), 2e-2), (ref.noise((256, 100)), 2e-2), (ref.noise((64, 200)), 2e-2),
    (ref.noise((600, 300)), 2e-2), (ref.noise((64, 64)), 2e-2)],
    ids=["red-wide", "blue-tall", "200x64", "256x100", "64x200", "600x300", "64x64"])
def test_every_tile_and_the_global_image_encode_to_transformers_rows(encoder, vlm, image, tolerance):
    fitted = ref.fit(vlm["hf"], image)
    got = encoder(fitted)  # raises if mtmd's chunks are not our layout
    want = ref.features(vlm["hf"], [image])[0]
    assert got.shape == want.shape == (encoder.layout.image_rows(fitted.width, fitted.height), 64)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale)


def test_a_layout_mtmd_does_not_give_is_refused(encoder, vlm):
    """A prompt must never hold tokens mtmd would not have put there: a layout whose row token
    differs (here a made-up newline id) fails the encode, naming the sizes."""
    good = encoder.layout
    ids = {"<fake_token_around_image>": good.before[0], "<global-img>": good.before[1], "\n": 5, "\n\n": 6}
    ids.update({f"<row_{r}_col_{c}>": good.tile_tokens.opens[r - 1][c - 1][1] for r in range(1, 5) for c in range(1, 5)})
    encoder.layout = idefics3_layout(64, 16, 2, ids.get, good.tiling)
    try:
        with pytest.raises(RuntimeError, match="mtmd laid out a 256x82 image as 9 image chunks"):
            encoder(ref.fit(vlm["hf"], ref.solid((1, 2, 3), ref.WIDE)))
    finally:
        encoder.layout = good


def test_a_layout_that_does_not_split_takes_mtmds_overview(encoder, vlm):
    """A prompt laid out without tiles (an mmproj whose processor settings the daemon could not
    read) gets mtmd's overview, which is last among its chunks: the global image's rows."""
    import attrs

    good = encoder.layout
    encoder.layout = attrs.evolve(good, tiling=attrs.evolve(good.tiling, split=False))
    try:
        image = ref.noise(ref.WIDE)
        got = encoder(ref.fit(vlm["hf"], image))
    finally:
        encoder.layout = good
    want = ref.features(vlm["hf"], [image])[0][-4:]  # the global image's rows
    assert got.shape == (4, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))

"""basert's vision tower (plugins/basert/vision.py) against transformers' Idefics3 on the tiny
SmolVLM (tools/fixtures/tiny_vlm.py): the embedding rows of an image (every tile's and the
global image's, at several aspect ratios), read from the llama.cpp mmproj and from the Hugging
Face directory, equal ``get_image_features`` on what transformers' own processor cuts; the pixel shuffle
orders rows and columns as transformers does; and the language half of the HF directory
(``model.text_model.*``) is the text GGUF's model."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.core.media import Image  # noqa: E402
from superfluid.plugins.basert import model as models  # noqa: E402
from superfluid.plugins.basert import vision  # noqa: E402
from tests import vision_reference as ref  # noqa: E402
from tools.fixtures.tiny_vlm import build  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vlm():
    return build()


SIZES = [(64, 64), (200, 64), (256, 100), (64, 200), (600, 300)]  # square small, wide, tall, past the longest edge


def _images() -> list[Image]:
    return [ref.solid((255, 0, 0), ref.WIDE), ref.solid((0, 0, 255), ref.WIDE)] + \
        [ref.noise(size, seed) for seed, size in enumerate(SIZES)]


@pytest.fixture(scope="module")
def reference(vlm) -> list[np.ndarray]:
    """transformers' image features (the connector's output) per image, on what its processor
    cut: [(tiles + 1) * rows, hidden] each."""
    return ref.features(str(vlm["hf"]), _images())


@pytest.mark.parametrize("where", ["mmproj", "hf"])
def test_the_towers_rows_equal_transformers_image_features(vlm, reference, where):
    src = str(vlm[where])
    shape = vision.read_shape(src, name="vlm")
    assert (shape.image_size, shape.patch_size, shape.scale_factor, shape.rows, shape.out_size) == (64, 16, 2, 4, 64)
    assert shape.mean == shape.std == (0.5, 0.5, 0.5)
    assert (shape.tiling.tile, shape.tiling.longest_edge, shape.tiling.split) == (64, 256, True)
    encode = vision.encoder(vision.load(src, name="vlm", device=CPU, dtype=torch.float32, out_size=64))
    info = ref.layout(vlm["hf"])
    for image, want in zip(_images(), reference):
        got = encode(ref.fit(vlm["hf"], image))
        fitted = ref.fit(vlm["hf"], image)
        assert got.shape == want.shape == (info.image_rows(fitted.width, fitted.height), 64), image.width
        assert got.dtype == np.float32
        scale = float(np.abs(want).max())
        assert scale > 1.0  # rows big enough to move the logits (the fixture makes them so)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    red, blue = (encode(ref.fit(vlm["hf"], i)) for i in _images()[:2])
    assert np.abs(red - blue).max() > 0.1 * float(np.abs(red).max())  # red and blue are told apart


def test_the_mmproj_and_the_hf_directory_give_one_tower(vlm):
    a = vision.read(str(vlm["mmproj"]), name="vlm")
    b = vision.read(str(vlm["hf"]), name="vlm")
    import attrs

    assert a[0].layer_norm_eps == pytest.approx(b[0].layer_norm_eps, rel=1e-6)  # a float32 in GGUF metadata
    assert attrs.evolve(a[0], layer_norm_eps=b[0].layer_norm_eps) == b[0]
    assert a[1].keys() == b[1].keys() == vision.expected_shapes(a[0]).keys()
    for key in a[1]:
        torch.testing.assert_close(a[1][key], b[1][key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("side,s", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_pixel_shuffle_orders_rows_as_transformers_does(side, s):
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    x = torch.randn(2, side * side, 5)
    want = Idefics3Connector.pixel_shuffle(None, x, s)
    torch.testing.assert_close(vision.pixel_shuffle(x, s), want, rtol=0, atol=0)
    # the first row is the top-left s x s block, its patches row-major
    block = [r * side + c for r in range(s) for c in range(s)]
    torch.testing.assert_close(vision.pixel_shuffle(x, s)[:, 0], x[:, block].reshape(2, -1))


def test_without_processor_settings_an_image_must_be_one_tile(vlm):
    import attrs

    tower = vision.load(str(vlm["mmproj"]), name="vlm", device=CPU, dtype=torch.float32)
    tower.shape = attrs.evolve(tower.shape, tiling=None)
    encode = vision.encoder(tower)
    assert encode(ref.solid((1, 2, 3))).shape == (4, 64)
    with pytest.raises(ValueError, match="32x32"):
        encode(ref.solid((1, 2, 3), size=32))


def test_a_text_gguf_is_no_mmproj_and_a_mismatched_width_is_refused(vlm):
    with pytest.raises(ConfigError, match="not a vision mmproj"):
        vision.read_shape(str(vlm["gguf"]), name="vlm")
    with pytest.raises(ConfigError, match="'vlm'.*64-wide rows.*128-wide"):
        vision.load(str(vlm["mmproj"]), name="vlm", device=CPU, dtype=torch.float32, out_size=128)


def test_the_hf_directorys_language_half_is_the_text_gguf(vlm):
    """Idefics3's language half (``model.text_model.*``, ``lm_head``) loads as the llama the text
    GGUF holds: same shape, same logits."""
    hf = models.load(str(vlm["hf"]), name="vlm", device=CPU, dtype=torch.float32)
    gg = models.load(str(vlm["gguf"]), name="vlm", device=CPU, dtype=torch.float32)
    assert hf.shape.arch == "llama" and not hf.shape.tie_embeddings
    assert (hf.shape.vocab_size, hf.shape.hidden_size, hf.shape.n_layers) == (gg.shape.vocab_size, 64, 2)
    from superfluid.plugins.basert.dense_attention import DenseAttention

    tokens = torch.tensor([1, 504, 2583, 314, 260, 3358, 47, 49152, 49154])
    logits = []
    for m in (hf, gg):
        attn = DenseAttention(m.shape, 1, 16, CPU, torch.float32)
        attn.begin([(0, 0, len(tokens))])
        with torch.inference_mode():
            logits.append(m.logits(m(tokens, torch.arange(len(tokens)), attn)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)


def test_a_tile_not_a_whole_number_of_patches_keeps_the_whole_ones_as_transformers_does(tmp_path):
    """SmolVLM-Instruct's SigLIP takes 384-px tiles in 14-px patches (27 a side, 6 px left over);
    so does the SigLIP-400M-shaped tower of the encoding benchmark. A random Idefics3 with 72-px
    tiles in 16-px patches (4 a side, 8 px left over) saved by transformers: basert's rows for one
    tile equal ``get_image_features``."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    text = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=72, patch_size=16, num_channels=3, layer_norm_eps=1e-6)
    torch.manual_seed(5)
    model = Idefics3ForConditionalGeneration(Idefics3Config(text_config=text, vision_config=vis, scale_factor=2,
                                                            image_token_id=63)).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    shape = vision.read_shape(str(tmp_path), name="odd")
    assert (shape.image_size, shape.patch_size, shape.side, shape.rows) == (72, 16, 4, 4)
    tower = vision.load(str(tmp_path), name="odd", device=CPU, dtype=torch.float32, out_size=32)
    pixels = torch.rand(1, 3, 72, 72) * 2 - 1
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixels[None],
                                              pixel_attention_mask=torch.ones(1, 1, 72, 72, dtype=torch.bool))
        want = torch.cat(list(want.pooler_output)).reshape(-1, 32)
        got = tower(pixels)[0]
    assert got.shape == want.shape == (4, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

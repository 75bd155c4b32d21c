"""basert's LLaVA-NeXT vision half (plugins/basert/llava_next.py) against transformers on the tiny
fixture (tools/fixtures/tiny_llava_next.py): the crops core/anyres_pixels.py cuts are the
processor's ``pixel_values`` (before normalising, to the byte after it), and the packed rows the
encoder gives are ``get_image_features``' (CLIP tower, projector, base image, unpadded grid,
newlines) for red and blue images at a wide and a tall aspect ratio, and for noise at sizes that
need resizing and unpadding; the prompt layout is one span of that many rows."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from superfluid.core.anyres_pixels import crops  # noqa: E402
from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.core.image_tiles import normalise  # noqa: E402
from superfluid.core.media import Image, placeholder  # noqa: E402
from superfluid.plugins.basert import llava_next, vision  # noqa: E402

RED, BLUE = (255, 0, 0), (0, 0, 255)
WIDE, TALL = (64, 32), (32, 96)


@functools.cache
def _hf() -> str:
    from tools.fixtures import tiny_llava_next

    return str(tiny_llava_next.build()["hf"])


@functools.cache
def _reference():
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    torch.set_num_threads(2)
    model = LlavaNextForConditionalGeneration.from_pretrained(_hf(), dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(_hf()), model


@functools.cache
def _encode():
    return vision.encoder(vision.load(_hf(), name="llava", device="cpu", dtype=torch.float32, out_size=64))


def _image(size: tuple[int, int], rgb=None, seed: int = 3) -> Image:
    w, h = size
    if rgb is None:
        pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    else:
        pixels = np.broadcast_to(np.asarray(rgb, dtype=np.uint8), (h, w, 3))
    return Image.from_rgb(w, h, np.ascontiguousarray(pixels).tobytes())


def _theirs(image: Image):
    from PIL import Image as PILImage

    proc, model = _reference()
    inputs = proc(text="<image>\nwhat colour?", images=[PILImage.fromarray(image.array())], return_tensors="pt")
    with torch.no_grad():
        rows = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              image_sizes=inputs["image_sizes"]).pooler_output[0]
    return inputs, rows.numpy()


CASES = [(WIDE, RED), (WIDE, BLUE), (TALL, RED), (TALL, BLUE), ((100, 40), None), ((37, 111), None), ((24, 24), None)]


@pytest.mark.parametrize("size,rgb", CASES)
def test_the_crops_are_the_processors_pixels(size, rgb):
    image = _image(size, rgb)
    inputs, _ = _theirs(image)
    shape = vision.read_shape(_hf(), name="llava")
    ours = normalise(crops(image, shape.rule), shape.mean, shape.std)
    theirs = inputs["pixel_values"][0].numpy()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("size,rgb", CASES)
def test_the_packed_rows_equal_transformers_image_features(size, rgb):
    image = _image(size, rgb)
    inputs, theirs = _theirs(image)
    ours = _encode()(image)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    rule = vision.read_shape(_hf(), name="llava").rule
    image_id = _reference()[1].config.image_token_id
    assert ours.shape[0] == rule.image_rows(*size) == inputs["input_ids"][0].tolist().count(image_id)


def test_red_and_blue_rows_differ_and_so_do_wide_and_tall():
    encode = _encode()
    red, blue = encode(_image(WIDE, RED)), encode(_image(WIDE, BLUE))
    assert not np.allclose(red, blue, atol=1e-3)
    assert encode(_image(TALL, RED)).shape[0] != red.shape[0]


def test_an_image_is_one_span_of_its_rows_and_reaches_the_engine_as_sent():
    shape = vision.read_shape(_hf(), name="llava")
    info = shape.layout(lambda text: None)
    image = _image(TALL, BLUE)
    assert info.fit(37, 111) == (37, 111) and info.image_rows(*TALL) == 76
    tokens, spans = info.place(image, 5)
    assert tokens == [placeholder(image.digest)] * 76
    assert [(s.start, s.rows, s.offset) for s in spans] == [(5, 76, 0)]


def test_a_config_basert_does_not_implement_is_refused_naming_it(tmp_path):
    import json
    import shutil

    for name in ("config.json", "processor_config.json"):
        shutil.copy(f"{_hf()}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_feature_select_strategy"] = "full"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vision_feature_select_strategy 'full'"):
        vision.read_shape(str(tmp_path), name="llava")
    config.update(vision_feature_select_strategy="default", vision_feature_layer=[-2, -1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="several layers"):
        llava_next.read_shape(str(tmp_path), config, "llava")


def test_llava_hf_checkpoints_tower_names_are_read_too(tmp_path):
    """llava-hf's released checkpoints (saved by transformers 4) keep CLIP's tensors under
    ``vision_tower.vision_model.``: the same weights under those names give the same rows."""
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("config.json", "processor_config.json"):
        shutil.copy(f"{_hf()}/{name}", tmp_path / name)
    tensors = load_file(f"{_hf()}/model.safetensors")
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    encode = vision.encoder(vision.load(str(tmp_path), name="llava", device="cpu", dtype=torch.float32))
    image = _image(TALL, BLUE)
    np.testing.assert_array_equal(encode(image), _encode()(image))


def test_its_mmproj_serves_text_and_the_400_says_basert_serves_the_hf_directory():
    """The fixture's llama.cpp files (text GGUF, legacy mmproj): basert serves the text and
    names where the images are served (not llama.cpp, which refuses the family)."""
    from superfluid.core.cli import load
    from superfluid.plugins.basert import create_engine
    from tools.fixtures import tiny_llava_next

    files = tiny_llava_next.build(gguf=True)
    config, _ = load(["serve", "--model", str(files["gguf"]), "--engine", "basert", "--device", "cpu",
                      "--threads", "2", "--max-context", "512"])
    engine = create_engine(model=config.models[0], config=config)
    try:
        assert not engine.capabilities.vision
        assert engine.capabilities.images_not_served == (
            "basert does not serve LLaVA-NeXT images (projector mlp with image_grid_pinpoints); they are served "
            "from the model's Hugging Face directory with --engine basert (llama.cpp refuses them); text chat is "
            "served here")
    finally:
        engine.close()

"""How Gemma 3 and Qwen-VL images are laid out in a prompt on llama.cpp, read from the mmproj
(plugins/llamacpp/vision.py), and the core rules that keep an image whole (core/media.py): a
prefix snaps to an image's start, a prefill chunk that would end inside an image runs to its end,
and a lane's M-RoPE grids ride along in its plan."""

from __future__ import annotations

import pytest

from superfluid.core.errors import ConfigError
from superfluid.core.media import Image, MediaSpan, grids, snap, whole_chunk
from superfluid.plugins.llamacpp import vision
from tests import vlm_families_reference as ref

pytest.importorskip("transformers")


def _token_id(family: str):
    tok = ref.processor(family).tokenizer

    def token_id(text: str):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return token_id


def _image(w: int, h: int) -> Image:
    return Image.from_rgb(w, h, bytes(w * h * 3))


@pytest.mark.parametrize("family,size", [("qwen2.5-vl", (168, 84)), ("qwen3-vl", (96, 192)), ("gemma3", (128, 64))])
def test_the_layout_is_the_processors(family, size):
    """An image placed by our layout gives the processor's image tokens, in number and around
    them (Gemma 3's blank lines are text the front end tokenizes beside the prompt's)."""
    from PIL import Image as PILImage

    paths = ref.fixture(family)
    layout = vision.vision_info("m", str(paths["mmproj"]), _token_id(family))
    proc = ref.processor(family)
    inputs = proc(text=ref.image_prompt(family, "a", "b"), images=[PILImage.new("RGB", size)], return_tensors="pt")
    want = inputs["input_ids"][0].tolist()
    image_id = ref.model(family).config.image_token_id
    fitted = layout.fit(*size)
    tokens, spans = layout.place(_image(*fitted), 5)
    (span,) = spans
    assert span.rows == want.count(image_id) == layout.image_rows(*fitted)
    laid = [image_id if t < 0 else t for t in tokens]
    first = want.index(image_id)
    assert want[first - len(layout.before):first + span.rows + len(layout.after)] == laid
    assert span.start == 5 + len(layout.before)
    if family == "gemma3":
        assert fitted == (64, 64) and span.grid is None and span.n_pos == span.rows
        assert layout.text_around == ("\n\n", "\n\n") and layout.resample == vision.BILINEAR
    else:  # the merged grid is the processor's, and the image takes max(nx, ny) positions
        t, gh, gw = inputs["image_grid_thw"][0].tolist()
        assert fitted == size and span.grid == (gw // 2, gh // 2) and span.n_pos == max(span.grid)


def test_a_gemma3_image_longer_than_n_ubatch_is_refused_at_load():
    paths = ref.fixture("gemma3")
    with pytest.raises(ConfigError, match="gemma3 images are 16 rows.*n_ubatch >= 16"):
        vision.vision_info("m", str(paths["mmproj"]), _token_id("gemma3"), n_ubatch=8)
    assert vision.vision_info("m", str(paths["mmproj"]), _token_id("gemma3"), n_ubatch=16).rows == 16


def test_another_projector_is_refused_naming_it(tmp_path):
    import gguf

    path = tmp_path / "mmproj-llava.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="projector 'mlp' is not served.*gemma3.*qwen2.5vl_merger"):
        vision.vision_info("m", str(path), lambda text: 1)


def _span(start: int, rows: int, grid=None) -> MediaSpan:
    return MediaSpan(image=_image(1, 1), start=start, rows=rows, grid=grid)


def test_prefixes_snap_to_whole_images_and_chunks_run_to_an_images_end():
    spans = [_span(10, 18, (6, 3)), _span(40, 16)]
    assert [snap(spans, n) for n in (0, 10, 11, 27, 28, 39, 41, 56, 57)] == [0, 10, 10, 10, 28, 39, 40, 56, 57]
    assert whole_chunk(spans, 0, 12) == 28      # would end inside the first image: runs to its end
    assert whole_chunk(spans, 0, 10) == 10      # ends at its start: as it is
    assert whole_chunk(spans, 28, 20) == 28     # the second image whole
    assert whole_chunk(spans, 28, 5) == 5
    assert grids(spans) == ((10, 6, 3),)
    with pytest.raises(ValueError, match="6x2 grid is not 18 rows"):
        _span(0, 18, (6, 2))


def test_qwen_pixel_limits_come_from_the_processor_settings_beside_the_mmproj(tmp_path):
    """Without settings, transformers' defaults (up to 1,003,520 pixels); a
    ``preprocessor_config.json`` beside the mmproj (the released models' own limits) wins, and
    transformers 5's ``processor_config.json`` is read too."""
    import json

    paths = ref.fixture("qwen2.5-vl")
    token_id = _token_id("qwen2.5-vl")
    assert vision.vision_info("m", str(paths["mmproj"]), token_id).fit(4000, 3000) == (1148, 840)
    (tmp_path / "mmproj.gguf").symlink_to(paths["mmproj"])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert vision.vision_info("m", str(tmp_path / "mmproj.gguf"), token_id).fit(4000, 3000) == (4004, 2996)
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"size": {"shortest_edge": 3136, "longest_edge": 200704}}}))
    assert vision.vision_info("m", str(tmp_path / "mmproj.gguf"), token_id).fit(4000, 3000) == (504, 364)

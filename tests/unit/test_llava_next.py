"""LLaVA-NeXT on the tiny fixture (tools/fixtures/tiny_llava_next.py): transformers' model packs
exactly the rows core/anyres.py counts, for a red and a blue image, wide and tall; and llama.cpp
refuses the family, because libmtmd lays its images out otherwise (measured here, so that the
day libmtmd follows transformers this test says so)."""

from __future__ import annotations

import ctypes
import functools

import pytest

from superfluid.core.anyres import AnyRes
from superfluid.core.errors import ConfigError

pytest.importorskip("transformers")

# (width, height, colour): wide 2 x 1 tiles, tall 1 x 3, one within a tile, a wide one with padding cut
IMAGES = [(64, 32, "red"), (64, 32, "blue"), (32, 96, "red"), (32, 96, "blue"), (24, 24, "red"), (100, 40, "blue")]


@functools.cache
def _fixture(gguf: bool = False):
    from tools.fixtures import tiny_llava_next

    return tiny_llava_next.build(gguf=gguf)


@functools.cache
def _reference():
    import torch
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    torch.set_num_threads(2)
    hf = str(_fixture()["hf"])
    model, info = LlavaNextForConditionalGeneration.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return AutoProcessor.from_pretrained(hf), model.eval()


def _pil(w: int, h: int, colour: str):
    from PIL import Image as PILImage

    return PILImage.new("RGB", (w, h), colour)


def test_the_models_image_rows_are_the_anyres_layout():
    """The processor's ``<image>`` count, the rows the model packs (base image, unpadded grid,
    a newline a row) and the rows it scatters into the prompt all equal core/anyres.py's."""
    import torch

    proc, model = _reference()
    rule = AnyRes.from_hf_config(model.config.to_dict())
    assert (rule.tile, rule.patch, rule.strategy, rule.extra) == (32, 8, "default", 1)
    image_id = model.config.image_token_id
    for w, h, colour in IMAGES:
        inputs = proc(text="<image>\nwhat colour?", images=[_pil(w, h, colour)], return_tensors="pt")
        with torch.no_grad():
            feats = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                   image_sizes=inputs["image_sizes"]).pooler_output
        rows = rule.image_rows(w, h)
        assert inputs["input_ids"][0].tolist().count(image_id) == sum(f.shape[0] for f in feats) == rows, (w, h)
    assert [rule.image_rows(w, h) for w, h in ((64, 32), (32, 96), (24, 24))] == [52, 76, 36]


def test_the_fixtures_images_move_its_replies():
    """Greedy replies to a red and a blue image differ (the fixture is loud enough for an
    engine's test to tell images apart), and a wide and a tall image give different logits."""
    import torch

    proc, model = _reference()
    last = {}
    for w, h, colour in IMAGES[:4]:
        inputs = proc(text="<image>\nwhat colour?", images=[_pil(w, h, colour)], return_tensors="pt")
        with torch.no_grad():
            last[(w, h, colour)] = model(**inputs).logits[0, -1]
    assert not torch.allclose(last[(64, 32, "red")], last[(64, 32, "blue")], atol=1e-3)
    assert not torch.allclose(last[(64, 32, "red")], last[(32, 96, "red")], atol=1e-3)
    inputs = proc(text="<image>\nwhat colour?", images=[_pil(64, 32, "red")], return_tensors="pt")
    other = proc(text="<image>\nwhat colour?", images=[_pil(64, 32, "blue")], return_tensors="pt")
    with torch.no_grad():
        red = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0].tolist()
        blue = model.generate(**other, max_new_tokens=8, do_sample=False)[0].tolist()
    assert red != blue


def _mtmd_rows(mmproj: str, model_path: str, images) -> list[int]:
    """The image rows libmtmd tokenizes each image into (all its image chunks)."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    llm = llama_cpp.Llama(model_path=model_path, n_ctx=256, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, 2, False, False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, params)
    assert ctx, "libmtmd cannot load the fixture's mmproj"
    marker = mtmd.mtmd_default_marker()
    counts = []
    try:
        for img in images:
            raw = img.tobytes()
            bitmap = mtmd.mtmd_bitmap_init(img.width, img.height, (ctypes.c_ubyte * len(raw)).from_buffer_copy(raw))
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                text = mtmd.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
                bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
                assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
                pictures = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
                counts.append(sum(mtmd.mtmd_input_chunk_get_n_tokens(c) for c in pictures
                                  if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE))
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                mtmd.mtmd_bitmap_free(bitmap)
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()
    return counts


def test_libmtmds_layout_is_not_transformers_so_llamacpp_refuses_the_family():
    """The legacy route converts the fixture (projector ``mlp`` with its pinpoints), and libmtmd
    loads it, but lays an image out as the overview's 16 rows plus 16 a tile: no unpadding, no
    newline rows, no tiles at all for an image within one tile. transformers: 52, 76, 36 rows.
    So the daemon refuses the mmproj when the model loads, naming the projector and why."""
    pytest.importorskip("llama_cpp")
    from superfluid.plugins.llamacpp import vision

    paths = _fixture(gguf=True)
    sizes = [(64, 32), (32, 96), (24, 24)]
    rule = AnyRes.from_hf_config(_reference()[1].config.to_dict())
    got = _mtmd_rows(str(paths["mmproj"]), str(paths["gguf"]), [_pil(w, h, "red") for w, h in sizes])
    assert got == [48, 64, 16]
    assert [rule.image_rows(w, h) for w, h in sizes] == [52, 76, 36]
    with pytest.raises(ConfigError, match=r"projector 'mlp' with image_grid_pinpoints \(LLaVA-NeXT's anyres\) "
                                          r"is not served on llama.cpp: libmtmd .*unpadding and image_newline"):
        vision.vision_info("m", str(paths["mmproj"]), lambda text: 1)

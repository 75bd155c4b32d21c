"""core/smart_resize.py: Qwen-VL's image sizes and merged grids, against transformers' own image
processor (the fixtures' configs) and against libmtmd (the tiny Qwen fixtures' mmproj).

* For images of many sizes (half-way cases, the pixel limits binding both ways) the grid is
  transformers' ``image_grid_thw`` over the merge.
* Handed the image at :meth:`SmartResize.size`, with :func:`mtmd_token_limits`, libmtmd gives the
  same grid. Handed a raw image whose side is half-way between two merged patches, it rounds the
  other way: the front end resizes first.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from superfluid.core.smart_resize import SmartResize, mtmd_token_limits
from tests import vlm_families_reference as ref
from tests.mtmd_session import MtmdSession

FAMILIES = ("qwen2.5-vl", "qwen3-vl")


def _sizes(factor: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(5)
    some = [(int(w), int(h)) for w, h in rng.integers(10, 420, size=(24, 2))]
    half = (5 * factor) // 2  # 2.5 merged patches: where Python and C round apart
    return some + [(half, factor * 3), (factor * 3, half), (7, 7), (30, 900), (400, 401), (3 * factor, 2 * factor)]


def _rule(family: str, **limits) -> SmartResize:
    cfg = json.loads((ref.fixture(family)["hf"] / "preprocessor_config.json").read_text())
    rule = SmartResize.from_preprocessor(cfg)
    return SmartResize(rule.patch, rule.merge, **limits) if limits else rule


def _processor(family: str, rule: SmartResize):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(
        str(ref.fixture(family)["hf"]), size={"shortest_edge": rule.min_pixels, "longest_edge": rule.max_pixels})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("limits", [{}, {"min_pixels": 20 * 32 * 32, "max_pixels": 40 * 32 * 32}],
                         ids=["default-limits", "tight-limits"])
def test_grid_is_transformers(family, limits):
    from PIL import Image

    rule = _rule(family, **limits)
    proc = _processor(family, rule)
    assert (rule.patch, rule.merge) == (proc.patch_size, proc.merge_size)
    for w, h in _sizes(rule.factor):
        image = Image.new("RGB", (w, h), (200, 30, 30))
        t, gh, gw = proc(image, return_tensors="np")["image_grid_thw"][0].tolist()
        assert (gw // rule.merge, gh // rule.merge) == rule.grid(w, h), (w, h)
        W, H = rule.size(w, h)
        assert rule.min_pixels <= W * H <= rule.max_pixels


@pytest.mark.parametrize("family", FAMILIES)
def test_libmtmd_gives_the_grid_of_an_image_resized_first(family):
    rule = _rule(family)
    paths = ref.fixture(family)
    s = MtmdSession(str(paths["gguf"]), str(paths["mmproj"]), image_tokens=mtmd_token_limits(rule))
    try:
        def grid(w, h):
            chunks, desc = s.tokenize(f"x{s.marker}", [(w, h, bytes((9, 99, 199)) * (w * h))])
            s.mtmd.mtmd_input_chunks_free(chunks)
            [image] = [c for c in desc if c.kind == "image"]
            return image.nx, image.ny

        for w, h in _sizes(rule.factor):
            assert grid(*rule.size(w, h)) == rule.grid(w, h), (w, h)
        half = (5 * rule.factor) // 2
        raw = grid(half, 3 * rule.factor)
        assert raw != rule.grid(half, 3 * rule.factor)  # C rounds 2.5 up, Python to even
        assert raw == (3, 3) and rule.grid(half, 3 * rule.factor) == (2, 3)
    finally:
        s.close()


def test_token_limits_match_the_processors_pixels():
    assert mtmd_token_limits(SmartResize()) == (4, 1280)
    assert mtmd_token_limits(SmartResize(patch=16, merge=2, min_pixels=65536, max_pixels=16777216)) == (64, 16384)

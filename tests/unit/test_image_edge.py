"""Images at the edge (plugins/http/images.py), fuzzed: whatever bytes or URL a client sends, the
result is a checked image at the tile size or a 400 (InvalidRequest) naming the part, never
another exception (which would be a 500)."""

from __future__ import annotations

import base64
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.core.errors import InvalidRequest
from superfluid.plugins.http.images import data_url_bytes, decode

PARAM = "messages[0].content[0].image_url.url"


def _png(size=(20, 12), mode="RGB", fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format=fmt)
    return buf.getvalue()


SEEDS = [_png(), _png(fmt="JPEG"), _png(fmt="WEBP"), _png(mode="P", fmt="GIF"), _png(mode="RGBA")]


@pytest.mark.parametrize("data", SEEDS, ids=["png", "jpeg", "webp", "gif", "rgba"])
def test_every_served_format_decodes_to_the_tile(data):
    img = decode(data, PARAM, 64, 1 << 20)
    assert (img.width, img.height, len(img.pixels)) == (64, 64, 64 * 64 * 3)
    assert decode(data, PARAM, 64, 1 << 20).digest == img.digest  # the same content, the same name


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 4000), flips=st.lists(st.tuples(st.integers(0, 4000),
                                                                                        st.integers(0, 255)), max_size=6))
def test_mutated_images_decode_or_are_400s_naming_the_part(seed, cut, flips):
    data = bytearray(seed[:cut] if cut < len(seed) else seed)
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    try:
        img = decode(bytes(data), PARAM, 32, 1 << 20)
    except InvalidRequest as exc:
        assert exc.param == PARAM and exc.status == 400
    else:
        assert len(img.pixels) == 32 * 32 * 3


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_400s(data):
    with pytest.raises(InvalidRequest):
        decode(data, PARAM, 32, 1 << 20)


@settings(max_examples=300, deadline=None)
@given(head=st.sampled_from(["data:image/png;base64,", "data:;base64,", "data:image/png,", "data:", ""]),
       body=st.text(max_size=64))
def test_data_urls_give_bytes_or_400s(head, body):
    try:
        data = data_url_bytes(head + body, PARAM, 1 << 10)
    except InvalidRequest as exc:
        assert exc.param == PARAM
    else:
        assert data == base64.b64decode(body, validate=True) and head.endswith(";base64,")


def test_pixels_are_checked_before_decompressing():
    bomb = _png(size=(6000, 6000), mode="L")  # a few KB that would inflate to 36 MB
    assert len(bomb) < 100_000
    with pytest.raises(InvalidRequest, match="6000x6000 pixels"):
        decode(bomb, PARAM, 64, 1 << 20)


def test_an_image_keeps_its_aspect_ratio_as_the_processor_resizes_it():
    """A model with processor settings (SmolVLM's, at the tiny fixture's scale): the longest edge
    goes to 256 and the other follows, never squeezed to one tile; transparency lands on white,
    as transformers' processors composite it."""
    from PIL import Image as PILImage

    from superfluid.core.image_tiles import Tiling
    from superfluid.core.media import idefics3_layout

    ids = {"<fake_token_around_image>": 1, "<global-img>": 2, "\n": 3}
    ids.update({f"<row_{r}_col_{c}>": 10 * r + c for r in range(1, 5) for c in range(1, 5)})
    vision = idefics3_layout(64, 16, 2, ids.get, Tiling(tile=64, longest_edge=256))
    wide = decode(_png(size=(200, 64)), PARAM, vision, 1 << 20)
    tall = decode(_png(size=(64, 200)), PARAM, vision, 1 << 20)
    assert (wide.width, wide.height) == (256, 82) and (tall.width, tall.height) == (82, 256)
    buf = io.BytesIO()
    PILImage.new("RGBA", (8, 8), (255, 0, 0, 0)).save(buf, format="PNG")  # red, fully transparent
    clear = decode(buf.getvalue(), PARAM, vision, 1 << 20)
    assert clear.pixels[:3] == bytes([255, 255, 255])

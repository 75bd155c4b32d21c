"""core/media.py: images as values, content-hash placeholders, spans, the encoder cache, and
finding a model's mmproj."""

from __future__ import annotations

import numpy as np
import pytest

from superfluid.core.image_tiles import Tiling
from superfluid.core.media import (EncoderCache, Image, MediaSpan, find_mmproj, idefics3_layout, images_of,
                                   leading_placeholders, leading_tokens, placeholder, spans_within)


def solid(v: int, size: int = 4) -> Image:
    return Image.from_rgb(size, size, bytes([v]) * (size * size * 3))


def test_placeholders_are_negative_and_name_the_content():
    a, b = solid(1), solid(2)
    assert placeholder(a.digest) < 0 and placeholder(a.digest) == placeholder(solid(1).digest)
    assert placeholder(a.digest) != placeholder(b.digest)
    with pytest.raises(ValueError):
        Image.from_rgb(4, 4, b"short")


def test_the_idefics3_layout_wraps_rows_in_the_image_tokens():
    ids = {"<fake_token_around_image>": 7, "<global-img>": 9}
    info = idefics3_layout(64, 16, 2, ids.get)
    assert (info.rows, info.before, info.after) == (4, (7, 9), (7,))
    tokens = info.prompt_tokens(solid(3))
    assert tokens[:2] == [7, 9] and tokens[-1] == 7 and leading_placeholders(tokens[2:]) == 4
    assert leading_tokens([5, 6, -1, 4]) == 2
    with pytest.raises(ValueError, match="image tokens"):
        idefics3_layout(64, 16, 2, {}.get)


def _tiled_ids() -> dict[str, int]:
    ids = {"<fake_token_around_image>": 7, "<global-img>": 9, "\n": 10, "\n\n": 11}
    ids.update({f"<row_{r}_col_{c}>": 100 + 10 * r + c for r in range(1, 5) for c in range(1, 5)})
    return ids


def test_a_split_image_fills_one_span_per_tile_then_the_global_image():
    info = idefics3_layout(64, 16, 2, _tiled_ids().get, Tiling(tile=64, longest_edge=256))
    image = Image.from_rgb(256, 82, bytes(256 * 82 * 3))  # a wide image, fitted: 2 rows of 4 tiles
    assert info.fit(200, 64) == (256, 82) and info.grid(256, 82) == (2, 4) and info.image_rows(256, 82) == 36
    tokens, spans = info.place(image, 5)
    ph = placeholder(image.digest)
    rows = [ph] * 4
    want = ([7, 111, *rows, 7, 112, *rows, 7, 113, *rows, 7, 114, *rows, 10,
             7, 121, *rows, 7, 122, *rows, 7, 123, *rows, 7, 124, *rows, 11, 7, 9, *rows, 7])
    assert tokens == want
    assert [(s.start, s.rows, s.offset) for s in spans] == [(5 + i, 4, 4 * k) for k, i in enumerate(
        j for j, t in enumerate(tokens) if t == ph and (j == 0 or tokens[j - 1] != ph))]
    assert spans[-1].offset == 32 and images_of(spans) == (image,)
    # a size alone (an image only being counted) lays out the same
    assert info.place(Image(0, 0, b"", image.digest), 5, (256, 82))[0] == tokens
    with pytest.raises(ValueError, match="row_1_col_1"):
        idefics3_layout(64, 16, 2, {k: v for k, v in _tiled_ids().items() if "row_1_col_1" not in k}.get,
                        Tiling(tile=64, longest_edge=256))


def test_row_blocks_read_each_span_from_its_offset_into_the_images_rows():
    image = solid(5)
    cache = EncoderCache(lambda img: np.arange(12, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32))
    a, b = MediaSpan(image, start=2, rows=4, offset=0), MediaSpan(image, start=8, rows=4, offset=8)
    assert cache.row_block((a, b), 3, 3)[:, 0].tolist() == [1, 2, 3]
    assert cache.row_block((a, b), 9, 3)[:, 0].tolist() == [9, 10, 11]
    assert cache.encodes == 1


def test_the_encoder_runs_once_per_content_and_rows_follow_positions():
    calls = []

    def encode(image):
        calls.append(image.digest)
        return np.full((3, 2), image.pixels[0], dtype=np.float32) + np.arange(3)[:, None]

    cache = EncoderCache(encode)
    a, b = MediaSpan(solid(1), start=5, rows=3), MediaSpan(solid(2), start=8, rows=3)
    block = cache.row_block((a, b), 6, 4)  # a's rows 1-2, then b's rows 0-1
    assert block[:, 0].tolist() == [2, 3, 2, 3] and cache.encodes == 2
    cache.row_block((a,), 5, 3)
    assert cache.encodes == 2 and len(calls) == 2
    assert spans_within((a, b), 0, 6) == (a,) and spans_within((a, b), 8, 9) == (b,)


def test_the_encoder_cache_stays_within_its_bytes():
    cache = EncoderCache(lambda image: np.zeros((100, 10), dtype=np.float32), max_bytes=8000)
    for v in range(5):
        cache.rows(solid(v))
    assert cache.encodes == 5
    cache.rows(solid(4))  # the newest is kept
    assert cache.encodes == 5
    cache.rows(solid(0))  # the oldest was dropped
    assert cache.encodes == 6


def test_find_mmproj(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    assert find_mmproj(str(model), None) is None
    (tmp_path / "mmproj-m-f16.gguf").write_bytes(b"x")
    assert find_mmproj(str(model), None) == str(tmp_path / "mmproj-m-f16.gguf")
    (tmp_path / "mmproj-other.gguf").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        find_mmproj(str(model), None)
    assert find_mmproj(str(model), str(tmp_path / "mmproj-other.gguf")).endswith("mmproj-other.gguf")
    with pytest.raises(FileNotFoundError):
        find_mmproj(str(model), str(tmp_path / "missing.gguf"))

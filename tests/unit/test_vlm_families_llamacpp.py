"""Gemma 3, Qwen2.5-VL and Qwen3-VL on llama.cpp, standalone: the tiny fixtures' GGUF and mmproj
driven through llama-cpp-python's own bindings (tests/mtmd_session.py: ``mtmd_tokenize``,
``mtmd_helper_eval_chunks``, greedy ``llama_decode``), against transformers' processor and
``generate`` on the same weights (tests/vlm_families_reference.py).

What it shows, per family, for a red and a blue image at a wide and a tall aspect ratio:

* the greedy tokens equal transformers';
* libmtmd's image chunk holds as many rows as the processor's image tokens, and its position
  count (``mtmd_input_chunk_get_n_pos``) is max(columns, rows) of the merged grid for Qwen-VL
  (M-RoPE), the row count for Gemma 3; the text around it is the processor's token for token;
* red and blue give different tokens (the image reaches the logits);
* which decode each family needs: M-RoPE positions (Qwen) or non-causal attention for the image
  (Gemma 3).

Gemma 3's processor stretches an image to its square tile; libmtmd letterboxes it (pads the short
side black), so llama.cpp is handed the image already stretched to the tile, as the engine must
do; :func:`test_gemma3_mtmd_letterboxes_what_transformers_stretches` pins the difference.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import vlm_families_reference as ref
from tests.mtmd_session import MtmdSession

pytest.importorskip("transformers")

RED, BLUE = (255, 0, 0), (0, 0, 255)
N_NEW = 8
# (wide, tall) images, (width, height): Qwen's sides are multiples of the merged patch (28 and 32
# pixels), so neither transformers nor libmtmd resizes them; Gemma 3 squeezes any image to 64 × 64
SIZES = {"gemma3": ((128, 64), (64, 128)), "qwen2.5-vl": ((168, 84), (84, 168)),
         "qwen3-vl": ((192, 96), (96, 192))}
CASES = [(family, rgb, shape) for family in ref.FAMILIES for rgb in (RED, BLUE) for shape in ("wide", "tall")]


@pytest.fixture(scope="module")
def sessions():
    opened: dict[str, MtmdSession] = {}

    def get(family: str) -> MtmdSession:
        if family not in opened:
            paths = ref.fixture(family)
            opened[family] = MtmdSession(str(paths["gguf"]), str(paths["mmproj"]))
        return opened[family]

    yield get
    for s in opened.values():
        s.close()


def _size(family: str, shape: str) -> tuple[int, int]:
    return SIZES[family][0 if shape == "wide" else 1]


def _pixels(family: str, rgb, size: tuple[int, int]) -> tuple[int, int, bytes]:
    """The image as llama.cpp is handed it: Gemma 3's stretched to its tile first (bilinear, as
    its processor resizes), the others as they are."""
    w, h = size
    if family != "gemma3":
        return w, h, bytes(rgb) * (w * h)
    from PIL import Image

    tile = ref.processor(family).image_processor.size
    stretched = Image.frombytes("RGB", (w, h), bytes(rgb) * (w * h)).resize(
        (tile["width"], tile["height"]), Image.Resampling.BILINEAR)
    return stretched.width, stretched.height, stretched.tobytes()


def _prompt(family: str, marker: str) -> str:
    """The llama.cpp prompt for transformers' ``Describe<image>please``: libmtmd puts Gemma 3's
    ``<start_of_image>`` … ``<end_of_image>`` (Qwen's ``<|vision_start|>`` … ``<|vision_end|>``)
    around the marker; Gemma 3's processor also puts a blank line each side."""
    return f"Describe\n\n{marker}\n\nplease" if family == "gemma3" else f"Describe{marker}please"


def _llama(session: MtmdSession, family: str, rgb, size, suppress) -> tuple[list, list[int], list[bool]]:
    """(the chunks libmtmd made, the greedy tokens, each chunk's non-causal flag)."""
    chunks, desc = session.tokenize(_prompt(family, session.marker), [_pixels(family, rgb, size)])
    try:
        flags = session.non_causal(chunks)
        session.clear()
        n_past = session.eval_chunks(chunks)
        assert n_past == sum(c.n_pos for c in desc)
        return desc, session.greedy(n_past, N_NEW, suppress=suppress), flags
    finally:
        session.mtmd.mtmd_input_chunks_free(chunks)


@pytest.mark.parametrize("family,rgb,shape", CASES,
                         ids=[f"{f}-{'red' if c == RED else 'blue'}-{s}" for f, c, s in CASES])
def test_greedy_tokens_equal_transformers(sessions, family, rgb, shape):
    size = _size(family, shape)
    want = ref.reference(family, "Describe", "please", rgb, size, N_NEW)
    desc, got, _ = _llama(sessions(family), family, rgb, size, want.suppressed)
    [image] = [c for c in desc if c.kind == "image"]
    # the prompt around the image is the processor's, token for token
    image_id = ref.model(family).config.image_token_id
    assert [t for c in desc for t in c.tokens] == [t for t in want.input_ids if t != image_id]
    assert image.n_tokens == want.image_tokens
    if family == "gemma3":
        assert image.n_pos == image.n_tokens == 16
    else:  # M-RoPE: the merged grid is the processor's, and the image takes max(nx, ny) positions
        assert (image.nx, image.ny) == want.grid
        assert image.n_tokens == image.nx * image.ny
        assert image.n_pos == max(image.nx, image.ny) < image.n_tokens
    assert got == want.tokens


@pytest.mark.parametrize("family", ref.FAMILIES)
@pytest.mark.parametrize("shape", ["wide", "tall"])
def test_red_and_blue_differ(sessions, family, shape):
    size = _size(family, shape)
    eos = ref.reference(family, "Describe", "please", RED, size, 1).suppressed
    red = _llama(sessions(family), family, RED, size, eos)[1]
    blue = _llama(sessions(family), family, BLUE, size, eos)[1]
    assert red != blue


@pytest.mark.parametrize("family,mrope,non_causal", [("gemma3", False, True), ("qwen2.5-vl", True, False),
                                                      ("qwen3-vl", True, False)])
def test_the_decode_each_family_needs(sessions, family, mrope, non_causal):
    s = sessions(family)
    assert s.use_mrope is mrope
    desc, _, flags = _llama(s, family, RED, _size(family, "wide"), ())
    image_flags = {flag for c, flag in zip(desc, flags) if c.kind == "image"}
    assert image_flags == {non_causal}


def test_qwen3_vl_image_rows_carry_deepstack_columns(sessions):
    """Qwen3-VL's rows are wider than the language half: DeepStack features ride along as extra
    columns (one more block of n_embd per DeepStack layer), which the engine must feed whole."""
    s = sessions("qwen3-vl")
    chunks, desc = s.tokenize(_prompt("qwen3-vl", s.marker), [_pixels("qwen3-vl", RED, (192, 96))])
    try:
        rows = s.encode(chunks, [c.kind for c in desc].index("image"))
    finally:
        s.mtmd.mtmd_input_chunks_free(chunks)
    n_embd = ref.model("qwen3-vl").config.text_config.hidden_size
    assert s.n_embd_inp == 2 * n_embd
    assert rows.shape == (18, 2 * n_embd)


def test_gemma3_mtmd_letterboxes_what_transformers_stretches(sessions):
    """Handed a wide image, libmtmd pads it to the square tile (black bars) where transformers'
    processor stretches it; handed the stretched image, its rows are transformers' image
    features. So the engine stretches Gemma 3's images to the tile itself."""
    import torch
    from PIL import Image

    s, m, proc = sessions("gemma3"), ref.model("gemma3"), ref.processor("gemma3")
    w, h = 128, 64
    wide = Image.frombytes("RGB", (w, h), bytes(RED) * (w * h))
    with torch.no_grad():
        feats = m.model.get_image_features(pixel_values=proc.image_processor(wide, return_tensors="pt")["pixel_values"])
    want = (feats.pooler_output if hasattr(feats, "pooler_output") else feats)[0].numpy()

    def rows(pixels):
        chunks, desc = s.tokenize(_prompt("gemma3", s.marker), [pixels])
        try:
            return s.encode(chunks, [c.kind for c in desc].index("image"))
        finally:
            s.mtmd.mtmd_input_chunks_free(chunks)

    scale = np.abs(want).max()
    assert np.abs(rows(_pixels("gemma3", RED, (w, h))) - want).max() < 1e-2 * scale
    assert np.abs(rows((w, h, wide.tobytes())) - want).max() > 0.5 * scale

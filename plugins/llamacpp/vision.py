"""Images on llama.cpp: the layout read from the mmproj in the daemon, the encoder in the worker.

The daemon reads only the mmproj's metadata (``gguf``), to lay an image out in a prompt: the
projector's tile, and the processor's longest edge (``clip.vision.preproc_image_size``) by which
mtmd splits an image into tiles plus a global image, as transformers' Idefics3 processor does
(:mod:`superfluid.core.image_tiles`). The projector's weights load once, in the worker, into an
mtmd context (libmtmd, llama.cpp's multimodal library, which llama-cpp-python binds). There mtmd
tokenizes an image (its own preprocessing: the same resize, tiles and Lanczos filter) into text
chunks and one image chunk per tile, then the global image's; every image chunk is encoded in
that order, and the text chunks are checked against our layout's tokens, so a prompt never
holds tokens mtmd would not have put there. The rows are decoded as embedding batches
(:mod:`.runner`): llama.cpp takes token rows or embedding rows in one ``llama_decode``, never
both.

Served projectors: SmolVLM / Idefics3 (tiles, rows decoded like tokens); Gemma 3 (one image
squeezed to its tile, rows decoded with non-causal attention, one whole image a step:
:mod:`.noncausal`); Qwen2-VL, Qwen2.5-VL and Qwen3-VL (the image resized by the processor's
smart-resize rule to a grid of merged patches, rows placed by M-RoPE positions: :mod:`.mrope`).
Others are refused when the model loads, naming the projector; LLaVA-NeXT (``mlp`` with
``image_grid_pinpoints``) with the reason: libmtmd's layout of its images is not transformers'."""

from __future__ import annotations

import ctypes
import json
import os
from typing import Callable

import numpy as np

from superfluid.core.errors import ConfigError
from superfluid.core.image_tiles import from_mmproj
from superfluid.core.media import Image, VisionInfo, idefics3_layout, placeholder
from superfluid.core.smart_resize import SmartResize, mtmd_token_limits

# the mmproj's clip.projector_type -> the family it serves
SERVED_PROJECTORS = {"idefics3": "idefics3", "gemma3": "gemma3", "qwen2vl_merger": "qwen2vl",
                     "qwen2.5vl_merger": "qwen25vl", "qwen3vl_merger": "qwen3vl"}
QWEN_FAMILIES = ("qwen2vl", "qwen25vl", "qwen3vl")
BILINEAR = 2  # Pillow's filter number: Gemma 3's processor stretches an image to its tile with it


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def vision_info(model_name: str, mmproj: str, token_id: Callable[[str], int | None], n_ubatch: int = 512
                ) -> VisionInfo:
    """How the model lays out an image, from its mmproj's metadata; ConfigError for a file that
    is no mmproj, a projector not served, a vocabulary without the image tokens, or a Gemma 3
    image longer than ``n_ubatch`` (its non-causal decode must hold the image whole)."""
    import gguf

    try:
        reader = gguf.GGUFReader(mmproj)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a configuration error
        raise ConfigError(f"model {model_name!r}: cannot read mmproj {mmproj}: {exc}") from None
    projector = _field(reader, "clip.projector_type")
    if not _field(reader, "clip.has_vision_encoder") or projector is None:
        raise ConfigError(f"model {model_name!r}: {mmproj} is not a vision mmproj (no clip vision encoder)")
    if projector in ("mlp", "mlp_norm") and _field(reader, "clip.vision.image_grid_pinpoints") is not None:
        raise ConfigError(f"model {model_name!r}: mmproj projector {projector!r} with image_grid_pinpoints "
                          "(LLaVA-NeXT's anyres) is not served on llama.cpp: libmtmd gives an image the "
                          "overview's and every tile's full patch grid, without LLaVA-NeXT's unpadding and "
                          "image_newline rows, and does not tile an image within one tile, so its rows are not "
                          "the ones transformers' processor writes (core/anyres.py)")
    if projector not in SERVED_PROJECTORS:
        raise ConfigError(f"model {model_name!r}: mmproj projector {projector!r} is not served yet "
                          f"(served: {', '.join(SERVED_PROJECTORS)}: SmolVLM / Idefics3, Gemma 3, "
                          "Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    family = SERVED_PROJECTORS[projector]
    try:
        if family == "gemma3":
            layout = gemma3_layout(reader, token_id)
            if layout.rows > n_ubatch:
                raise ConfigError(f"model {model_name!r}: gemma3 images are {layout.rows} rows, decoded whole in "
                                  f"one micro-batch of {n_ubatch}: set n_ubatch >= {layout.rows}")
            return layout
        if family in QWEN_FAMILIES:
            return qwen_vl_layout(reader, family, token_id, processor_settings(mmproj))
        tile = int(_field(reader, "clip.vision.image_size"))
        tiling = from_mmproj({"clip.vision.preproc_image_size": _field(reader, "clip.vision.preproc_image_size")}, tile)
        return idefics3_layout(tile, int(_field(reader, "clip.vision.patch_size")),
                               int(_field(reader, "clip.vision.projector.scale_factor") or 2), token_id, tiling)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {model_name!r}: mmproj {mmproj}: {exc}") from None


def _ids(token_id: Callable[[str], int | None], family: str, *names: str) -> tuple[int, ...]:
    ids = tuple(token_id(name) for name in names)
    if None in ids:
        raise ValueError(f"the vocabulary lacks {family}'s image tokens {list(names)}")
    return ids


def gemma3_layout(reader, token_id: Callable[[str], int | None]) -> VisionInfo:
    """Gemma 3: any image stretched (bilinear) to the square tile, ``(tile / patch)² / merge²``
    rows (the mmproj's scale factor, 4 unless it says), written as its processor expands
    ``<start_of_image>``: a blank line, ``<start_of_image>``, the rows, ``<end_of_image>``, a
    blank line (the blank lines tokenized with the text around them, as the processor does)."""
    tile, patch = int(_field(reader, "clip.vision.image_size")), int(_field(reader, "clip.vision.patch_size"))
    merge = int(_field(reader, "clip.vision.projector.scale_factor") or 4)
    rows = (tile // patch) ** 2 // (merge * merge)
    start, end = _ids(token_id, "gemma3", "<start_of_image>", "<end_of_image>")
    return VisionInfo(tile=tile, rows=rows, before=(start,), after=(end,), family="gemma3", resample=BILINEAR,
                      text_around=("\n\n", "\n\n"))


def processor_settings(mmproj: str) -> dict:
    """The image processor's settings from a ``preprocessor_config.json`` (or transformers 5's
    ``processor_config.json``) beside the mmproj, the model's own pixel limits; {} without one."""
    folder = os.path.dirname(os.path.abspath(mmproj))
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            cfg = cfg.get(key) or {} if key else cfg
            if cfg:
                return cfg
    return {}


def qwen_vl_layout(reader, family: str, token_id: Callable[[str], int | None], settings: dict | None = None
                   ) -> VisionInfo:
    """Qwen-VL: the image resized by the processor's smart-resize rule to a grid of merged
    patches, one row each, between ``<|vision_start|>`` and ``<|vision_end|>``: the mmproj's patch
    and merge sizes, the pixel limits of the processor's settings (``preprocessor_config.json``
    beside the mmproj) or, without them, transformers' defaults (3,136 to 1,003,520 pixels)."""
    limits = SmartResize.from_preprocessor(settings or {})
    rule = SmartResize(patch=int(_field(reader, "clip.vision.patch_size")),
                       merge=int(_field(reader, "clip.vision.spatial_merge_size") or 2),
                       min_pixels=limits.min_pixels, max_pixels=limits.max_pixels)
    start, end = _ids(token_id, family, "<|vision_start|>", "<|vision_end|>")
    return VisionInfo(tile=rule.factor, rows=0, before=(start,), after=(end,), family=family, smart_resize=rule)


class MtmdEncoder:
    """An mtmd context in the worker: :meth:`__call__` encodes an image (as the front end fitted
    it) into its embedding rows, every tile's then the global image's, a ``rows × n_embd``
    float32 array; ``rows`` is one tile's (Qwen-VL: unused, each image's grid decides).
    ``mrope`` and ``non_causal`` say how the rows must be decoded (libmtmd's answers)."""

    def __init__(self, mmproj: str, model, threads: int, rows: int):
        import llama_cpp
        import llama_cpp._logger
        from llama_cpp import mtmd_cpp as mtmd

        self.mtmd = mtmd
        # libmtmd logs every image it encodes; route it through llama-cpp-python's logger, which
        # the worker keeps at errors only
        mtmd.mtmd_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        vocab = llama_cpp.llama_model_get_vocab(model)

        def token_id(text: str) -> int | None:
            out = (llama_cpp.llama_token * 8)()
            raw = text.encode()
            n = llama_cpp.llama_tokenize(vocab, raw, len(raw), out, 8, False, True)
            return out[0] if n == 1 else None

        try:  # the layout the daemon gave the prompt, read here the same way
            self.layout = vision_info("mtmd", mmproj, token_id)
        except ConfigError as exc:
            raise RuntimeError(str(exc)) from None
        if self.layout.smart_resize is not None:  # libmtmd's pixel limits made the processor's
            params.image_min_tokens, params.image_max_tokens = mtmd_token_limits(self.layout.smart_resize)
        self.ctx = mtmd.mtmd_init_from_file(mmproj.encode(), model, params)
        if not self.ctx:
            raise RuntimeError(f"cannot load mmproj {mmproj}")
        if not mtmd.mtmd_support_vision(self.ctx):
            raise RuntimeError(f"mmproj {mmproj} has no vision encoder")
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self.non_causal = bool(mtmd.mtmd_decode_use_non_causal(self.ctx, None))  # (None: the image half)
        self.marker = mtmd.mtmd_default_marker()
        self.rows = rows
        self.n_embd = llama_cpp.llama_model_n_embd_inp(model)

    def __call__(self, image: Image) -> np.ndarray:
        mtmd = self.mtmd
        pixels = (ctypes.c_ubyte * len(image.pixels)).from_buffer_copy(image.pixels)
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = mtmd.mtmd_input_text(text=self.marker, text_len=len(self.marker), add_special=False,
                                        parse_special=True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize failed ({rc})")
            return self._encode(image, chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def _encode(self, image: Image, chunks) -> np.ndarray:
        """Every image chunk's rows, in order, once mtmd's layout is checked to be ours."""
        mtmd = self.mtmd
        laid: list[int] = []
        pictures = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                pictures.append(chunk)
                laid += [-1] * mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            else:
                n = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                laid += [int(ptr[k]) for k in range(n.value)]
        hole = placeholder(image.digest)
        want = [-1 if t == hole else t for t in self.layout.prompt_tokens(image)]
        if self.layout.family == "idefics3" and self.layout.grid(image.width, image.height) == (0, 0) and pictures:
            # not split: the prompt holds the global image alone, as transformers' processor lays
            # it out. mtmd gives its overview last, after the one tile it always cuts (the same
            # pixels), or after the slices of its generic path (an mmproj without the
            # processor's longest edge, which the daemon then could not split either)
            pictures = pictures[-1:]
        elif laid != want:
            raise RuntimeError(f"mtmd laid out a {image.width}x{image.height} image as {len(pictures)} image chunks "
                               f"in {len(laid)} positions, the prompt's layout as {len(want)} positions")
        out = []
        grid = self.layout.smart_resize.grid(image.width, image.height) if self.layout.smart_resize else None
        for chunk in pictures:
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if grid is not None:
                tokens = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
                got = (mtmd.mtmd_image_tokens_get_nx(tokens), mtmd.mtmd_image_tokens_get_ny(tokens))
                if got != grid:
                    raise RuntimeError(f"mtmd made a {image.width}x{image.height} image a {got[0]}x{got[1]} grid, "
                                       f"the layout a {grid[0]}x{grid[1]} one")
            elif n != self.layout.rows:
                raise RuntimeError(f"an image tile encodes to {n} rows, the layout expects {self.layout.rows}")
            if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            embd = mtmd.mtmd_get_output_embd(self.ctx)
            out.append(np.ctypeslib.as_array(embd, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy())
        return np.concatenate(out)

    def close(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None

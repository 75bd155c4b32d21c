"""Images on llama.cpp: the layout read from the mmproj in the daemon, the encoder in the worker.

The daemon reads only the mmproj's metadata (``gguf``), to lay an image out in a prompt; the
projector's weights load once, in the worker, into an mtmd context (libmtmd, llama.cpp's
multimodal library, which llama-cpp-python binds). There an image is encoded into embedding rows,
which the runner decodes as embedding batches (:mod:`.runner`): llama.cpp takes token rows or
embedding rows in one ``llama_decode``, never both.

Only projectors whose image rows decode like tokens (causal attention, one position a row) are
served: SmolVLM / Idefics3. Others (M-RoPE positions, non-causal image attention) are refused
when the model loads, naming the projector."""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from superfluid.core.errors import ConfigError
from superfluid.core.media import Image, VisionInfo, idefics3_layout

SERVED_PROJECTORS = ("idefics3",)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def vision_info(model_name: str, mmproj: str, token_id: Callable[[str], int | None]) -> VisionInfo:
    """How the model lays out an image, from its mmproj's metadata; ConfigError for a file that
    is no mmproj, a projector not served, or a vocabulary without the image tokens."""
    import gguf

    try:
        reader = gguf.GGUFReader(mmproj)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a configuration error
        raise ConfigError(f"model {model_name!r}: cannot read mmproj {mmproj}: {exc}") from None
    projector = _field(reader, "clip.projector_type")
    if not _field(reader, "clip.has_vision_encoder") or projector is None:
        raise ConfigError(f"model {model_name!r}: {mmproj} is not a vision mmproj (no clip vision encoder)")
    if projector not in SERVED_PROJECTORS:
        raise ConfigError(f"model {model_name!r}: mmproj projector {projector!r} is not served yet "
                          f"(served: {', '.join(SERVED_PROJECTORS)}, i.e. SmolVLM / Idefics3)")
    try:
        return idefics3_layout(int(_field(reader, "clip.vision.image_size")), int(_field(reader, "clip.vision.patch_size")),
                               int(_field(reader, "clip.vision.projector.scale_factor") or 2), token_id)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {model_name!r}: mmproj {mmproj}: {exc}") from None


class MtmdEncoder:
    """An mtmd context in the worker: :meth:`__call__` encodes an image (already resized to the
    tile) into its embedding rows, a ``rows × n_embd`` float32 array."""

    def __init__(self, mmproj: str, model, threads: int, rows: int):
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
        self.ctx = mtmd.mtmd_init_from_file(mmproj.encode(), model, params)
        if not self.ctx:
            raise RuntimeError(f"cannot load mmproj {mmproj}")
        if not mtmd.mtmd_support_vision(self.ctx):
            raise RuntimeError(f"mmproj {mmproj} has no vision encoder")
        if mtmd.mtmd_decode_use_mrope(self.ctx):
            raise RuntimeError(f"mmproj {mmproj} needs M-RoPE positions, which are not served")
        self.marker = mtmd.mtmd_default_marker()
        self.rows = rows
        import llama_cpp

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
            # An image the size of the tile comes back as its overview (and, for Idefics3, one
            # identical tile); the first image chunk is the image.
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    break
            else:
                raise RuntimeError("mtmd gave no image chunk")
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if n != self.rows:
                raise RuntimeError(f"the image encodes to {n} rows, the layout expects {self.rows}")
            if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            out = mtmd.mtmd_get_output_embd(self.ctx)
            return np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def close(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None

"""A GGUF model and its mmproj driven through llama-cpp-python's low-level bindings (``llama_cpp``
and ``llama_cpp.mtmd_cpp``), with no superfluid code in between: the independent llama.cpp side
of the tests that check the mtmd families (Gemma 3, Qwen2.5-VL, Qwen3-VL) against transformers,
and the ground truth the engine's own M-RoPE positions (plugins/llamacpp/mrope.py) are held to.

:meth:`MtmdSession.prompt` tokenizes a prompt with libmtmd (the media marker where the image
goes), evaluates it with ``mtmd_helper_eval_chunks`` or, chunk by chunk, with
``mtmd_helper_decode_image_chunk`` (whose post-decode callback shows the positions libmtmd wrote),
and :meth:`MtmdSession.greedy` continues with one-token ``llama_decode`` steps and the argmax.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):
    """A log callback that drops every line (kept at module level: llama.cpp holds the pointer)."""


@dataclass
class Chunk:
    """One mtmd input chunk as the tests see it."""

    kind: str                 # "text" or "image"
    n_tokens: int
    n_pos: int
    tokens: list[int] = field(default_factory=list)  # a text chunk's token ids
    nx: int = 0               # an image chunk's grid (M-RoPE models: the merged patches across, down)
    ny: int = 0


class MtmdSession:
    """One llama.cpp context (``n_seq`` sequences, a KV of its own each: llama.cpp's default)
    with an mtmd context for ``mmproj``."""

    def __init__(self, gguf: str, mmproj: str, *, n_ctx: int = 1024, n_batch: int = 512, n_seq: int = 1,
                 threads: int = 2, n_ubatch: int | None = None, image_tokens: tuple[int, int] | None = None):
        import llama_cpp
        from llama_cpp import mtmd_cpp as mtmd

        self.ll, self.mtmd = llama_cpp, mtmd
        llama_cpp.llama_backend_init()
        # llama.cpp and libmtmd log every tensor and image; errors still raise here
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
        mtmd.mtmd_log_set(_QUIET, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(_QUIET, ctypes.c_void_p(0))
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"cannot load {gguf}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch or n_batch  # micro-batches: what one forward pass holds
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("cannot make a llama.cpp context")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        if image_tokens:  # libmtmd's limits on an image's rows (its own defaults otherwise)
            params.image_min_tokens, params.image_max_tokens = image_tokens
        self.mctx = mtmd.mtmd_init_from_file(mmproj.encode(), self.model, params)
        if not self.mctx:
            raise RuntimeError(f"cannot load mmproj {mmproj}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_embd_inp = llama_cpp.llama_model_n_embd_inp(self.model)
        self.marker = mtmd.mtmd_default_marker().decode()
        self.use_mrope = bool(mtmd.mtmd_decode_use_mrope(self.mctx))

    # ---- tokenize ----------------------------------------------------------------------------

    def tokenize(self, text: str, images) -> tuple[object, list[Chunk]]:
        """(the mtmd chunks, what they hold) for ``text`` with one marker per image in
        ``images`` (``(width, height, rgb bytes)``). The caller frees the chunks."""
        mtmd = self.mtmd
        bitmaps = []
        for w, h, pixels in images:
            buf = (ctypes.c_ubyte * len(pixels)).from_buffer_copy(pixels)
            bitmaps.append(mtmd.mtmd_bitmap_init(w, h, buf))
        chunks = mtmd.mtmd_input_chunks_init()
        raw = text.encode()
        inp = mtmd.mtmd_input_text(text=raw, text_len=len(raw), add_special=True, parse_special=True)
        arr = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        try:
            rc = mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
        finally:
            for b in bitmaps:
                mtmd.mtmd_bitmap_free(b)
        if rc != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            raise RuntimeError(f"mtmd_tokenize failed ({rc})")
        return chunks, self.describe(chunks)

    def describe(self, chunks) -> list[Chunk]:
        mtmd = self.mtmd
        out = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            c = mtmd.mtmd_input_chunks_get(chunks, i)
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(c)
            n_pos = mtmd.mtmd_input_chunk_get_n_pos(c)
            if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out.append(Chunk("text", n_tokens, n_pos, [ptr[j] for j in range(n.value)]))
            else:
                img = mtmd.mtmd_input_chunk_get_tokens_image(c)
                out.append(Chunk("image", n_tokens, n_pos, nx=mtmd.mtmd_image_tokens_get_nx(img),
                                 ny=mtmd.mtmd_image_tokens_get_ny(img)))
        return out

    def non_causal(self, chunks) -> list[bool]:
        """``mtmd_decode_use_non_causal`` for each chunk."""
        mtmd = self.mtmd
        return [bool(mtmd.mtmd_decode_use_non_causal(self.mctx, mtmd.mtmd_input_chunks_get(chunks, i)))
                for i in range(mtmd.mtmd_input_chunks_size(chunks))]

    # ---- evaluate ----------------------------------------------------------------------------

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.mem, True)

    def eval_chunks(self, chunks, seq: int = 0, n_past: int = 0) -> int:
        """``mtmd_helper_eval_chunks`` (logits for the last row); the next position."""
        new = self.ll.llama_pos(0)
        rc = self.mtmd.mtmd_helper_eval_chunks(self.mctx, self.ctx, chunks, n_past, seq, self.n_batch, True,
                                               ctypes.byref(new))
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_eval_chunks failed ({rc})")
        return new.value

    def encode(self, chunks, index: int) -> np.ndarray:
        """Image chunk ``index``'s embedding rows (``n_tokens × n_embd_inp``), encoded by mtmd."""
        mtmd = self.mtmd
        chunk = mtmd.mtmd_input_chunks_get(chunks, index)
        if mtmd.mtmd_encode_chunk(self.mctx, chunk) != 0:
            raise RuntimeError("mtmd_encode_chunk failed")
        n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        out = mtmd.mtmd_get_output_embd(self.mctx)
        return np.ctypeslib.as_array(out, shape=(n * self.n_embd_inp,)).reshape(n, self.n_embd_inp).copy()

    def image_positions(self, chunks, index: int, n_past: int, seq: int = 0) -> tuple[np.ndarray, int]:
        """Decode image chunk ``index`` at ``n_past`` with ``mtmd_helper_decode_image_chunk`` and
        return (the positions its post-decode callback saw, ``n_pos_per_embd × n_tokens``
        section-major as libmtmd put them in the batch; the next position)."""
        mtmd = self.mtmd
        chunk = mtmd.mtmd_input_chunks_get(chunks, index)
        rows = np.ascontiguousarray(self.encode(chunks, index), dtype=np.float32)
        seen: list[np.ndarray] = []

        def on_decoded(view, user_data):
            v = view.contents
            seen.append(np.ctypeslib.as_array(v.pos, shape=(v.n_pos * v.n_tokens,)).reshape(v.n_pos, v.n_tokens).copy())
            return 0

        callback = mtmd.mtmd_helper_post_decode_callback(on_decoded)
        new = self.ll.llama_pos(0)
        rc = mtmd.mtmd_helper_decode_image_chunk(
            self.mctx, self.ctx, chunk, rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n_past, seq,
            self.n_batch, ctypes.byref(new), callback, None)
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_decode_image_chunk failed ({rc})")
        return np.concatenate(seen, axis=1), new.value

    def decode_tokens(self, tokens: list[int], pos: list[int], seq: int = 0) -> None:
        """One ``llama_decode`` of token rows at ``pos`` (one position each; llama.cpp widens a
        token's position to (p, p, p, 0) for M-RoPE), logits for the last."""
        ll = self.ll
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, (t, p) in enumerate(zip(tokens, pos)):
                batch.token[i] = t
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            rc = ll.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
        finally:
            ll.llama_batch_free(batch)

    def logits(self, index: int = -1) -> np.ndarray:
        ptr = self.ll.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def greedy(self, n_past: int, n_new: int, seq: int = 0, suppress: tuple[int, ...] = ()) -> list[int]:
        """``n_new`` argmax tokens from the logits the last decode left, each fed back at the next
        position; the ``suppress`` tokens never win (transformers' ``min_new_tokens`` does the
        same to its end-of-sequence tokens), so the comparison runs token for token."""
        out = []
        for _ in range(n_new):
            logits = self.logits()
            logits[list(suppress)] = -np.inf
            token = int(logits.argmax())
            out.append(token)
            self.decode_tokens([token], [n_past], seq)
            n_past += 1
        return out

    def close(self) -> None:
        ll = self.ll
        if self.mctx:
            self.mtmd.mtmd_free(self.mctx)
            self.mctx = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None

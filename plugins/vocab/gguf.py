"""The model's vocabulary, loaded in the daemon (weights stay in the worker).

Tokenizing in the daemon keeps the worker's pipe for ticks only; a vocab-only load reads just the
tokenizer tables from the GGUF."""

from __future__ import annotations

import ctypes
import functools
import logging

import llama_cpp
import llama_cpp._logger  # routes llama.cpp's log through Python logging

from superfluid.core.engine import ModelInfo
from superfluid.core.errors import ConfigError


RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1",
                   "granitehybrid", "lfm2", "plamo2", "nemotron_h", "qwen3next"}


class Vocab:
    def __init__(self, path: str, name: str):
        # llama.cpp's loader prints every metadata key; keep the daemon's terminal readable.
        llama_cpp._logger.logger.setLevel(logging.ERROR)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise ConfigError(f"model {name!r}: cannot read {path} as a GGUF model")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.info = self._read_info(path, name)
        arch = self._meta("general.architecture") or ""
        # Sliding-window and recurrent models share one KV pool. A recurrent state cannot be cut
        # back to an earlier position, so their slots are not reused as prefixes; a sliding-window
        # cache can be, where the window's cells before the cut are still held (checked when a
        # lane is seeded: core.tick_runner.TickRunner.seed calls llamacpp's LlamaCppRunner.keep_prefix).
        self.sliding_window = self._meta(f"{arch}.attention.sliding_window") is not None
        self.recurrent = arch in RECURRENT_ARCHS
        self.shared_pool = self.sliding_window or self.recurrent

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # a long chat template
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def _read_info(self, path: str, name: str) -> ModelInfo:
        v = self._vocab

        def tok(t: int) -> int | None:
            return None if t < 0 else t

        def text(t: int) -> str:
            return "" if t < 0 else self.piece(t, special=True).decode("utf-8", errors="replace")

        bos, eos = llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v)
        return ModelInfo(
            name=name, path=path, chat_template=self._meta("tokenizer.chat_template"),
            bos_token=text(bos), eos_token=text(eos), bos_id=tok(bos),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(v)),
            fim_prefix=tok(llama_cpp.llama_vocab_fim_pre(v)),
            fim_suffix=tok(llama_cpp.llama_vocab_fim_suf(v)),
            fim_middle=tok(llama_cpp.llama_vocab_fim_mid(v)),
            n_vocab=self.n_vocab, n_ctx_train=self._context_length(), n_embd=self._width())

    def _width(self) -> int:
        """The model's hidden size (an embedding's width), from metadata."""
        arch = self._meta("general.architecture") or ""
        try:
            return int(self._meta(f"{arch}.embedding_length") or "0")
        except ValueError:
            return 0

    def _context_length(self) -> int:
        """Training context from metadata (a vocab-only load reports 0 through the API)."""
        arch = self._meta("general.architecture") or ""
        value = self._meta(f"{arch}.context_length") or "0"
        try:
            return int(value)
        except ValueError:
            return 0

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @functools.lru_cache(maxsize=1 << 17)
    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab:
            return b""
        return self.piece(token, special=False)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

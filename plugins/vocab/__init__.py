"""Tokenizers the engine plugins share (a library, not a plugin: it registers no hooks).

The MLX and basert engines read both GGUF files and Hugging Face directories, and the llama.cpp
engine reads GGUFs; all three tokenize in the daemon with these classes, so one file gives the
same token ids whichever engine serves it.

For a GGUF the tokenizer is llama.cpp's own, from a vocab-only load of the same file (llama.cpp
is a core dependency, so this costs nothing extra): the token ids, the chat template and the
special tokens are exactly what the llama.cpp engine uses on that file, which is what lets one
file serve both engines and their outputs be compared token for token. (transformers can build a
tokenizer from GGUF metadata too, but needs the ``gguf`` package and converts the vocabulary
into a different implementation, with its own normalization corner cases.)

For an mlx-lm model directory the tokenizer is the directory's Hugging Face tokenizer, loaded
through transformers as mlx-lm does."""

from __future__ import annotations

import functools
import json
import os

import attrs
import llama_cpp

from superfluid.core.engine import ModelInfo
from superfluid.core.errors import ConfigError
from .gguf import Vocab


class GGUFVocab(Vocab):
    """llama.cpp's vocab-only GGUF loader (llama-cpp-python is a core dependency) plus the
    end-of-generation set a Python runner stops on (the llama.cpp runner asks llama.cpp itself),
    the hidden size (the width of an embedding) and the architecture."""

    def __init__(self, path: str, name: str):
        super().__init__(path, name)
        self.eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)}
        arch = self._meta("general.architecture") or ""
        self.info = attrs.evolve(self.info, n_embd=int(self._meta(f"{arch}.embedding_length") or 0))
        self.arch = arch
        self.model_type = "llama"  # the MLX loader reads llama-family GGUFs only


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class HFVocab:
    """A model directory's Hugging Face tokenizer (transformers, as mlx-lm loads it)."""

    def __init__(self, path: str, name: str):
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise ConfigError(f"model {name!r}: cannot load the tokenizer in {path}: {exc}") from None
        with open(os.path.join(path, "config.json")) as fh:
            config = json.load(fh)
        t = self.tok
        self.n_vocab = max(len(t), int(config.get("vocab_size") or 0))
        self.special = set(t.all_special_ids) | {i for i, added in t.added_tokens_decoder.items()
                                                  if getattr(added, "special", False)}
        self.byte_level = self._is_byte_level()
        self._bytes = _byte_decoder() if self.byte_level else None
        probe = t.encode("a", add_special_tokens=True)
        # a vision-language directory (SmolVLM) keeps its language half's shape in text_config
        shape = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        self.info = ModelInfo(
            name=name, path=path, chat_template=getattr(t, "chat_template", None),
            bos_token=t.bos_token or "", eos_token=t.eos_token or "", bos_id=t.bos_token_id,
            add_bos=bool(t.bos_token_id is not None and probe[:1] == [t.bos_token_id]),
            n_vocab=self.n_vocab,
            n_ctx_train=int(shape.get("max_position_embeddings") or config.get("max_position_embeddings") or 0),
            n_embd=int(shape.get("hidden_size") or config.get("hidden_size") or 0))
        self.model_type = str(config.get("model_type") or "")
        eos = config.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [eos]
        self.eog = {int(e) for e in eos if e is not None}
        if t.eos_token_id is not None:
            self.eog.add(t.eos_token_id)
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as fh:
                g = json.load(fh).get("eos_token_id")
            self.eog.update(int(e) for e in (g if isinstance(g, list) else [g]) if e is not None)

    def _is_byte_level(self) -> bool:
        try:
            backend = json.loads(self.tok.backend_tokenizer.to_str())
        except Exception:
            return False
        return "ByteLevel" in json.dumps(backend.get("decoder") or {})

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        if not parse_special:
            # transformers always parses special-token text; split it so it stays plain text
            return self.tok.encode(text, add_special_tokens=add_special, split_special_tokens=True)
        return self.tok.encode(text, add_special_tokens=add_special)

    @functools.lru_cache(maxsize=1 << 17)
    def token_bytes(self, token: int) -> bytes:
        if token in self.special or not 0 <= token < len(self.tok):
            return b""
        piece = self.tok.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self._bytes is not None:
            try:
                return bytes(self._bytes[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def close(self) -> None:
        pass


def open_vocab(path: str, name: str):
    if os.path.isdir(path):
        return HFVocab(path, name)
    return GGUFVocab(path, name)

"""A GGUF's chat facts (template, BOS and EOS text) read from its metadata header alone.

``gguf.GGUFReader`` parses every field into numpy views, a vocabulary's tokens one by one, which
takes seconds on a 50k-token model; ``superfluid template`` needs three values. This walks the
key-value header with the ``gguf`` package's type codes, skips what it does not need, and never
touches the tensors."""

from __future__ import annotations

import mmap
import struct

from gguf.constants import GGUF_MAGIC, GGUFValueType

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
TOKENS = "tokenizer.ggml.tokens"


class GgufError(ValueError):
    pass


class _Header:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def scalar(self, code: str):
        size = struct.calcsize(code)
        if self.pos + size > len(self.buf):
            raise GgufError("the metadata ends early")
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise GgufError("the metadata ends early")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_string(self) -> int:
        """Skip a string, returning where it started."""
        start = self.pos
        self.pos += 8 + self.scalar("Q")
        return start

    def value(self, vtype: int, keep: bool):
        """A value of type ``vtype`` (None when not ``keep``; arrays: their strings' offsets)."""
        if vtype == GGUFValueType.STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if vtype == GGUFValueType.ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item == GGUFValueType.STRING:
                return [self.skip_string() for _ in range(count)]
            if item in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item])
                return None
            for _ in range(count):
                self.value(item, False)
            return None
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise GgufError(f"unknown metadata value type {vtype}")


def chat_facts(path: str) -> tuple[str | None, str, str]:
    """(chat template or None, BOS text, EOS text) of the GGUF at ``path`` ("" for a token it
    does not name). OSError if it cannot be opened; :class:`GgufError` if it is not a GGUF."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise GgufError("not a GGUF file")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        head = _Header(buf, order)
        head.pos = 8
        head.scalar("Q")  # tensors
        found: dict = {}
        for _ in range(head.scalar("Q")):
            key = head.string()
            vtype = head.scalar("I")
            found[key] = head.value(vtype, keep=key == "tokenizer.chat_template")

        def token(key: str) -> str:
            index, offsets = found.get(key), found.get(TOKENS)
            if not isinstance(index, int) or not isinstance(offsets, list) or not 0 <= index < len(offsets):
                return ""
            head.pos = offsets[index]
            return head.string()

        template = found.get("tokenizer.chat_template")
        return (template if isinstance(template, str) else None,
                token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"))

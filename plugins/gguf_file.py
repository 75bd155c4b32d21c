"""A GGUF file's metadata and tensor table, read without ``gguf.GGUFReader``'s cost.

``GGUFReader`` turns every metadata value into numpy views, a vocabulary's tokens and merges one
by one: on SmolLM2-135M (49k tokens, 48k merges) that is about 4 s, more than half of basert's
whole load, paid on every server start by a reader that needs none of those strings. This walks
the same header with the ``gguf`` package's own type codes and sizes, decodes the scalars, keeps
a string array as the offsets of its strings (:class:`Strings`, decoded when read), and maps the
tensors the way ``GGUFReader`` does, so that ``gguf.quants.dequantize`` takes them unchanged
(tests/unit/test_gguf_file.py checks both against ``GGUFReader``, value by value and bit by bit).

Values are what ``GGUFReader``'s ``field.contents()`` gives: Python scalars and strings, lists
for arrays (an array of arrays flattened, as it does), except that a string array is a
:class:`Strings` sequence. A file that is not a GGUF, or ends early, is a :class:`GgufError`
(a ValueError); one that cannot be opened an OSError."""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, \
    GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
# Tensor types GGUFReader maps as their own numpy type; the rest (quantized) as their raw bytes.
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}
VERSIONS = (2, GGUF_VERSION)  # GGUFReader's too: version 1 counted lengths in 32 bits


class GgufError(ValueError):
    pass


def _text(raw) -> str:
    return bytes(raw).decode("utf-8", errors="replace")


class Strings(Sequence):
    """A metadata string array (a vocabulary's tokens, its merges), each string decoded only
    when read: the offsets of its strings are all that the walk keeps."""

    def __init__(self, buf: memoryview, u64: struct.Struct, starts: list[int]):
        self._buf, self._u64, self._starts = buf, u64, starts

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start = self._starts[index]
        (n,) = self._u64.unpack_from(self._buf, start)
        return _text(self._buf[start + 8:start + 8 + n])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"<Strings: {len(self)}>"


class Tensor(NamedTuple):
    """One tensor's entry: ``dims`` in ggml's order (innermost first, ``GGUFReader``'s
    ``shape``), ``offset`` the absolute start of its data, ``data`` those bytes mapped read-only
    in ``GGUFReader``'s dtype and shape (what ``gguf.quants.dequantize`` takes)."""
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    n_bytes: int
    data: np.ndarray

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The shape in numpy's (row-major) order: a Linear weight is [out, in]."""
        return tuple(reversed(self.dims))

    def dequantize(self) -> np.ndarray:
        """The values as float32 in :attr:`array_shape` (an F32 tensor: a read-only view of the map)."""
        return np.asarray(dequantize(self.data, self.tensor_type), dtype=np.float32).reshape(self.array_shape)


class GgufFile:
    """A GGUF's metadata (``fields``, by key, in file order) and, on first use, its tensor table
    (``tensors``, by name, in file order). The file stays mapped while either is referenced."""

    def __init__(self, path: str):
        self.path = path
        self._map = np.memmap(path, mode="r")  # ValueError on an empty file, OSError if unreadable
        self._buf = memoryview(self._map)
        # tensors are sliced from a plain ndarray over the map: a np.memmap slice is a memmap too,
        # and dequantize's hundreds of thousands of row groups would each pay its __array_finalize__
        self._bytes = np.asarray(self._map)
        if len(self._buf) < 24 or struct.unpack_from("<I", self._buf, 0)[0] != GGUF_MAGIC:
            raise GgufError("not a GGUF file")
        self._order = "<" if struct.unpack_from("<I", self._buf, 4)[0] & 0xFFFF else ">"
        self._u32, self._u64 = struct.Struct(self._order + "I"), struct.Struct(self._order + "Q")
        self.version = self._u32.unpack_from(self._buf, 4)[0]
        if self.version not in VERSIONS:
            raise GgufError(f"GGUF version {self.version} is not readable (only {VERSIONS})")
        self._pos = 8
        try:
            self._n_tensors, n_fields = self._scalar("Q"), self._scalar("Q")
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key = self._string()
                if key in self.fields:
                    raise GgufError(f"metadata key {key} appears twice")
                self.fields[key] = self._value(self._scalar("I"))
        except struct.error:
            raise GgufError("the metadata ends early") from None
        self._tensor_info = self._pos
        self.alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GgufError(f"general.alignment {self.alignment!r} is not a power of two")

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # ---- the header walk ----------------------------------------------------------------

    def _scalar(self, code: str):
        value = struct.unpack_from(self._order + code, self._buf, self._pos)[0]
        self._pos += struct.calcsize(code)
        return value

    def _skip_string(self) -> int:
        """Step over a string, returning where it starts."""
        start = self._pos
        self._pos += 8 + self._u64.unpack_from(self._buf, start)[0]
        if self._pos > len(self._buf):
            raise struct.error("past the end")
        return start

    def _string(self) -> str:
        start = self._skip_string()
        return _text(self._buf[start + 8:self._pos])

    def _value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise GgufError(f"unknown metadata value type {vtype}")
        item, count = self._scalar("I"), self._scalar("Q")
        if item == GGUFValueType.STRING:
            return Strings(self._buf, self._u64, [self._skip_string() for _ in range(count)])
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item]).newbyteorder(self._order)
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise struct.error("past the end")
            values = np.frombuffer(self._buf[self._pos:end], dtype=dtype).tolist()
            self._pos = end
            return values
        out: list = []
        for _ in range(count):  # an array of arrays, flattened as GGUFReader's contents() does
            value = self._value(item)
            out.extend(value if isinstance(value, (list, Strings)) else [value])
        return out

    # ---- tensors --------------------------------------------------------------------------

    @functools.cached_property
    def tensors(self) -> dict[str, Tensor]:
        """The tensor table, each tensor's data mapped where ``general.alignment`` puts it."""
        self._pos = self._tensor_info
        entries = []
        try:
            for _ in range(self._n_tensors):
                name = self._string()
                dims = tuple(self._scalar("Q") for _ in range(self._scalar("I")))
                entries.append((name, dims, self._scalar("I"), self._scalar("Q")))
        except struct.error:
            raise GgufError("the tensor table ends early") from None
        start = -(-self._pos // self.alignment) * self.alignment
        out: dict[str, Tensor] = {}
        for name, dims, raw_type, offset in entries:
            if name in out:
                raise GgufError(f"tensor {name} appears twice")
            qtype = GGMLQuantizationType(raw_type)  # ValueError on a type gguf does not know
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
            begin = start + offset
            if begin + n_bytes > len(self._buf):
                raise GgufError(f"tensor {name}'s data ends past the end of the file")
            shape = tuple(reversed(dims))
            element = _ELEMENT_TYPES.get(qtype)
            raw = self._bytes[begin:begin + n_bytes]
            if element is None:
                data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
            else:
                data = raw.view(np.dtype(element).newbyteorder(self._order)).reshape(shape)
            out[name] = Tensor(name, qtype, dims, begin, n_bytes, data)
        return out

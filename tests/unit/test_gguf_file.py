"""plugins/gguf_file.py reads what ``gguf.GGUFReader`` reads, value for value and bit for bit.

basert's weights, reranker heads, mmproj towers and LoRA adapters and the KV shape are read with
:class:`GgufFile` instead of ``GGUFReader`` (seconds faster on a real vocabulary), so every
metadata value and every tensor's mapped bytes, type, shape and offset are checked against
``GGUFReader``'s on files written here: every scalar and array type, a string array (kept
undecoded), a nested array, a custom alignment, both byte orders, and F32, F16, BF16, I32 and
quantized (Q4_1, Q8_0, and a K-quant) tensors; then basert's weights against the ones the
``GGUFReader`` path gave."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFEndian, GGUFValueType as V
from superfluid.plugins.basert import weights
from superfluid.plugins.formats._gguf_meta import chat_facts
from superfluid.plugins.gguf_file import GgufError, GgufFile, Strings
from tests.tinygguf import BOS, CHATML_TEMPLATE, EOS, build_vocab, write_tiny_llama

WORDS = ["alpha", "", "βeta ☃", "gamma delta"]


def write_everything(path, endianess=GGUFEndian.LITTLE, alignment=64):
    """A GGUF with a value of every type and a tensor of several kinds, aligned at ``alignment``."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(alignment)
    for vtype, value in ((V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60000), (V.INT16, -30000),
                         (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000), (V.UINT64, 2**63 + 5),
                         (V.INT64, -(2**62)), (V.FLOAT32, 0.1), (V.FLOAT64, 0.1), (V.BOOL, True),
                         (V.STRING, "Grüße")):
            w.add_key_value(f"t.{vtype.name.lower()}", value, vtype)
    w.add_key_value("t.u32s", [1, 2, 3], V.ARRAY, sub_type=V.UINT32)
    w.add_key_value("t.f32s", [0.5, -1.25, 1e-7], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.strings", WORDS, V.ARRAY)
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
    rng = np.random.default_rng(1)
    values = rng.standard_normal((4, 64), dtype=np.float32)
    w.add_tensor("f32", values)
    w.add_tensor("f16", values.astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.add_tensor("vector", values[0])
    for qtype in (Q.BF16, Q.Q4_1, Q.Q8_0):
        w.add_tensor(qtype.name.lower(), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    size = gguf.GGML_QUANT_SIZES[Q.Q6_K][1]  # no quantizer for K-quants here: any bytes dequantize,
    blocks = rng.integers(0, 256, (4, size), dtype=np.uint8)  # once each block's scale d (last) is finite
    blocks[:, -2:] = np.array([0.01], dtype=np.float16).view(np.uint8)
    w.add_tensor("q6_k", blocks.reshape(2, 2 * size), raw_dtype=Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_reads_as_gguf_reader(path) -> GgufFile:
    reader = gguf.GGUFReader(path)
    ours = GgufFile(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        got = ours.fields[key]
        if reader.fields[key].types[:1] == [V.ARRAY] and reader.fields[key].types[-1] == V.STRING \
                and len(reader.fields[key].types) == 2:
            assert isinstance(got, Strings), key  # kept as offsets, decoded on reading
            got = list(got)
        assert got == value and type(got) is type(value), key
    assert ours.alignment == reader.alignment
    assert [t.name for t in ours.tensors.values()] == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        t = ours.tensors[theirs.name]
        assert (t.tensor_type, t.dims, t.offset, t.n_bytes) == \
            (theirs.tensor_type, tuple(theirs.shape.tolist()), theirs.data_offset, theirs.n_bytes)
        assert same_bits(t.data, theirs.data), t.name
        if t.tensor_type in (Q.I32,):
            continue
        want = np.asarray(gguf.quants.dequantize(theirs.data, theirs.tensor_type), dtype=np.float32)
        assert same_bits(t.dequantize(), want.reshape(tuple(reversed(theirs.shape.tolist())))), t.name
    return ours


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_and_tensor_reads_as_gguf_reader_reads_it(tmp_path, endianess):
    ours = assert_reads_as_gguf_reader(write_everything(tmp_path / "all.gguf", endianess))
    assert ours.alignment == 64 and all(t.offset % 64 == 0 for t in ours.tensors.values())
    assert ours.get("t.nested") == [1, 2, 3] and ours.get("t.missing", 7) == 7
    assert ours.tensors["q6_k"].data.dtype == np.uint8  # quantized: raw bytes, as dequantize takes them


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0", "Q4_0"])
def test_a_model_file_reads_as_gguf_reader_reads_it(tmp_path, quant):
    ours = assert_reads_as_gguf_reader(write_tiny_llama(tmp_path / "tiny.gguf", quant=quant))
    tokens = ours.fields["tokenizer.ggml.tokens"]
    vocab, _, _ = build_vocab()
    assert len(tokens) == len(vocab) and tokens[1] == BOS and tokens[-1] == vocab[-1]
    assert tokens[2:5] == vocab[2:5] and tokens == vocab


def test_chat_facts_decode_only_their_tokens(tmp_path):
    assert chat_facts(str(write_tiny_llama(tmp_path / "tiny.gguf"))) == (CHATML_TEMPLATE, BOS, EOS)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_basert_weights_are_the_ones_gguf_reader_gave(tmp_path, quant):
    """The weights basert reads, bit for bit those of the GGUFReader path it replaced
    (dequantize, reshape to numpy order, undo llama's Q/K permutation, cast)."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", quant=quant, n_head=4, n_head_kv=2)
    shape, got = weights.read_weights(str(path), name="tiny", dtype=torch.float32)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert shape.vocab_size == len(build_vocab()[0]) and (shape.n_heads, shape.n_kv_heads) == (4, 2)
    assert set(got) == set(weights.expected_shapes(shape))
    for key, tensor in got.items():
        t = reader[weights._gguf_name(key, shape)]
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = want.reshape(tuple(reversed(t.shape.tolist())))
        part = key.split(".")[-2]
        if part in ("q", "k"):
            want = weights._unpermute(want, shape.n_heads if part == "q" else shape.n_kv_heads)
        assert same_bits(tensor.numpy(), np.ascontiguousarray(want)), key


def test_what_is_not_a_whole_gguf_is_a_value_error(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    (tmp_path / "foreign.gguf").write_bytes(b"GGML" + data[4:])
    (tmp_path / "header.gguf").write_bytes(data[:2000])  # inside the vocabulary
    (tmp_path / "tensors.gguf").write_bytes(data[:-100])  # the last tensor's data cut short
    for name, message in (("foreign", "not a GGUF"), ("header", "ends early")):
        with pytest.raises(GgufError, match=message):
            GgufFile(str(tmp_path / f"{name}.gguf"))
    short = GgufFile(str(tmp_path / "tensors.gguf"))
    assert short.get("general.architecture") == "llama"  # the header alone still reads
    with pytest.raises(GgufError, match="output.weight"):
        short.tensors
    (tmp_path / "empty.gguf").touch()
    with pytest.raises(ValueError):  # numpy cannot map an empty file
        GgufFile(str(tmp_path / "empty.gguf"))

"""The tiny self-written GGUF (tests/tinygguf.py) loads and runs in llama.cpp."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from ..llama_reference import in_child  # noqa: E402
from ..tinygguf import (  # noqa: E402
    BOS,
    EOS,
    FIM_MID,
    FIM_PRE,
    FIM_SUF,
    IM_END,
    IM_START,
    build_vocab,
    token_ids,
    write_tiny_llama,
)

TEXT = "Hello world, ünïcode!"
IDS = token_ids()


@pytest.fixture(scope="module", params=["F32", "F16", "Q8_0", "Q4_0"])
def tiny(request, tmp_path_factory):
    """(quant, path, seconds to write, Llama) for each quantization. The Llama here holds the
    vocabulary only: whatever computes runs in a child process (``in_child``), so that a crash in
    llama.cpp fails one test rather than the run."""
    quant = request.param
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{quant}.gguf"
    t0 = time.perf_counter()
    write_tiny_llama(path, quant=quant)
    took = time.perf_counter() - t0
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    yield quant, path, took, llm
    llm.close()


@pytest.fixture(scope="module")
def raw_vocab(tiny):
    """The same file loaded vocab-only through the low-level API: (model, vocab)."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(tiny[1]).encode(), params)
    assert model, "llama_model_load_from_file failed"
    yield model, llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def test_writes_fast_and_types(tiny):
    quant, path, took, _ = tiny
    assert took < 5.0
    assert path.stat().st_size < 1_000_000
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["output_norm.weight"] == "F32"
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    assert kinds["blk.1.ffn_down.weight"] == quant
    assert kinds["token_embd.weight"] == quant
    assert len(kinds) == 3 + 2 * 9


def test_roundtrip_high_level(tiny):
    llm = tiny[3]
    toks = llm.tokenize(TEXT.encode())
    assert toks[0] == IDS[BOS]
    assert llm.detokenize(toks).decode() == TEXT
    # ü and ï are not pieces: they must come from the byte-fallback tokens.
    assert any(3 <= t < 3 + 256 for t in toks)


def _detok(vocab, toks, n, remove_special):
    out = ctypes.create_string_buffer(256)
    m = llama_cpp.llama_detokenize(vocab, toks, n, out, 256, remove_special, False)
    assert m >= 0
    return out.raw[:m].decode()


def test_roundtrip_low_level(raw_vocab):
    _, vocab = raw_vocab
    data = TEXT.encode()
    buf = (llama_cpp.llama_token * 128)()
    # Without BOS, llama.cpp strips the SentencePiece space prefix it added: exact.
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, 128, False, False)
    assert n > 0 and buf[0] != IDS[BOS]
    assert _detok(vocab, buf, n, False) == TEXT
    # With BOS removed by remove_special, llama.cpp keeps the prefix space (SPM
    # behaviour, as with Llama-2 models); the high-level API strips it itself.
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, 128, True, False)
    assert n > 0 and buf[0] == IDS[BOS]
    assert _detok(vocab, buf, n, True).removeprefix(" ") == TEXT


def test_special_tokens(raw_vocab, tiny):
    _, vocab = raw_vocab
    assert llama_cpp.llama_vocab_fim_pre(vocab) == IDS[FIM_PRE]
    assert llama_cpp.llama_vocab_fim_suf(vocab) == IDS[FIM_SUF]
    assert llama_cpp.llama_vocab_fim_mid(vocab) == IDS[FIM_MID]
    assert llama_cpp.llama_vocab_bos(vocab) == IDS[BOS]
    assert llama_cpp.llama_vocab_eos(vocab) == IDS[EOS]
    assert llama_cpp.llama_vocab_eot(vocab) == IDS[IM_END]
    assert llama_cpp.llama_vocab_is_eog(vocab, IDS[IM_END])
    assert llama_cpp.llama_vocab_is_eog(vocab, IDS[EOS])
    assert not llama_cpp.llama_vocab_is_eog(vocab, IDS[IM_START])
    assert not llama_cpp.llama_vocab_is_eog(vocab, IDS[FIM_MID])
    # Control tokens are parsed from text only when asked to.
    llm = tiny[3]
    fim = f"{FIM_PRE}def f{FIM_SUF}return x{FIM_MID}".encode()
    toks = llm.tokenize(fim, add_bos=False, special=True)
    assert toks[0] == IDS[FIM_PRE] and toks[-1] == IDS[FIM_MID] and IDS[FIM_SUF] in toks
    assert IDS[FIM_PRE] not in llm.tokenize(fim, add_bos=False, special=False)
    assert llm.metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


def last_logits_and_greedy_runs(path: str) -> tuple[np.ndarray, list[dict]]:
    """In the child: the last position's logits for a prompt, and two greedy completions."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(path, n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        llm.eval(llm.tokenize(b"The user said hello"))
        n_vocab = llama_cpp.llama_vocab_n_tokens(llm._model.vocab)
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
        llm.reset()
        runs = [llm.create_completion("Hello world", max_tokens=8, temperature=0) for _ in range(2)]
        return logits, runs
    finally:
        llm.close()


@pytest.fixture(scope="module")
def computed(tiny):
    return in_child(last_logits_and_greedy_runs, str(tiny[1]))


def test_logits_finite(computed):
    logits, _ = computed
    assert len(logits) == len(build_vocab()[0])
    assert np.isfinite(logits).all()
    assert logits.std() > 0


def test_greedy_completion_deterministic(computed):
    _, runs = computed
    for r in runs:
        assert r["usage"]["completion_tokens"] == 8
        assert r["choices"][0]["finish_reason"] == "length"
    assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"]

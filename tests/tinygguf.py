"""Write a tiny, random-weight llama-architecture GGUF that llama.cpp loads and runs.

Tests use it where the real default model (SmolLM2) lacks a feature, for example
fill-in-the-middle tokens, or where they need a model written in well under a second.

    from tests.tinygguf import write_tiny_llama
    path = write_tiny_llama(tmp_path / "tiny.gguf", quant="Q8_0")

The tokenizer is a real SentencePiece-style ("llama") vocabulary:

    0 <unk>, 1 <s>, 2 </s>, 3..258 the byte-fallback tokens <0x00>..<0xFF>,
    then ordinary pieces (single characters and "▁"-prefixed English words with
    every prefix, so that llama.cpp's score-driven merges reach whole words),
    then the control tokens <|im_start|>, <|im_end|>, <fim_prefix>, <fim_suffix>,
    <fim_middle> (their ids are in SPECIAL_TOKENS / ``token_ids()``).

Any text round-trips (unknown characters fall back to bytes). ``<|im_end|>`` and
``</s>`` end generation; the FIM ids are set under ``tokenizer.ggml.fim_*_token_id``.
The weights are random (seeded, std 0.02 unless ``std`` says), so outputs are deterministic nonsense.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import Keys

ARCH = "llama"
SPM_SPACE = "\u2581"  # "▁", SentencePiece's word-start marker

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
FIM_PRE, FIM_SUF, FIM_MID = "<fim_prefix>", "<fim_suffix>", "<fim_middle>"
SPECIAL_TOKENS = (IM_START, IM_END, FIM_PRE, FIM_SUF, FIM_MID)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Ordinary words; each becomes "▁word" plus all its "▁"-prefixes as pieces.
_WORDS = (
    "the of and to in is it you that was for on are with as be at this have from or "
    "one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some "
    "her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did "
    "get come made may part def return import print class self None True False "
    "Hello hello world code function value "
    "The I A You We It This user assistant system"
).split()
_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    ".,!?;:'\"-_()[]{}<>=+*/\\#@&%$|~`^"
)

_QUANTS = {
    "F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}


def build_vocab() -> tuple[list[str], list[float], list[int]]:
    """Return (tokens, scores, token types) of the tiny SentencePiece vocabulary."""
    tokens: list[str] = [UNK, BOS, EOS]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(TokenType.BYTE)

    pieces: list[str] = [SPM_SPACE, *_CHARS]
    for word in _WORDS:
        for end in range(1, len(word) + 1):
            pieces.append(SPM_SPACE + word[:end])
    seen: set[str] = set()
    rank = 0
    for piece in pieces:
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        # SentencePiece scores are log-probabilities: longer pieces win merges.
        scores.append(-10.0 + len(piece) - rank * 1e-4)
        types.append(TokenType.NORMAL)
        rank += 1

    for tok in SPECIAL_TOKENS:
        tokens.append(tok)
        scores.append(0.0)
        types.append(TokenType.CONTROL)
    return tokens, scores, types


def token_ids() -> dict[str, int]:
    """Ids of the named tokens (unk/bos/eos and the control tokens)."""
    tokens, _, _ = build_vocab()
    index = {t: i for i, t in enumerate(tokens)}
    return {t: index[t] for t in (UNK, BOS, EOS, *SPECIAL_TOKENS)}


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    quant: str = "F32",
    seed: int = 0,
    pooling: int | None = None,
    std: float = 0.02,
) -> Path:
    """Write the tiny llama GGUF to ``path`` and return it as a Path; ``pooling`` (llama.cpp's
    pooling type: 1 mean, 2 cls, 3 last) is written as an embedding model's GGUF declares it.
    ``std`` is the random weights' spread: at 0.02 attention is nearly uniform, so a test that
    needs positions to matter (rope scaling) asks for more (~0.2: sharp attention, spread logits)."""
    if quant not in _QUANTS:
        raise ValueError(f"quant must be one of {sorted(_QUANTS)}, not {quant!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    qtype, ftype = _QUANTS[quant]
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if n_embd % block or n_ff % block:
            raise ValueError(f"{quant} needs n_embd and n_ff to be multiples of {block}")

    path = Path(path)
    tokens, scores, types = build_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv

    w = GGUFWriter(str(path), ARCH)
    w.add_name("tiny-llama-test")
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType(pooling))

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(ids[UNK])
    w.add_bos_token_id(ids[BOS])
    w.add_eos_token_id(ids[EOS])
    w.add_eot_token_id(ids[IM_END])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_uint32(Keys.Tokenizer.FIM_PRE_ID, ids[FIM_PRE])
    w.add_uint32(Keys.Tokenizer.FIM_SUF_ID, ids[FIM_SUF])
    w.add_uint32(Keys.Tokenizer.FIM_MID_ID, ids[FIM_MID])
    w.add_chat_template(CHATML_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weight(name: str, rows: int, cols: int) -> None:
        # numpy shape (rows, cols) is GGUF/ggml ne = [cols, rows]: rows of length cols.
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float32)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    weight("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        weight(f"blk.{i}.attn_k.weight", n_embd_kv, n_embd)
        weight(f"blk.{i}.attn_v.weight", n_embd_kv, n_embd)
        weight(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        weight(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    norm("output_norm.weight")
    weight("output.weight", n_vocab, n_embd)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

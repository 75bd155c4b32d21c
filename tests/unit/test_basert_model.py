"""basert's transformer against transformers itself, on tiny random models of every architecture.

Each model is built by transformers (``*ForCausalLM(config)``), saved as safetensors and loaded by
``basert.model.load``; fp32 logits must agree within 1e-4 whether the prompt is fed whole, in
chunks, or as a prefill then token-by-token decode through DenseAttention, and when two
sequences share one flat batch. Norm weights and biases are perturbed away from their 1/0
initial values, so a forgotten Gemma ``1 + w`` or a dropped qwen2 bias shows. The GGUF path is
checked on tests/tinygguf.py's llama against transformers' own GGUF conversion, and the loader's
refusals (unknown architecture, unreadable quantization, missing tensor) on files made to fail.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch


transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import tests.tinygguf as tinygguf  # noqa: E402
from tests.llama_reference import all_logits, in_child  # noqa: E402
from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.plugins.basert import model as basert  # noqa: E402
from superfluid.plugins.basert.dense_attention import DenseAttention  # noqa: E402
from superfluid.plugins.basert.kv_pool import PagedKV  # noqa: E402
from superfluid.plugins.basert.shape import ModelShape, expected_shapes  # noqa: E402
from tools.bench.basert_reference import transformers_from_gguf  # noqa: E402

TOL = 1e-4
PROMPT_LEN = 13
VOCAB = 320
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=VOCAB, max_position_embeddings=256)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # short, so a 13-token prompt's RoPE is affected


def _configs() -> dict[str, tuple[object, type]]:
    t = transformers
    gemma_layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return {
        "llama": (t.LlamaConfig(num_hidden_layers=2, rope_theta=5000.0, tie_word_embeddings=False,
                                **COMMON), t.LlamaForCausalLM),
        "llama3-scaled": (t.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True,
                                        rope_scaling=LLAMA3_SCALING, **COMMON), t.LlamaForCausalLM),
        "qwen2": (t.Qwen2Config(num_hidden_layers=2, **COMMON), t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config(num_hidden_layers=3, head_dim=24, **COMMON), t.Qwen3ForCausalLM),
        # A window (4) shorter than the prompt, local and global layers with their own RoPE bases.
        "gemma3": (t.Gemma3TextConfig(num_hidden_layers=4, head_dim=16, sliding_window=4,
                                      layer_types=gemma_layers, query_pre_attn_scalar=24, **COMMON),
                   t.Gemma3ForCausalLM),
        # A final soft-cap (HF Gemma 3 applies it; it ignores attn_logit_softcapping, as llama.cpp does).
        "gemma3-softcap": (t.Gemma3TextConfig(num_hidden_layers=2, head_dim=16, sliding_window=5,
                                              layer_types=["sliding_attention", "full_attention"],
                                              attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                                              **COMMON),
                           t.Gemma3ForCausalLM),
    }


CASES = list(_configs())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (HF model, directory it was saved to), built on first use."""
    cache: dict[str, tuple[object, Path]] = {}

    def get(case: str):
        if case not in cache:
            config, cls = _configs()[case]
            torch.manual_seed(CASES.index(case))
            hf = cls(config).eval()
            with torch.no_grad():
                for pname, p in hf.named_parameters():
                    if "norm" in pname:
                        p.add_(torch.randn_like(p) * 0.2)
                    elif pname.endswith("bias"):
                        p.normal_(0.0, 0.1)
                    else:
                        p.normal_(0.0, 0.08)  # larger than the default init: non-trivial logits
            folder = tmp_path_factory.mktemp(case)
            hf.save_pretrained(folder, safe_serialization=True)
            cache[case] = (hf, folder)
        return cache[case]

    return get


def _prompt(seed: int, n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()


def _run(model, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed ``tokens`` to one sequence in the given chunk sizes; all positions' logits."""
    attn = DenseAttention(model.shape, 1, 64, "cpu", torch.float32)
    out, start = [], 0
    for size in chunks:
        attn.begin([(0, start, size)])
        hidden = model(tokens[start:start + size], torch.arange(start, start + size), attn)
        out.append(model.logits(hidden))
        start += size
    assert start == len(tokens)
    return torch.cat(out)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("feed", ["whole", "chunks", "decode"])
def test_logits_match_transformers(saved, case, feed):
    hf, folder = saved(case)
    model = basert.load(str(folder), name=case, device=torch.device("cpu"), dtype=torch.float32)
    tokens = _prompt(1)
    chunks = {"whole": [PROMPT_LEN], "chunks": [5, 1, 4, 3], "decode": [4] + [1] * (PROMPT_LEN - 4)}[feed]
    got = _run(model, tokens, chunks)
    want = _reference(hf, tokens)
    assert want.abs().max() > 0.1, "reference logits too flat to tell anything apart"
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"{case} fed {feed}: max |Δlogit| {diff:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_flex_decode_steps_match_transformers(saved, case):
    """Every architecture's decode steps through the fixed-size flex decoder (the CUDA path, its
    FlexAttention unfused here) on 4-token pages, against transformers: Gemma's windows (4, 5)
    end and start inside pages. Prefill 4 tokens, then one token a step."""
    from superfluid.plugins.basert.decode_graph import DecodeGraphs
    from superfluid.plugins.basert.kv_pool import PagedKV

    hf, folder = saved(case)
    model = basert.load(str(folder), name=case, device=torch.device("cpu"), dtype=torch.float32)
    s = model.shape
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=8, block_size=4,
                   dtype=torch.float32, device=torch.device("cpu"), scratch=True)
    decoder = DecodeGraphs(model, pool, max_lanes=2, max_context=32, graphs=False)
    tokens = _prompt(1)
    got = []
    with torch.inference_mode():
        assert pool.reserve([(0, 0, 4)])
        got.append(model.logits(model(tokens[:4], torch.arange(4), pool.begin_step([(0, 0, 4)]))))
        for p in range(4, PROMPT_LEN):
            row = [(0, p, 1)]
            assert pool.reserve(row)
            got.append(model.logits(decoder.hidden([int(tokens[p])], [p], pool.step_tables(row))))
            pool.step_done(row)
    diff = (torch.cat(got) - _reference(hf, tokens)).abs().max().item()
    assert diff < TOL, f"{case}: max |Δlogit| {diff:.2e}"


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_flat_batch_of_two_sequences(saved, case):
    """Two sequences in one step (a prefill beside a decode): each as if it ran alone."""
    hf, folder = saved(case)
    model = basert.load(str(folder), name=case, device="cpu", dtype=torch.float32)
    a, b = _prompt(2, 11), _prompt(3, 9)
    attn = DenseAttention(model.shape, 2, 32, "cpu", torch.float32)
    attn.begin([(1, 0, 6)])  # b's first 6 tokens alone
    model(b[:6], torch.arange(6), attn)
    attn.begin([(0, 0, 11), (1, 6, 3)])  # a whole, then b's last 3, one flat batch
    tokens = torch.cat([a, b[6:]])
    positions = torch.cat([torch.arange(11), torch.arange(6, 9)])
    logits = model.logits(model(tokens, positions, attn))
    assert (logits[:11] - _reference(hf, a)).abs().max() < TOL
    assert (logits[11:] - _reference(hf, b)[6:]).abs().max() < TOL


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_batched_decode_rows(saved, case):
    """Several one-token rows in a step take DenseAttention's batched path (keys padded to the
    longest sequence and masked), beside a prefill chunk; each sequence still matches alone."""
    hf, folder = saved(case)
    model = basert.load(str(folder), name=case, device="cpu", dtype=torch.float32)
    prompts = [_prompt(10 + i, n) for i, n in enumerate((5, 9, 12))]
    extra = _prompt(20, 6)
    attn = DenseAttention(model.shape, 4, 32, "cpu", torch.float32)
    for seq, p in enumerate(prompts):
        attn.begin([(seq, 0, len(p) - 3)])
        model(p[:-3], torch.arange(len(p) - 3), attn)
    got: list[list[torch.Tensor]] = [[], [], []]
    for step in range(3):
        rows = [(seq, len(p) - 3 + step, 1) for seq, p in enumerate(prompts)]
        tokens = [p[len(p) - 3 + step:len(p) - 2 + step] for p in prompts]
        positions = [torch.tensor([len(p) - 3 + step]) for p in prompts]
        if step == 1:  # a prefill chunk in the middle of the decode rows
            rows.insert(1, (3, 0, 6))
            tokens.insert(1, extra)
            positions.insert(1, torch.arange(6))
        attn.begin(rows)
        logits = model.logits(model(torch.cat(tokens), torch.cat(positions), attn))
        if step == 1:
            assert (logits[1:7] - _reference(hf, extra)).abs().max() < TOL
            logits = torch.cat([logits[:1], logits[7:]])
        for seq in range(3):
            got[seq].append(logits[seq])
    for seq, p in enumerate(prompts):
        diff = (torch.stack(got[seq]) - _reference(hf, p)[-3:]).abs().max().item()
        assert diff < TOL, f"{case} sequence {seq}: max |Δlogit| {diff:.2e}"


def test_rewind_cuts_the_cache(saved):
    """begin() at an earlier start drops what followed: a re-fed suffix gives the same logits."""
    hf, folder = saved("llama")
    model = basert.load(str(folder), name="llama", device="cpu", dtype=torch.float32)
    tokens, other = _prompt(4), _prompt(5)
    attn = DenseAttention(model.shape, 1, 64, "cpu", torch.float32)
    attn.begin([(0, 0, PROMPT_LEN)])
    model(torch.cat([tokens[:7], other[7:]]), torch.arange(PROMPT_LEN), attn)
    attn.begin([(0, 7, PROMPT_LEN - 7)])
    logits = model.logits(model(tokens[7:], torch.arange(7, PROMPT_LEN), attn))
    assert (logits - _reference(hf, tokens)[7:]).abs().max() < TOL
    with pytest.raises(ValueError):
        attn.begin([(0, PROMPT_LEN + 1, 1)])  # a hole in the cache


def test_bfloat16_tracks_transformers(saved):
    hf, folder = saved("qwen3")
    model = basert.load(str(folder), name="qwen3", device="cpu", dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    tokens = _prompt(6)
    attn = DenseAttention(model.shape, 1, 64, "cpu", torch.bfloat16)
    attn.begin([(0, 0, PROMPT_LEN)])
    hidden = model(tokens, torch.arange(PROMPT_LEN), attn)
    assert hidden.dtype == torch.bfloat16
    got = model.logits(hidden)
    assert got.dtype == torch.float32
    hf16 = type(hf)(hf.config).to(torch.bfloat16).eval()
    hf16.load_state_dict(hf.state_dict())
    exact = _reference(hf, tokens)
    ours = (got - exact).abs().max().item()
    theirs = (_reference(hf16, tokens) - exact).abs().max().item()
    # bf16 rounding, not a bug: basert's error from fp32 is of the size transformers' own bf16 has
    assert 0 < ours < 1.5 * theirs, f"basert bf16 off by {ours:.3f}, transformers bf16 by {theirs:.3f}"


# ---- shapes ---------------------------------------------------------------------------------

LLAMA_31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_shape_of_llama_31_8b():
    shape = ModelShape.from_hf_config(LLAMA_31_8B)
    assert shape.arch == "llama" and shape.head_dim == 128 and shape.windows == (None,) * 32
    assert PagedKV.bytes_per_token(shape.n_layers, shape.n_kv_heads, shape.head_dim, torch.bfloat16, 0) == \
        32 * 2 * 8 * 128 * 2
    assert shape.param_count() == 8_030_261_248  # the published count
    assert shape.weight_bytes(2) == 2 * 8_030_261_248
    assert math.isclose(shape.attn_scale, 128 ** -0.5)
    # llama3 frequencies as transformers computes them
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(basert.rope_inv_freq(shape, local=False), want.float(), rtol=1e-6, atol=0)


def test_shape_counts_of_published_models():
    """Parameter counts as published, so weight_bytes is right for rooflines (tied heads once)."""
    llama_32_1b = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                   "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0}}
    assert ModelShape.from_hf_config(llama_32_1b).param_count() == 1_235_814_400
    qwen25 = ModelShape.from_hf_config({  # Qwen2.5-0.5B, transformers-4 spelling
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
        "max_window_layers": 21, "tie_word_embeddings": True, "rms_norm_eps": 1e-6})
    assert qwen25.param_count() == 494_032_768
    assert qwen25.windows == (None,) * 24 and qwen25.qkv_bias and not qwen25.o_bias


def test_shape_of_gemma3_old_config_spelling():
    """transformers-4-era config.json (rope_local_base_freq, sliding_window_pattern)."""
    shape = ModelShape.from_hf_config({
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768})
    assert shape.windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert shape.tie_embeddings and shape.local_rope_theta == 10000.0 and shape.rope_theta == 1e6
    assert shape.embed_scale == math.sqrt(640) and shape.activation == "gelu_tanh"


def test_random_model_of_a_real_shape_is_finite_and_seeded():
    shape = ModelShape.from_hf_config({**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512,
                                       "num_hidden_layers": 4, "num_attention_heads": 8,
                                       "num_key_value_heads": 2, "vocab_size": 1000})
    outs = []
    for _ in range(2):
        model = basert.random_model(shape, device="cpu", dtype=torch.bfloat16, seed=3)
        attn = DenseAttention(shape, 1, 16, "cpu", torch.bfloat16)
        attn.begin([(0, 0, 8)])
        outs.append(model.logits(model(torch.arange(8), torch.arange(8), attn)))
    assert torch.isfinite(outs[0]).all() and outs[0].std() > 0
    assert torch.equal(outs[0], outs[1])


# ---- GGUF -----------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_tiny_gguf_matches_transformers_reading_it(tmp_path, quant):
    path = tinygguf.write_tiny_llama(tmp_path / f"tiny-{quant}.gguf", quant=quant, n_layer=2)
    model = basert.load(str(path), name="tiny", device="cpu", dtype=torch.float32)
    assert model.shape.arch == "llama" and not model.shape.tie_embeddings
    hf = transformers_from_gguf(str(path))
    tokens = torch.randint(0, model.shape.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    for chunks in ([PROMPT_LEN], [6] + [1] * (PROMPT_LEN - 6)):
        got = _run(model, tokens, chunks)
        diff = (got - _reference(hf, tokens)).abs().max().item()
        assert diff < TOL, f"{quant} chunks {chunks}: max |Δlogit| {diff:.2e}"


def _gguf_cases() -> dict[str, tuple[object, type]]:
    """Shapes llama.cpp and transformers' GGUF reader both take as they are: transformers reads
    no head_dim for qwen3 (its default 128) nor query_pre_attn_scalar for gemma3 (256), and
    llama.cpp fixes gemma3's 5-local:1-global pattern and local RoPE base."""
    t = transformers
    common = dict(hidden_size=64, intermediate_size=96, vocab_size=len(tinygguf.build_vocab()[0]),
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    return {
        "llama": (t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common),
                  t.LlamaForCausalLM),
        # Llama 3.1's rope scaling, which the converter turns into a rope_freqs tensor; tied head.
        "llama3-scaled": (t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING, **common),
                          t.LlamaForCausalLM),
        "qwen2": (t.Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common),
                  t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                **common), t.Qwen3ForCausalLM),
        "gemma3": (t.Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=256, sliding_window=4, query_pre_attn_scalar=256, **common),
                   t.Gemma3ForCausalLM),
    }


def _write_converted_gguf(hf, arch: str, path: Path) -> None:
    """``hf`` as llama.cpp's convert_hf_to_gguf.py writes it (F32): GGUF names and metadata,
    llama's Q/K rows permuted into llama.cpp's RoPE layout, Gemma's norms with the +1 folded in,
    no output tensor when tied, tests/tinygguf.py's vocabulary (so llama.cpp can load it)."""
    from superfluid.plugins.basert import weights

    c = hf.config
    shape = ModelShape.from_hf_config(c.to_dict())
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(shape.rope_theta)
    if arch == "llama":
        w.add_rope_dimension_count(shape.head_dim)
    elif arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    tokens, scores, types = tinygguf.build_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if shape.rope_scaling is not None:  # llama.cpp's converter: per-frequency divisors
        plain = basert.rope_inv_freq(attrs.evolve(shape, rope_scaling=None), local=False)
        w.add_tensor("rope_freqs.weight", (plain / basert.rope_inv_freq(shape, local=False)).numpy())
    for key in expected_shapes(shape):
        data = state[weights._hf_name(key, shape)]
        kind = key.split(".")[-2]
        if arch == "llama" and kind in ("q", "k"):
            n = shape.n_heads if kind == "q" else shape.n_kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if arch == "gemma3" and key.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(weights._gguf_name(key, shape), np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["llama", "llama3-scaled", "qwen2", "qwen3", "gemma3"])
def test_converted_gguf_of_each_arch(tmp_path, case):
    """A tiny HF model written as GGUF the way llama.cpp converts it: basert reading the GGUF
    gives the HF model's logits; so does transformers reading it (the writer is right), and so
    does llama.cpp itself when installed (the conversion rules are right)."""
    config, cls = _gguf_cases()[case]
    arch = "llama" if case.startswith("llama") else case
    torch.manual_seed(11)
    hf = cls(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = tmp_path / f"{arch}.gguf"
    _write_converted_gguf(hf, arch, path)
    tokens = torch.randint(3, config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    want = _reference(hf, tokens)

    model = basert.load(str(path), name=arch, device="cpu", dtype=torch.float32)
    assert model.shape.windows == hf_windows(hf) and model.shape.tie_embeddings == config.tie_word_embeddings
    for chunks in ([PROMPT_LEN], [5] + [1] * (PROMPT_LEN - 5)):
        diff = (_run(model, tokens, chunks) - want).abs().max().item()
        assert diff < TOL, f"basert on the {arch} GGUF, chunks {chunks}: max |Δlogit| {diff:.2e}"
    if case != "llama3-scaled":  # transformers' GGUF reader ignores rope_freqs (llama.cpp does not)
        assert (_reference(transformers_from_gguf(str(path)), tokens) - want).abs().max() < TOL

    pytest.importorskip("llama_cpp")
    # F32 KV (type 0): no fp16 rounding of K/V; in a child process, so a crash fails this test only
    theirs = torch.tensor(in_child(all_logits, str(path), tokens.tolist(), n_ctx=32, n_threads=1,
                                   type_k=0, type_v=0, flash_attn=False)[:PROMPT_LEN])
    # ggml's CPU GELU reads an fp16 table, worth ~1e-3 on these logits; its SiLU is exact.
    tol = 5e-3 if arch == "gemma3" else TOL
    assert (theirs - want).abs().max() < tol


def hf_windows(hf) -> tuple[int | None, ...]:
    types = getattr(hf.config, "layer_types", None) or ["full_attention"] * hf.config.num_hidden_layers
    window = getattr(hf.config, "sliding_window", None)
    return tuple(window if t == "sliding_attention" else None for t in types)


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that renames the architecture, drops one tensor or re-types one as raw bytes."""

    arch_override: str | None = None
    drop: str | None = None
    retype: tuple[str, gguf.GGMLQuantizationType] | None = None

    def __init__(self, path, arch, *args, **kwargs):
        super().__init__(path, self.arch_override or arch, *args, **kwargs)

    def add_tensor(self, name, tensor, *args, **kwargs):
        if name == self.drop:
            return
        if self.retype and name == self.retype[0]:
            qtype = self.retype[1]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = tensor.shape  # F32 data, rows of length cols
            return super().add_tensor(name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=qtype)
        return super().add_tensor(name, tensor, *args, **kwargs)


def _bad_gguf(tmp_path, monkeypatch, **attrs_) -> str:
    writer = type("W", (_Writer,), attrs_)
    monkeypatch.setattr(tinygguf, "GGUFWriter", writer)
    return str(tinygguf.write_tiny_llama(tmp_path / "bad.gguf", n_embd=64, quant="F32"))


def test_gguf_unknown_architecture(tmp_path, monkeypatch):
    path = _bad_gguf(tmp_path, monkeypatch, arch_override="mamba")
    with pytest.raises(ConfigError, match=r"^model 'bad': architecture 'mamba'.*llama, qwen2, qwen3, gemma3"):
        basert.load(path, name="bad", device="cpu", dtype=torch.float32)


def test_gguf_missing_tensor(tmp_path, monkeypatch):
    path = _bad_gguf(tmp_path, monkeypatch, drop="blk.1.ffn_up.weight")
    with pytest.raises(ConfigError, match=r"^model 'bad': tensor blk\.1\.ffn_up\.weight is missing"):
        basert.load(path, name="bad", device="cpu", dtype=torch.float32)


def test_gguf_unsupported_quantization(tmp_path, monkeypatch):
    path = _bad_gguf(tmp_path, monkeypatch, retype=("blk.0.attn_v.weight", gguf.GGMLQuantizationType.Q8_1))
    with pytest.raises(ConfigError, match=r"^model 'bad': tensor blk\.0\.attn_v\.weight .*type Q8_1"):
        basert.load(path, name="bad", device="cpu", dtype=torch.float32)


def test_hf_errors_name_what_is_wrong(saved, tmp_path):
    hf, folder = saved("qwen2")
    config = json.loads((folder / "config.json").read_text())
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"^model 'q': architecture 'gpt2'.*llama, qwen2, qwen3, gemma3"):
        basert.load(str(tmp_path), name="q", device="cpu", dtype=torch.float32)
    # a config that wants more layers than the file has: the first absent tensor is named
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"^model 'q': tensor model\.layers\.2\.input_layernorm\.weight is missing"):
        basert.load(str(tmp_path), name="q", device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(ConfigError, match=r"^model 'q': tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        basert.load(str(tmp_path), name="q", device="cpu", dtype=torch.float32)


# ---- DenseAttention's soft-capped path ------------------------------------------------------

def _attend(shape, q, k, v, *, window, softcap, chunks):
    attn = DenseAttention(shape, 1, 32, "cpu", torch.float32)
    out, start = [], 0
    for size in chunks:
        attn.begin([(0, start, size)])
        out.append(attn.attend(0, q[start:start + size], k[start:start + size], v[start:start + size],
                               window=window, scale=0.3, softcap=softcap))
        start += size
    return torch.cat(out)


def test_softcap_path_masks_and_groups_like_sdpa():
    """The manual path (taken only with a soft-cap) against SDPA, with a cap too large to bite,
    then against the formula written out for one query."""
    shape = ModelShape.from_hf_config({**LLAMA_31_8B, "num_hidden_layers": 1, "hidden_size": 32,
                                       "num_attention_heads": 4, "num_key_value_heads": 2})
    g = torch.Generator().manual_seed(0)
    t, d = 10, shape.head_dim
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (4, 2, 2))
    for window in (None, 3):
        plain = _attend(shape, q, k, v, window=window, softcap=None, chunks=[10])
        capped = _attend(shape, q, k, v, window=window, softcap=1e6, chunks=[4, 1, 5])
        assert (plain - capped).abs().max() < 1e-5
    # batched decode rows (two sequences, different lengths) on the capped path, against each alone
    for softcap in (None, 0.5):
        alone = [_attend(shape, q[:n], k[:n], v[:n], window=3, softcap=softcap, chunks=[n - 1, 1])[-1]
                 for n in (6, 10)]
        attn = DenseAttention(shape, 2, 32, "cpu", torch.float32)
        attn.begin([(0, 0, 5), (1, 0, 9)])
        attn.attend(0, torch.cat([q[:5], q[:9]]), torch.cat([k[:5], k[:9]]), torch.cat([v[:5], v[:9]]),
                    window=3, scale=0.3, softcap=softcap)
        attn.begin([(0, 5, 1), (1, 9, 1)])
        both = attn.attend(0, q[[5, 9]], k[[5, 9]], v[[5, 9]], window=3, scale=0.3, softcap=softcap)
        assert (both - torch.stack(alone)).abs().max() < 1e-6
    got = _attend(shape, q, k, v, window=3, softcap=0.5, chunks=[10])
    i, head = 7, 3  # query 7 sees keys 5, 6, 7; head 3 reads kv head 1
    scores = torch.tanh((k[5:8, 1] @ q[i, head]) * 0.3 / 0.5) * 0.5
    want = torch.softmax(scores, 0) @ v[5:8, 1]
    assert (got[i, head] - want).abs().max() < 1e-6


def test_unreadable_paths(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ConfigError, match=r"^model 'j': .*junk\.gguf is not a readable GGUF file"):
        basert.load(str(junk), name="j", device="cpu", dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"^model 'j': .*neither a \.gguf file nor a directory"):
        basert.load(str(tmp_path / "absent.bin"), name="j", device="cpu", dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"^model 'j': .* has no config\.json"):
        basert.load(str(tmp_path), name="j", device="cpu", dtype=torch.float32)

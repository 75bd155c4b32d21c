"""basert serving a Hugging Face model directory (config.json + model.safetensors + tokenizer
files) behind the real server: the path a user takes with a downloaded checkpoint instead of a
GGUF. The weights are tiny and random (so the text is noise), but everything around them is
real: the directory's config picks the architecture, its safetensors are the weights, and its
tokenizer (SmolLM2's, as transformers converts it from the default GGUF: the tiny-LoRA fixture's
``base-hf/``, cached) is the one the server uses, which ``/tokenize`` shows by agreeing with the
GGUF's own tokenizer."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from .serverproc import ServerProcess

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's ids (config.json's eos_token_id is what HFVocab stops on)
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
TEXT = "The quick brown fox jumps over the lazy dog. <|im_start|>user\nHi there!<|im_end|>"


def _small(**extra):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=True, **IDS, **extra)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_small()))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_small(head_dim=16)))


def _gemma3():
    config = transformers.Gemma3TextConfig(**_small(head_dim=16, query_pre_attn_scalar=16, sliding_window=32))
    return transformers.Gemma3ForCausalLM(config)


BUILDERS = {"llama": _llama, "qwen3": _qwen3, "gemma3_text": _gemma3}


@pytest.fixture(scope="module")
def tokenizer_dir(model_path):
    """SmolLM2's tokenizer files as transformers converts them from the default GGUF: those of the
    tiny-LoRA fixture's ``base-hf/`` (built once per cache, and here only if the cache lacks it),
    instead of converting the whole model again for its three small files."""
    from tools.fixtures import tiny_lora

    where = tiny_lora.paths()
    assert str(where["base_gguf"]) == model_path
    if not (where["base_hf"] / "config.json").exists():
        tiny_lora._stage_dir(where["base_hf"], tiny_lora._save_base)
    return where["base_hf"]


def build_dir(root, tokenizer_dir, model_type: str):
    """A tiny random ``model_type`` model saved as transformers saves it, beside SmolLM2's tokenizer."""
    import torch

    torch.manual_seed(0)
    model = BUILDERS[model_type]()
    assert model.config.model_type == model_type
    out = root / model_type
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory, tokenizer_dir):
    """Factory: serve_dir(model_type) -> a basert server on a fresh tiny directory of that type."""
    started: list[ServerProcess] = []

    def start(model_type: str) -> ServerProcess:
        root = tmp_path_factory.mktemp(f"hf_{model_type}")
        path = build_dir(root, tokenizer_dir, model_type)
        args = ["--model", str(path), "--model-name", "tiny", "--engine", "basert", "--threads", "2",
                "--max-context", "1024"]
        srv = ServerProcess(args, root / "server.log")
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def llama(serve_dir):
    return serve_dir("llama")


def test_the_directory_is_what_it_claims(tmp_path, tokenizer_dir):
    """The fixture itself: transformers' own files, tied head (no lm_head tensor), SmolLM2's vocab."""
    from safetensors import safe_open

    path = build_dir(tmp_path, tokenizer_dir, "llama")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == VOCAB
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        assert tuple(st.get_slice("model.embed_tokens.weight").get_shape()) == (VOCAB, 64)
    assert "lm_head.weight" not in keys
    assert all((path / name).is_file() for name in TOKENIZER_FILES)


def test_health_names_basert(llama):
    health = llama.get_json("/health")
    text = json.dumps(health["models"]["tiny"] if "models" in health else health)
    assert "basert" in text and "kv_blocks" in text


def test_chat_completion_answers_with_usage(llama):
    status, body = llama.call("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 5  # the chat template's markup is there
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_tokenizer_is_the_directorys(llama, model_path):
    """The server tokenizes with the directory's tokenizer.json: the same ids as the GGUF's
    tokenizer, special tokens (ChatML) parsed."""
    from superfluid.plugins.vocab import GGUFVocab

    gguf = GGUFVocab(model_path, "g")
    try:
        want = gguf.tokenize(TEXT, True, True)
    finally:
        gguf.close()
    status, body = llama.call("POST", "/tokenize", {"content": TEXT, "add_special": True, "parse_special": True})
    assert status == 200, body
    assert body["tokens"] == want
    assert 1 in want and 2 in want  # <|im_start|> and <|im_end|> as single ids


def test_greedy_completion_is_repeatable(llama):
    def complete() -> dict:
        status, body = llama.call("POST", "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body

    first, second = complete(), complete()
    assert first["usage"]["completion_tokens"] == 12
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_other_architectures_start_and_answer(serve_dir, model_type):
    srv = serve_dir(model_type)
    try:
        assert "basert" in json.dumps(srv.get_json("/health"))
        arch = {"qwen3": "qwen3", "gemma3_text": "gemma3"}[model_type]
        assert re.search(rf"basert on \S+ \(\w+, {arch}\)", srv.log()), srv.log()  # built as that architecture
        status, body = srv.call("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert 1 <= body["usage"]["completion_tokens"] <= 6
        texts = []
        for _ in range(2):
            status, body = srv.call("POST", "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            texts.append(body["choices"][0]["text"])
        assert texts[0] == texts[1]
    finally:
        srv.stop()

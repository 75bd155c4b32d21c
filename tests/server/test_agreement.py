"""At temperature 0 a reply through the server is what llama-cpp-python's own Llama(...) generates
for the same prompt alone: same tokens, same text. Flash attention changes SmolLM2's greedy text,
so the reference uses the setting the server's context gets (auto, which is on for this CPU)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from ..llama_reference import greedy_completions, in_child

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a compiler does.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me three tips for learning Python.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the difference between a list and a tuple?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
]
MAX_TOKENS = 48


def _generate_alone(model_path, prompts, flash_attn: bool) -> dict:
    """Each prompt generated alone by llama-cpp-python's high-level Llama, in a child process."""
    return in_child(greedy_completions, model_path, list(prompts), MAX_TOKENS, flash_attn)


@pytest.fixture(scope="module")
def reference(model_path):
    return _generate_alone(model_path, PROMPTS, flash_attn=True)


def _ask(client, prompt):
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


def test_alone_matches_llama(client, reference):
    for p in PROMPTS[:4]:
        assert _ask(client, p) == reference[p], p


def test_eight_lanes_busy_matches_llama(client, reference):
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = dict(zip(PROMPTS, pool.map(lambda p: _ask(client, p), PROMPTS)))
    mismatched = [p for p in PROMPTS if answers[p] != reference[p]]
    assert not mismatched, {p: (answers[p], reference[p]) for p in mismatched}


def test_flash_attn_off_matches_llama_without_it(start_server, model_path, reference):
    """--flash-attn off reaches the worker's context: its greedy replies are Llama(flash_attn=False)'s,
    and at least one of them differs from the flash-attention reply (else this proves nothing)."""
    openai = pytest.importorskip("openai")
    srv = start_server("--max-batch", "2", "--flash-attn", "off")
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    off = _generate_alone(model_path, PROMPTS, flash_attn=False)
    assert any(off[p] != reference[p] for p in PROMPTS), "flash attention changed no reply"
    try:
        for p in PROMPTS:
            assert _ask(client, p) == off[p], p
    finally:
        srv.stop()


def test_flash_attn_value_is_checked():
    from superfluid.core.cli import load
    from superfluid.core.errors import ConfigError
    config, _ = load(["serve", "--flash-attn", "off"])
    assert config.models[0]["flash-attn"] == "off"
    with pytest.raises(ConfigError, match="flash-attn"):
        load(["serve", "--flash-attn", "fast"])

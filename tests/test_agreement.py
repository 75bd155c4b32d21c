"""At temperature 0 a reply through the server is what llama-cpp-python's own Llama(...) generates
for the same prompt alone: same tokens, same text. Flash attention changes SmolLM2's greedy text,
so the reference uses the setting the server's context gets (auto, which is on for this CPU)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

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


@pytest.fixture(scope="module")
def reference(model_path):
    """Each prompt generated alone by llama-cpp-python's high-level Llama."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path, n_ctx=2048, flash_attn=True, verbose=False, seed=0)
    refs = {}
    for p in PROMPTS:
        out = llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0, repeat_penalty=1.0)
        refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
    del llm
    return refs


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

"""LoRA adapters per row on basert, through the real server and the ``openai`` client: SmolLM2's
GGUF with the fixture's two PEFT adapters (tools/fixtures/tiny_lora.py) as ``smollm2:a`` and
``smollm2:b`` beside the base model. Eight concurrent requests mixed across the three run in the
same steps (basert puts rows of different sets in one batch); each greedy reply equals
transformers + peft alone on the fixture's base directory (the same dequantized weights), and a
long prompt cached under one adapter is not served under another."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("peft")

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "The quick brown fox",
]
LONG = ("<|im_start|>system\n" + " ".join(f"Rule {i}: answer politely and briefly." for i in range(30))
        + "<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n")
# tokens a reply: each is a step of every lane on the server and of peft's generate for the
# reference; 12 already tell the three sets apart on every prompt (test_adapters_change_the_replies)
MAX_TOKENS = 12
SETS = {"smollm2": None, "smollm2:a": "a", "smollm2:b": "b"}


@pytest.fixture(scope="module")
def srv(start_server, tiny_lora):
    return start_server("--engine", "basert", "--threads", "2", "--max-batch", "8",
                        "--lora", f"a={tiny_lora['a_peft']}", "--lora", f"b={tiny_lora['b_peft']}")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_lora):
    """{model name: {prompt: text}}: peft's greedy completion of each prompt alone, up to
    MAX_TOKENS or the end-of-turn token, as the server's completions endpoint returns it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_lora["base_hf"]))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_lora["base_hf"]), dtype=torch.float32).eval()
    out = {}
    for name, adapter in SETS.items():
        model = PeftModel.from_pretrained(base, str(tiny_lora[f"{adapter}_peft"])) if adapter else base
        out[name] = {}
        for p in PROMPTS + [LONG]:
            ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
            if tok.eos_token_id in gen:
                gen = gen[:gen.index(tok.eos_token_id)]
            out[name][p] = tok.decode(gen)
        if adapter:
            base = model.unload()
    return out


def _ask(client, model, prompt):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text, r


def test_adapters_change_the_replies(reference):
    for p in PROMPTS:
        assert len({reference[m][p] for m in SETS}) == 3, p


def test_eight_concurrent_requests_mixed_across_adapters_match_each_reference(client, reference, srv):
    jobs = [(list(SETS)[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _ask(client, *job)[0], jobs))
    wrong = [(m, p, got, reference[m][p]) for (m, p), got in zip(jobs, answers) if got != reference[m][p]]
    assert not wrong, wrong
    assert srv.get_json("/health")  # still serving


def test_a_prefix_cached_under_one_adapter_is_not_served_under_another(client, reference):
    got_a, _ = _ask(client, "smollm2:a", LONG)
    assert got_a == reference["smollm2:a"][LONG]
    got_b, r = _ask(client, "smollm2:b", LONG)
    assert got_b == reference["smollm2:b"][LONG]  # a cross-adapter hit would give a's KV to b
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) == 0
    got_base, r = _ask(client, "smollm2", LONG)
    # at most the one token ("<|im_start|>") LONG shares with PROMPTS[0], which the concurrent test sent
    # the base model: its own prefix, where a's would be the whole of LONG's head
    assert got_base == reference["smollm2"][LONG] and (r.usage.prompt_tokens_details.cached_tokens or 0) <= 1
    got_a, r = _ask(client, "smollm2:a", LONG)  # a's own prefix is reused (the cache works)
    assert got_a == reference["smollm2:a"][LONG] and r.usage.prompt_tokens_details.cached_tokens > 0

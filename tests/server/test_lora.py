"""LoRA adapters chosen per request, through the real server on llama.cpp serving SmolLM2 with
two random adapters (tools/fixtures/tiny_lora.py) and the base model at once, driven by the
``openai`` client. Every greedy reply equals llama-cpp-python's own ``Llama(lora_path=...)`` for
its adapter, alone (tests/lora_reference.py); replies differ between adapters (else nothing is
shown); a long prompt cached under one adapter is never served to another; adapters load and
unload through the admin API while requests run, with nothing lost."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from ..llama_reference import in_child
from ..lora_reference import agrees_up_to_a_close_call, greedy_under_adapter

openai = pytest.importorskip("openai")

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a compiler does.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
# a prompt long enough to be cached (and, on a cross-adapter hit, served) as a prefix
LONG = ("<|im_start|>system\n" + " ".join(f"Rule {i}: answer politely and briefly." for i in range(40))
        + "<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n")
MAX_TOKENS = 16
# LONG is prefilled in steps of this many tokens by the server and by the reference alike: adapter
# b's reply to it is a near-tie that 128-token and 512-token steps decide differently
STEP = 128
SETS = {"smollm2": None, "smollm2:a": "a", "smollm2:b": "b"}
# Requests decoded side by side run in batches the lone reference never sees, and under an adapter
# llama.cpp's logits move with the batch's shape (by up to ~1 in a logit, measured with Llama itself):
# a concurrent reply equals its reference up to any position the reference decided by less than this
CLOSE_CALL = 1.0


@pytest.fixture(scope="module")
def fixture_paths(tiny_lora):
    """tools/fixtures/tiny_lora.py's files (conftest's ``tiny_lora``)."""
    return tiny_lora


@pytest.fixture(scope="module")
def srv(start_server, fixture_paths):
    return start_server("--max-batch", "8", "--prefill-budget", str(STEP), "--lora", f"a={fixture_paths['a_gguf']}",
                        "--lora", f"b={fixture_paths['b_gguf']}")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def reference(fixture_paths, model_path):
    """{model name: {prompt: (text, tokens)}} from Llama with each adapter (or none)."""
    out = {}
    for name, adapter in SETS.items():
        lora = str(fixture_paths[f"{adapter}_gguf"]) if adapter else None
        out[name] = in_child(greedy_under_adapter, model_path, lora, PROMPTS + [LONG], MAX_TOKENS, n_batch=STEP)
    return out


def _alone(reference, model, prompt):
    """A lone request's reply as the reference gives it: (text, completion tokens)."""
    return reference[model][prompt][:2]


def _ask(client, model, prompt, **extra):
    """((text, completion tokens), response): compared with a lone reference's first two items."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **extra)
    return (r.choices[0].text, r.usage.completion_tokens), r


def test_adapters_change_the_replies(reference):
    """Else the other tests would show nothing."""
    for p in PROMPTS:
        assert len({reference[m][p][0] for m in SETS}) == 3, p


def test_models_lists_each_adapter_under_its_base(srv):
    models = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert models["smollm2:a"]["parent"] == "smollm2" and models["smollm2:b"]["parent"] == "smollm2"
    listed = srv.get_json("/lora-adapters")
    assert [(a["id"], a["name"]) for a in listed] == [(0, "a"), (1, "b")]


def test_eight_concurrent_requests_mixed_across_adapters_match_each_reference(client, reference):
    jobs = [(list(SETS)[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _ask(client, *job)[0], jobs))
    wrong = [(m, p, got, reference[m][p][0]) for (m, p), got in zip(jobs, answers)
             if not agrees_up_to_a_close_call(got[0], reference[m][p], CLOSE_CALL)]
    assert not wrong, wrong


def test_llama_server_lora_field_selects_by_id_and_name(client, reference):
    p = PROMPTS[0]
    assert _ask(client, "smollm2", p, extra_body={"lora": [{"id": 1, "scale": 1.0}]})[0] == _alone(reference, "smollm2:b", p)
    assert _ask(client, "smollm2", p, extra_body={"lora": [{"id": "a"}]})[0] == _alone(reference, "smollm2:a", p)
    assert _ask(client, "smollm2:a", p, extra_body={"lora": [{"id": 0, "scale": 0}]})[0] == _alone(reference, "smollm2", p)


def test_a_prefix_cached_under_one_adapter_is_not_served_under_another(client, reference):
    got_a, _ = _ask(client, "smollm2:a", LONG)
    assert got_a == _alone(reference, "smollm2:a", LONG)
    got_b, r = _ask(client, "smollm2:b", LONG)
    assert got_b == _alone(reference, "smollm2:b", LONG)  # a cross-adapter hit would give a's KV to b
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) == 0
    got_base, r = _ask(client, "smollm2", LONG)
    # at most the one token ("<|im_start|>") LONG shares with PROMPTS[0], which the tests before sent
    # the base model: its own prefix, where a's would be the whole of LONG's head
    assert got_base == _alone(reference, "smollm2", LONG) and (r.usage.prompt_tokens_details.cached_tokens or 0) <= 1
    got_a, r = _ask(client, "smollm2:a", LONG)  # a's own prefix is reused (the cache works)
    assert got_a == _alone(reference, "smollm2:a", LONG) and r.usage.prompt_tokens_details.cached_tokens > 0


def test_unknown_adapters_are_refused_in_the_protocols_shape(client, srv):
    with pytest.raises(openai.NotFoundError):
        _ask(client, "smollm2:nope", PROMPTS[0])
    with pytest.raises(openai.BadRequestError, match="lora"):
        _ask(client, "smollm2", PROMPTS[0], extra_body={"lora": [{"id": 7, "scale": 1.0}]})
    status, body = srv.call("POST", "/admin/models/smollm2/adapters", {"name": "c", "path": "/nonexistent.gguf"})
    assert status == 400 and "does not exist" in body["error"]["message"]


def test_a_file_that_is_no_adapter_of_this_model_is_a_clear_422(srv, fixture_paths, client, reference):
    status, body = srv.call("POST", "/admin/models/smollm2/adapters",
                            {"name": "wrong", "path": str(fixture_paths["wrong_gguf"])})
    assert status == 422, body
    assert "wrong" not in {a["name"] for a in srv.get_json("/lora-adapters")}
    assert _ask(client, "smollm2", PROMPTS[1])[0] == _alone(reference, "smollm2", PROMPTS[1])  # still serving


def test_runtime_load_and_unload_under_traffic_lose_nothing(srv, client, reference, fixture_paths):
    results, errors = {}, []

    def run(key, model, prompt):
        try:
            results[key] = (model, prompt, _ask(client, model, prompt)[0])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((key, model, repr(exc)))

    threads = [threading.Thread(target=run, args=(i, m, PROMPTS[i % len(PROMPTS)]))
               for i, m in enumerate(["smollm2:a", "smollm2", "smollm2:b", "smollm2:a"] * 2)]
    for t in threads:
        t.start()
    # load b's file again as "c" while they run: served once the answer comes
    status, body = srv.call("POST", "/admin/models/smollm2/adapters",
                            {"name": "c", "path": str(fixture_paths["b_gguf"])})
    assert status == 200, body
    got_c = _ask(client, "smollm2:c", PROMPTS[2])[0][0]  # decoded beside the threads' requests
    assert agrees_up_to_a_close_call(got_c, reference["smollm2:b"][PROMPTS[2]], CLOSE_CALL), got_c
    # unload "a" while its requests may still run: they finish; new ones are 404 from then on
    status, body = srv.call("DELETE", "/admin/models/smollm2/adapters/a")
    assert status in (200, 202), body
    with pytest.raises(openai.NotFoundError):
        _ask(client, "smollm2:a", PROMPTS[0])
    for t in threads:
        t.join(300)
    assert not errors, errors
    wrong = {k: v for k, v in results.items()
             if not agrees_up_to_a_close_call(v[2][0], reference[v[0]][v[1]], CLOSE_CALL)}
    assert len(results) == 8 and not wrong, wrong
    assert "a" not in {a["name"] for a in srv.get_json("/lora-adapters")}


def test_every_front_end_that_names_a_model_selects_the_adapter(srv, client):
    """Anthropic's /v1/messages and Ollama's /api/chat on MODEL:ADAPTER reply as a chat completion
    on it does, and not as the base model (the same greedy tokens from the same prompt)."""
    messages = [{"role": "user", "content": "Name three rivers."}]

    def chat(model):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        return r.choices[0].message.content

    assert chat("smollm2:b") != chat("smollm2")
    status, body = srv.call("POST", "/v1/messages", {"model": "smollm2:b", "max_tokens": 16, "temperature": 0,
                                                     "messages": messages})
    assert status == 200 and body["content"][0]["text"] == chat("smollm2:b")
    status, body = srv.call("POST", "/api/chat", {"model": "smollm2:b", "stream": False, "messages": messages,
                                                  "options": {"temperature": 0, "num_predict": 16}})
    assert status == 200 and body["message"]["content"] == chat("smollm2:b")
    assert "smollm2:b" in {m["name"] for m in srv.get_json("/api/tags")["models"]}

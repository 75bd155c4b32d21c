"""The OpenAI API against the real server and the real SmolLM2 model, through the openai client."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest

CHATML = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def test_chat_completion(client):
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": "Say hello to me."}])
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_whole(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=30, messages=messages)
    stream = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=30, messages=messages,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_length_and_usage(client):
    r = client.completions.create(model="smollm2", prompt=[1, 4093, 198, 19161], max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 4
    assert r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text


def test_completion_stream(client):
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is",
                                            max_tokens=8, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_sequence(client):
    prompt = CHATML.format(q="Describe the sea in two sentences.")
    full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) > 6
    stop = " " + words[5]  # a stop string from the middle of the reply, spanning tokens maybe
    cut = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
                                    stop=["never-appears", stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < full.usage.completion_tokens


def test_eight_concurrent_requests(client):
    questions = ["Explain recursion.", "What is a linked list?", "Describe TCP.", "What is Rust?",
                 "Explain a hash map.", "What is a mutex?", "Describe HTTP caching.", "What is a GPU?"]

    def one(q):
        return client.completions.create(model="smollm2", prompt=CHATML.format(q=q), max_tokens=32,
                                         temperature=0, extra_body={"ignore_eos": True})

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, questions))
    assert len(results) == 8
    for r in results:
        assert r.usage.completion_tokens == 32
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text.strip()


def test_models_health_slots_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    health = server.get_json("/health")
    assert health["status"] == "ok"
    assert health["models"]["smollm2"]["worker_pid"] > 0
    assert health["models"]["smollm2"]["native_rounds"] is True  # the decode loop in C is built and used
    slots = server.get_json("/slots")["models"]["smollm2"]["slots"]
    assert len(slots) == 10  # 8 lanes' KV buffers and 2 spare ones
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    m = server.metrics()
    assert m['superfluid_prefill_budget_tokens{model="smollm2"}'] > 0
    assert m['superfluid_decode_grant_tokens{model="smollm2"}'] >= 1
    assert m['superfluid_generated_tokens_total{model="smollm2"}'] >= 4
    assert m['superfluid_prompt_tokens_total{model="smollm2"}'] > 0
    assert any(k.startswith("superfluid_ttft_seconds_count") and v > 0 for k, v in m.items())
    assert 'superfluid_lanes_busy{model="smollm2"}' in m
    assert 'superfluid_queue_depth{model="smollm2",qos="agent"}' in m


def test_penalties_reach_llamacpps_sampler(client):
    prompt = CHATML.format(q="Count from one to twenty in words.")
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0)
    penalized = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
                                          frequency_penalty=1.5, presence_penalty=1.0,
                                          extra_body={"repeat_penalty": 1.3})
    assert penalized.choices[0].text and penalized.choices[0].text != plain.choices[0].text


def _counter(server, name: str) -> float:
    return server.metrics().get(f'{name}{{model="smollm2"}}', 0.0)


def test_a_reply_sent_whole_runs_in_quiet_ticks_that_yield_to_a_newcomer(start_server):
    """With --quiet-ticks, a lone non-streamed lane decodes in quiet ticks (250 ms with lanes
    free); a streamed newcomer ends the quiet tick in flight instead of waiting for it."""
    openai = pytest.importorskip("openai")
    server = start_server("--max-batch", "4", "--quiet-ticks")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    quiet0 = _counter(server, "superfluid_quiet_ticks_total")
    early0 = _counter(server, "superfluid_ticks_ended_early_total")
    with cf.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(client.completions.create, model="smollm2", prompt=CHATML.format(q="Tell a story."),
                            max_tokens=600, temperature=0, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 30
        while _counter(server, "superfluid_quiet_ticks_total") == quiet0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _counter(server, "superfluid_quiet_ticks_total") > quiet0
        for _ in range(3):  # one newcomer may land between two ticks, where it has nothing to end
            parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smollm2", temperature=0, max_tokens=2, stream=True,
                messages=[{"role": "user", "content": "Hi"}]) if c.choices]
            assert "".join(parts)
            if _counter(server, "superfluid_ticks_ended_early_total") > early0 or whole.done():
                break
        assert _counter(server, "superfluid_ticks_ended_early_total") > early0
        assert whole.result().usage.completion_tokens == 600


def test_a_short_prompt_reuses_a_similar_head_in_place(client):
    """A prompt sharing 10 of its 30 tokens with an earlier one (under the 16 worth a copy, over
    a tenth of it) is seeded from that earlier prompt's slot, even with empty slots to spare."""
    rng = random.Random()
    first = [rng.randrange(1000, 40000) for _ in range(30)]
    second = first[:10] + [rng.randrange(1000, 40000) for _ in range(20)]
    client.completions.create(model="smollm2", prompt=first, max_tokens=2, temperature=0)
    r = client.completions.create(model="smollm2", prompt=second, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 30
    assert r.usage.prompt_tokens_details.cached_tokens == 10

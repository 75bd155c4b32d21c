"""The prefix cache against the real server and model: a conversation's next turn, a repeated
prompt, and a burst of requests sharing a long prefix prefill the shared tokens once."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request

import pytest

SYSTEM = ("You are a meticulous assistant for a team of software engineers. " * 12).strip()
LONG_DOC = " ".join(f"Note {i}: the cache layer keeps hot entries close to the scheduler." for i in range(60))


def metric(server, name):
    return server.settled_metric(name)


def post(server, path, body):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def cache_server(start_server):
    """One server for the two tests below: each measures its own metric deltas and reads only
    the caches its own requests leave (the second turn runs first, on an empty cache)."""
    return start_server("--max-batch", "4")


def check_second_turn_reuses_the_prefix(srv, max_tokens: int) -> tuple[float, float, dict, float]:
    """A conversation's second turn prefills only its new tokens; (cold seconds, warm seconds,
    the second reply, tokens reused). Shared with the unified-pool test."""
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_DOC + "\nSummarize."}]
    before = metric(srv, "superfluid_prefill_tokens_total")
    first, cold_s = post(srv, "/v1/chat/completions", {"messages": turn1, "max_tokens": max_tokens, "temperature": 0})
    cold_prefill = metric(srv, "superfluid_prefill_tokens_total") - before
    assert cold_prefill == first["usage"]["prompt_tokens"]

    reply = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks. Shorter?"}]
    hits_before = metric(srv, "superfluid_prefix_cache_hit_tokens_total")
    before = metric(srv, "superfluid_prefill_tokens_total")
    second, warm_s = post(srv, "/v1/chat/completions", {"messages": turn2, "max_tokens": max_tokens, "temperature": 0})
    warm_prefill = metric(srv, "superfluid_prefill_tokens_total") - before
    reused = metric(srv, "superfluid_prefix_cache_hit_tokens_total") - hits_before
    assert reused >= first["usage"]["prompt_tokens"] - 1
    assert warm_prefill == second["usage"]["prompt_tokens"] - reused
    assert warm_prefill < 40, (cold_prefill, warm_prefill)  # only the new turn
    return cold_s, warm_s, second, reused


def test_second_turn_reuses_the_prefix(cache_server):
    cold_s, warm_s, _, _ = check_second_turn_reuses_the_prefix(cache_server, max_tokens=1)
    assert warm_s < cold_s            # prefilled ~30 tokens instead of ~900


def test_repeated_prompt_reuses_cache_and_gives_the_same_text(cache_server):
    srv = cache_server
    body = {"prompt": f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
                      "<|im_start|>assistant\n", "max_tokens": 24, "temperature": 0}
    a, _ = post(srv, "/v1/completions", body)
    hits = metric(srv, "superfluid_prefix_cache_hits_total")
    b, _ = post(srv, "/v1/completions", body)
    assert metric(srv, "superfluid_prefix_cache_hits_total") == hits + 1
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    slots = srv.get_json("/slots")["models"]["smollm2"]["slots"]
    assert any(s["state"] == "free" and s["cached_tokens"] > 100 for s in slots)


def test_a_short_shared_head_is_kept_when_a_slot_cache_is_overwritten(start_server):
    """One lane, so every request overwrites the previous one's cache: the few tokens two raw
    ChatML prompts share (below the 16 worth a copy) stay in place, only the rest is prefilled,
    and the reply is the one the prompt gets from an empty slot."""
    srv = start_server("--max-batch", "1")
    fruit = {"prompt": "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
             "max_tokens": 8, "temperature": 0}
    other = {**fruit, "prompt": "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"}
    cold, _ = post(srv, "/v1/completions", fruit)        # an empty slot: nothing to reuse
    assert cold["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    post(srv, "/v1/completions", other)                  # overwrites the fruit prompt's cache
    before = metric(srv, "superfluid_prefill_tokens_total")
    warm, _ = post(srv, "/v1/completions", fruit)        # lands on the other prompt's cache
    head = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < head < 16, warm["usage"]
    assert metric(srv, "superfluid_prefill_tokens_total") - before == warm["usage"]["prompt_tokens"] - head
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


def test_shared_prefix_burst_prefills_the_prefix_once(start_server):
    srv = start_server("--max-batch", "8")
    prefix = f"<|im_start|>system\n{SYSTEM}\n{LONG_DOC}<|im_end|>\n<|im_start|>user\n"
    prompts = [prefix + f"Question {i}: what is note {i} about?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(32)]
    before = metric(srv, "superfluid_prefill_tokens_total")
    with cf.ThreadPoolExecutor(32) as pool:  # 32 requests against 8 lanes: all complete
        results = list(pool.map(lambda p: post(srv, "/v1/completions",
                                               {"prompt": p, "max_tokens": 4, "temperature": 0})[0], prompts))
    assert len(results) == 32 and all(r["usage"]["completion_tokens"] >= 1 for r in results)
    prefilled = metric(srv, "superfluid_prefill_tokens_total") - before
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in results]
    shared = min(prompt_tokens) - 20          # the common part, conservatively
    suffixes = sum(p - shared for p in prompt_tokens)
    times_prefilled = (prefilled - suffixes) / shared
    assert times_prefilled <= 1.0, (prefilled, shared, suffixes)


# haiku prompts that share only the template's first tokens, under a tenth of them (no similar head is cut)
WORDS = {season: " ".join(f"{season}{i}" for i in range(12)) for season in ("winter", "spring", "summer", "autumn")}


def test_prefix_evicted_to_host_memory_comes_back(start_server):
    """The host tier is lossless: a prefix that went to host memory and came back gives the same
    reply as the same prefix served from the pool. (A cache hit feeds the last prompt token alone,
    so at a near-tie its greedy text may differ from a cold prefill's, as with llama-server's
    prompt cache; both hits here take the same path.)"""
    srv = start_server("--max-batch", "1")  # one lane, four KV buffers: the fourth new prompt evicts the oldest
    doc = {"prompt": f"<|im_start|>system\n{SYSTEM}\n{LONG_DOC}<|im_end|>\n<|im_start|>user\n"
                     "What is note 7 about?<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 24, "temperature": 0}
    cold, _ = post(srv, "/v1/completions", doc)
    from_pool, _ = post(srv, "/v1/completions", doc)
    for season in ("winter", "spring", "summer", "autumn"):  # three fill the spare buffers, one pushes doc out
        post(srv, "/v1/completions", {"prompt": f"<|im_start|>user\n{WORDS[season]}: a haiku about {season}, please."
                                                "<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 8, "temperature": 0})
    assert metric(srv, "superfluid_prefix_evictions_total") >= 1
    assert metric(srv, "superfluid_host_cache_bytes") > 0
    before = metric(srv, "superfluid_prefill_tokens_total")
    hits = metric(srv, "superfluid_prefix_cache_hit_tokens_total")
    from_host, _ = post(srv, "/v1/completions", doc)
    assert from_host["choices"][0]["text"] == from_pool["choices"][0]["text"]
    assert metric(srv, "superfluid_prefix_cache_hit_tokens_total") - hits >= cold["usage"]["prompt_tokens"] - 1
    assert metric(srv, "superfluid_prefill_tokens_total") - before <= 2


def test_default_watermark_fires_when_lanes_fill_the_pool(start_server):
    """Occupancy is measured against every cell of the per-sequence buffers (the lanes' and the
    two spare ones, which hold cached prefixes too), so the default --pressure-high (85 %) fires
    when four cached prefixes fill ~92 % of four buffers, and evicts the oldest down to
    --pressure-low (70 %). Buffers of 256 cells and prompts of ~240 tokens fill them as 512 cells
    and ~490 tokens did, for half the prefill."""
    srv = start_server("--max-batch", "2", "--max-context", "256")
    words = " ".join(f"item{i}" for i in range(80))  # 242 tokens with the template
    prompts = [f"<|im_start|>user\nList {n}: {words}<|im_end|>\n<|im_start|>assistant\n" for n in "ABCD"]
    for prompt in prompts:  # one after the other: each leaves its KV cached in its buffer
        out, _ = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert 225 < out["usage"]["prompt_tokens"] < 250
    snap = srv.get_json("/slots")["models"]["smollm2"]
    assert snap["kv_capacity"] == 4 * 256  # every buffer's cells
    evicted = sum(v for k, v in srv.metrics().items()
                  if k.startswith("superfluid_prefix_evictions") and 'reason="watermark"' in k)
    assert evicted >= 1
    # at least the oldest went: eviction counts the cells D's lane held then (it may still have
    # been prefilling, so three caches can end up a little over --pressure-low)
    assert snap["kv_cached"] <= 3 * 250

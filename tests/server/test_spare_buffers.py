"""The llama.cpp spare sequence buffers and a shared pool's bounded prefix cache, against the real
server and model (SmolLM2).

With --max-batch 2 the worker holds four per-sequence KV buffers: two lanes run at most, and the
buffers keep the four most recently finished conversations, so a returning one is seeded from its
buffer in place; the fifth pushes the oldest out to host memory, from where it comes back. In a
shared pool (--kv-unified) cached prefixes keep at most one lane's context of cells."""

from __future__ import annotations

import concurrent.futures as cf
import time

from .test_prefix_cache import metric, post

MODEL = "smollm2"


def first_turn(name: str, n: int = 12) -> str:
    notes = " ".join(f"{name} note {i}: the {name.lower()} team ships on day {i}." for i in range(n))
    return f"<|im_start|>user\n{name} here. {notes}\nSummarize.<|im_end|>\n<|im_start|>assistant\n"


def turn(srv, prompt: str, max_tokens: int = 8) -> dict:
    out, _ = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return out


def second_turn(prompt: str, reply: dict) -> str:
    return (prompt + reply["choices"][0]["text"] + "<|im_end|>\n<|im_start|>user\nShorter?<|im_end|>\n"
            "<|im_start|>assistant\n")


def cached(out: dict) -> int:
    return out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def host_hits(srv) -> float:
    return metric(srv, "superfluid_prefix_cache_host_hits_total")


def slots(srv) -> dict:
    return srv.get_json("/slots")["models"][MODEL]


def test_spare_buffers_keep_the_most_recent_conversations(start_server):
    srv = start_server("--max-batch", "2")
    health = srv.get_json("/health")["models"][MODEL]
    assert health["n_seq_max"] == 4 and not health["kv_unified"]
    assert health["kv_bytes"] == health["n_ctx"] * health["bytes_per_cell"] > 0
    snap = slots(srv)
    assert len(snap["slots"]) == 4 and snap["max_batch"] == 2

    # three conversations take a turn each: every one stays cached in a buffer of its own
    prompts = {name: first_turn(name) for name in ("Alpha", "Bravo", "Charlie", "Delta", "Echo")}
    firsts = {name: turn(srv, prompts[name]) for name in ("Alpha", "Bravo", "Charlie")}
    held = sorted(s["cached_tokens"] for s in slots(srv)["slots"])
    assert held[0] == 0 and all(n >= firsts["Alpha"]["usage"]["prompt_tokens"] - 20 for n in held[1:])

    # Alpha returns: seeded from its own buffer, nothing loaded from host memory or sent there
    hits = host_hits(srv)
    again = turn(srv, second_turn(prompts["Alpha"], firsts["Alpha"]))
    assert cached(again) >= firsts["Alpha"]["usage"]["prompt_tokens"]
    assert host_hits(srv) == hits
    assert metric(srv, "superfluid_prefix_evictions_total") == 0 and slots(srv)["host_cache_entries"] == 0

    # Delta fills the fourth buffer, Echo pushes out the least recently finished (Bravo) ...
    for name in ("Delta", "Echo"):
        firsts[name] = turn(srv, prompts[name])
    assert metric(srv, "superfluid_prefix_evictions_total") >= 1 and slots(srv)["host_cache_entries"] >= 1
    # ... which comes back from host memory
    hits = host_hits(srv)
    bravo = turn(srv, second_turn(prompts["Bravo"], firsts["Bravo"]))
    assert cached(bravo) >= firsts["Bravo"]["usage"]["prompt_tokens"]
    assert host_hits(srv) == hits + 1

    # a burst never runs more lanes than --max-batch, whatever buffers are free
    busiest = 0
    with cf.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(turn, srv, first_turn(f"Burst{i}", 10), 24) for i in range(5)]
        while not all(f.done() for f in futures):
            busiest = max(busiest, sum(s["state"] != "free" for s in slots(srv)["slots"]))
            time.sleep(0.02)
        assert all(f.result()["usage"]["completion_tokens"] >= 1 for f in futures)
    assert busiest == 2


def test_shared_pool_keeps_one_lanes_context_of_cached_prefixes(start_server):
    """--kv-unified, --max-context 512: three finished conversations of ~320 tokens would hold
    ~960 cells as cached prefixes; the cache keeps at most 512, the oldest goes to host memory
    (reason cache_bound) and comes back from there."""
    srv = start_server("--max-batch", "2", "--kv-unified", "--max-context", "512")
    assert srv.get_json("/health")["models"][MODEL]["kv_unified"] is True
    prompts = {name: first_turn(name, 20) for name in ("Alpha", "Bravo", "Charlie")}
    firsts = {name: turn(srv, p) for name, p in prompts.items()}
    assert all(260 < f["usage"]["prompt_tokens"] < 400 for f in firsts.values())
    snap = slots(srv)
    assert 0 < snap["kv_cached"] <= 512
    bounded = sum(v for k, v in srv.metrics().items()
                  if k.startswith("superfluid_prefix_evictions_total") and 'reason="cache_bound"' in k)
    assert bounded >= 1 and snap["host_cache_entries"] >= 1
    hits = host_hits(srv)
    alpha = turn(srv, second_turn(prompts["Alpha"], firsts["Alpha"]))
    assert cached(alpha) >= firsts["Alpha"]["usage"]["prompt_tokens"]
    assert host_hits(srv) == hits + 1
    assert slots(srv)["kv_cached"] <= 512

"""One KV pool shared by all lanes (llama.cpp ``kv_unified``, as sliding-window and recurrent
models get), against the real server and model, forced for a plain-attention model with
--kv-unified: cached prefixes share their cells with the lanes they seed, and a pool smaller than
lanes × context refuses plans that the scheduler replans (evict, requeue) instead of failing."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

from .test_prefix_cache import LONG_DOC, SYSTEM, check_second_turn_reuses_the_prefix, metric, post


def test_unified_pool_second_turn_reuses_the_prefix(start_server):
    srv = start_server("--max-batch", "4", "--kv-unified")
    assert '"kv_unified": true' in json.dumps(srv.get_json("/health"))
    _, _, second, reused = check_second_turn_reuses_the_prefix(srv, max_tokens=8)
    assert second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", reused) == reused


def test_unified_pool_shared_prefix_burst_prefills_it_once(start_server):
    srv = start_server("--max-batch", "8", "--kv-unified")
    prefix = f"<|im_start|>system\n{SYSTEM}\n{LONG_DOC}<|im_end|>\n<|im_start|>user\n"
    prompts = [prefix + f"Question {i}: what is note {i} about?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(32)]
    before = metric(srv, "superfluid_prefill_tokens_total")
    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: post(srv, "/v1/completions",
                                               {"prompt": p, "max_tokens": 4, "temperature": 0})[0], prompts))
    assert len(results) == 32 and all(r["usage"]["completion_tokens"] >= 1 for r in results)
    prefilled = metric(srv, "superfluid_prefill_tokens_total") - before
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in results]
    shared = min(prompt_tokens) - 20          # the common part, conservatively
    suffixes = sum(p - shared for p in prompt_tokens)
    times_prefilled = (prefilled - suffixes) / shared
    print(f"unified pool burst: prefilled {prefilled} tokens, shared prefix prefilled {times_prefilled:.2f} times")
    assert times_prefilled <= 1.0, (prefilled, shared, suffixes)


def stream(srv, body) -> dict:
    """A streamed completion: its text, finish reason and any error seen mid-stream."""
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, finish, errors = [], None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk.get("choices", []):
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish": finish, "errors": errors}


TOPICS = ["rivers", "volcanoes", "lighthouses", "glaciers", "bridges", "libraries", "orchards", "deserts",
          "harbors", "comets", "forests", "railways", "bakeries", "canyons", "windmills", "coral reefs"]


def test_small_pool_holds_fewer_lanes_and_every_request_completes(start_server):
    """16 lanes against a pool of 1024 cells (one context's worth; 16 × ~135 tokens needed, about
    twice the pool, with 16 generated tokens a lane: a pool of 2048 and 32 tokens a lane took
    twice the decoding for the same refusals): the plans it cannot hold are refused and
    replanned (cached prefixes evicted, the newest lanes requeued); every request completes,
    none fails or resets mid-stream.

    Its text at temperature 0 is not always byte-identical to the request's text alone: in one
    pool a sequence's cells lie among other sequences' cells, so llama.cpp's attention sums
    them in another order (float rounding), and a near-tie can flip. Measured here, not asserted."""
    srv = start_server("--max-batch", "16", "--kv-unified", "--max-context", "1024", "--kv-pool-cells", "1024")
    assert '"n_ctx": 1024' in json.dumps(srv.get_json("/health"))
    bodies = [{"prompt": f"<|im_start|>user\nTopic {i}: {topic}. " + " ".join(
                   f"Fact {j} about {topic}: it differs from place to place." for j in range(6))
               + f"\nWrite a short paragraph about {topic}.<|im_end|>\n<|im_start|>assistant\n",
               "max_tokens": 16, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
              for i, topic in enumerate(TOPICS)]
    alone = [stream(srv, b) for b in bodies]
    assert all(a["finish"] == "length" and not a["errors"] for a in alone)
    before = metric(srv, "superfluid_kv_pool_rejections_total")
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: stream(srv, b), bodies))
    rejections = metric(srv, "superfluid_kv_pool_rejections_total") - before
    same = sum(a["text"] == t["text"] for a, t in zip(alone, together))
    print(f"small pool: {rejections:.0f} refused plans; {same}/16 texts identical to alone")
    assert rejections >= 1  # the pool really was too small for all lanes at once
    for i, t in enumerate(together):
        assert not t["errors"], (i, t["errors"])
        assert t["finish"] == "length", (i, t)  # all 16 tokens: nothing cut, nothing reset
    assert metric(srv, "superfluid_requests_total") >= 32

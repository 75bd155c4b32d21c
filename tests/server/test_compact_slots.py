"""On llama.cpp, busy lanes sit in neighbouring slots (EngineCapabilities.compact_slots): a batch
attends over every per-sequence KV buffer from its lowest slot to its highest, so scattered lanes
cost more a step. Real server, real model: after traffic has left a cached prefix in every slot,
bursts of 4 requests must each run in 4 consecutive slots."""

from __future__ import annotations

import concurrent.futures as cf
import time


def _burst(srv, n: int, tag: str, max_tokens: int) -> list[list[int]]:
    """Send ``n`` distinct completions at once; the busy slot sets seen while they run."""
    def one(i):
        status, body = srv.call("POST", "/v1/completions", {
            "prompt": f"[{tag}.{i}] Write a long story about a lighthouse keeper number {i}.",
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert status == 200, body

    seen = []
    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        deadline = time.monotonic() + 120
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            slots = srv.call("GET", "/slots")[1]["models"]["smollm2"]["slots"]
            busy = sorted(s["id"] for s in slots if s["state"] != "free")
            if len(busy) == n:
                seen.append(busy)
            time.sleep(0.05)
        for f in futures:
            f.result()
    return seen


def test_bursts_run_in_consecutive_slots(start_server):
    srv = start_server("--max-batch", "8")
    try:
        _burst(srv, 8, "fill", 8)           # every slot now holds a cached prefix
        for n in (1, 2, 1, 2):              # uneven traffic ages the caches out of slot order
            _burst(srv, n, f"age{n}", 8)
        for round_ in range(3):
            seen = _burst(srv, 4, f"four{round_}", 48)
            assert seen, "never saw the 4 lanes busy together"
            for busy in seen:
                assert busy[-1] - busy[0] == 3, f"round {round_}: lanes in slots {busy}"
    finally:
        srv.stop()

"""Faults against the real server and model: a killed worker is restarted and every stream
completes with the text an undisturbed run gives."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
import urllib.request

PROMPTS = [f"<|im_start|>user\nTell me about topic number {i}: {t}.<|im_end|>\n<|im_start|>assistant\n"
           for i, t in enumerate(["volcanoes", "the moon", "bees", "trains", "rivers", "chess", "clouds",
                                  "bread"])]
TOKENS = 64  # the kill comes after 10 chunks a stream: each is then well under way, not near its end


def stream(base, prompt, seen=None):
    body = json.dumps({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                       "stream": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
                if seen is not None:
                    seen.append(1)
    return "".join(text)


def test_worker_kill_loses_nothing(start_server):
    srv = start_server("--max-batch", "8")
    with cf.ThreadPoolExecutor(8) as pool:
        reference = list(pool.map(lambda p: stream(srv.base, p), PROMPTS))
    pid = srv.get_json("/health")["models"]["smollm2"]["worker_pid"]
    seen: list[int] = []
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, srv.base, p, seen) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while len(seen) < 8 * 10 and time.monotonic() < deadline:  # every stream well under way
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        texts = [f.result(timeout=300) for f in futures]
    assert texts == reference
    health = srv.get_json("/health")["models"]["smollm2"]
    assert health["restarts"] == 1 and health["worker_pid"] != pid and health["state"] == "ready"

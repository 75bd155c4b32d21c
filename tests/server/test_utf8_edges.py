"""UTF-8 at the edges of a reply, on the real server: SmolLM2 answers "Hi" with an emoji, whose
bytes span several tokens, so a reply cut by max_tokens can end inside a character. No chunk, no
whole reply and no logprob ``token`` string may hold U+FFFD; the exact bytes stay in
logprobs' ``bytes``."""

from __future__ import annotations

import json
import urllib.request

import pytest

HI = [{"role": "user", "content": "Hi"}]


def stream(server, body: dict) -> list[dict]:
    req = urllib.request.Request(server.base + "/v1/chat/completions", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode("utf-8").strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("max_tokens", [3, 4, 5, 6, 7])
def test_a_reply_cut_inside_a_character_never_shows_a_replacement(server, max_tokens):
    body = {"messages": HI, "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    chunks = stream(server, body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "\ufffd" not in text
    status, whole = server.call("POST", "/v1/chat/completions", body)
    assert status == 200, whole
    message = whole["choices"][0]["message"]["content"]
    assert "\ufffd" not in message and message == text
    entries = whole["choices"][0]["logprobs"]["content"]
    assert len(entries) == whole["usage"]["completion_tokens"]
    raw = b"".join(bytes(e["bytes"]) for e in entries)
    assert all("\ufffd" not in e["token"] for e in entries)
    # the text is the tokens' bytes, less a character the cut left unfinished
    assert raw.decode("utf-8", errors="ignore") == message or raw.startswith(message.encode())


def test_the_seen_case_hi_with_five_tokens(server):
    """The reported case: the greedy reply to "Hi" cut at 5 tokens ended in a "\\ufffd" chunk."""
    chunks = stream(server, {"messages": HI, "max_tokens": 5, "temperature": 0})
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert all("\ufffd" not in (c or "") for c in contents)

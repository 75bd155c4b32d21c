"""Per-key limits against a real server with a real policy file: requests-per-minute and
tokens-per-minute (429 ``rate_limit_exceeded`` with Retry-After and x-ratelimit-* headers, which
successes carry too), lanes (429 ``too_many_concurrent_requests``; the slot comes back when the
request ends, or when its client goes away), another key unaffected, and the per-key counters on
/metrics (the key's name, never its secret)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

from .test_auth import ASK, call, error

SECRETS = {"rpm": "sk-rpm-secret-1", "tpm": "sk-tpm-secret-2", "lanes": "sk-lanes-secret-3",
           "free": "sk-free-secret-4"}
TPM = 100
POLICY = f"""
[keys.rpm]
sha256 = "{hash_secret(SECRETS['rpm'])}"
requests-per-minute = 3

[keys.tpm]
sha256 = "{hash_secret(SECRETS['tpm'])}"
tokens-per-minute = {TPM}

[keys.lanes]
sha256 = "{hash_secret(SECRETS['lanes'])}"
lanes = 1

[keys.free]
sha256 = "{hash_secret(SECRETS['free'])}"
"""
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


@pytest.fixture(scope="module")
def limited(start_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(POLICY)
    return start_server("--key-policy", str(path), "--max-batch", "4")


def chat(srv, name: str, **extra):
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 2, **extra}
    return call(srv, "POST", "/v1/chat/completions", body, key=SECRETS[name])


def stream_open(srv, name: str, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed chat whose first chunk has arrived (so it is in flight); the caller reads or closes."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    body = json.dumps({"model": "smollm2", "messages": ASK, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True})
    conn.request("POST", "/v1/chat/completions", body=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {SECRETS[name]}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the role chunk: the request holds its lane
    return conn, resp


def until(check, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def metrics(srv, name: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {SECRETS[name]}"} if name else {}
    with urllib.request.urlopen(urllib.request.Request(srv.base + "/metrics", headers=headers), timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in /metrics")


def test_requests_per_minute(limited):
    seen = []
    for expected in (2, 1, 0):
        status, headers, body = chat(limited, "rpm")
        assert status == 200, body
        assert headers["x-ratelimit-limit-requests"] == "3"  # successes carry them too
        seen.append(int(headers["x-ratelimit-remaining-requests"]))
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in headers  # no tokens-per-minute on this key
    assert seen == [2, 1, 0]
    status, headers, body = chat(limited, "rpm")
    assert status == 429, body
    err = error(body)
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "requests per minute" in err["message"] and "'rpm'" in err["message"]
    assert 1 <= int(headers["retry-after"]) <= 20  # one request every 20 s at 3 a minute
    assert all(h in headers for h in RATE_HEADERS) and headers["x-ratelimit-remaining-requests"] == "0"
    assert SECRETS["rpm"] not in json.dumps(body)
    # another key is unaffected, and an unlimited key gets no x-ratelimit-* headers
    status, headers, _ = chat(limited, "free")
    assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)


def test_openai_client_sees_a_rate_limit_error(limited):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=limited.base + "/v1", api_key=SECRETS["rpm"], timeout=120, max_retries=0)
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)
    assert exc.value.status_code == 429 and exc.value.code == "rate_limit_exceeded"
    assert exc.value.response.headers["retry-after"]


def test_tokens_per_minute(limited):
    remaining, results, started = [], [], time.monotonic()
    for _ in range(12):
        status, headers, body = chat(limited, "tpm", max_tokens=4, ignore_eos=True)
        results.append((status, headers, body))
        if status != 200:
            break
        assert headers["x-ratelimit-limit-tokens"] == str(TPM)
        remaining.append(int(headers["x-ratelimit-remaining-tokens"]))
    status, headers, body = results[-1]
    assert status == 429, [r[0] for r in results]
    ok = [b for s, _, b in results if s == 200]
    assert ok, "the first request fits the budget"
    prompt = ok[0]["usage"]["prompt_tokens"]
    used = sum(b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"] for b in ok)
    assert used >= TPM - prompt  # refused only once the budget could not hold another prompt…
    refill = (time.monotonic() - started) * TPM / 60
    # …and not before: each passed with its prompt in the bucket (which refills TPM/60 a second)
    assert used - ok[-1]["usage"]["completion_tokens"] <= TPM + refill + 1
    assert remaining == sorted(remaining, reverse=True)  # a whole reply's headers: after its completion
    err = error(body)
    assert err["code"] == "rate_limit_exceeded" and "tokens per minute" in err["message"]
    assert int(headers["retry-after"]) >= 1 and all(h in headers for h in TOKEN_HEADERS)
    assert int(headers["x-ratelimit-remaining-tokens"]) < prompt
    assert chat(limited, "free")[0] == 200


def test_lanes(limited):
    conn, first = stream_open(limited, "lanes", max_tokens=24)
    try:
        status, headers, body = chat(limited, "lanes")
        assert status == 429, body
        err = error(body)
        assert err["code"] == "too_many_concurrent_requests" and err["type"] == "rate_limit_error"
        assert "lanes = 1" in err["message"] and headers["retry-after"] == "1"
        assert chat(limited, "free")[0] == 200  # another key is unaffected
        rest = first.read()
        assert b"[DONE]" in rest
    finally:
        conn.close()
    assert until(lambda: chat(limited, "lanes")[0] == 200)  # the slot is back once it ended
    status, _, body = chat(limited, "lanes", stream=True)
    assert status == 200


def test_a_client_that_goes_away_gives_its_lane_back(limited):
    conn, _ = stream_open(limited, "lanes", max_tokens=400)  # far longer than the wait below
    assert chat(limited, "lanes")[0] == 429
    conn.close()
    started = time.monotonic()
    assert until(lambda: chat(limited, "lanes")[0] == 200, timeout=10), limited.log()
    assert time.monotonic() - started < 10


def test_a_session_turn_is_a_generation_of_its_key(limited):
    status, _, made = call(limited, "POST", "/v1/sessions", {"model": "smollm2"}, key=SECRETS["lanes"])
    assert status == 201, made
    turn = f"/v1/sessions/{made['id']}/turns"
    conn, first = stream_open(limited, "lanes", max_tokens=24)
    try:
        status, _, body = call(limited, "POST", turn, {"messages": ASK, "max_tokens": 2}, key=SECRETS["lanes"])
        assert status == 429 and error(body)["code"] == "too_many_concurrent_requests", body
        assert b"[DONE]" in first.read()
    finally:
        conn.close()
    assert until(lambda: call(limited, "POST", turn, {"messages": ASK, "max_tokens": 2},
                              key=SECRETS["lanes"])[0] == 200)
    call(limited, "DELETE", f"/v1/sessions/{made['id']}", key=SECRETS["lanes"])


def test_a_refused_request_gives_its_lane_back(limited):
    """A 400 from the scheduler (a prompt over the context) ends the request: the slot is free."""
    status, _, body = chat(limited, "lanes", max_tokens=None, messages=[{"role": "user", "content": "hi " * 3000}])
    assert status == 400, body
    assert chat(limited, "lanes")[0] == 200


def test_metrics_per_key_name_never_the_secret(limited):
    text = metrics(limited, "free")  # with a policy /metrics needs a key too
    for secret in SECRETS.values():
        assert secret not in text and hash_secret(secret) not in text
    assert sample(text, "superfluid_key_requests_total", key="rpm") >= 3
    assert sample(text, "superfluid_key_rejections_total", key="rpm", reason="requests_per_minute") >= 1
    assert sample(text, "superfluid_key_rejections_total", key="tpm", reason="tokens_per_minute") >= 1
    assert sample(text, "superfluid_key_rejections_total", key="lanes", reason="lanes") >= 2
    assert sample(text, "superfluid_key_tokens_total", key="tpm", kind="prompt") >= 1
    assert sample(text, "superfluid_key_tokens_total", key="tpm", kind="completion") >= 4
    assert sample(text, "superfluid_key_requests_total", key="free") >= 1
    assert sample(text, "superfluid_key_in_flight", key="lanes") == 0  # every slot given back


def test_without_a_policy_no_limits_and_the_key_label_is_a_dash(server):
    status, headers, body = call(server, "POST", "/v1/chat/completions",
                                 {"model": "smollm2", "messages": ASK, "max_tokens": 2})
    assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers), body
    assert sample(metrics(server), "superfluid_key_requests_total", key="-") >= 1

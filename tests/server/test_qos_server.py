"""QoS against the real server and model: preemption (with and without parking), batch-invariant
lanes, fill-in-the-middle limits, class caps at startup."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ..tinygguf import write_tiny_llama

AGENT_PROMPTS = [
    "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain in detail how an operating system schedules processes.<|im_end|>\n<|im_start|>assistant\n",
]
AGENT_TOKENS = 160


def post(base, path, body, headers=None, timeout=120):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def complete(base, prompt, max_tokens, qos=None, extra=None):
    headers = {"x-superfluid-qos": qos} if qos else {}
    status, body, _ = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, **(extra or {})},
                           headers)
    assert status == 200, body
    return body["choices"][0]["text"]


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def metric(server, name):
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


@pytest.fixture(scope="module")
def references(server):
    """Each agent prompt alone, undisturbed (temperature 0)."""
    return {p: complete(server.base, p, AGENT_TOKENS) for p in AGENT_PROMPTS}


@pytest.mark.parametrize("park", [True, False], ids=["park", "no-park"])
def test_preempted_lane_text_equals_unpreempted(start_server, references, park):
    srv = start_server("--max-batch", "2", *(["--park"] if park else ["--no-park"]))
    prefilled_before = metric(srv, "superfluid_prefill_tokens_total")
    with cf.ThreadPoolExecutor(2) as pool:
        agents = [pool.submit(complete, srv.base, p, AGENT_TOKENS, "agent") for p in AGENT_PROMPTS]

        def both_decoding():
            slots = srv.get_json("/slots")["models"]["smollm2"]["slots"]
            return sum(s["state"] == "decoding" and s["generated_tokens"] > 20 for s in slots) == 2
        wait_for(both_decoding, what="two decoding agent lanes")
        chat = complete(srv.base, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", 8, "interactive")
        texts = [a.result(timeout=120) for a in agents]
    assert chat
    assert metric(srv, "superfluid_preemptions_total") >= 1
    for prompt, text in zip(AGENT_PROMPTS, texts):
        assert text == references[prompt]
    prefilled = metric(srv, "superfluid_prefill_tokens_total") - prefilled_before
    prompt_tokens = metric(srv, "superfluid_prompt_tokens_total")
    if park:  # the resumed lane restored its KV: only its last sampled token was fed again
        assert prefilled <= prompt_tokens + 2 * metric(srv, "superfluid_preemptions_total")
    else:     # it prefilled prompt + generated tokens again
        assert prefilled >= prompt_tokens + 20


def test_batch_invariant_needs_permission(server):
    status, body, _ = post(server.base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                           {"x-superfluid-batch-invariant": "true"})
    assert status == 403
    assert body["error"]["code"] == "batch_invariant_not_allowed"


def test_batch_invariant_output_equals_alone(start_server):
    srv = start_server("--max-batch", "8", "--http-allow-batch-invariant")
    prompt = "<|im_start|>user\nDescribe a sunset over the ocean.<|im_end|>\n<|im_start|>assistant\n"
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    bi = {"x-superfluid-batch-invariant": "true"}
    _, alone, _ = post(srv.base, "/v1/completions", {"prompt": prompt, "max_tokens": 48, **sampled}, bi)
    with cf.ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(complete, srv.base, p, 96) for p in
                [f"<|im_start|>user\nTell me fact number {i} about space.<|im_end|>\n<|im_start|>assistant\n"
                 for i in range(7)]]
        wait_for(lambda: sum(s["state"] != "free" for s in
                             srv.get_json("/slots")["models"]["smollm2"]["slots"]) == 7, what="7 busy lanes")
        status, loaded, _ = post(srv.base, "/v1/completions", {"prompt": prompt, "max_tokens": 48, **sampled}, bi)
        for f in busy:
            f.result(timeout=120)
    assert status == 200
    assert loaded["choices"][0]["text"] == alone["choices"][0]["text"]


def test_batch_invariant_lane_is_not_seeded_from_cached_kv(start_server):
    """KV cached beside other traffic must not seed a batch-invariant lane: its output may not
    depend on what ran next to it. The same prompt without the header reuses the cache."""
    srv = start_server("--max-batch", "4", "--http-allow-batch-invariant")
    prompt = ("<|im_start|>system\nYou are a careful assistant who answers in full sentences.<|im_end|>\n"
              "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n")
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    with cf.ThreadPoolExecutor(3) as pool:  # the prefix is computed beside other lanes
        side = [pool.submit(complete, srv.base, f"<|im_start|>user\nCount to {i}.<|im_end|>\n", 24)
                for i in range(2)]
        status, first, _ = post(srv.base, "/v1/completions", body)
        for f in side:
            f.result(timeout=120)
    assert status == 200
    status, invariant, _ = post(srv.base, "/v1/completions", body, {"x-superfluid-batch-invariant": "true"})
    assert status == 200
    assert invariant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, again, _ = post(srv.base, "/v1/completions", body)
    assert status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache was there to take


def test_aged_agents_do_not_take_an_interactive_requests_right_to_preempt(start_server):
    """More agents than lanes: the queued ones age past the starvation bound (one tick here) and
    tie with an interactive chat. The chat still preempts a running agent (aging orders
    admission; it does not take a class's right to preempt), so it ends before any agent does."""
    srv = start_server("--max-batch", "2", "--starvation-ticks", "1", "--no-park")
    done: list[tuple[str, float]] = []

    def agent(i):
        complete(srv.base, f"<|im_start|>user\nWrite story number {i} about a harbour.<|im_end|>\n"
                           "<|im_start|>assistant\n", 96, "agent")
        done.append(("agent", time.monotonic()))

    with cf.ThreadPoolExecutor(4) as pool:
        agents = [pool.submit(agent, i) for i in range(4)]
        wait_for(lambda: srv.get_json("/slots")["models"]["smollm2"]["queued"] == 2, what="two queued agents")
        ticks = srv.get_json("/slots")["models"]["smollm2"]["ticks"]
        wait_for(lambda: srv.get_json("/slots")["models"]["smollm2"]["ticks"] >= ticks + 3, what="aging ticks")
        complete(srv.base, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", 8, "interactive")
        done.append(("chat", time.monotonic()))
        for f in agents:
            f.result(timeout=180)
    assert done[0][0] == "chat", f"the chat waited for an agent to finish: {[who for who, _ in done]}"
    assert metric(srv, "superfluid_preemptions_total") >= 1


@pytest.fixture(scope="module")
def tiny_fim_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-fim.gguf", quant="Q8_0"))


def test_fim_rate_limit_deadline_and_infill(start_server, tiny_fim_model):
    srv = start_server("--fim-model", tiny_fim_model, "--fim-max-batch", "1", "--completion-burst", "3",
                       "--completion-rate", "1/m")
    fim = {"model": "smollm2", "prompt": "def add(a, b):\n    ", "suffix": "\n    return c\n", "max_tokens": 8}
    # The tiny model's weights are random: ignore_eos keeps a sampled end-of-text from making an empty reply.
    status, body, _ = post(srv.base, "/v1/completions", {**fim, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1
    assert body["model"] == "fim"
    status, body, _ = post(srv.base, "/infill", {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 4,
                                                 "ignore_eos": True})
    assert status == 200, body
    assert "content" in body and body["tokens_predicted"] >= 1
    # The third request of the burst holds the only FIM lane; the fourth finds the bucket empty.
    with cf.ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, srv.base, "/v1/completions", {**fim, "max_tokens": 1500, "ignore_eos": True})
        wait_for(lambda: any(s["state"] != "free" for s in srv.get_json("/slots")["models"]["fim"]["slots"]),
                 what="the FIM lane busy")
        status, body, headers = post(srv.base, "/v1/completions", fim)
        assert status == 429, body
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert int(headers["Retry-After"]) >= 1
        assert long.result(timeout=120)[0] == 200
    # The chat model is untouched by the FIM limits.
    assert complete(srv.base, "The capital of France is", 4)


def test_fim_deadline_fails_fast(start_server, tiny_fim_model):
    srv = start_server("--fim-model", tiny_fim_model, "--fim-max-batch", "1", "--completion-deadline-ms", "150")
    fim = {"prompt": "def add(a, b):\n    ", "suffix": "\n", "max_tokens": 2000, "ignore_eos": True}
    with cf.ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, srv.base, "/v1/completions", fim)
        wait_for(lambda: any(s["state"] != "free" for s in srv.get_json("/slots")["models"]["fim"]["slots"]),
                 what="the FIM lane busy")
        t = time.monotonic()
        status, body, _ = post(srv.base, "/v1/completions", {**fim, "max_tokens": 4})
        assert status == 503, body
        assert body["error"]["code"] == "start_deadline_exceeded"
        assert time.monotonic() - t < 2.0
        assert long.result(timeout=120)[0] == 200


def test_fim_on_model_without_fim_tokens(server):
    status, body, _ = post(server.base, "/v1/completions", {"prompt": "a", "suffix": "b", "max_tokens": 2})
    assert status == 400
    assert body["error"]["code"] == "fim_unsupported"


@pytest.mark.parametrize("flag,needle", [("background=20", "between 1 and --max-batch"),
                                         ("urgent=2", "unknown QoS class"),
                                         ("agent", "expected CLASS=N")])
def test_class_lanes_checked_at_startup(model_path, flag, needle):
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model_path,
                          "--port", "0", "--class-lanes", flag], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "class-lanes" in out.stderr and needle in out.stderr

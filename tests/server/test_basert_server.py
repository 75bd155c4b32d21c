"""basert behind the real server, on the CPU, with the real default model (SmolLM2 GGUF): what the
scheduler offers (QoS preemption with parking, the prefix cache on shared pages, batch-invariant
lanes, client disconnect, structured output and tools), speculation and narrow KV, and the
startup errors of its flags."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import subprocess
import sys
import time

import pytest

from .test_qos_server import complete, post, wait_for

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

pytest.importorskip("torch")

BASERT = ("--engine", "basert", "--threads", "2")
AGENT_PROMPTS = [
    "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain in detail how an operating system schedules processes.<|im_end|>\n<|im_start|>assistant\n",
]
# tokens an agent (and its reference) decodes: enough that both agents are still decoding when
# the interactive request preempts one
AGENT_TOKENS = 32
# tokens a reply to the repeating prompt decodes (greedy, seeded, penalized): each must draft
# under --speculate 4, and prompt lookup matches the prompt's list within the first 16 tokens
# (measured at 32 tokens, each after the requests before it in the speculation test: greedy
# 13 drafted, seeded 15, penalized 8, logprobs 14, JSON 11; was 64)
SPEC_TOKENS = 32
# a prompt that repeats itself, so prompt lookup has drafts to offer
REPEATING = ("<|im_start|>user\nCopy this list exactly, twice: apples, pears, plums, figs, dates, limes, "
             "kiwis, grapes, melons, cherries.<|im_end|>\n<|im_start|>assistant\n")
SEEDED = {"temperature": 0.7, "top_p": 0.95, "seed": 11}  # a sampled request that repeats its text
PENALIZED = {"frequency_penalty": 0.3, "repeat_penalty": 1.05}  # greedy, with llama.cpp's penalties
FRUITS = {"type": "object", "properties": {"fruits": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "colour": {"type": "string"}},
    "required": ["name", "colour"]}}}, "required": ["fruits"]}


def metric(server, name):
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


def slots(server):
    return server.get_json("/slots")["models"]["smollm2"]["slots"]


@pytest.fixture(scope="module")
def basert(start_server):
    return start_server(*BASERT, "--max-batch", "4", "--http-allow-batch-invariant")


@pytest.fixture(scope="module")
def references(basert):
    """references(*keys) -> {key: the module's server's reply}: undisturbed (no preemption,
    speculation or narrow KV), each computed once per module, when a test first asks for it."""
    makers = {p: (lambda p=p: complete(basert.base, p, AGENT_TOKENS)) for p in AGENT_PROMPTS}
    makers[REPEATING] = lambda: complete(basert.base, REPEATING, SPEC_TOKENS)
    makers["seeded"] = lambda: complete(basert.base, REPEATING, SPEC_TOKENS, extra=SEEDED)
    makers["logprobs"] = lambda: logprobs_of(basert, REPEATING)
    makers["penalized"] = lambda: complete(basert.base, REPEATING, SPEC_TOKENS, extra=PENALIZED)
    makers["json"] = lambda: json_reply(basert)
    done = {}

    def get(*keys):
        for key in keys:
            if key not in done:
                done[key] = makers[key]()
        return {key: done[key] for key in keys}
    return get


def start_beside(start_server, references, flags, *keys):
    """(server, references): a server with ``flags`` started on a thread while the module's
    server computes the references ``keys`` (a start is seconds of loading, mostly on one core,
    so it overlaps the decoding of the references instead of following it)."""
    with cf.ThreadPoolExecutor(1) as pool:
        server = pool.submit(start_server, *BASERT, *flags)
        refs = references(*keys)
        return server.result(), refs


def json_reply(server):
    """A greedy reply held to a JSON schema (a list of objects: its keys repeat, so prompt
    lookup has drafts)."""
    status, body, _ = post(server.base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "List three fruits with their colours as JSON."}],
        "max_tokens": SPEC_TOKENS, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "fruits", "schema": FRUITS}}})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def logprobs_of(server, prompt):
    """A greedy completion's text and per-token logprobs (2 candidates each)."""
    status, body, _ = post(server.base, "/v1/completions", {"prompt": prompt, "max_tokens": 32, "temperature": 0,
                                                            "ignore_eos": True, "logprobs": 2})
    assert status == 200, body
    choice = body["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_health_names_the_engine_and_its_pool(basert):
    health = basert.get_json("/health")
    model = health["models"]["smollm2"] if "models" in health else health
    text = json.dumps(model)
    assert "basert" in text and "kv_blocks" in text


def test_shared_prefix_is_prefilled_once_and_its_pages_held_once(basert):
    """On the module's server before any other test's request (it runs second in this file): the
    pages its four lanes hold are this test's alone. Run later it holds too: eight requests on four
    lanes replace every lane's cached pages."""
    srv = basert
    system = "You are a meticulous assistant for a team of software engineers. " * 20
    prefix = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    prompts = [prefix + f"Question {i}: name a colour.<|im_end|>\n<|im_start|>assistant\n" for i in range(8)]
    before = metric(srv, "superfluid_prefill_tokens_total")
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: post(srv.base, "/v1/completions",
                                               {"prompt": p, "max_tokens": 2, "temperature": 0})[1], prompts))
    prefilled = metric(srv, "superfluid_prefill_tokens_total") - before
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in results]
    shared = min(prompt_tokens) - 16
    suffixes = sum(p - shared for p in prompt_tokens)
    assert (prefilled - suffixes) / shared <= 1.0, (prefilled, shared, suffixes)
    # four slots now hold the ~300-token prefix as cached KV, on the same pages
    used = srv.settled_metric("superfluid_kv_cells_used")
    assert used < shared + 4 * 64, (used, shared)


def test_preempted_lane_with_parking_gives_the_unpreempted_text(start_server, references):
    srv, references = start_beside(start_server, references, ("--max-batch", "2", "--park"), *AGENT_PROMPTS)
    with cf.ThreadPoolExecutor(2) as pool:
        agents = [pool.submit(complete, srv.base, p, AGENT_TOKENS, "agent") for p in AGENT_PROMPTS]
        # basert's ticks are long while every lane is busy (--tick-target-ms), so /slots may show
        # one decoding state per tick: both lanes decoding is enough
        wait_for(lambda: sum(s["state"] == "decoding" for s in slots(srv)) == 2,
                 timeout=120, what="two decoding agent lanes")
        chat = complete(srv.base, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", 6, "interactive")
        texts = [a.result(timeout=300) for a in agents]
    assert chat
    assert metric(srv, "superfluid_preemptions_total") >= 1
    for prompt, text in zip(AGENT_PROMPTS, texts):
        assert text == references[prompt]
    # the resumed lane restored its parked pages: only its last sampled token was fed again
    prefilled = metric(srv, "superfluid_prefill_tokens_total")
    prompt_tokens = metric(srv, "superfluid_prompt_tokens_total")
    assert prefilled <= prompt_tokens + 2 * metric(srv, "superfluid_preemptions_total")


def test_batch_invariant_lane_equals_itself_alone(basert):
    prompt = "<|im_start|>user\nDescribe a sunset over the ocean.<|im_end|>\n<|im_start|>assistant\n"
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    bi = {"x-superfluid-batch-invariant": "true"}
    _, alone, _ = post(basert.base, "/v1/completions", {"prompt": prompt, "max_tokens": 24, **sampled}, bi)
    with cf.ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(complete, basert.base, f"<|im_start|>user\nFact {i} about space?<|im_end|>\n", 48)
                for i in range(3)]
        wait_for(lambda: sum(s["state"] != "free" for s in slots(basert)) == 3, timeout=60, what="3 busy lanes")
        status, loaded, _ = post(basert.base, "/v1/completions", {"prompt": prompt, "max_tokens": 24, **sampled}, bi)
        for f in busy:
            f.result(timeout=300)
    assert status == 200
    assert loaded["choices"][0]["text"] == alone["choices"][0]["text"]


def test_seeded_sampling_is_the_same_alone_and_beside_others(basert):
    """A lone sampled lane is drawn on the host, two or more on the device: same seed, same text."""
    prompt = "<|im_start|>user\nName a fruit and a colour.<|im_end|>\n<|im_start|>assistant\n"
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 7}
    _, alone, _ = post(basert.base, "/v1/completions", body)
    with cf.ThreadPoolExecutor(3) as pool:
        side = [pool.submit(post, basert.base, "/v1/completions", {**body, "seed": 100 + i}) for i in range(2)]
        together = pool.submit(post, basert.base, "/v1/completions", body)
        [f.result(timeout=300) for f in side]
        _, beside, _ = together.result(timeout=300)
    assert beside["choices"][0]["text"] == alone["choices"][0]["text"]


def test_disconnect_mid_stream_frees_the_lane(basert):
    conn = http.client.HTTPConnection("127.0.0.1", basert.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": "Write a very long story about a dragon.", "max_tokens": 1000,
                                  "ignore_eos": True, "temperature": 0, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    chunks = 0
    while chunks < 3:
        if resp.fp.readline().startswith(b"data: {"):
            chunks += 1
    closed_at = time.monotonic()
    conn.sock.close()
    conn.close()
    wait_for(lambda: all(s["state"] == "free" for s in slots(basert)), timeout=10, what="the lane freed")
    assert time.monotonic() - closed_at < 10


def test_structured_output_and_a_forced_tool_call(basert):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=basert.base + "/v1", api_key="unused", timeout=300, max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"]}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A large city and its population, as JSON."}],
        max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_speculation_keeps_greedy_and_seeded_text_and_reports_acceptance(start_server, references):
    srv, references = start_beside(start_server, references, ("--max-batch", "4", "--speculate", "4"),
                                   REPEATING, AGENT_PROMPTS[0], "seeded", "logprobs", "penalized", "json")
    assert complete(srv.base, REPEATING, SPEC_TOKENS) == references[REPEATING]
    assert complete(srv.base, AGENT_PROMPTS[0], AGENT_TOKENS) == references[AGENT_PROMPTS[0]]
    greedy_drafted = metric(srv, "superfluid_spec_drafted_tokens_total")
    # a sampled lane speculates too, and its seeded text is the one it gives without speculation
    assert complete(srv.base, REPEATING, SPEC_TOKENS, extra=SEEDED) == references["seeded"]
    assert metric(srv, "superfluid_spec_drafted_tokens_total") > greedy_drafted
    # and a lane that asks for logprobs: it drafts, and gives the same text and logprobs
    before = metric(srv, "superfluid_spec_drafted_tokens_total")
    text, logprobs = logprobs_of(srv, REPEATING)
    assert metric(srv, "superfluid_spec_drafted_tokens_total") > before
    assert text == references["logprobs"][0]
    assert logprobs == pytest.approx(references["logprobs"][1], abs=1e-3)
    # penalties and a JSON schema: each verify position sees the window and the grammar's mask
    # it would have seen, so these draft and keep their text too
    for name, ask in (("penalized", lambda: complete(srv.base, REPEATING, SPEC_TOKENS, extra=PENALIZED)),
                      ("json", lambda: json_reply(srv))):
        before = metric(srv, "superfluid_spec_drafted_tokens_total")
        assert ask() == references[name], name
        assert metric(srv, "superfluid_spec_drafted_tokens_total") > before, name
    drafted = metric(srv, "superfluid_spec_drafted_tokens_total")
    accepted = metric(srv, "superfluid_spec_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert 0 < metric(srv, "superfluid_spec_acceptance_rate") <= 1


def test_eight_bit_kv_serves_close_to_full_width(start_server, references):
    flags = ("--max-batch", "2", "--kv-bits", "8", "--max-context", "512")
    srv, references = start_beside(start_server, references, flags, AGENT_PROMPTS[1])
    text = complete(srv.base, AGENT_PROMPTS[1], 20)  # 20 tokens: well over the 20 characters checked
    ref = references[AGENT_PROMPTS[1]]
    same = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    assert same >= 20, (text, ref)  # agrees well past the start (measured figures: docs/benchmarks.md)


def test_flex_attention_serves_the_gather_paths_text(start_server, references):
    """``--attention flex`` on the CPU: two lanes decode together through the fixed-size decoder
    (FlexAttention's reference path here; its compiled kernel and graphs on CUDA), and each text
    is the one the default (gather) path gave."""
    # a 512-token context: the CPU's unfused flex evaluates its mask over the whole pool (lanes x
    # context), so a smaller pool is a cheaper step on the same path
    flags = ("--max-batch", "2", "--attention", "flex", "--max-context", "512")
    srv, references = start_beside(start_server, references, flags, *AGENT_PROMPTS)
    model = srv.get_json("/health")
    assert '"attention": "flex"' in json.dumps(model)
    with cf.ThreadPoolExecutor(2) as pool:  # 12 tokens: the CPU's flex is slow (it is not the CPU's default)
        texts = list(pool.map(lambda p: complete(srv.base, p, 12), AGENT_PROMPTS))
    for prompt, text in zip(AGENT_PROMPTS, texts):
        assert len(text) > 12 and references[prompt].startswith(text), (text, references[prompt])


BAD_FLAGS = [
    (("--attention", "flex", "--kv-bits", "8"), "attention flex"),
    (("--attention", "paged"), "attention"),
    (("--cuda-graphs", "on", "--device", "cpu"), "cuda-graphs on"),
    (("--kv-bits", "3"), "kv-bits"),
    (("--kv-bits", "wide"), "kv-bits"),
    (("--speculate", "99"), "speculate"),
    (("--speculate", "-1"), "speculate"),
    (("--device", "cuda:7"), "cuda:7"),
    (("--device", "tpu"), "tpu"),
    (("--dtype", "int3"), "dtype"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(model_path):
    """{flags: the finished ``serve`` with them}, run three at a time: each is a fresh interpreter
    that spends seconds importing torch and the engine before it fails, on one core, so run one
    after another they left the other core idle."""
    def serve(flags):
        return subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model_path,
                               "--port", "0", *BASERT, *flags], capture_output=True, text=True, timeout=180)
    with cf.ThreadPoolExecutor(3) as pool:
        return dict(zip([f for f, _ in BAD_FLAGS], pool.map(serve, [f for f, _ in BAD_FLAGS])))


@pytest.mark.parametrize("flags,needle", BAD_FLAGS)
def test_bad_flags_fail_at_startup_naming_them(bad_flag_runs, flags, needle):
    out = bad_flag_runs[flags]
    assert out.returncode != 0
    assert needle in out.stderr, out.stderr[-2000:]

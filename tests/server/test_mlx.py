"""The MLX engine (plugins/mlx), for real on the CPU device: the GGUF loader against llama.cpp,
the tick runner (batched decode, parking, copies, park files), per-lane sampling against
mlx-lm's own rules, and real servers on a tiny written model and on SmolLM2.

MLX on Linux runs the reference CPU kernels: SmolLM2 decodes at a few tokens per second here,
so the server tests that need many tokens (preemption, worker kill, concurrency) use the tiny
model, and SmolLM2 gets short replies to short prompts, its server beside the reference run
(each on a core of its own)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
import urllib.request

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")

from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, Seed, TickPlan  # noqa: E402
from superfluid.plugins.mlx import loader  # noqa: E402
from superfluid.plugins.mlx.runner import MlxRunner  # noqa: E402
from superfluid.plugins.mlx.sampling import LaneSampler  # noqa: E402
from superfluid.plugins.vocab import GGUFVocab  # noqa: E402

from ..llama_reference import in_child, text_logits  # noqa: E402
from ..tinygguf import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("mlx") / "tiny-mlx.gguf", quant="Q8_0",
                                n_layer=2, n_embd=64, n_ff=128))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    vocab = GGUFVocab(tiny_path, "tiny")
    yield loader.load(tiny_path), vocab
    vocab.close()


# ---- loader ---------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_0"])
def test_gguf_logits_match_llamacpp(tmp_path, quant):
    """Name mapping, quantized triples and the GGUF Q/K permutation (traditional RoPE): the
    logits of every position agree with llama.cpp on the same file."""
    import numpy as np

    path = str(write_tiny_llama(tmp_path / f"t-{quant}.gguf", quant=quant, seed=3))
    # llama.cpp's side in a child process: a crash there fails this test, not the run
    tokens, ref = in_child(text_logits, path, b"Hello world, the water is one way to make a long day")
    model = loader.load(path)
    ours = np.array(model(mx.array([tokens])).astype(mx.float32))[0]
    scale = np.abs(ref).max()
    # llama.cpp also quantizes the activations (to Q8) in a quantized matmul; MLX does not.
    tolerance = 2e-3 if quant == "F32" else 2e-2
    assert np.abs(ours - ref).max() <= tolerance * scale + 1e-4


def test_unsupported_gguf_is_refused(tmp_path):
    path = str(write_tiny_llama(tmp_path / "t.gguf", quant="F16"))
    meta_arch = {"general.architecture": "gemma3"}
    with pytest.raises(loader.ModelLoadError, match="architecture"):
        loader.gguf_model_args(meta_arch, {})
    assert loader.load(path) is not None  # F16 loads as plain arrays


# ---- the tick runner ------------------------------------------------------------------------

def _prompt(vocab, text):
    return vocab.tokenize(text, True, True)


def _generate(runner, lanes: dict[int, list[int]], n: int, grant: int = 3, sampling=GREEDY, **first):
    """Drive the runner as the scheduler would: prefill + first token, then decode grants."""
    out = {s: [] for s in lanes}
    pos = {s: len(t) for s, t in lanes.items()}
    plans = [LanePlan(slot=s, pos=first.get("pos", 0), feed=t[first.get("pos", 0):], sample=True,
                      max_new=grant, reset=True, sampling=sampling, **{k: v for k, v in first.items() if k != "pos"})
             for s, t in lanes.items()]
    while plans:
        res = runner.run(TickPlan(lanes=plans))
        nxt = []
        for lp in plans:
            lr = res.lanes[lp.slot]
            out[lp.slot] += lr.tokens
            if lp.reset:
                pos[lp.slot] = lp.pos
            pos[lp.slot] += lr.n_fed
            if not lr.eog and len(out[lp.slot]) < n:
                nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True,
                                    max_new=min(grant, n - len(out[lp.slot])), decode=True))
        plans = nxt
    return out, res


def test_batched_decode_equals_each_lane_alone(tiny):
    model, vocab = tiny
    prompts = {0: _prompt(vocab, "the water is"), 1: _prompt(vocab, "Hello world, how are you"),
               2: _prompt(vocab, "def print(self): return None and some more words")}
    alone = {}
    for slot, toks in prompts.items():
        runner = MlxRunner(model, vocab.eog, StopFlag(), 4096)
        alone[slot] = _generate(runner, {slot: toks}, 24)[0][slot]
    runner = MlxRunner(model, vocab.eog, StopFlag(), 4096)
    together, res = _generate(runner, prompts, 24)
    assert together == alone
    assert res.kv_used == sum(len(t) + 23 for t in prompts.values())
    assert any(step.decode_tokens == 3 for step in res.steps)


def test_park_restore_copy_and_files(tiny, tmp_path):
    model, vocab = tiny
    toks = _prompt(vocab, "the people of the water could find a long way")
    runner = MlxRunner(model, vocab.eog, StopFlag(), 4096)
    reference = _generate(runner, {0: toks}, 16)[0][0]

    # Park after 6 tokens, release the slot, restore it into another slot and go on.
    runner = MlxRunner(model, vocab.eog, StopFlag(), 4096)
    first = _generate(runner, {0: toks}, 6)[0][0]
    res = runner.run(TickPlan(park=[(0, "k")], release=[0]))
    assert res.parked["k"] > 0 and res.parked_bytes == res.parked["k"] and runner.length(0) == 0
    res = runner.run(TickPlan(save=[("k", str(tmp_path / "k.npz"))], drop_parked=["k"]))
    assert not runner.parked  # dropped at once: the writer holds its own copy
    for _ in range(200):  # written off the tick thread: the tick in which it finished reports it
        if str(tmp_path / "k.npz") in res.saved:
            break
        res = runner.run(TickPlan(collect_saves=True))
    assert res.saved[str(tmp_path / "k.npz")] > 0
    runner.run(TickPlan(load=[(str(tmp_path / "k.npz"), "k2")]))
    seq = toks + first
    n_kv = len(seq) - 1  # the last sampled token was never fed
    rest = _generate(runner, {5: seq}, 10, pos=n_kv, seed=Seed(key="k2"))[0][5]
    assert first + rest == reference

    # Seed(slot=5): a new lane seeded with the first 8 prompt tokens of slot 5's KV.
    out = _generate(runner, {6: toks}, 16, pos=8, seed=Seed(slot=5))[0][6]
    assert out == reference
    missing = runner.run(TickPlan(lanes=[LanePlan(slot=7, pos=3, feed=[1], sample=True, max_new=1, reset=True,
                                                  sampling=GREEDY, seed=Seed(key="nope"))]))
    assert missing.lanes[7].restore_failed


def test_a_park_file_of_seventeen_layers_or_more_loads(tmp_path):
    """Layer 16's flags are saved as "bf16", the name the older layout's one flag had: a park file
    of SmolLM2 (30 layers) was read as the older layout and never loaded, so a session recovered
    after a restart prefilled its whole conversation again on MLX."""
    import numpy as np

    from superfluid.plugins.mlx.parking import ParkedKV

    class Runner(ParkedKV):
        n_layers, kv_bits = 30, 0

        def __init__(self):
            self.parked = {}

    runner = Runner()
    cells = np.arange(3 * 5 * 8, dtype=np.float32).reshape(1, 3, 5, 8)
    runner.parked["k"] = (5, [[(cells + i, False), (cells - i, False)] for i in range(30)])
    path = tmp_path / "s.kv"
    with open(path, "wb") as f:
        runner.save_writer("k")(f)
    assert runner.load(str(path), "back") == runner._nbytes(runner.parked["k"]) > 0
    n, layers = runner.parked["back"]
    assert n == 5 and len(layers) == 30
    assert np.array_equal(layers[16][0][0], cells + 16) and np.array_equal(layers[29][1][0], cells - 29)


def test_a_restarted_server_restores_a_seventeen_layer_session_from_its_park_file(tmp_path):
    """The same on a real server: a session's KV persisted at SIGTERM is restored by the next
    daemon's first turn instead of prefilled (17 layers, so layer 16's flags are in the file)."""
    from .serverproc import ServerProcess

    model = str(write_tiny_llama(tmp_path / "tiny17.gguf", quant="Q8_0", n_layer=17, n_embd=64, n_ff=128))
    args = ["--model", model, "--model-name", "tiny", "--engine", "mlx", "--max-context", "2048",
            "--state-dir", str(tmp_path / "state"), "--park", "--max-batch", "2"]
    system = "You are a careful assistant for a library. Answer briefly and politely. " * 4

    def turn(srv, sid, text):
        status, body = srv.call("POST", f"/v1/sessions/{sid}/turns", {
            "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        return body["usage"]

    srv = ServerProcess(args, tmp_path / "first.log")
    try:
        sid = srv.call("POST", "/v1/sessions", {"system": system})[1]["id"]
        turn(srv, sid, "Where is the library?")
    finally:
        assert srv.stop() == 0, srv.log()
    assert "persisted 1 sessions" in srv.log()
    srv = ServerProcess(args, tmp_path / "second.log")
    try:
        usage = turn(srv, sid, "Thank you.")
    finally:
        srv.stop()
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] * 0.7, usage


@pytest.mark.parametrize("request_", ["request_stop", "request_yield"])
def test_stop_flag_ends_tick_between_steps(tiny, request_):
    model, vocab = tiny
    flag = StopFlag()
    getattr(flag, request_)()
    runner = MlxRunner(model, vocab.eog, flag, 4096)
    res = runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=_prompt(vocab, "the"), sample=True, max_new=5,
                                              reset=True, sampling=GREEDY)]))
    assert res.stopped_early and res.lanes[0].n_fed == 0


# ---- sampling, row by row against mlx-lm's rules ------------------------------------------------

def test_sampler_follows_mlx_lm_rules():
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

    logits = mx.random.normal((1, 64), key=mx.random.key(7)) * 3
    history = [3, 5, 5, 9]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, min_p=0.05, seed=11,
                            repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, penalty_last_n=64)
    # Penalties: the same rows as mlx-lm's processors give.
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=64,
                                   presence_penalty=0.4, presence_context_size=64,
                                   frequency_penalty=0.2, frequency_context_size=64)
    expected = logits + 0  # mlx-lm's repetition penalty writes into its input
    for p in procs:
        expected = p(mx.array(history), expected)
    lane = LaneSampler(params, history)
    ours = logits + 0
    for p in lane.processors:
        ours = p(mx.array(lane.tokens), ours)
    assert mx.allclose(ours, expected).item()
    # Filters: every draw is in the set mlx-lm's top-p → min-p → top-k chain keeps.
    lp = expected - mx.logsumexp(expected, axis=-1, keepdims=True)
    kept = apply_top_k(apply_min_p(apply_top_p(lp, 0.9), 0.05, 1), 12)
    allowed = set(mx.argwhere(kept[0] > -float("inf")).reshape(-1).tolist()) if hasattr(mx, "argwhere") else \
        {i for i, v in enumerate(kept[0].tolist()) if v > -float("inf")}
    draws = [int(LaneSampler(params, history).sample(logits + 0).item()) for _ in range(3)]
    assert len(set(draws)) == 1  # seeded: the same token every time
    lane = LaneSampler(SamplingParams(temperature=0.8, top_p=0.9, top_k=12, min_p=0.05, seed=1))
    tokens = {int(lane.sample(expected).item()) for _ in range(200)}
    assert tokens <= allowed and len(tokens) > 1
    # Greedy is the argmax.
    assert int(LaneSampler(GREEDY).sample(logits).item()) == int(mx.argmax(logits).item())


# ---- real servers ---------------------------------------------------------------------------

def post(base, path, body, headers=None, timeout=180):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(base, prompt, max_tokens, qos=None, **extra):
    headers = {"x-superfluid-qos": qos} if qos else {}
    body = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True, **extra}, headers)
    return body["choices"][0]["text"]


def stream_text(base, prompt, max_tokens, seen=None):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
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


def metric(server, name):
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


TINY_PROMPTS = [f"<|im_start|>user\nTell me about the {w} of the water<|im_end|>\n<|im_start|>assistant\n"
                for w in ("people", "word", "number", "time")]


@pytest.fixture(scope="module")
def tiny_server(start_server, tiny_path):
    return start_server("--model", tiny_path, "--model-name", "tiny", "--engine", "mlx", "--max-batch", "4")


def test_tiny_server_api_and_four_lanes(tiny_server):
    openai = pytest.importorskip("openai")
    srv = tiny_server
    health = srv.get_json("/health")["models"]["tiny"]
    assert health["engine"] == "mlx" and health["state"] == "ready"
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=12, temperature=0)
    assert chat.usage.completion_tokens >= 1 and chat.choices[0].message.content is not None
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0, stream=True)
        if c.choices]
    assert "".join(parts) == chat.choices[0].message.content
    alone = [complete(srv.base, p, 40) for p in TINY_PROMPTS]
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(srv.base, p, 40), TINY_PROMPTS))
    assert together == alone


def test_tiny_preemption_with_parking_keeps_text(start_server, tiny_path, tiny_server):
    agents = TINY_PROMPTS[:2]
    with cf.ThreadPoolExecutor(1) as pool:  # the parking server starts while tiny_server gives the references
        starting = pool.submit(start_server, "--model", tiny_path, "--model-name", "tiny", "--engine", "mlx",
                               "--max-batch", "2", "--park")
        references = [complete(tiny_server.base, p, 300) for p in agents]
        srv = starting.result()
    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(complete, srv.base, p, 300, "agent") for p in agents]

        def both_decoding():
            slots = srv.get_json("/slots")["models"]["tiny"]["slots"]
            return sum(s["state"] == "decoding" and s["generated_tokens"] > 20 for s in slots) == 2
        wait_for(both_decoding, what="two decoding agent lanes")
        chat = complete(srv.base, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", 8, "interactive")
        texts = [f.result(timeout=120) for f in futures]
    assert chat
    assert metric(srv, "superfluid_preemptions_total") >= 1
    assert texts == references
    srv.stop()


def test_tiny_worker_kill_loses_nothing(tiny_server):
    srv = tiny_server
    # The kill comes as soon as every stream has 50 tokens: 250 more keep them running through it
    # (the tiny model decodes a few hundred tokens a second here, the kill follows within a poll).
    n = 300
    with cf.ThreadPoolExecutor(4) as pool:  # the same four streams at once, unkilled
        reference = list(pool.map(lambda p: stream_text(srv.base, p, n), TINY_PROMPTS))
    pid = srv.get_json("/health")["models"]["tiny"]["worker_pid"]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_text, srv.base, p, n) for p in TINY_PROMPTS]

        def all_decoding():
            slots = srv.get_json("/slots")["models"]["tiny"]["slots"]
            return sum(s["state"] == "decoding" and s["generated_tokens"] > 50 for s in slots) == 4
        wait_for(all_decoding, what="every stream under way")
        os.kill(pid, signal.SIGKILL)
        texts = [f.result(timeout=120) for f in futures]
    assert texts == reference
    health = srv.get_json("/health")["models"]["tiny"]
    assert health["restarts"] == 1 and health["worker_pid"] != pid and health["state"] == "ready"


# ---- SmolLM2 ------------------------------------------------------------------------------------

def _chatml(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# The first through SmolLM2's chat format (its reply names Paris); the others plain, as a chat
# template would triple what SmolLM2 prefills at a few tokens a second on MLX's CPU kernels
SMOL_QUESTION = "What is the capital of France?"
SMOL_PROMPTS = [_chatml(SMOL_QUESTION), "Name three colors.", "Write a haiku about the sea."]
SMOL_TOKENS = 6  # "The capital of France is Paris": Paris is the 6th token


def test_smollm2_on_mlx_agrees_with_mlx_lm_generate(start_server, model_path):
    """Greedy replies through the server equal mlx-lm's own generation loop (``generate_step``,
    which ``mlx_lm.generate`` drives) on the same GGUF-built model, prompt by prompt. The server
    runs in a thread beside this process's reference run (each one core of MLX's CPU kernels)."""
    openai = pytest.importorskip("openai")
    from mlx_lm.generate import generate_step

    def serve():
        srv = start_server("--engine", "mlx", "--max-batch", "4")
        try:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=180, max_retries=0)
            served = []
            for q in SMOL_PROMPTS:
                r = client.completions.create(model="smollm2", prompt=q, max_tokens=SMOL_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
                served.append(r.choices[0].text)
            stream = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": SMOL_QUESTION}], max_tokens=SMOL_TOKENS,
                temperature=0, stream=True)
            return served, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        finally:
            srv.stop()

    vocab = GGUFVocab(model_path, "smollm2")
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            future = ex.submit(serve)
            model = loader.load(model_path)
            own = []
            for q in SMOL_PROMPTS:
                prompt = mx.array(vocab.tokenize(q, True, True))
                toks = [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, max_tokens=SMOL_TOKENS)),
                                               range(SMOL_TOKENS))]
                own.append(b"".join(vocab.token_bytes(t) for t in toks).decode("utf-8", errors="replace"))
            served, streamed = future.result()
    finally:
        vocab.close()
    assert "Paris" in streamed
    matches = sum(a == b for a, b in zip(served, own))
    print(f"MLX agreement: {matches} of {len(own)} replies identical to mlx-lm's generate_step")
    assert "Paris" in served[0]
    assert matches == len(own), list(zip(served, own))


def test_mlx_engine_registered_by_entry_point():
    from superfluid.core.engine import EngineRegistry
    from superfluid.core.plugins import make_plugin_manager

    registry = EngineRegistry()
    make_plugin_manager().hook.superfluid_add_engines(register=registry.add)
    assert "mlx" in registry.names() and "llamacpp" in registry.names()


def test_model_directory_matches_gguf(tmp_path, model_path):
    """The mlx-lm directory path: SmolLM2 written as an mlx-lm directory (plugins/mlx/convert)
    gives the same logits through mlx-lm's loader, and its Hugging Face tokenizer the same ids
    and bytes as the GGUF's."""
    import numpy as np

    from superfluid.plugins.mlx.convert import convert
    from superfluid.plugins.vocab import HFVocab

    out = convert(model_path, str(tmp_path / "smol-mlx"))
    hf, gg = HFVocab(out, "d"), GGUFVocab(model_path, "g")
    text = "<|im_start|>user\nHello, world! What's the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    tokens = gg.tokenize(text, True, True)
    assert hf.tokenize(text, True, True) == tokens
    assert hf.tokenize("<|im_end|>", False, False) == gg.tokenize("<|im_end|>", False, False)
    assert all(hf.token_bytes(t) == gg.token_bytes(t) for t in range(0, gg.n_vocab, 97))
    assert hf.info.chat_template == gg.info.chat_template and hf.info.eos_token == gg.info.eos_token
    a = np.array(loader.load(out)(mx.array([tokens])))
    b = np.array(loader.load(model_path)(mx.array([tokens])))
    assert np.abs(a - b).max() < 1e-4
    gg.close()

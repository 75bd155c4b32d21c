"""--kv-bits 8|4 on the MLX engine (mlx-lm's QuantizedKVCache, plugins/mlx/kv_cells.py).

* The runner on a tiny random llama with 64-long heads: batched decode equals each lane alone,
  parking / restoring / park files / copies at 8 and 4 bits continue exactly as the unparked
  lane, the parked bytes are the narrow cells', and a park file of another width is a miss.
* SmolLM2 served through the openai client at 16, 8 and 4 bits: /health's kv_pool counts the
  narrower cells (from the GGUF's shape: 2 bytes an element, or bits/8 plus a scale and a bias
  of 2 bytes per 64); greedy replies, alone and with 3 concurrent requests, equal mlx-lm's own
  ``generate_step`` run with a prompt cache of ``QuantizedKVCache`` at the same width; at 4 bits
  they are not full width's (so the width really reached the cache). SmolLM2 runs a few tokens a
  second on MLX's CPU kernels, one core a process: the prompts are plain (no chat template) and
  the replies 4 tokens (4-bit KV already changes the haiku's first token), the three servers run
  at once while this process computes the references, and full width's replies are computed only
  until one differs.
* Parking and the host tier on a served tiny 64-head model at 8 / 4 bits: a preempted lane's
  text equals its unpreempted reply, and a prefix evicted to host memory comes back from there
  to the same reply.
* A model whose heads are not whole groups of 64 is refused at startup, naming the engine.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")
openai = pytest.importorskip("openai")

from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import Seed, TickPlan  # noqa: E402
from superfluid.plugins.mlx import kv_cells, loader, pool  # noqa: E402
from superfluid.plugins.mlx.runner import MlxRunner  # noqa: E402
from superfluid.plugins.vocab import GGUFVocab  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402
from .test_mlx import TINY_PROMPTS, _generate, complete, metric, wait_for  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

# Plain prompts (a chat template would triple what SmolLM2 prefills); the haiku first: its 4-bit
# reply differs from full width's at the first token
QUESTIONS = ["Write a haiku about the sea.", "Name three colors.", "The capital of France is"]
TOKENS = 4


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """A tiny random llama whose heads are 64 long (two heads of 64, one KV head), so its caches
    quantize in whole groups."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("mlx-kvbits") / "tiny-64.gguf", quant="Q8_0",
                                n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=256))


@pytest.fixture(scope="module")
def wide(wide_path):
    vocab = GGUFVocab(wide_path, "tiny")
    yield loader.load(wide_path), vocab
    vocab.close()


# ---- the runner --------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_runner_batches_parks_and_files_at_each_width(wide, tmp_path, bits):
    model, vocab = wide
    toks = vocab.tokenize("the people of the water could find a long way", True, True)
    prompts = {0: toks, 1: vocab.tokenize("Hello world, how are you", True, True),
               2: vocab.tokenize("def print(self): return None and some more words", True, True)}
    alone = {s: _generate(MlxRunner(model, vocab.eog, StopFlag(), 4096, kv_bits=bits), {s: t}, 16)[0][s]
             for s, t in prompts.items()}
    together, res = _generate(MlxRunner(model, vocab.eog, StopFlag(), 4096, kv_bits=bits), prompts, 16)
    assert together == alone and any(step.decode_tokens == 3 for step in res.steps)
    reference = alone[0]

    runner = MlxRunner(model, vocab.eog, StopFlag(), 4096, kv_bits=bits)
    first = _generate(runner, {0: toks}, 6)[0][0]
    assert all(isinstance(c, kv_cells.QuantizedKVCache) and c.bits == bits for c in runner.caches[0])
    n_kv = runner.length(0)
    res = runner.run(TickPlan(park=[(0, "k")], release=[0]))
    shape = pool.model_shape(model, pool.cache_type(model), bits)
    full = pool.model_shape(model, pool.cache_type(model))
    assert res.parked["k"] == n_kv * shape.bytes_per_cell() < n_kv * full.bytes_per_cell()
    path = str(tmp_path / "k.npz")
    res = runner.run(TickPlan(save=[("k", path)], drop_parked=["k"]))
    for _ in range(200):  # written off the tick thread
        if path in res.saved:
            break
        res = runner.run(TickPlan(collect_saves=True))
    assert res.saved[path] > 0
    other = MlxRunner(model, vocab.eog, StopFlag(), 4096, kv_bits=0 if bits else 8)
    assert other.run(TickPlan(load=[(path, "x")])).parked["x"] == 0 and "x" not in other.parked  # another width
    runner.run(TickPlan(load=[(path, "k2")]))
    assert "k2" in runner.parked
    seq = toks + first
    rest = _generate(runner, {5: seq}, 10, pos=len(seq) - 1, seed=Seed(key="k2"))[0][5]
    assert first + rest == reference
    out = _generate(runner, {6: toks}, 16, pos=8, seed=Seed(slot=5))[0][6]  # a copy of slot 5's first 8
    assert out == reference


def test_probe_and_shape_bytes(wide):
    model, _ = wide
    assert kv_cells.probe(model, 8) is None and kv_cells.probe(model, 4) is None
    # 2 layers x (K + V) x 64 elements: 64 (8-bit) or 32 (4-bit) bytes of ints + a scale and a bias a group
    assert pool.model_shape(model, "f16", 8).bytes_per_cell() == 2 * 2 * (64 + 4)
    assert pool.model_shape(model, "f32", 4).bytes_per_cell() == 2 * 2 * (32 + 8)
    assert pool.model_shape(model, "f16").bytes_per_cell() == 2 * 2 * 128
    assert pool.cache_type(model) == {4: "f32", 2: "f16"}[cache_element(model)]  # what the caches really hold


# ---- SmolLM2 through the server ------------------------------------------------------------------

def expected_bytes_per_cell(model_path: str, bits: int, element: int) -> int:
    """From the GGUF's own shape: every layer's K and V rows (KV heads x head length), ``element``
    bytes an element at full width, else ``bits`` an element and a scale and a bias of
    ``element`` bytes per 64."""
    from superfluid.plugins.kvpool.shape import gguf_file_getter

    get = gguf_file_getter(model_path)
    layers, heads = int(get("llama.block_count")), int(get("llama.attention.head_count"))
    width = int(get("llama.attention.head_count_kv")) * int(get("llama.embedding_length")) // heads
    row = element * width if not bits else width * bits // 8 + width // 64 * 2 * element
    return layers * 2 * row


def cache_element(model) -> int:
    """Bytes an element of what the model's caches really hold (one token run through it)."""
    caches = [kv_cells.new_cache(0) for _ in model.layers]
    model(mx.array([[1]]), cache=caches)
    return caches[0].keys.itemsize


def served_replies(srv) -> tuple[list[str], list[str]]:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)

    def ask(q: str) -> str:
        r = client.completions.create(model="smollm2", prompt=q, max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [ask(q) for q in QUESTIONS]
    with cf.ThreadPoolExecutor(len(QUESTIONS)) as ex:
        together = list(ex.map(ask, QUESTIONS))
    return alone, together


def mlx_lm_replies(model, vocab, bits: int, questions=QUESTIONS) -> list[str]:
    """mlx-lm's generate_step, its caches quantized to ``bits`` from the first token (0: its own)."""
    from mlx_lm.generate import generate_step

    out = []
    for q in questions:
        prompt = mx.array(vocab.tokenize(q, True, True))
        cache = [kv_cells.new_cache(bits) for _ in model.layers] if bits else None
        steps = generate_step(prompt, model, max_tokens=TOKENS, prompt_cache=cache)
        toks = [int(t) for (t, _), _ in zip(steps, range(TOKENS))]
        out.append(b"".join(vocab.token_bytes(t) for t in toks).decode("utf-8", errors="replace"))
    return out


def test_smollm2_pool_and_replies_at_16_8_4(start_server, model_path):
    def serve(bits: int):
        """/health, and at 8 / 4 bits the served replies; each server stops when done."""
        srv = start_server("--engine", "mlx", "--max-batch", "4", "--kv-bits", str(bits))
        try:
            return srv.get_json("/health")["models"]["smollm2"], served_replies(srv) if bits else None
        finally:
            srv.stop()

    vocab = GGUFVocab(model_path, "smollm2")
    try:
        # the servers (one core each while they decode) run beside this process's references
        with cf.ThreadPoolExecutor(3) as ex:
            futures = {bits: ex.submit(serve, bits) for bits in (0, 8, 4)}
            model = loader.load(model_path)
            element = cache_element(model)
            own = {bits: mlx_lm_replies(model, vocab, bits) for bits in (8, 4)}
            full = {0: mlx_lm_replies(model, vocab, 0, QUESTIONS[:1])[0]}  # the rest only if needed
            results = {bits: f.result() for bits, f in futures.items()}
        health = {bits: h for bits, (h, _) in results.items()}
        served = {bits: r for bits, (_, r) in results.items() if bits}
        for bits, h in health.items():
            per_cell = expected_bytes_per_cell(model_path, bits, element)
            assert h["bytes_per_cell"] == h["kv_pool"]["bytes_per_cell"] == per_cell, bits
            assert h["kv_bytes"] == h["n_ctx"] * per_cell == h["kv_pool"]["kv_bytes"]
            assert h["kv_pool"]["shape"]["type_k"] == ({4: "f32", 2: "f16"}[element] if not bits else f"q{bits}_g64")
        assert health[0]["n_ctx"] == health[8]["n_ctx"] == health[4]["n_ctx"]
        print("MLX SmolLM2 bytes per cell at full width / 8 / 4 bits:",
              [health[b]["bytes_per_cell"] for b in (0, 8, 4)], "kv_bytes:", [health[b]["kv_bytes"] for b in (0, 8, 4)])
        for bits in (8, 4):
            alone, together = served[bits]
            same = sum(a == b for a, b in zip(alone, own[bits]))
            print(f"{bits}-bit: {same} of {len(own[bits])} replies equal mlx-lm's")
            assert alone == own[bits], list(zip(alone, own[bits]))
            assert together == own[bits]

        def full_reply(i: int) -> str:
            if i not in full:
                full[i] = mlx_lm_replies(model, vocab, 0, QUESTIONS[i:i + 1])[0]
            return full[i]
        # 4-bit KV changes some reply: the width reached the cache (full width's replies as needed)
        assert any(got != full_reply(i) for i, got in enumerate(served[4][0]))
    finally:
        vocab.close()


# ---- parking and the host tier on a served model --------------------------------------------------

def conversation(name: str) -> str:
    """A prompt long enough for the host tier to keep (over 64 tokens), its own from the first word."""
    notes = " ".join(f"{name} note {i}: the {name.lower()} team ships on day {i}." for i in range(10))
    return f"{name} here. {notes}\nSummarize."


@pytest.fixture(scope="module")
def parking_servers(start_server, wide_path):
    """{bits: a tiny 64-head server with --park at that width}: both start at once (a core each),
    and stop at once after the module's tests."""
    def start(bits: int):
        return start_server("--model", wide_path, "--model-name", "tiny", "--engine", "mlx", "--max-batch", "2",
                            "--park", "--kv-bits", str(bits))

    with cf.ThreadPoolExecutor(2) as ex:
        servers = dict(zip((8, 4), ex.map(start, (8, 4))))
    yield servers
    with cf.ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda srv: srv.stop(), servers.values()))


@pytest.mark.parametrize("bits", [8, 4])
def test_parking_and_host_tier_under_kv_bits(parking_servers, bits):
    srv = parking_servers[bits]
    health = srv.get_json("/health")["models"]["tiny"]
    assert health["kv_pool"]["shape"]["kv_bits"] == bits
    # the host tier: five conversations through four buffers push the first out to host memory
    prompts = [conversation(name) for name in ("Alpha", "Bravo", "Charlie", "Delta", "Echo")]
    firsts = [complete(srv.base, p, 24) for p in prompts]
    host_bytes = metric(srv, "superfluid_host_cache_bytes")
    assert metric(srv, "superfluid_prefix_evictions_total") >= 1 and host_bytes > 0
    assert host_bytes % health["bytes_per_cell"] == 0  # whole cells of the narrow width
    hits = metric(srv, "superfluid_prefix_cache_host_hits_total")
    assert complete(srv.base, prompts[0], 24) == firsts[0]
    assert metric(srv, "superfluid_prefix_cache_host_hits_total") == hits + 1

    # parking: two agent lanes decoding, an interactive request preempts one; nothing changes
    agents = TINY_PROMPTS[:2]
    references = [complete(srv.base, p, 300) for p in agents]
    with cf.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(complete, srv.base, p, 300, "agent") for p in agents]

        def both_decoding():
            slots = srv.get_json("/slots")["models"]["tiny"]["slots"]
            return sum(s["state"] == "decoding" and s["generated_tokens"] > 20 for s in slots) == 2
        wait_for(both_decoding, what="two decoding agent lanes")
        chat = complete(srv.base, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", 8, "interactive")
        texts = [f.result(timeout=300) for f in futures]
    assert chat and metric(srv, "superfluid_preemptions_total") >= 1
    assert texts == references


def test_heads_not_whole_groups_are_refused(start_server, tmp_path):
    """The default tiny model's heads are 16 long: --kv-bits 8 fails at startup, naming the engine."""
    path = str(write_tiny_llama(tmp_path / "tiny-16.gguf", quant="Q8_0"))
    with pytest.raises(RuntimeError, match="engine 'mlx' cannot serve --kv-bits 8"):
        start_server("--model", path, "--model-name", "tiny", "--engine", "mlx", "--kv-bits", "8")

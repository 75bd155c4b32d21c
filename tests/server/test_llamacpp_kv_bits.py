"""``--kv-bits 8|4`` on llama.cpp: K and V stored as q8_0 / q4_0 (flash attention on), the pool
sized, reported and checked against llama.cpp's own log at the narrower cells, and greedy replies
equal to llama-cpp-python's own ``Llama`` with the same cache types.

One real server per width (module-scoped), driven by the openai client; the reference runs in a
child process (tests/llama_reference.in_child)."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import pytest

from superfluid.core.errors import ConfigError
from superfluid.core.kv_context_options import kv_context_options
from superfluid.core.options import PluginOptions
from superfluid.plugins.kvpool.shape import from_gguf, gguf_file_getter
from superfluid.plugins.llamacpp.context_params import FLASH_AUTO, FLASH_OFF, FLASH_ON, context_settings

from ..kv_rope_reference import greedy_at_kv_bits
from ..llama_reference import in_child

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a compiler does.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 32
CONTEXT = 2048
# ggml's block sizes: (bytes, values) a block (ggml_type_size / ggml_blck_size)
BLOCKS = {0: (2, 1), 8: (34, 32), 4: (18, 32)}


# ---- unit: the sizing and the settings ----------------------------------------------------------

def _core(**values):
    """``CORE_OPTIONS.of(model)``'s view of the KV/rope options: defaults but ``values``."""
    return PluginOptions("core", kv_context_options()).of({k.replace("_", "-"): v for k, v in values.items()})


def test_bytes_per_cell_at_each_width_from_the_models_own_shape(model_path):
    """SmolLM2-135M: 30 layers, 3 KV heads of 64 values for K and for V, so a cell is 30 × 2 ×
    192 values: 2 bytes each at f16, 34 bytes per 32 at q8_0, 18 per 32 at q4_0."""
    get = gguf_file_getter(model_path)
    arch = get("general.architecture")
    layers, kv_heads = int(get(f"{arch}.block_count")), int(get(f"{arch}.attention.head_count_kv"))
    head = int(get(f"{arch}.embedding_length")) // int(get(f"{arch}.attention.head_count"))
    values = layers * 2 * kv_heads * head
    for bits, kind in ((0, "f16"), (8, "q8_0"), (4, "q4_0")):
        size, block = BLOCKS[bits]
        assert from_gguf(get, kind, kind).bytes_per_cell() == values * size // block, kind
    assert from_gguf(get, "q8_0", "q8_0").bytes_per_cell() * 64 == from_gguf(get).bytes_per_cell() * 34


def test_kv_bits_picks_the_cache_type_and_turns_flash_attention_on():
    for bits, kind in ((0, "f16"), (8, "q8_0"), (4, "q4_0")):
        settings, flash = context_settings(_core(kv_bits=bits), FLASH_AUTO, "m")
        assert (settings.type_k, settings.type_v) == (kind, kind)
        assert flash == (FLASH_ON if bits else FLASH_AUTO)
    assert context_settings(_core(), FLASH_OFF, "m")[1] == FLASH_OFF  # full width: off stays off


def test_kv_bits_with_flash_attention_off_is_refused_saying_why():
    with pytest.raises(ConfigError, match="model 'm': kv-bits 8 .*flash attention"):
        context_settings(_core(kv_bits=8), FLASH_OFF, "m")


# ---- the real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(start_server):
    """One server per width, 4 lanes each."""
    return {bits: start_server("--max-batch", "4", "--kv-bits", str(bits)) for bits in (0, 8, 4)}


def _pool(srv) -> dict:
    return srv.get_json("/health")["models"]["smollm2"]


def test_health_counts_the_narrower_cells_and_llama_cpp_agrees(servers):
    pools = {bits: _pool(srv) for bits, srv in servers.items()}
    full = pools[0]["kv_pool"]
    for bits, model in pools.items():
        pool = model["kv_pool"]
        size, block = BLOCKS[bits]
        assert pool["shape"]["type_k"] == pool["shape"]["type_v"] == {0: "f16", 8: "q8_0", 4: "q4_0"}[bits]
        # narrower by exactly the block ratio, same cells
        assert pool["cells"] == full["cells"] == (4 + 2) * CONTEXT  # lanes + 2 spare sequences
        assert pool["bytes_per_cell"] * 2 * block == full["bytes_per_cell"] * size
        assert pool["kv_bytes"] == pool["cells"] * pool["bytes_per_cell"]
        # llama.cpp's own log (MiB with two decimals) says the same
        logged = sum(c["mib"] for c in pool["llama_caches"]) * 2**20
        assert abs(logged - pool["kv_bytes"]) <= 0.005 * 2**20 * len(pool["llama_caches"]) + 1, (bits, logged)
        assert model["kv_bytes_logged"] and model["kv_bytes_computed"] == model["kv_bytes"]


def test_metrics_report_the_narrower_pool(servers):
    per_cell = {bits: srv.metrics()['superfluid_kv_pool_bytes_per_cell{model="smollm2"}']
                for bits, srv in servers.items()}
    assert per_cell[8] * 64 == per_cell[0] * 34 and per_cell[4] * 64 == per_cell[0] * 18


def test_the_host_tier_holds_the_narrower_cells(servers):
    """The same conversations on each server: the prefixes evicted to host memory (the spare
    sequences full) are the same ones, in llama.cpp's own sequence state, narrower by the block
    ratio (a state's few header bytes aside). Parked lanes are saved the same way."""
    held = {}
    for bits, srv in servers.items():
        for i in range(10):  # 6 sequences (4 lanes + 2 spare): the oldest prefixes go to the host tier
            # ~90 tokens: over the host tier's least (core/prefix.py's MIN_HOST_TOKENS, 64)
            status, body = srv.call("POST", "/v1/completions", {
                "model": "smollm2", "prompt": f"Story number {i}: " + "the cat sat on the mat and " * 12,
                "max_tokens": 2, "temperature": 0})
            assert status == 200, body
        slots = srv.get_json("/slots")["models"]["smollm2"]
        held[bits] = (slots["host_cache_entries"], slots["host_cache_bytes"])
    assert held[0][0] > 0 and held[8][0] == held[4][0] == held[0][0], held
    for bits in (8, 4):
        size, block = BLOCKS[bits]
        assert abs(held[bits][1] / held[0][1] - size / (2 * block)) < 0.005, held


@pytest.fixture(scope="module")
def references(model_path):
    return {bits: in_child(greedy_at_kv_bits, model_path, PROMPTS, MAX_TOKENS, bits) for bits in (8, 4)}


def _client(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=180, max_retries=0)


def _ask(client, prompt):
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_replies_equal_llama_with_the_same_cache_types_alone(servers, references, bits):
    client = _client(servers[bits])
    for p in PROMPTS[:2]:
        assert _ask(client, p) == references[bits][p], p


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_replies_equal_llama_with_the_same_cache_types_concurrent(servers, references, bits):
    client = _client(servers[bits])
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = dict(zip(PROMPTS, pool.map(lambda p: _ask(client, p), PROMPTS)))
    wrong = {p: (answers[p], references[bits][p]) for p in PROMPTS if answers[p] != references[bits][p]}
    assert not wrong, wrong


def test_four_bit_kv_changes_some_reply(servers, references):
    """The 4-bit replies are not the full-width ones (else the equality above proves nothing)."""
    client = _client(servers[0])
    full = {p: _ask(client, p) for p in PROMPTS}
    assert any(full[p] != references[4][p] for p in PROMPTS), "q4_0 KV changed no reply"


@pytest.mark.parametrize("flags,needle", [
    (("--kv-bits", "8", "--flash-attn", "off"), "flash attention"),
    (("--kv-bits", "3"), "kv-bits"),
])
def test_bad_kv_bits_settings_fail_at_startup_saying_why(model_path, flags, needle):
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model_path,
                          "--port", "0", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert needle in out.stderr, out.stderr[-2000:]

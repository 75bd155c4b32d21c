"""KV pool sizing (plugins/kvpool, llama.cpp's device memory and log reading, the /metrics
collector): bytes per cell from a model's declared key and value lengths, llama.cpp's allocation
with sliding-window layers, the layout's limits, and where free memory is measured. The real
engines are checked against these in tests/server/test_kv_sizing.py."""

from __future__ import annotations

import pytest

from superfluid.plugins.kvpool import layout as kvlayout
from superfluid.plugins.kvpool.layout import FreeMemory, decide
from superfluid.plugins.kvpool.shape import KVShape, from_gguf, parse_meta_value, swa_layers

GIB = 1 << 30

# Qwen3-shaped: head length 32 where 64 / 4 heads would say 16
QWEN3 = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.embedding_length": 64,
         "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
         "qwen3.attention.key_length": 32, "qwen3.attention.value_length": 32}
# Gemma 3 270M's keys (its GGUF's values): 18 layers, one KV head of 256 where 640 / 4 would say 160
GEMMA3 = {"general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.embedding_length": 640,
          "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
          "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
          "gemma3.attention.sliding_window": 512}


def test_bytes_per_cell_from_key_and_value_lengths():
    qwen = from_gguf(QWEN3.get)
    assert qwen.bytes_per_cell() == 2 * 2 * (32 + 32) * 2 == 512      # layers × kv heads × (K + V) × f16
    assert not qwen.sliding and qwen.allocated_bytes(2048, 4, False) == 2048 * 512
    gemma = from_gguf(GEMMA3.get)
    assert gemma.bytes_per_cell() == 18 * 1 * (256 + 256) * 2 == 18432
    # without the declared lengths, llama.cpp's default: n_embd / n_head
    plain = {k: v for k, v in QWEN3.items() if "key_length" not in k and "value_length" not in k}
    assert from_gguf(plain.get).bytes_per_cell() == 2 * 2 * (16 + 16) * 2


def test_gemma3_window_layers_and_llamacpp_allocation():
    gemma = from_gguf(GEMMA3.get)
    assert gemma.swa == swa_layers(18, 6) and sum(gemma.swa) == 15 and gemma.n_swa == 512
    assert [il for il in range(18) if not gemma.swa[il]] == [5, 11, 17]   # llama.cpp's period of 6
    assert gemma.bytes_per_cell(window=False) == 3 * 1024 and gemma.bytes_per_cell(window=True) == 15 * 1024
    # swa_full (llama_context_default_params, the worker's): every layer holds every cell
    assert gemma.allocated_bytes(16384, 6, True, swa_full=True) == 16384 * 18432
    # swa_full off: the window layers' cache is pad256(min(cells, window × sequences + n_ubatch))
    assert gemma.window_cells(16384, 6, True, False, 512) == 3584
    assert gemma.allocated_bytes(16384, 6, True, swa_full=False, n_ubatch=512) == 16384 * 3072 + 3584 * 15360
    # per-sequence streams: each its own window cache of pad256(min(cells a stream, window + n_ubatch))
    assert gemma.allocated_bytes(4 * 2048, 4, False, swa_full=False) == 4 * 2048 * 3072 + 4 * 1024 * 15360
    # the most cells a budget holds: the window caches are a fixed part when not full-size
    assert gemma.cells_within(16384 * 18432, 6, swa_full=True) == 16384
    assert gemma.cells_within(16384 * 3072 + 3584 * 15360, 6, swa_full=False) == 16384


def test_per_layer_heads_window_pattern_and_swa_lengths():
    hybrid = {"general.architecture": "jamba", "jamba.block_count": 4, "jamba.embedding_length": 64,
              "jamba.attention.head_count": [4, 4, 4, 4], "jamba.attention.head_count_kv": [0, 2, 0, 2]}
    shape = from_gguf(hybrid.get)
    assert shape.k_width == (0, 32, 0, 32) and shape.bytes_per_cell() == 2 * (32 + 32) * 2
    stated = {**GEMMA3, "gemma3.attention.sliding_window_pattern": [True, False] * 9,
              "gemma3.attention.key_length_swa": 128, "gemma3.attention.value_length_swa": 128}
    shape = from_gguf(stated.get)
    assert shape.swa == (True, False) * 9 and shape.k_width[:2] == (128, 256)
    assert shape.bytes_per_cell() == 9 * (128 + 128) * 2 + 9 * (256 + 256) * 2
    # V padded to the widest layer when V is transposed (flash attention off)
    assert shape.bytes_per_cell(v_trans=True) == 9 * (128 + 256) * 2 + 9 * (256 + 256) * 2
    # q8_0 cache: 34 bytes a block of 32
    assert KVShape((64,), (64,), (False,), 0, "q8_0", "q8_0").bytes_per_cell() == 2 * 68


def test_llama_meta_strings_parse():
    assert parse_meta_value("512") == 512 and parse_meta_value("1e-06") == 1e-06
    assert parse_meta_value("[0, 2, 0, 2]") == [0, 2, 0, 2]
    assert parse_meta_value("[true, false]") == [True, False] and parse_meta_value("[]") == []
    assert parse_meta_value("gemma3") == "gemma3" and parse_meta_value(None) is None


def test_layout_limits():
    mem = FreeMemory(64 * GIB)
    per_seq = decide(4, 2048, False, 1000, FreeMemory(GIB))
    assert (per_seq.n_seq, per_seq.n_ctx, per_seq.unified, per_seq.cap) == (6, 6 * 2048, False, kvlayout.PER_SEQUENCE)
    pool = decide(4, 2048, True, 1000, mem)
    assert (pool.n_ctx, pool.unified, pool.cap) == (4 * 2048, True, kvlayout.LANES)
    capped = decide(4, 2048, True, 1000, FreeMemory(10_000_000))      # 60 % of 10 MB: 6000 cells
    assert (capped.n_ctx, capped.cap, capped.budget_bytes) == (6000, kvlayout.MEMORY, 6_000_000)
    tiny = decide(4, 2048, True, 1000, FreeMemory(1_000_000))
    assert (tiny.n_ctx, tiny.cap) == (2048, kvlayout.ONE_LANE)          # one lane always fits
    assert decide(16, 2048, True, 1000, mem, pool_cells=3000).n_ctx == 3000
    assert decide(16, 2048, True, 1000, mem, pool_cells=100).n_ctx == 2048
    assert decide(1, 2048, False, 1, mem).n_seq == 4 and decide(300, 16, False, 1, mem).n_seq == 256
    d = capped.describe()
    assert d["kv_bytes"] == 6000 * 1000 and d["shared"] and d["cap"] == "memory" and d["sequences"] == 6
    assert "capped at 60%" in capped.line() and "6000 cells" in capped.line()


def test_free_memory_where_the_weights_sit(monkeypatch):
    from superfluid.plugins.llamacpp.device_memory import Device, weights_free

    class VM:
        available = 10 * GIB

    monkeypatch.setattr("psutil.virtual_memory", lambda: VM)
    cpu = Device("CPU", "CPU", 64 * GIB, 64 * GIB)   # ggml's CPU device calls all memory free
    gpus = [cpu, Device("CUDA0", "GPU", 30 * GIB, 80 * GIB), Device("CUDA1", "GPU", 20 * GIB, 80 * GIB)]
    on_gpu = weights_free(-1, 0, gpus)
    assert on_gpu == FreeMemory(50 * GIB, "CUDA0+CUDA1", "ggml_backend_dev_memory after loading")
    host = weights_free(0, GIB, gpus)                  # no layer offloaded: the host, less mapped weights
    assert host.free_bytes == 9 * GIB and host.where == "host"
    assert weights_free(-1, 0, [cpu]).free_bytes == 10 * GIB
    assert "not reachable" in weights_free(-1, 0, None).how


def test_ggml_devices_are_read_from_the_library():
    pytest.importorskip("llama_cpp")
    from superfluid.plugins.llamacpp.device_memory import ggml_devices

    devices = ggml_devices()
    assert devices and any(d.kind == "CPU" and d.total > 0 for d in devices)


def test_kv_log_lines():
    from superfluid.plugins.llamacpp.kv_log import agrees, parse, total_bytes

    line = ("llama_kv_cache: size =   54.00 MiB (  3072 cells,  18 layers,  6/1 seqs), "
            "K (f16):   27.00 MiB, V (f16):   27.00 MiB\n")
    cache = parse(line)
    assert (cache.mib, cache.cells, cache.layers, cache.streams) == (54.0, 3072, 18, 1)
    assert parse("llama_kv_cache:        CPU KV buffer size =    54.00 MiB") is None
    assert total_bytes([cache]) == 3072 * 18432 and agrees(3072 * 18432, [cache])
    assert not agrees(3072 * 11520, [cache])           # n_embd / n_head's figure for Gemma 3


def test_pool_gauges_read_engines_at_scrape_time():
    from superfluid.plugins.http.info.kv_pool_metrics import KVPoolGauges

    layout = decide(2, 256, True, 512, FreeMemory(GIB)).describe()

    class Engine:
        def __init__(self, desc):
            self.desc = desc

        def describe(self):
            return self.desc

    class Runtime:
        def __init__(self, desc):
            self.engine = Engine(desc)

    gauges = KVPoolGauges()
    gauges.serve(lambda: {"a": Runtime({"kv_bytes": 512 * 512, "kv_pool": layout}), "b": Runtime({})})
    samples = {(m.name, tuple(s.labels.values())): s.value for m in gauges.collect() for s in m.samples}
    assert samples[("superfluid_kv_pool_bytes", ("a",))] == 512 * 512
    assert samples[("superfluid_kv_pool_bytes_per_cell", ("a",))] == 512
    assert samples[("superfluid_kv_pool_info", ("a", "shared", "lanes", "host"))] == 1
    assert not any(labels[0] == "b" for _, labels in samples)

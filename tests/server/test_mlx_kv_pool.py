"""The MLX adapter's KV pool (plugins/mlx/pool.py), sized as llama.cpp's: on a Gemma-3-shaped
directory (heads of 32 where 64 / 4 says 16, five window layers and one global) the bytes per
cell are what the slots' caches really take, a sliding-window model gets a shared pool whose
bound the runner keeps, a batched step masks each window layer as one lane alone does, and the
server reports the pool on /health and /metrics."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, TickPlan  # noqa: E402
from superfluid.plugins.mlx import loader, pool  # noqa: E402
from superfluid.plugins.mlx.runner import MlxRunner  # noqa: E402

from .kv_models import smollm2_tokenizer, tiny_gemma3_dir  # noqa: E402
from .test_mlx import GREEDY, _generate  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

NAME = "smollm2"


GEMMA3_CACHE = "tiny-gemma3-text-v1"  # the recipe: kv_models.GEMMA3 with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def gemma3(model_path):
    """The Gemma-3-shaped directory and its config, built once per cache (torch's seeded random
    weights and the tokenizer read from the GGUF take seconds; the directory never changes)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from tools.fixtures.vlm_build import build, cache_root

    def save(stage: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            tok = smollm2_tokenizer(Path(tmp) / "tok", model_path)
            built, _ = tiny_gemma3_dir(Path(tmp), tok)
            for f in built.iterdir():
                shutil.move(str(f), str(stage / f.name))

    path = build(cache_root(GEMMA3_CACHE), save, gguf=False)["hf"]
    return str(path), json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def model(gemma3):
    return loader.load(gemma3[0])


def expected_per_cell(config: dict, element: int = 4) -> int:
    """Every layer's K and V (the runner keeps a plain cache on window layers too), float32."""
    return config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 * element


def test_shape_is_what_the_caches_take(model, gemma3):
    _, config = gemma3
    shape = pool.model_shape(model, pool.cache_type(model))
    per_cell = expected_per_cell(config)
    assert shape.bytes_per_cell() == per_cell == 3072
    assert shape.swa == (True,) * 5 + (False,) and shape.n_swa == 16 and shape.sliding
    runner = MlxRunner(model, {2}, StopFlag(), 4096)
    runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(range(10, 50)), sample=True, max_new=1,
                                        reset=True, sampling=GREEDY)]))
    caches = runner.caches[0]
    held = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    assert held == caches[0].keys.shape[2] * per_cell             # allocated cells (256 a step) × bytes a cell


def test_layout_is_a_capped_shared_pool(model):
    shape = pool.model_shape(model, pool.cache_type(model))
    roomy = pool.layout(shape, 2, 128, pool.FreeMemory(1 << 30))
    assert roomy.unified and roomy.n_ctx == 256 and roomy.n_seq == 4 and roomy.cap == "lanes"
    tight = pool.layout(shape, 2, 128, pool.FreeMemory(200 * 3072 * 10 // 6))
    assert tight.n_ctx == 200 and tight.cap == "memory"
    assert pool.layout(shape, 2, 128, pool.FreeMemory(1 << 30), pool_cells=300).n_ctx == 300
    assert pool.device_free().where == "host"                     # Linux: no Metal


def test_shared_pool_refuses_a_step_past_its_cells(model):
    runner = MlxRunner(model, {2}, StopFlag(), 32, shared_pool=True)
    first = runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(range(10, 30)), sample=True, max_new=1,
                                                reset=True, sampling=GREEDY)]))
    assert first.lanes[0].n_fed == 20 and not first.rejected_tokens
    second = runner.run(TickPlan(lanes=[LanePlan(slot=1, pos=0, feed=list(range(10, 30)), sample=True, max_new=1,
                                                 reset=True, sampling=GREEDY)]))
    assert second.rejected_tokens == 20 and second.lanes[1].n_fed == 0 and runner.kv_used() == 20


def test_batched_decode_past_the_window_equals_each_lane_alone(model):
    """Lanes longer than the 16-token window, decoded together: each window layer's mask hides what
    left its own lane's window (the batch view's), as a lane alone's cache does."""
    prompts = {0: list(range(100, 130)), 1: list(range(300, 321)), 2: list(range(500, 512))}
    alone = {s: _generate(MlxRunner(model, {2}, StopFlag(), 4096), {s: t}, 12)[0][s] for s, t in prompts.items()}
    together, res = _generate(MlxRunner(model, {2}, StopFlag(), 4096), prompts, 12)
    assert together == alone
    assert any(step.decode_tokens == 3 for step in res.steps)


def test_server_reports_the_pool(start_server, gemma3):
    path, config = gemma3
    with cf.ThreadPoolExecutor(1) as ex:  # the capped server starts beside the first
        capping = ex.submit(start_server, "--engine", "mlx", "--max-batch", "2", "--max-context", "128",
                            "--kv-pool-cells", "200", model=path)
        srv = start_server("--engine", "mlx", "--max-batch", "2", "--max-context", "128", model=path)
        capped = capping.result()
    h = srv.get_json("/health")["models"][NAME]
    p = h["kv_pool"]
    assert p["shared"] and p["sequences"] == 4 and p["cells"] == h["n_ctx"] == 256 and p["cap"] == "lanes"
    assert h["bytes_per_cell"] == expected_per_cell(config) and h["kv_bytes"] == 256 * expected_per_cell(config)
    assert srv.metrics()[f'superfluid_kv_pool_bytes{{model="{NAME}"}}'] == h["kv_bytes"]
    status, body = srv.call("POST", "/v1/completions", {"model": NAME, "prompt": "the water", "max_tokens": 4,
                                                        "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    p = capped.get_json("/health")["models"][NAME]["kv_pool"]
    assert p["cells"] == 200 and p["cap"] == "pool-cells"
    with cf.ThreadPoolExecutor(2) as ex:  # both stop at once (else the module's end stops them one by one)
        list(ex.map(lambda s: s.stop(), (srv, capped)))

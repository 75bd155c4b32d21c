"""Shared fixtures: the real default model and real servers on loopback ports."""

from __future__ import annotations

import os

import pytest

from superfluid.core import lane_guard
from superfluid.core.default_model import default_model_path

from .serverproc import ServerProcess

# Small enough for CI's two cores, big enough for every test prompt.
TEST_CONTEXT = "2048"


@pytest.fixture(scope="session", autouse=True)
def lane_strays(tmp_path_factory):
    """Every daemon these tests start runs under the lane-ownership guard (``core/lane_guard.py``):
    ``SUPERFLUID_LANE_GUARD`` names this file, where a daemon appends each stray lane write
    (its log has the error too). Set in the environment, so servers started any way inherit it."""
    path = tmp_path_factory.mktemp("lane_guard") / "strays.txt"
    path.touch()
    old = os.environ.get(lane_guard.ENV)
    os.environ[lane_guard.ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(lane_guard.ENV, None)
    else:
        os.environ[lane_guard.ENV] = old


@pytest.fixture(autouse=True)
def lane_fields_owned(lane_strays):
    """Fails the test during which a daemon wrote a lane's field outside the lane's methods."""
    seen = lane_strays.stat().st_size
    yield
    with open(lane_strays) as f:
        f.seek(seen)
        new = f.read()
    assert not new, f"a daemon wrote lane fields outside core/lane.py (see its log):\n{new}"


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory, model_path):
    """Factory: start_server(*flags, model=None, env=None) → a running ServerProcess (``env``: extra
    environment variables; ``model``: another GGUF than the default). It is stopped when the test
    module that started it ends (``keep=True``: at the end of the session), so servers do not
    pile up over a run: each holds a model and its worker, and a whole run starts dozens.

    ``shared=True``: one server per configuration for the whole session: a module whose tests do
    not change a server's state (no unloads, no kills, no counters read as absolute values) gets
    the one an earlier module started with the same flags, model and environment."""
    started: list[ServerProcess] = []
    by_config: dict[tuple, ServerProcess] = {}

    def start(*flags: str, keep: bool = False, model: str | None = None,
              env: dict[str, str] | None = None, shared: bool = False) -> ServerProcess:
        key = (flags, model, tuple(sorted((env or {}).items())))
        if shared and key in by_config and by_config[key].proc.poll() is None:
            return by_config[key]
        args = ["--model", model or model_path, "--model-name", "smollm2", "--max-context", TEST_CONTEXT, *flags]
        log = tmp_path_factory.mktemp("server") / "server.log"
        srv = ServerProcess(args, log, env=env)
        srv.keep = keep or shared
        started.append(srv)
        if shared:
            by_config[key] = srv
        return srv

    start.started = started
    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module", autouse=True)
def stop_servers_after_module(start_server):
    """Stop the servers this module started (its module fixtures' teardowns run first)."""
    before = len(start_server.started)
    yield
    for srv in start_server.started[before:]:
        if not srv.keep:
            srv.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """One shared server with 8 lanes, for the API tests."""
    return start_server("--max-batch", "8", shared=True)


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def tiny_lora() -> dict:
    """The LoRA fixture's paths (tools/fixtures/tiny_lora.py: adapters ``a`` and ``b`` on SmolLM2 as
    PEFT dirs ``a_peft``/``b_peft`` and GGUFs ``a_gguf``/``b_gguf``, ``base_hf``, ``base_gguf``, and
    ``wrong_gguf`` for another base), built once per cache."""
    from tools.fixtures.tiny_lora import build

    return build()

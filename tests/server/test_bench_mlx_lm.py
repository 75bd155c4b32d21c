"""mlx_lm.server as a target the bench starts itself (``NAME=mlx-lm:MODEL.gguf``): for real, on
the default model converted to an mlx-lm directory, through ``python -m tools.bench``. The
server answers the bench's own requests (a completion and a chat stream, whose gaps give the
smoothness figures), and its process is gone when the bench ends, whether the bench finished or
was SIGKILLed mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")

from superfluid.core import lifeline  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache() -> Path:
    """The superfluid cache the bench converts into (tools/suite/mlx_lm_dir.py: keyed by the GGUF's
    path, size and time), so the conversion is done once per machine, not once per run; the
    conversion itself is checked fresh by test_mlx.py::test_model_directory_matches_gguf."""
    from superfluid.core.default_model import cache_dir

    return cache_dir().parent  # ~/.cache/superfluid (or $SUPERFLUID_CACHE): its mlx-lm/ folder


def _bench(args: list[str], cache: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, SUPERFLUID_CACHE=str(cache), PYTHONUNBUFFERED="1")
    return lifeline.popen([sys.executable, "-m", "tools.bench", *args], cwd=str(ROOT), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _gone(pid: int, timeout: float = 15.0) -> bool:
    """The process no longer runs (absent, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_bench_starts_mlx_lm_measures_it_and_stops_it(model_path, cache, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(["--target", f"mlx=mlx-lm:{model_path}", "--concurrency", "1", "--rounds", "1",
                   "--warmup", "0", "--max-tokens", "4", "--ttft-max-tokens", "5", "--lanes", "2",
                   "--context", "512", "--logs", str(tmp_path / "logs"), "--json", str(out)], cache)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    doc = json.loads(out.read_text())
    assert doc["error"] is None
    launched = doc["launched"]["mlx"]
    assert launched["kind"] == "mlx-lm" and launched["command"][1:4] == ["-m", "mlx_lm", "server"]
    # the completion went through the bench's client: mlx_lm.server ignores ignore_eos, so at
    # most max_tokens (a greedy reply to these prompts runs longer than 4 tokens)
    (rnd,) = doc["throughput_rounds"]
    assert rnd["completion_tokens"] == [4]
    (chat,) = doc["ttft_rounds"]
    assert chat["ttft_s"][0] is not None and chat["completion_tokens"] == [5]
    assert chat["deltas"][0] >= 2 and len(chat["gaps_s"][0]) == chat["deltas"][0] - 1
    gaps = doc["smoothness_s"]["mlx"]["1"]
    assert gaps["streams"] == 1 and 0 < gaps["p50"] <= gaps["p99"] <= gaps["max"]
    assert "| mlx p50 |" in stdout.decode()
    assert _gone(launched["pid"]), "mlx_lm.server outlived the bench"


def test_mlx_lm_dies_with_a_killed_bench(model_path, cache, tmp_path):
    """SIGKILL runs no cleanup: the kernel must end the server (lifeline's parent-death signal)."""
    proc = _bench(["--target", f"mlx=mlx-lm:{model_path}", "--concurrency", "1", "--rounds", "50",
                   "--max-tokens", "400", "--lanes", "1", "--context", "1024",
                   "--logs", str(tmp_path / "logs")], cache)
    pid, seen = None, b""
    try:
        deadline = time.monotonic() + 120
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
            seen += line
            m = re.search(rb"ready at \S+, pid (\d+)", line)
            pid = int(m.group(1)) if m else None
        assert pid is not None, seen.decode()[-3000:]
        assert not _gone(pid, 0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone(pid), "mlx_lm.server outlived a SIGKILLed bench"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if pid is not None and not _gone(pid, 0):
            os.killpg(pid, signal.SIGKILL)

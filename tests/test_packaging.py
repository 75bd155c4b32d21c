"""`pip install .` gives namespaced packages (superfluid.core, superfluid.plugins.*), never a bare
top-level core or plugins, and registers the built-in plugins through the entry-point group."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    wheel = next(tmp_path.glob("superfluid-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "superfluid/core/scheduler.py" in names
    assert "superfluid/plugins/llamacpp/worker.py" in names
    assert "superfluid/plugins/http/openai_routes.py" in names
    assert not [n for n in names if n.startswith(("core/", "plugins/", "tests/", "tools/"))]
    # the llama.cpp worker's decode loop in C (setup.py), compiled into the wheel
    assert [n for n in names if n.startswith("superfluid/plugins/llamacpp/_rounds.") and n.endswith(".so")]
    meta = zipfile.ZipFile(wheel)
    eps = meta.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[superfluid]" in eps
    for plugin in ("qos = superfluid.plugins.qos", "llamacpp = superfluid.plugins.llamacpp",
                   "http = superfluid.plugins.http"):
        assert plugin in eps
    assert "superfluid = superfluid.core.cli:main" in eps

    # Installed (not editable) into a folder of its own, it imports from there.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    out = subprocess.run([sys.executable, "-c", "import superfluid.core.cli as c, superfluid.plugins.http as h;"
                          "print(c.__file__); print(h.__file__)"],
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert all(line.startswith(str(target)) for line in out.stdout.split()), out.stdout


def test_builtin_plugins_load_through_entry_points():
    from superfluid.core.plugins import make_plugin_manager
    pm = make_plugin_manager()
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"qos", "llamacpp", "http"} <= names

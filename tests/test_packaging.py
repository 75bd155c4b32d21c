"""`pip install .` gives namespaced packages (superfluid.core, superfluid.plugins.*), never a bare
top-level core or plugins, and registers the built-in plugins through the entry-point group."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_entry_points(tmp_path):
    # built from a copy of the sources: a checkout's build/ folder (ignored by git) keeps modules
    # that were moved or deleted since it was made, and setuptools would pack them too
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("core", "plugins"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, timeout=300)
    wheel = next(tmp_path.glob("superfluid-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "superfluid/core/scheduler.py" in names
    assert "superfluid/plugins/llamacpp/worker.py" in names
    assert "superfluid/plugins/http/openai/routes.py" in names
    # every package of the source tree (pyproject.toml lists them by name), and the dashboard page
    packages = sorted(str(p.parent.relative_to(ROOT)) for top in ("core", "plugins")
                      for p in ROOT.glob(f"{top}/**/__init__.py"))
    assert "plugins/http/prepare" in packages
    missing = [p for p in packages if f"superfluid/{p}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel (pyproject.toml's list): {missing}"
    assert "superfluid/plugins/http/static/dashboard.html" in names
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

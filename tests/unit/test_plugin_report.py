"""``superfluid plugins`` (core/plugin_report.py), run as a real subprocess over the real entry
points: the built-ins, the two example plugins (installed from examples/ by tools/dev/setup.sh)
as another distribution's entry points, a TOML ``plugins`` module; and the hook reference in
docs/plugins.md, which must match core/hookspecs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def superfluid(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "superfluid.core.cli", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **(env or {})), cwd=ROOT)


def by_name(out: str) -> dict:
    return {p["name"]: p for p in json.loads(out)["plugins"]}


def hooks(entry: dict) -> dict:
    return {h["name"]: h for h in entry["hooks"]}


def test_lists_built_ins_and_third_party_entry_points():
    done = superfluid("plugins", "--json")
    assert done.returncode == 0, done.stderr
    plugins = by_name(done.stdout)
    qos = plugins["qos"]
    assert (qos["source"], qos["distribution"], qos["module"]) == ("built-in", "superfluid", "superfluid.plugins.qos")
    assert hooks(qos)["superfluid_pick_next"]["decision"] and not hooks(qos)["superfluid_pick_next"]["wrapper"]
    assert not hooks(qos)["superfluid_add_config"]["decision"]

    fair, echo = plugins["fair_share"], plugins["echo_engine"]
    assert (fair["source"], fair["distribution"], fair["version"]) == ("entry point", "superfluid-fair-share", "0.1.0")
    assert (echo["source"], echo["distribution"], echo["version"]) == ("entry point", "superfluid-echo-engine", "0.1.0")
    assert set(hooks(fair)) == {"superfluid_add_config", "superfluid_pick_next"}
    assert hooks(fair)["superfluid_pick_next"] == {"name": "superfluid_pick_next", "decision": True, "wrapper": True}
    assert set(hooks(echo)) == {"superfluid_add_engines"}


def test_the_table_names_sources_and_marks_decisions():
    done = superfluid("plugins")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "entry point of superfluid-fair-share 0.1.0" in lines["fair_share"]
    assert "pick_next* (wrapper)" in lines["fair_share"]
    assert "entry point of superfluid-echo-engine 0.1.0" in lines["echo_engine"]
    assert "built-in" in lines["qos"] and "plan_tick*" in lines["qos"] and "add_config," in lines["qos"]


def test_a_toml_plugin_is_listed_as_such(tmp_path):
    (tmp_path / "shortest_first.py").write_text(
        "from superfluid.core.hookspecs import hookimpl\n\n"
        "@hookimpl\ndef superfluid_pick_next(queue):\n    return min(queue, key=lambda lane: lane.n_prompt)\n\n"
        "@hookimpl\ndef superfluid_tick_done(model, stats):\n    pass\n")
    config = tmp_path / "policy.toml"
    config.write_text('plugins = ["shortest_first"]\n')
    done = superfluid("plugins", "--config", str(config), "--json", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    mine = by_name(done.stdout)["shortest_first"]
    assert (mine["source"], mine["distribution"]) == ("toml", None)
    assert {h["name"]: h["decision"] for h in mine["hooks"]} == {"superfluid_pick_next": True,
                                                                 "superfluid_tick_done": False}
    names = list(by_name(done.stdout))
    assert names[-1] == "shortest_first", "a TOML plugin registers last, so its decisions are asked first"


def test_a_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('plugins = ["no_such_module_here"]\n')
    done = superfluid("plugins", "--config", str(config))
    assert done.returncode == 2
    assert "cannot import 'no_such_module_here'" in done.stderr and str(config) in done.stderr
    done = superfluid("plugins", "--config", str(tmp_path / "missing.toml"))
    assert done.returncode == 2 and "config file not found" in done.stderr


def test_the_hook_reference_in_the_docs_is_up_to_date():
    sys.path.insert(0, str(ROOT / "tools" / "dev"))
    try:
        import hook_reference
    finally:
        sys.path.pop(0)
    from superfluid.core import hookspecs
    names = [n for n in vars(hookspecs) if n.startswith("superfluid_")]
    ref = hook_reference.reference()
    assert all(f"### {n}" in ref for n in names)
    current = hook_reference.current((ROOT / "docs" / "plugins.md").read_text())
    assert current == ref, "docs/plugins.md's hook reference is stale: run tools/dev/hook_reference.py --write"

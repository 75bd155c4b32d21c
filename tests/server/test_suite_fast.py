"""The serving-semantics suite's fast subset: every scenario of tools/suite against superfluid with
small workloads, and agents + chat against a superfluid without QoS, which must fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.suite import report, runner
from tools.suite.common import ERROR, FAIL, NA, PASS, Outcome
from tools.suite.scenarios import ALL, BY_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("suite")


@pytest.mark.parametrize("key", [m.KEY for m in ALL])
def test_scenario_passes_on_superfluid(key, model_path, out_dir):
    o = runner.run_scenario(BY_KEY[key], "superfluid", "superfluid", True, model_path, out_dir)
    if o.verdict == ERROR and o.reason.startswith("not available"):
        pytest.skip(o.reason)  # an API the scenario needs has not landed yet
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(o.figures, default=str)[:3000]}"


def test_agents_chat_fails_without_qos(model_path, out_dir):
    """The pass condition can fail: with --no-http-qos-header the chat is one more agent-class
    request and waits for a lane, so its first token is late."""
    o = runner.run_scenario(BY_KEY["agents_chat"], "superfluid", "superfluid-no-qos", True, model_path,
                            out_dir, qos=False)
    assert o.verdict == FAIL, o.reason
    assert o.figures["agents_completed"] == o.figures["agents"]
    assert o.figures["chat_ttft_s"] > o.figures["ttft_bound_s"]


def test_unsupported_target_is_na(model_path, out_dir):
    o = runner.run_scenario(BY_KEY["worker_kill"], "llama-cpp-python", "llama-cpp-python", True,
                            model_path, out_dir)
    assert o.verdict == NA and o.reason


def test_table_and_json(tmp_path):
    outs = [Outcome("worker_kill", "a", PASS, "ok"), Outcome("worker_kill", "b", NA, "no worker"),
            Outcome("shared_prefix", "a", FAIL, "twice"), Outcome("shared_prefix", "b", ERROR, "not available")]
    titles = {m.KEY: m.TITLE for m in ALL}
    table = report.table(outs, titles, ["a", "b"])
    assert "| worker kill | ✓ | n/a |" in table
    assert "| shared-prefix burst | ✗ | err |" in table
    report.write_json(tmp_path / "s.json", outs, {"command": "x"})
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [o["verdict"] for o in doc["outcomes"]] == [PASS, NA, FAIL, ERROR]


def test_resume_keeps_earlier_outcomes_in_scenario_order(tmp_path, model_path):
    """--resume re-runs only the named scenarios and keeps the rest of OUT/suite.json."""
    from tools.suite import cli
    earlier = [Outcome("shared_prefix", "llama-server", FAIL, "8 times"),
               Outcome("worker_kill", "llama-server", PASS, "stale: replaced by the new run")]
    report.write_json(tmp_path / "suite.json", earlier, {"command": "first run"})
    cli.main(["--targets", "llama-server", "--scenarios", "worker_kill", "--resume",
              "--model", model_path, "--out", str(tmp_path)])
    outcomes, doc = report.read_json(tmp_path / "suite.json")
    assert [(o.scenario, o.verdict) for o in outcomes] == [("worker_kill", NA), ("shared_prefix", FAIL)]
    assert doc["earlier_run"]["command"] == "first run"
    assert doc["earlier_run"]["kept"] == ["shared_prefix/llama-server"]

"""Opt-in: the published Claude Code and Codex CLIs (npm, 350-400 MB each) against a real
``superfluid serve``. CI does not install them; the protocols are tested on every run with the
``anthropic`` and ``openai`` SDKs. Run with ``SUPERFLUID_AGENT_CLIS=1`` (the CLIs are installed
under ``SUPERFLUID_AGENT_CLIS_DIR``, default ~/.cache/superfluid/agent-clis, if missing)."""

from __future__ import annotations

import os

import pytest

from tools.bench import agent_clis

pytestmark = pytest.mark.skipif(os.environ.get("SUPERFLUID_AGENT_CLIS") != "1",
                                reason="opt-in: SUPERFLUID_AGENT_CLIS=1 runs the npm CLIs")


@pytest.fixture(scope="module")
def clis():
    return agent_clis.ensure_clis(agent_clis.DEFAULT_DIR)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    srv = agent_clis.Serve(tmp_path_factory.mktemp("agent-clis"))
    yield srv
    srv.stop()


def test_claude_code_answers_and_its_repeated_turn_stays_warm(clis, serve, tmp_path):
    first = agent_clis.run_claude(clis["claude"], serve, tmp_path)
    assert first["exit"] == 0 and first["stdout"], first
    second = agent_clis.run_claude(clis["claude"], serve, tmp_path)
    assert second["exit"] == 0 and second["stdout"], second
    assert second["prefill_tokens"] <= 0.25 * first["prefill_tokens"], (first, second)


def test_codex_exec_answers(clis, serve, tmp_path):
    done = agent_clis.run_codex(clis["codex"], serve, tmp_path)
    assert done["exit"] == 0 and done["stdout"], done

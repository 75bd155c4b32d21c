"""The whole corpus (../shared/templates): every template that renders a call round-trips
whole, a character at a time and as SmolLM2's tokens, and docs/formats.md's table is the one the
code makes today (python -m tools.formats.table --markdown)."""

from __future__ import annotations

import pathlib

import pytest

from tools.formats import table

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = ROOT.parent / "shared" / "templates"


@pytest.fixture(scope="module")
def rows():
    if not TEMPLATES.is_dir():
        pytest.skip(f"no template corpus at {TEMPLATES}")
    return list(table.rows(TEMPLATES))


def test_every_template_that_renders_a_call_reads_it_back(rows):
    assert len(rows) == 46
    for row in rows:
        for calls in ("calls1", "calls2"):
            assert row[calls] in ("ok/ok/ok", "n/a"), row
    rendered = [r for r in rows if r["calls1"] != "n/a"]
    assert len(rendered) >= 36  # the templates that write a call today; fewer means a regression
    assert all(r["render"].startswith("yes") for r in rows
               if r["template"] not in ("CohereForAI-c4ai-command-r-plus-tool_use",
                                        "fireworks-ai-llama-3-firefunction-v2", "llama-cpp-deepseek-r1"))


def test_the_docs_table_is_current(rows):
    docs = (ROOT / "docs" / "formats.md").read_text()
    assert table.markdown(rows) in docs, "docs/formats.md's table is stale: python -m tools.formats.table --markdown"

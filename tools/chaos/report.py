"""The chaos table: scenario, fault, pass condition, result, key figures; and the JSON file."""

from __future__ import annotations

import json

from tools.suite.report import read_json, write_json  # noqa: F401 (re-exported)

from .common import SYMBOL, Outcome


def _figures(o: Outcome, headline: list[str]) -> str:
    shown = {k: o.figures[k] for k in headline if k in o.figures}
    return json.dumps(shown, default=str).replace("|", "/") if shown else ""


def table(outcomes: list[Outcome], modules: dict) -> str:
    lines = ["| scenario | fault | pass condition | result | key figures |", "|---|---|---|---|---|"]
    for o in outcomes:
        m = modules[o.scenario]
        lines.append(f"| {m.TITLE} | {m.FAULT} | {m.PASS} | {SYMBOL[o.verdict]} {o.reason.replace('|', '/')} "
                     f"| {_figures(o, getattr(m, 'HEADLINE', []))} |")
    return "\n".join(lines)

"""The ✓/✗/n-a table, the figures behind each verdict, and the JSON file."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

from .common import SYMBOL, Outcome

# the headline figures of each scenario, printed under the table
HEADLINE = {
    "worker_kill": ["completed", "identical_to_undisturbed", "restarts"],
    "daemon_restart": ["exit_code", "exit_seconds", "turns_survived", "next_turn_prompt_tokens",
                       "next_turn_cached_tokens"],
    "agents_chat": ["chat_ttft_s", "agents_completed", "wall_s"],
    "kv_exhaustion": ["completed", "demand_over_pool", "wall_s", "median_latency_s"],
    "unload": ["requests", "succeeded", "saw_model_unloaded", "unclear_errors", "hung", "after_reload_status"],
    "tool_session": ["completed", "first_window_median_s", "last_window_median_s", "cold_s", "late_over_cold",
                     "late_over_early", "last_prompt_tokens", "last_cached_fraction"],
    "disconnect": ["states", "end"],
    "shared_prefix": ["completed", "times_prefix_prefilled", "shared_prefix_tokens", "median_ttft_s", "wall_s"],
}


def table(outcomes: list[Outcome], titles: dict[str, str], names: list[str]) -> str:
    by = {(o.scenario, o.target): o for o in outcomes}
    keys = list(dict.fromkeys(o.scenario for o in outcomes))
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in keys:
        cells = [SYMBOL[by[(k, n)].verdict] if (k, n) in by else "" for n in names]
        lines.append(f"| {titles[k]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures(outcomes: list[Outcome], titles: dict[str, str]) -> str:
    lines = []
    for o in outcomes:
        shown = {k: o.figures[k] for k in HEADLINE.get(o.scenario, []) if k in o.figures}
        lines.append(f"- {titles[o.scenario]} / {o.target}: {SYMBOL[o.verdict]} {o.reason}"
                     + (f" — {json.dumps(shown)}" if shown else ""))
    return "\n".join(lines)


def write_json(path: Path, outcomes: list[Outcome], meta: dict) -> None:
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{platform.machine()} {platform.system()} {platform.release()}", **meta,
           "outcomes": [o.to_json() for o in outcomes]}
    path.write_text(json.dumps(doc, indent=2, default=str))


def read_json(path: Path) -> tuple[list[Outcome], dict]:
    """The outcomes and the rest of a suite.json written by ``write_json``."""
    doc = json.loads(Path(path).read_text())
    outcomes = [Outcome(o["scenario"], o["target"], o["verdict"], o.get("reason", ""), o.get("figures") or {},
                        o.get("seconds", 0.0)) for o in doc.pop("outcomes", [])]
    return outcomes, doc

"""The agents + interactive chat timeline: one bar per request, coloured by phase, and the chat's
first token marked; one PNG per target."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"queued": "#c7c7c7", "waiting": "#c7c7c7", "prefilling": "#f0a030", "decoding": "#3b7dd8"}
LABELS = {"queued": "queued", "waiting": "waiting (queue + prefill, not visible from outside)",
          "prefilling": "prefilling", "decoding": "decoding"}


def timeline(outcome, path: Path) -> Path | None:
    """Write the PNG for one agents_chat outcome; None when matplotlib is missing or nothing ran."""
    records = outcome.figures.get("requests")
    if not records:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(records) + 1.6))
    seen = set()
    for y, rec in enumerate(records):
        for state, a, b in rec.get("phases") or []:
            label = LABELS.get(state, state) if state not in seen else None
            seen.add(state)
            ax.barh(y, b - a, left=a, color=COLOURS.get(state, "#888"), edgecolor="none", label=label, height=0.6)
        if rec.get("first_token") is not None and rec["name"] == "chat":
            ax.plot([rec["first_token"]], [y], marker="*", color="crimson", markersize=14,
                    label=f"chat first token ({rec['first_token'] - rec['sent']:.2f} s after send)", linestyle="none")
        ax.plot([rec["sent"]], [y], marker="|", color="black", markersize=10)
    ax.set_yticks(range(len(records)))
    ax.set_yticklabels([r["name"] for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first agent was sent")
    ttft = outcome.figures.get("chat_ttft_s")
    ax.set_title(f"agents + interactive chat — {outcome.target}: chat TTFT "
                 f"{'none' if ttft is None else f'{ttft:.2f} s'} ({'pass' if outcome.verdict == 'pass' else outcome.verdict})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
